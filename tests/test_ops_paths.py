"""The fused op's other paths: the NumPy dropout mask, Post-LN weight gradients in bf16 against float64,
torch.func transforms, what torch.compile receives, the policy seam, triton_op registration, and the
cached call plan. The kernels' multi-row tiles and column chunks: ``test_ops_paths_kernels.py``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from _ops_paths_inputs import (  # sets TRITON_INTERPRET=1 without CUDA, before the kernels are imported
    DEVICE,
    HAS_TRITON,
    _inputs,
    _triton_ready,
    needs_triton,
)

from addnorm.ops import add_norm, compile_path, dropout_keep_mask, fused_op_preferred, set_compile_path
from addnorm.ops import functional as fn
from addnorm.ops import library as lib
from addnorm.ops.args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y
from addnorm.ops.reference import dropout_keep_mask_numpy

pytestmark = pytest.mark.slow  # compilers (torch.compile)

# --- the NumPy mask (the eager CPU path) ---------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 7, 2**33 + 5, 2**63 - 1])
def test_numpy_mask_is_the_torch_mask_bit_for_bit(seed):
    for rows, cols in ((1, 1), (8, 64), (37, 300)):
        for p in (1e-5, 0.1, 0.5, 0.97, 1 - 1e-9):
            want = dropout_keep_mask(seed, rows, cols, p)
            assert torch.equal(torch.from_numpy(dropout_keep_mask_numpy(seed, rows, cols, p)), want)
    assert not dropout_keep_mask(seed, 4, 4, 1 - 1e-9).any()  # p within 2**-25 of 1 drops everything


def test_eager_cpu_dropout_uses_the_hashed_mask_and_keeps_it_for_backward():
    x, r, w, b, _ = _inputs(6, 50, device="cpu")
    x.requires_grad_(True)
    y, s = add_norm(x, r, w, b, prenorm=True, dropout_p=0.4, seed=123)
    keep = dropout_keep_mask(123, 6, 50, 0.4)
    torch.testing.assert_close(s, r + torch.where(keep, x / 0.6, 0.0))
    (gx,) = torch.autograd.grad(s.sum(), x)
    torch.testing.assert_close(gx, keep.float() / 0.6)


# --- Post-LN weight gradients in bf16 (flash-attn's failing case) --------------------------------


def _post_ln_dweight_errors(rows, hidden, seed):
    """|dweight - float64 dweight| of PyTorch's layer_norm on the bf16 stream upcast to fp32 (what its
    CUDA kernel does for bf16 input: fp32 statistics and accumulation) and of each backward path of
    the op, on bf16 x and residual with fp32 weight and bias.

    x and residual are multiples of 1/16 in [-4, 4], so s = x + r is exact in bf16 and every path
    normalises the same s: Triton's interpreter rounds fp32 -> bf16 towards zero where a GPU rounds
    to nearest, which would otherwise shift the interpreted statistics by a rounding bias."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randint(-64, 65, (rows, hidden), generator=g) / 16).to(torch.bfloat16)
    r = (torch.randint(-64, 65, (rows, hidden), generator=g) / 16).to(torch.bfloat16)
    w = 1 + 0.5 * torch.randn(hidden, generator=g)
    b = 0.5 * torch.randn(hidden, generator=g)  # |b| <= |w| in most columns: x_hat from y where allowed
    dy = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    s64 = x.double() + r.double()
    assert torch.equal(s64, (x + r).double())  # exact in bf16
    w64 = w.double().requires_grad_(True)
    (dw_ref,) = torch.autograd.grad(F.layer_norm(s64, (hidden,), w64, b.double(), 1e-5), w64, dy.double())

    def err(dw):
        return (dw.double() - dw_ref).abs().max().item()

    wt = w.clone().requires_grad_(True)
    errors = {"pytorch": err(torch.autograd.grad(F.layer_norm((x + r).float(), (hidden,), wt, b), wt, dy)[0])}
    paths = [("torch", XHAT_FROM_S), ("torch", XHAT_FROM_Y), ("torch", XHAT_FROM_XR)]
    if _triton_ready():
        paths += [("triton", XHAT_FROM_Y), ("triton", XHAT_FROM_XR)]
    for backend, xhat_from in paths:
        wt = w.clone().requires_grad_(True)
        args = (None, None, xhat_from, "layernorm", 1e-5, 1.0, 0.0, torch.bfloat16, torch.bfloat16, False)
        args += (backend,)
        y = lib.add_norm_fwd(x, r, wt, b, None, *args)[0]
        errors[(backend, xhat_from)] = err(torch.autograd.grad(y, wt, dy)[0])
    wt = w.clone().requires_grad_(True)
    errors["public"] = err(torch.autograd.grad(add_norm(x, r, wt, b), wt, dy)[0])
    return errors, dw_ref.abs().max().item()


