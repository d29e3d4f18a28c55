"""The native call path (``addnorm.ops.native``): the switch, the parameter packing and the refusals
(fast, nothing built); then, with the C++ extension built (``slow``): the launches' bytes, grid, block,
shared memory and stream against Triton's own launcher through a fake driver for every kind of call
signature (``tests/_native_bytes.py``, a process of its own: the real kernels compiled for sm_90), the
C++ node's autograd wiring against today's path through a CPU kernel computing with the torch
reference, the interpreted kernels through the node equal to today's path, the fallback on a forced
build failure, and torch.compile never seeing the node."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch
from _native_cases import _inputs, needs_interpreter

from addnorm import ops
from addnorm.ops import native, policy
from addnorm.ops.native import build
from addnorm.ops.native.layout import CONST, ROWS, SEED, TENSOR, Var, layout, pack

# --- fast: nothing built ---------------------------------------------------------------------------


def test_switch_validates_returns_previous_and_rebuilds_plans():
    version = policy.VERSION
    previous = ops.set_call_path("native")
    try:
        assert ops.call_path() == "native" and policy.VERSION == version + 1
        assert ops.set_call_path("native") == "native" and policy.VERSION == version + 1  # no change
        with pytest.raises(ValueError, match="set_call_path"):
            ops.set_call_path("c++")
    finally:
        ops.set_call_path(previous)
    assert ops.call_path() == previous == "python"  # the default (ADDNORM_NATIVE_CALL unset)


def test_env_switch_read_at_import():
    code = "import addnorm.ops as o; print(o.call_path())"
    env = {**os.environ, "ADDNORM_NATIVE_CALL": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "native"


def test_pack_as_triton_launcher():
    assert pack(12, 1e-5) == struct.unpack("<I", struct.pack("<f", 1e-5))[0]  # fp32: a float, not a double
    assert pack(13, 1e-5) == struct.unpack("<Q", struct.pack("<d", 1e-5))[0]
    assert pack(4, -3) == 0xFFFFFFFD and pack(5, -3) == 2**64 - 3
    assert pack(4, True) == 1  # i1 goes as an i32
    assert pack(11, 1.5) == struct.unpack("<I", struct.pack("<f", 1.5))[0] >> 16  # bf16: the high half
    assert pack(10, 0.5) == struct.unpack("<H", struct.pack("<e", 0.5))[0]


def _fake_ck(signature: dict, kinds: list[int], **run):
    run = {"launch_cooperative_grid": False, "launch_pdl": False, "global_scratch_size": 0,
           "profile_scratch_size": 0, "kernel_signature": bytes(kinds), **run}  # fmt: skip
    return SimpleNamespace(
        src=SimpleNamespace(signature=signature), run=SimpleNamespace(**run), packed_metadata=(4, 1, 96)
    )


def test_layout_from_the_signature_and_refusals():
    sig = {"X": "*fp32", "G": "constexpr", "n_rows": "i32", "eps": "fp32", "SEED": "i64", "K": "constexpr"}
    ck = _fake_ck(sig, [1, 4, 12, 5])
    params, block, smem = layout(ck, (Var(TENSOR, 0), None, Var(ROWS), 1e-5, Var(SEED), 3))
    assert (block, smem) == (128, 96)
    assert params == [
        (TENSOR, 8, 0, 0), (ROWS, 4, 0, 0), (CONST, 4, 0, pack(12, 1e-5)), (SEED, 8, 0, 0),
        (CONST, 8, 0, 0), (CONST, 8, 0, 0),  # the two scratch pointers
    ]  # fmt: skip
    assert "scratch" in layout(_fake_ck(sig, [1, 4, 12, 5], global_scratch_size=16), (Var(1),) * 6)
    assert "PDL" in layout(_fake_ck(sig, [1, 4, 12, 5], launch_pdl=True), (Var(1),) * 6)
    assert "parameters" in layout(ck, (Var(1),) * 5)
    assert "pointer" in layout(ck, (5, None, Var(ROWS), 1e-5, Var(SEED), 3))
    assert "signature" in layout(SimpleNamespace(run=None), ())


def test_cpu_tensors_never_build(monkeypatch):
    """A CPU-only install with the native switch on: the same results as today, nothing built."""
    monkeypatch.setattr(build, "_build", lambda: pytest.fail("built on the CPU"))
    x, r, w, b, _ = _inputs()
    want = ops.add_norm(x, r, w, b, prenorm=True)
    previous = ops.set_call_path("native")
    try:
        got = ops.add_norm(x, r, w, b, prenorm=True)
    finally:
        ops.set_call_path(previous)
    for u, v in zip(got, want, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


@needs_interpreter
def test_forced_build_failure_warns_once_and_takes_todays_path(monkeypatch, native_path):
    monkeypatch.setenv("ADDNORM_NATIVE_FORCE_FAIL", "1")
    monkeypatch.setattr(build, "_module", None)
    monkeypatch.setattr(build, "_failure", None)
    monkeypatch.setattr(native, "_warned", False)
    x, r, w, b, _ = _inputs(rows=4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = [ops.add_norm(x, r, w, b, backend="triton", norm=nm) for nm in ("layernorm", "rmsnorm")]
    assert [str(c.message) for c in caught if "native call" in str(c.message)] == [
        "addnorm: the native call path did not build or load (RuntimeError: ADDNORM_NATIVE_FORCE_FAIL is "
        "set); every call takes today's path"
    ]
    assert type(got[0].grad_fn).__name__ == "TritonAddNormBackward"
    ops.set_call_path("python")
    want = [ops.add_norm(x, r, w, b, backend="triton", norm=nm) for nm in ("layernorm", "rmsnorm")]
    for u, v in zip(got, want, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)
    assert any("did not build" in k for k in native.refusals())
