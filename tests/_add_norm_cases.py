"""The shared helpers of the fused op's tests (``test_ops_add_norm*.py``): random inputs, the op against
the float64 oracle with its tolerance rule, the cases that together cover every option, and the Triton
and GPU skip marks."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels run in the interpreter on CPU; must be set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from addnorm.ops import add_norm, add_norm_reference, resolve_backend  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}


def _triton_ready() -> bool:
    if not HAS_TRITON:
        return False
    if HAS_CUDA:
        return True
    from addnorm.ops.triton.kernels import kernels_are_interpreted

    return kernels_are_interpreted()


# the kernels run: on CUDA, or interpreted (TRITON_INTERPRET=1 before Triton was first imported)
needs_triton = pytest.mark.skipif(
    not _triton_ready(), reason="triton not importable, or no CUDA and the kernels not interpreted"
)
needs_gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


# --- helpers ------------------------------------------------------------------------------------


def make_case(
    rows=7,
    hidden=123,
    dtype=torch.float32,
    *,
    lead=None,
    gate=None,
    weight=True,
    bias=True,
    noncontig=False,
    device="cpu",
    res_dtype=None,
):
    """Random inputs: x, residual (rows x hidden, or lead + (hidden,)), weight, bias, gate."""
    shape = tuple(lead) + (hidden,) if lead is not None else (rows, hidden)
    g = torch.Generator().manual_seed(rows * 1009 + hidden)

    def rnd(*s, scale=1.0, dt=dtype):
        return (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(dt).to(device)

    if noncontig:
        # every other row of a taller tensor, and the hidden dim sliced from a wider one
        x = rnd(shape[0] * 2, hidden + 3)[::2, 1 : hidden + 1]
        r = rnd(shape[0] * 2, hidden + 5, dt=res_dtype or dtype)[::2, 2 : hidden + 2]
        assert not x.is_contiguous()
    else:
        x = rnd(*shape)
        r = rnd(*shape, scale=2.0, dt=res_dtype or dtype)
    w = (1.0 + 0.5 * rnd(hidden, dt=torch.float64)).to(dtype).to(device) if weight else None
    b = rnd(hidden, scale=0.3) if bias else None
    gt = None
    if gate == "scalar":
        gt = torch.tensor([0.7], dtype=dtype, device=device)
    elif gate == "vector":
        gt = (0.5 + 0.2 * rnd(hidden, dt=torch.float64)).to(dtype).to(device)
    return x, r, w, b, gt


def run(fn, x, r, w, b, g, dy, ds, prenorm):
    """Outputs and gradients (x, residual, weight, bias, gate) of fn(x, r, w, b, g)."""
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in (x, r, w, b, g)]
    out = fn(*leaves)
    y, s = out if prenorm else (out, None)
    loss = (y.double() * dy).sum()
    if s is not None:
        loss = loss + (s.double() * ds).sum()
    inputs = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(loss, inputs, allow_unused=True))
    gout = [next(grads) if t is not None else None for t in leaves]
    return [y.detach()] + ([s.detach()] if s is not None else []), gout


def assert_close_to_oracle(ours, low, ref, dtype, what):
    """|ours - ref| <= 2 |low - ref| + atol, elementwise maxima; low = the same formula in torch at
    the inputs' precision, ref = float64."""
    if ref is None:
        assert ours is None, what
        return
    assert ours.shape == ref.shape, what
    if ref.numel() == 0:
        return
    err = (ours.double() - ref).abs().max().item()
    base = (low.double() - ref).abs().max().item()
    tol = 2 * base + ATOL[dtype] * max(1.0, ref.abs().max().item())
    assert err <= tol, f"{what}: error {err:.3g} > 2 * torch error {base:.3g} + atol"