@pytest.mark.triton
def test_post_ln_bf16_weight_gradient_is_as_exact_as_pytorchs():
    """bf16 input, fp32 weight, hidden 2048, LayerNorm Post-LN: x_hat from the bf16 output y loses
    ~2**-9 relative per element, which dweight sums over every row; from s (saved or recomputed from
    x and residual) the gradient is as exact as PyTorch's own layer_norm backward in fp32. The op
    takes x_hat from x and residual whenever y is coarser than fp32 (Triton backend) or keeps s
    (torch backend)."""
    if _triton_ready():
        assert fn.Plan(*_plan_args(torch.bfloat16, "triton")).xhat_from == XHAT_FROM_XR
        assert fn.Plan(*_plan_args(torch.float32, "triton")).xhat_from == XHAT_FROM_Y
    errors, scale = _post_ln_dweight_errors(rows=64, hidden=2048, seed=0)
    bound = 2 * errors["pytorch"] + 1e-6 * scale
    for path in [("torch", XHAT_FROM_S), ("torch", XHAT_FROM_XR), ("triton", XHAT_FROM_XR), "public"]:
        if path in errors:
            assert errors[path] <= bound, (path, errors)
    # the test can fail: taking x_hat from the bf16 y is far less exact
    for path in [("torch", XHAT_FROM_Y), ("triton", XHAT_FROM_Y)]:
        if path in errors:
            assert errors[path] > 20 * bound, (path, errors)


def _plan_args(dtype, backend):
    x = torch.zeros(2, 8, dtype=dtype)
    w = torch.ones(8)
    return (x, x, w, w, "layernorm", 1e-5, False, 1.0, 0.0, dtype, dtype, backend)


# --- torch.func ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=[pytest.mark.triton, needs_triton])]
)
def test_torch_func_grad_and_vmap(backend):
    x, r, w, b, _ = _inputs(5, 24, device=DEVICE)
    kw = {"norm": "layernorm", "dropout_p": 0.2, "seed": 3, "backend": backend}

    def loss(w, x):
        return (add_norm(x, r, w, b, **kw) * torch.arange(24.0, device=DEVICE)).sum()

    gw = torch.func.grad(loss)(w, x)
    wl = w.clone().requires_grad_(True)
    (want,) = torch.autograd.grad(loss(wl, x), wl)
    torch.testing.assert_close(gw, want, rtol=1e-5, atol=1e-5)
    # vmap over a batch of (rows, hidden) inputs: each example's call as if made alone
    xs = torch.stack([x, 2 * x, x - 1])
    rms = {**kw, "norm": "rmsnorm", "prenorm": True}
    ys = torch.func.vmap(lambda xi: add_norm(xi, r, w, b, **rms))(xs)
    for i in range(3):
        yi = add_norm(xs[i], r, w, b, **rms)
        torch.testing.assert_close(ys[0][i], yi[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ys[1][i], yi[1], rtol=1e-5, atol=1e-5)
    # per-example gradients
    jac = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0))(w, xs)
    assert jac.shape == (3, 24) and torch.allclose(jac[0], gw, atol=1e-5)


# --- what torch.compile receives ------------------------------------------------------------------


class _Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f = torch.nn.Linear(d, d)
        self.w, self.b = torch.nn.Parameter(torch.ones(d) * 1.1), torch.nn.Parameter(torch.zeros(d) + 0.1)

    def forward(self, x, seed):
        y, s = add_norm(self.f(x), x, self.w, self.b, prenorm=True, dropout_p=0.1, seed=seed)
        return add_norm(self.f(y), s, self.w, None, norm="rmsnorm", alpha=1.3)


@pytest.fixture
def restore_compile_path():
    previous = compile_path()
    yield
    set_compile_path(previous)


