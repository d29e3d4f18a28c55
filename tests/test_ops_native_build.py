"""The native call with its extension built (slow tier: a C++ compile, 40-130 s the first time, and
Triton's real compiler in a process beside): the launches' bytes against Triton's own launcher, the
node against today's path, its autograd wiring through a reference CPU kernel, the dispatcher op,
and torch.compile never seeing it. The rules that need no build: ``test_ops_native_call.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _native_cases import HAS_TRITON, _inputs, needs_interpreter

from addnorm import ops
from addnorm.ops import functional
from addnorm.ops.native import build

pytestmark = pytest.mark.slow  # a C++ compile


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
