"""The native call path (``addnorm.ops.native``): the switch, the parameter packing and the refusals
(fast, nothing built); then, with the C++ extension built (``slow``): the launches' bytes, grid, block,
shared memory and stream against Triton's own launcher through a fake driver for every kind of call
signature (``tests/_native_bytes.py``, a process of its own: the real kernels compiled for sm_90), the
C++ node's autograd wiring against today's path through a CPU kernel computing with the torch
reference, the interpreted kernels through the node equal to today's path, the fallback on a forced
build failure, and torch.compile never seeing the node."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from addnorm import ops
from addnorm.ops import functional, native, policy
from addnorm.ops.native import build
from addnorm.ops.native.layout import CONST, ROWS, SEED, TENSOR, Var, layout, pack

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton under TRITON_INTERPRET=1"
)


@pytest.fixture
def native_path():
    """The native path on, CPU tensors let through (the interpreter's Triton backend), restored after."""
    previous = ops.set_call_path("native")
    native._ALLOW_CPU = True
    functional.clear_plans()
    try:
        yield
    finally:
        native._ALLOW_CPU = False
        ops.set_call_path(previous)
        functional.clear_plans()


def _inputs(rows=8, n=64, dtype=torch.float32, gate=None, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g, dtype=dtype, requires_grad=True)
    r = torch.randn(rows, n, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(n, generator=g, requires_grad=True)
    b = torch.randn(n, generator=g, requires_grad=True) if bias else None
    gt = {None: None, "one": torch.full((1,), 0.7), "vector": torch.rand(n, generator=g)}[gate]
    if gt is not None:
        gt.requires_grad_()
    return x, r, w, b, gt


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


# --- slow: the extension built ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def ext():
    if os.environ.get("ADDNORM_NATIVE_FORCE_FAIL"):
        pytest.skip("ADDNORM_NATIVE_FORCE_FAIL is set")
    build.forget()
    m = build.extension()
    if m is None:
        pytest.skip(f"the native extension did not build here: {build.failure()}")
    m.install_fake_cuda_guard(0x5EED)  # the CPU build has no CUDA guard: the stream the node asks for
    return m


@pytest.mark.slow
@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_launch_bytes_equal_tritons_launcher(ext):
    """Every kind of call signature: the native launches equal Triton's own launcher's, byte for byte
    (through the fake driver: real kernels compiled for sm_90, a process without the interpreter)."""
    script = Path(__file__).with_name("_native_bytes.py")
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": src, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["mismatches"] == [], json.dumps(got["mismatches"][:2], indent=1)[:6000]
    assert got["native_launches"] >= 2 * got["cases"]  # each recorded call: forward and backward native
    assert got["grad_fns"] == ["CppFunction"]


CASES = {
    "ln post": {},
    "ln pre": {"prenorm": True},
    "rms pre no bias": {"norm": "rmsnorm", "prenorm": True, "bias": False},
    "ln dropout seed": {"dropout_p": 0.2, "seed": 11},
    "ln pre gate vector": {"prenorm": True, "gate": "vector"},
    "rms gate one alpha": {"norm": "rmsnorm", "gate": "one", "alpha": 2.0, "bias": False},
    "pre residual_in_fp32 bf16": {"prenorm": True, "residual_in_fp32": True, "dtype": torch.bfloat16},
}


def _call(kw, inputs):
    kw = dict(kw)
    kw.pop("dtype", None), kw.pop("bias", None)
    gate = kw.pop("gate", None)
    x, r, w, b, g = inputs
    return (
        ops.add_norm(x, r, w, b, gate=g, backend="triton", **kw)
        if gate
        else ops.add_norm(x, r, w, b, backend="triton", **kw)
    )


def _grads(out, inputs):
    outs = out if isinstance(out, tuple) else (out,)
    loss = sum((o.float() * (i + 1.0)).sum() for i, o in enumerate(outs))
    leaves = [t for t in inputs if t is not None]
    return torch.autograd.grad(loss, leaves)


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("case", CASES)
def test_node_equals_todays_path(ext, native_path, case):
    """The interpreted kernels through the C++ node (its Python launchers: no kernel registers for the
    interpreter) equal today's path: outputs and every gradient, bit for bit; grad_fn the C++ node."""
    kw = CASES[case]
    inputs = _inputs(dtype=kw.get("dtype", torch.float32), gate=kw.get("gate"), bias=kw.get("bias", True))
    got = _call(kw, inputs)
    y = got[0] if isinstance(got, tuple) else got
    assert type(y.grad_fn).__name__ == "CppFunction"
    got_grads = _grads(got, inputs)
    ops.set_call_path("python")
    want = _call(kw, inputs)
    assert type((want[0] if isinstance(want, tuple) else want).grad_fn).__name__ == "TritonAddNormBackward"
    got_all = [*(got if isinstance(got, tuple) else (got,)), *got_grads]
    want_all = [*(want if isinstance(want, tuple) else (want,)), *_grads(want, inputs)]
    for u, v in zip(got_all, want_all, strict=True):
        torch.testing.assert_close(u, v, rtol=0, atol=0)


def _reference_kernel(launch, kw, record):
    """A test-only CPU kernel for the op: the forward and backward computed with the torch reference
    (``add_norm_reference``, in the inputs' dtypes), recording what the node hands each."""
    kw = {k: v for k, v in kw.items() if k in ("norm", "alpha", "dropout_p", "seed")}
    state = {}

    def forward(x, r, w, b, g, seed):
        record["fwd"] = (x, r, w, b, g, seed)
        state["inputs"] = [
            None if t is None else t.detach().clone().requires_grad_() for t in (x, r, w, b, g)
        ]
        with torch.no_grad():
            y, s = ops.add_norm_reference(*state["inputs"][:4], gate=state["inputs"][4], prenorm=True,
                                          dtype=None, **kw)  # fmt: skip
        return y.to(launch.fwd.y_dtype), (s.to(launch.fwd.s_dtype) if launch.fwd.store_s else None), None

    def backward(which, dy, ds, saved, x, r, w, b, g, seed, stats):
        record["bwd"] = (which, dy, ds, saved, x, r, w, b, g, seed, stats)
        leaves = state["inputs"]
        with torch.enable_grad():  # a backward runs without grad mode
            y, s = ops.add_norm_reference(*leaves[:4], gate=leaves[4], prenorm=True, dtype=None, **kw)
            loss = (y.float() * dy.float()).sum() + (0 if ds is None else (s.float() * ds.float()).sum())
            live = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(loss, live))
        dx, dr, dw, db, dg = (None if t is None else next(grads) for t in leaves)
        return dx, dr, dw, db, dg

    return forward, backward


@pytest.mark.slow
@needs_interpreter
@pytest.mark.parametrize("case", ["ln post", "ln pre", "rms pre no bias", "ln pre gate vector"])
@pytest.mark.parametrize("used", ["y and s", "y", "s"])
def test_node_wiring_through_a_reference_cpu_kernel(ext, native_path, case, used):
    """What the node saves and hands its backward, and which inputs get which gradient, against today's
    path: the node launches a CPU kernel computing with the torch reference."""
    from addnorm.ops.native.launch import NativeLaunch

    kw = CASES[case]
    if used != "y and s" and not kw.get("prenorm"):
        pytest.skip("Post-LN returns y only")
    inputs = _inputs(gate=kw.get("gate"), bias=kw.get("bias", True))
    _call(kw, inputs)  # makes the plan
    plan = functional._last[1]
    launch = plan.launches[2 if kw.get("gate") == "vector" else (1 if kw.get("gate") else 0)]
    record = {}
    fwd, bwd = _reference_kernel(launch, kw, record)
    launch.native = NativeLaunch(ext, launch, plan.device, py_forward=fwd, py_backward=bwd, native=False)
    launch.apply = launch.native.call
    plan.apply = plan.launches[0].apply
    plan.run = plan._triton_runner()

    def grads(out):
        y, s = out if isinstance(out, tuple) else (out, None)
        loss = (y * 2.0).sum() if used != "s" else 0.0
        if s is not None and used != "y":
            loss = loss + (s * 3.0).sum()
        leaves = [t for t in inputs if t is not None]
        return torch.autograd.grad(loss, leaves, allow_unused=True)

    got = _call(kw, inputs)
    got_grads = grads(got)
    assert type((got[0] if isinstance(got, tuple) else got).grad_fn).__name__ == "CppFunction"
    x, r, w, b, g = inputs
    fx, fr, fw, fb, fg, _ = record["fwd"]
    assert fx is not None and all(u is v or (u is None and v is None) for u, v in ((fw, w), (fb, b), (fg, g)))
    which, dy, ds, saved, bx, br, bw, bb, bg, _, stats = record["bwd"]
    y, s = got if isinstance(got, tuple) else (got, None)
    assert which == (1 if used != "y" and s is not None else 0) and (ds is None) == (which == 0)
    if used == "s":
        assert torch.equal(dy, torch.zeros_like(dy))  # only s used: the node hands zeros for dy
    else:
        assert torch.equal(dy, torch.full_like(dy, 2.0))
    assert torch.equal(saved, y if launch.save_y else s)  # what today's forward keeps
    assert (bx is not None) == launch.keep_x and (br is not None) == launch.keep_r
    assert bw is w and bb is b and bg is g
    ops.set_call_path("python")
    want = _call(kw, inputs)
    for u, v in zip(got_grads, grads(want), strict=True):
        assert (u is None) == (v is None)
        if u is not None:
            torch.testing.assert_close(u, v, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@needs_interpreter
def test_dispatcher_op_is_the_same_node(ext, native_path):
    x, r, w, b, _ = _inputs()
    ops.add_norm(x, r, w, b, backend="triton", prenorm=True)
    nl = functional._last[1].launches[0].native
    y, s = torch.ops.addnorm_native.add_norm(nl.plan.id, x, r, w, b, None, None, -1)
    assert type(y.grad_fn).__name__ == "CppFunction"
    ops.set_call_path("python")
    want = ops.add_norm(x, r, w, b, backend="triton", prenorm=True)
    torch.testing.assert_close(y, want[0], rtol=0, atol=0)
    torch.testing.assert_close(s, want[1], rtol=0, atol=0)


@pytest.mark.slow
@needs_interpreter
def test_torch_compile_never_sees_the_node(ext, native_path):
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    x, r, w, b, _ = _inputs()

    def f(x, r):
        y, s = ops.add_norm(x, r, w, b, backend="triton", prenorm=True)
        return y.sum() + s.sum()

    torch._dynamo.reset()
    out = torch.compile(f, backend=backend, fullgraph=True)(x, r)
    targets = [str(node.target) for gm in graphs for node in gm.graph.nodes]
    assert graphs and not any("addnorm_native" in t for t in targets)
    eager = f(x, r)  # eager, native path: the node
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-4)
    torch._dynamo.reset()