@pytest.mark.parametrize("path", ["composite", "kernel"])
def test_compiled_paths_drop_the_same_elements_as_eager(path, restore_compile_path):
    """Under torch.compile(fullgraph=True) add_norm hands Inductor its composite or the registered op;
    both give eager's outputs and gradients, with the same hashed dropout mask for the same seed."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Block(32)
    x = torch.randn(3, 5, 32)
    seed = torch.tensor(99)
    eager = model(x, seed)
    grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    set_compile_path(path)
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x, seed)
    got = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    for a, c in zip(got, grads, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)


@needs_triton
@pytest.mark.parametrize("path", ["composite", "kernel"])
def test_a_triton_call_compiles_into_one_graph(path, restore_compile_path, dynamo_cache_warnings):
    """A Triton-backend call under torch.compile(fullgraph=True) gives eager's outputs. Its trace-time
    plan builds none of the eager path's launch specs: the graph never launches from them, and Dynamo
    cannot trace their making (each launch's autograd.Function subclass is made with ``type`` and
    ``staticmethod``: "Failed to trace builtin operator staticmethod"), nor should it trace the specs'
    lru_caches (it warned about each on the H100)."""
    torch._dynamo.reset()
    x, r, w, b, _ = _inputs(4, 16, device=DEVICE)
    call = lambda x, r, w, b: add_norm(x, r, w, b, prenorm=True, backend="triton")  # noqa: E731
    eager = call(x, r, w, b)
    fn.clear_plans()  # the signature is new to the trace as to a fresh process
    set_compile_path(path)
    with dynamo_cache_warnings() as cached:
        got = torch.compile(call, fullgraph=True)(x, r, w, b)
    for a, e in zip(got, eager, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    assert not cached, "\n".join(cached)


def test_compile_path_setting_is_checked():
    assert compile_path() in ("composite", "kernel")
    with pytest.raises(ValueError, match="path: expected one of"):
        set_compile_path("opaque")


# --- policy --------------------------------------------------------------------------------------


def test_policy_prefers_unfused_modules_on_the_cpu_only_with_dropout():
    """(The GPUs' rules, by device name: tests/test_ops_policy.py.)"""
    assert fused_op_preferred(torch.device("cpu"), dropout=False)
    assert not fused_op_preferred(torch.device("cpu"), dropout=True)
    assert fused_op_preferred("cpu", dropout=False, numel=8)


# --- triton_op registration ----------------------------------------------------------------------


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_op_registration_finds_the_kernels_and_traces_on_the_cpu():
    """Where CUDA is present the ops are torch.library.triton_ops (forced here with ADDNORM_TRITON_OP=1):
    their schemas come from FwdArgs/BwdArgs, triton_op finds the kernels in their bodies (the backward's
    two: the row-sums pre-pass of the variant "row_sums" too), opcheck passes, and
    torch.compile(fullgraph=True) traces through them (on the CPU into the torch path). Compiled with
    aot_eager: Dynamo and AOTAutograd do the tracing this checks; Inductor's CPU code for the op is
    test_ops_compiled's and test_compiled_paths_drop_the_same_elements_as_eager's (it cost 50 s of
    gcc here on a cold cache)."""
    code = """
import torch
from torch._library.triton import get_triton_kernels_for_op
from addnorm.ops import library as lib, add_norm, set_compile_path
assert lib.TRITON_OP
names = [k.fn.__name__ for op in ('fwd', 'bwd') for k in get_triton_kernels_for_op(f'addnorm::add_norm_{op}')]
assert names == ['_add_norm_fwd_kernel', '_add_norm_bwd_kernel', '_add_norm_bwd_sums_kernel'], names
x, r, w = torch.randn(4, 16, requires_grad=True), torch.randn(4, 16), torch.ones(16, requires_grad=True)
args = (x, r, w, None, None, torch.tensor(3), None, 0, 'layernorm', 1e-5, 1.0, 0.1)
args += (torch.float32, torch.float32, True, 'torch')
torch.library.opcheck(lib.add_norm_fwd, args)
set_compile_path('kernel')
f = torch.compile(lambda x, r, w: add_norm(x, r, w, prenorm=True, dropout_p=0.1, seed=3), fullgraph=True,
                  backend='aot_eager')
y, s = f(x, r, w)
y2, s2 = add_norm(x, r, w, prenorm=True, dropout_p=0.1, seed=3)
torch.testing.assert_close(y, y2); torch.testing.assert_close(s, s2)
(y.square().sum() + s.sum()).backward()
print('ok')
"""
    env = {**os.environ, "ADDNORM_TRITON_OP": "1", "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


# --- the cached call plan ------------------------------------------------------------------------


def test_a_call_signature_is_planned_once_and_bad_tensors_still_get_clear_errors():
    fn.clear_plans()
    x, r, w, b, _ = _inputs(4, 16, device="cpu")
    for _ in range(3):
        add_norm(x, r, w, b)
        add_norm(x[:2], r[:2], w, b)  # another row count: the same plan
    assert len(fn._PLANS) == 1
    with pytest.raises(ValueError, match=r"weight: expected shape \(16,\)"):
        add_norm(x, r, w[:8], b)  # same key as the cached plan; torch rejects it, the check names it
    with pytest.raises(ValueError, match=r"bias: expected shape \(16,\)"):
        add_norm(x, r, w, b[:1], norm="rmsnorm")  # an add would broadcast it
    with pytest.raises(ValueError, match="residual: expected the shape of x"):
        add_norm(x, r[:2], w, b)


def test_an_option_that_cannot_be_keyed_is_checked_not_served_the_last_plan():
    """An unhashable option (a list for eps) cannot key a plan: the call is checked in full and
    refused, never run with the previous call's cached plan."""
    fn.clear_plans()
    x, r, w, b, _ = _inputs(4, 16, device="cpu")
    add_norm(x, r, w, b)
    with pytest.raises(ValueError, match="eps: expected a positive finite float"):
        add_norm(x, r, w, b, eps=[1e-5])
    with pytest.raises(TypeError, match="alpha: expected a finite Python float"):
        add_norm(x, r, w, b, alpha=[2.0])


def test_alternating_call_signatures_and_a_policy_change_each_get_their_own_plan():
    """The last call's plan is reused only for the same signature (the key compared, not hashed): calls
    alternating between two signatures get each its own result, and a change of policy plans anew."""
    from addnorm.ops import policy

    fn.clear_plans()
    x, r, w, b, _ = _inputs(4, 16, device="cpu")
    s = x + r
    for _ in range(2):
        y = add_norm(x, r, w, b)
        torch.testing.assert_close(y, F.layer_norm(s, (16,), w, b, 1e-5))
        y, s2 = add_norm(x, r, w, None, norm="rmsnorm", prenorm=True)
        torch.testing.assert_close(y, F.rms_norm(s, (16,), w, 1e-5))
        assert torch.equal(s2, s)
    assert len(fn._PLANS) == 2
    policy.invalidate()  # a new policy version: the same call is planned again, not served stale
    add_norm(x, r, w, None, norm="rmsnorm", prenorm=True)
    assert len(fn._PLANS) == 3


@needs_triton
def test_a_cached_triton_plan_still_names_a_tensor_on_another_device_or_of_another_shape(monkeypatch):
    """After the plan is cached, the Triton path's per-call checks name a residual, weight or bias on
    another device than x or of another shape, before any kernel is launched."""
    from addnorm.ops.triton import launchers as k

    fn.clear_plans()
    x, r, w, b, _ = _inputs(4, 16)
    add_norm(x, r, w, b, backend="triton")

    class NoKernel:
        def __getitem__(self, grid):
            raise AssertionError("a kernel was launched")

    monkeypatch.setattr(k, "fwd_kernel", NoKernel())
    bad = [
        ({"residual": r.to("meta")}, r"residual: expected a tensor on"),
        ({"weight": w.to("meta")}, r"weight: expected a tensor on"),
        ({"bias": b.to("meta")}, r"bias: expected a tensor on"),
        ({"residual": r[:2]}, r"residual: expected the shape of x"),
        ({"weight": w[:8]}, r"weight: expected shape \(16,\)"),
        ({"bias": b.reshape(1, 16)}, r"bias: expected shape \(16,\)"),
    ]
    for change, match in bad:
        args = {"residual": r, "weight": w, "bias": b, **change}
        with pytest.raises(ValueError, match=match):
            add_norm(x, args["residual"], args["weight"], args["bias"], backend="triton")
    assert len(fn._PLANS) == 1  # every call above had the cached plan's key


def test_no_environment_lookup_per_call(monkeypatch):
    x, r, w, b, _ = _inputs(4, 16, device="cpu")
    add_norm(x, r, w, b, dropout_p=0.1)
    add_norm(x, r, w, b, norm="rmsnorm", prenorm=True)

    class Watched(dict):
        def __getitem__(self, key):
            raise AssertionError(f"environment read per call: {key}")

        get = __getitem__

    monkeypatch.setattr(os, "environ", Watched(os.environ))
    monkeypatch.setattr(os, "getenv", lambda *a: (_ for _ in ()).throw(AssertionError(f"getenv {a}")))
    add_norm(x, r, w, b, dropout_p=0.1)
    add_norm(x, r, w, b, norm="rmsnorm", prenorm=True)


def test_eager_cpu_dropout_without_a_seed_drops_what_nn_dropout_drops():
    """No seed on the CPU in eager mode: the op's mask is nn.Dropout's (the same Bernoulli draws from
    torch's generator), and backward keeps it; a given seed still gives the hashed mask."""
    x, r, w, b, _ = _inputs(6, 50, device="cpu")
    x.requires_grad_(True)
    torch.manual_seed(3)
    y, s = add_norm(x, r, w, b, prenorm=True, dropout_p=0.3)
    torch.manual_seed(3)
    dropped = F.dropout(x, 0.3, training=True)
    torch.testing.assert_close(s, dropped + r, rtol=0, atol=0)
    torch.testing.assert_close(y, F.layer_norm(dropped + r, (50,), w, b), rtol=0, atol=0)
    (gx,) = torch.autograd.grad(s.sum(), x)
    torch.testing.assert_close(gx, (dropped != 0).float() / 0.7)
    assert 0 < (dropped == 0).float().mean() < 0.6