def check_against_oracle(
    backend,
    *,
    dtype=torch.float32,
    norm="layernorm",
    prenorm=True,
    alpha=1.0,
    dropout_p=0.0,
    residual_in_fp32=False,
    device="cpu",
    seed=1234,
    **case,
):
    """The op on ``backend`` against the float64 oracle and the same formula at the inputs' precision
    (outputs and every gradient), on the inputs ``make_case`` draws for ``case`` (rows, hidden, lead,
    gate, weight, bias, noncontig)."""
    x, r, w, b, g = make_case(dtype=dtype, device=device, **case)
    gen = torch.Generator().manual_seed(7)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device)
    ds = torch.randn(x.shape, generator=gen, dtype=torch.float64).to(device)
    kw = {"norm": norm, "eps": 1e-5, "prenorm": prenorm, "alpha": alpha, "dropout_p": dropout_p}

    def ours(x, r, w, b, g):
        return add_norm(
            x,
            r,
            w,
            b,
            gate=g,
            training=True,
            seed=seed,
            residual_in_fp32=residual_in_fp32,
            backend=backend,
            **kw,
        )

    def oracle(dt):
        return lambda x, r, w, b, g: add_norm_reference(
            x, r, w, b, gate=g, seed=seed if dropout_p else None, dtype=dt, **kw
        )

    if backend == "triton":  # the kernels really run (no silent fallback) for these shapes
        assert resolve_backend(backend, x.device, x.shape[-1], (dtype,)) == "triton"
    out, grads = run(ours, x, r, w, b, g, dy, ds, prenorm)
    out_ref, grads_ref = run(oracle(torch.float64), x, r, w, b, g, dy, ds, prenorm)
    low_dtype = torch.float32 if residual_in_fp32 else dtype
    out_low, grads_low = run(oracle(low_dtype), x, r, w, b, g, dy, ds, prenorm)
    assert out[0].dtype == dtype and out[0].shape == x.shape
    if prenorm:
        assert out[1].dtype == (torch.float32 if residual_in_fp32 else r.dtype)
    for i, name in enumerate(["y", "s"][: len(out)]):
        assert_close_to_oracle(out[i], out_low[i], out_ref[i], dtype, f"{backend} {name}")
    for name, o, lo, rf in zip(
        ("dx", "dresidual", "dweight", "dbias", "dgate"), grads, grads_low, grads_ref, strict=True
    ):
        if o is not None:
            assert o.dtype == dtype and o.shape == rf.shape
        assert_close_to_oracle(o, lo, rf, dtype, f"{backend} {name}")


# Cases that together cover every axis: dtype, norm, prenorm, alpha, gate, dropout, hidden size,
# rows (0, 1, odd), leading dims, non-contiguous, no affine / no bias, residual_in_fp32.
CASES = [
    dict(dtype=torch.float32, norm="layernorm", prenorm=True, hidden=123),
    dict(dtype=torch.float32, norm="rmsnorm", prenorm=False, hidden=1000, rows=5),
    dict(dtype=torch.float16, norm="layernorm", prenorm=False, alpha=2.0, hidden=5),
    dict(dtype=torch.bfloat16, norm="rmsnorm", prenorm=True, gate="vector", hidden=123),
    dict(dtype=torch.bfloat16, norm="layernorm", prenorm=True, dropout_p=0.25, hidden=1000, rows=3),
    dict(dtype=torch.float16, norm="rmsnorm", prenorm=False, gate="scalar", dropout_p=0.1, hidden=64),
    dict(dtype=torch.float32, norm="layernorm", prenorm=False, gate="vector", dropout_p=0.5, alpha=0.5),
    dict(dtype=torch.float32, norm="rmsnorm", prenorm=True, hidden=1, rows=1),
    dict(dtype=torch.float32, norm="layernorm", prenorm=True, hidden=1, rows=3),
    dict(dtype=torch.float32, norm="layernorm", prenorm=True, hidden=5120, rows=1),
    dict(dtype=torch.float16, norm="rmsnorm", prenorm=True, hidden=5120, rows=2, dropout_p=0.2),
    dict(dtype=torch.float32, norm="layernorm", prenorm=True, rows=0, hidden=37),
    dict(dtype=torch.float32, norm="rmsnorm", prenorm=False, rows=0, hidden=37, gate="vector"),
    dict(dtype=torch.float32, norm="layernorm", prenorm=False, lead=(2, 3), hidden=17),
    dict(dtype=torch.bfloat16, norm="rmsnorm", prenorm=True, noncontig=True, rows=5, hidden=33),
    dict(
        dtype=torch.float32, norm="layernorm", prenorm=False, noncontig=True, rows=4, hidden=33, gate="scalar"
    ),
    dict(dtype=torch.float32, norm="layernorm", prenorm=True, weight=False, bias=False, hidden=31),
    dict(dtype=torch.float16, norm="rmsnorm", prenorm=False, bias=True, hidden=31),
    dict(dtype=torch.float16, norm="layernorm", prenorm=True, residual_in_fp32=True, hidden=48, alpha=1.5),
    dict(dtype=torch.float32, norm="layernorm", prenorm=False, weight=False, bias=True, hidden=19),
]


def _case_id(c):
    parts = [str(c["dtype"]).replace("torch.", ""), c["norm"][:3], "pre" if c["prenorm"] else "post"]
    parts += [f"{k}={v}" for k, v in c.items() if k not in ("dtype", "norm", "prenorm")]
    return "-".join(parts)
