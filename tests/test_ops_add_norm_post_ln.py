"""Where the Post-LN backward takes x_hat (``XHAT_FROM_S``: the saved s; ``XHAT_FROM_Y``: the output y,
x_hat = (y - b) / w; ``XHAT_FROM_XR``: s recomputed from x and residual): opcheck of both registered ops,
each source against the float64 oracle on both backends, and the from-y backward where w is zero or
tiny, or only a weight or a bias is given (there it recomputes s)."""

from __future__ import annotations

import pytest
import torch
from _add_norm_cases import ATOL, DEVICE, _triton_ready, assert_close_to_oracle, make_case, needs_triton, run

from addnorm.ops import add_norm, add_norm_reference
from addnorm.ops import library as lib
from addnorm.ops.args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y


def _unsafe_affine(w, b, every=3):
    """Columns where x_hat = (y - b) / w is lost or ill-conditioned: exact zeros in w (every
    ``every``-th column from 0) and |w| = 1e-3 << |b| = 1 (every ``every``-th column from 1)."""
    w, b = w.clone(), b.clone()
    w[::every] = 0.0
    w[1::every] = 1e-3
    w[1 :: 2 * every] = -1e-3  # both signs
    b[1::every] = 1.0
    return w, b


XHAT_CASES = [(True, XHAT_FROM_S), (False, XHAT_FROM_S), (False, XHAT_FROM_Y), (False, XHAT_FROM_XR)]


@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("prenorm, xhat_from", XHAT_CASES)
def test_opcheck_forward_and_backward(norm, prenorm, xhat_from):
    """Both ops, with a zero weight and a |w| << |b| column (the from-y backward recomputes s there)."""
    x, r, w, b, g = make_case(5, 12, gate="vector")
    w, b = _unsafe_affine(w, b, every=5)
    x, r, w, b, g = (t.requires_grad_(True) for t in (x, r, w, b, g))
    seed = torch.tensor(17)
    args = (
        x,
        r,
        w,
        b,
        g,
        seed,
        None,
        xhat_from,
        norm,
        1e-5,
        0.9,
        0.2,
        torch.float32,
        torch.float32,
        prenorm,
        "torch",
    )
    torch.library.opcheck(lib.add_norm_fwd, args)
    y, s, mean, rstd = lib.add_norm_fwd(*[a.detach() if isinstance(a, torch.Tensor) else a for a in args])
    store_s = prenorm or xhat_from == XHAT_FROM_S
    assert s.numel() == (y.numel() if store_s else 0)
    saved = s if store_s else (y if xhat_from == XHAT_FROM_Y else s)
    dy, ds = torch.randn_like(y), torch.randn_like(y) if prenorm else None
    bargs = (dy, ds, saved, *(t.detach() for t in (x, r, w, b, g)), seed, None, mean, rstd)
    bargs = (*bargs, XHAT_FROM_S if prenorm else xhat_from, norm, 0.9, 0.2)
    bargs = (*bargs, torch.float32, torch.float32, torch.float32)
    bargs = (*bargs, True, "torch")
    torch.library.opcheck(lib.add_norm_bwd, bargs)
    assert all(torch.isfinite(t).all() for t in lib.add_norm_bwd(*bargs))


@pytest.mark.parametrize(
    "backend", ["torch", pytest.param("triton", marks=[pytest.mark.triton, needs_triton])]
)
@pytest.mark.parametrize("xhat_from", [XHAT_FROM_S, XHAT_FROM_Y, XHAT_FROM_XR])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_post_ln_backward_from_y_or_from_s(backend, xhat_from, norm):
    """Post-LN backward takes x_hat from s, from the output y (x_hat = (y - b) / w) or from s recomputed
    from x and residual: all agree with the float64 oracle on both backends."""
    if backend == "triton" and not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, g = make_case(6, 40, gate="vector", device=DEVICE)
    leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b, g)]
    seed = torch.tensor(5, device=DEVICE)
    y, s, _, _ = lib.add_norm_fwd(
        *leaves, seed, None, xhat_from, norm, 1e-5, 1.3, 0.2, torch.float32, torch.float32, False, backend
    )
    assert s.numel() == (y.numel() if xhat_from == XHAT_FROM_S else 0)
    dy = torch.randn_like(y)
    grads = torch.autograd.grad((y * dy).sum(), leaves)
    ref_leaves = [t.double().requires_grad_(True) for t in (x, r, w, b, g)]
    y_ref = add_norm_reference(
        *ref_leaves[:4], gate=ref_leaves[4], norm=norm, alpha=1.3, dropout_p=0.2, seed=5
    )
    ref = torch.autograd.grad((y_ref * dy.double()).sum(), ref_leaves)
    torch.testing.assert_close(y.double(), y_ref, atol=1e-5, rtol=1e-5)
    for got, want in zip(grads, ref, strict=True):
        torch.testing.assert_close(got.double(), want, atol=1e-4, rtol=1e-4)


def _post_ln(backend, xhat_from, norm, dropout_p):
    """Post-LN y = N(1.3 r + g dropout(x)) through the custom op, choosing where backward takes x_hat."""
    seed = torch.tensor(5, device=DEVICE) if dropout_p else None

    def fn(x, r, w, b, g):
        args = (seed, None, xhat_from, norm, 1e-5, 1.3, dropout_p, r.dtype, x.dtype, False, backend)
        y, s, _, _ = lib.add_norm_fwd(x, r, w, b, g, *args)
        assert s.numel() == (y.numel() if xhat_from == XHAT_FROM_S else 0)
        return y

    return fn


def _oracle(norm, dropout_p, dtype):
    kw = {"norm": norm, "alpha": 1.3, "dropout_p": dropout_p, "seed": 5 if dropout_p else None}
    return lambda x, r, w, b, g: add_norm_reference(x, r, w, b, gate=g, dtype=dtype, **kw)


BOTH_BACKENDS = ["torch", pytest.param("triton", marks=[pytest.mark.triton, needs_triton])]


def _check_post_ln_from_y(backend, norm, dropout_p, dtype, x, r, w, b, g):
    """Post-LN with the from-y backward: finite gradients, within the tolerance rule of the oracle."""
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64).to(DEVICE)
    out, grads = run(_post_ln(backend, XHAT_FROM_Y, norm, dropout_p), x, r, w, b, g, dy, None, False)
    out_ref, grads_ref = run(_oracle(norm, dropout_p, torch.float64), x, r, w, b, g, dy, None, False)
    out_low, grads_low = run(_oracle(norm, dropout_p, dtype), x, r, w, b, g, dy, None, False)
    assert_close_to_oracle(out[0], out_low[0], out_ref[0], dtype, "y")
    for name, o, lo, rf in zip(
        ("dx", "dresidual", "dweight", "dbias", "dgate"), grads, grads_low, grads_ref, strict=True
    ):
        assert o is None or torch.isfinite(o).all(), name
        assert_close_to_oracle(o, lo, rf, dtype, f"{backend} {name}")


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dropout_p, gate", [(0.0, None), (0.3, None), (0.3, "vector")])
def test_post_ln_from_y_with_zero_and_tiny_weights(backend, dtype, norm, dropout_p, gate):
    """x_hat cannot come from y where w_j = 0 or |b_j| >> |w_j|: there the backward recomputes s from x
    and residual, so the gradients stay finite and as close to the float64 oracle as the saved-s path."""
    if backend == "triton" and not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, g = make_case(6, 40, dtype, gate=gate, device=DEVICE)
    w, b = _unsafe_affine(w, b)
    _check_post_ln_from_y(backend, norm, dropout_p, dtype, x, r, w, b, g)
    if backend == "triton" and dtype == torch.float32:  # the public op's path for fp32 y on Triton
        dy = torch.randn(x.shape, dtype=torch.float64, device=DEVICE)
        seed = 5 if dropout_p else None
        kw = {"norm": norm, "alpha": 1.3, "dropout_p": dropout_p, "seed": seed, "backend": backend}
        public = run(lambda *t: add_norm(*t[:4], gate=t[4], **kw), x, r, w, b, g, dy, None, False)
        direct = run(_post_ln(backend, XHAT_FROM_Y, norm, dropout_p), x, r, w, b, g, dy, None, False)
        for p, d in zip(public[0] + public[1], direct[0] + direct[1], strict=True):
            assert p is None and d is None or torch.equal(p, d)


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("affine", ["weight", "bias"])
def test_post_ln_from_y_weight_or_bias_only(backend, norm, affine):
    """Weight only: zeros are unsafe; bias only (w = 1): |b_j| > 1 is unsafe."""
    if backend == "triton" and not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, g = make_case(6, 40, torch.bfloat16, gate="scalar", device=DEVICE)
    w, b = _unsafe_affine(w, b)
    b[::3] = 40.0  # |b| > 1 where w = 0
    w, b = (w, None) if affine == "weight" else (None, b)
    _check_post_ln_from_y(backend, norm, 0.2, torch.bfloat16, x, r, w, b, g)


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_post_ln_from_y_bf16_large_bias_small_weight(backend, norm):
    """bf16 y carries rounding error ~2**-8 |b|, which (y - b) / w would amplify by 1 / |w|: with
    |b| = 1 >> |w| = 1e-3 in half the columns, recomputing is within 2x the saved-s path's error."""
    if backend == "triton" and not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    dtype = torch.bfloat16
    x, r, w, b, g = make_case(8, 64, dtype, gate="scalar", device=DEVICE)
    w, b = _unsafe_affine(w, b, every=2)
    w[::2] = 1e-3
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64).to(DEVICE)
    _, grads_ref = run(_oracle(norm, 0.1, torch.float64), x, r, w, b, g, dy, None, False)
    _, grads_y = run(_post_ln(backend, XHAT_FROM_Y, norm, 0.1), x, r, w, b, g, dy, None, False)
    _, grads_s = run(_post_ln(backend, XHAT_FROM_S, norm, 0.1), x, r, w, b, g, dy, None, False)
    for name, gy, gs, rf in zip(
        ("dx", "dresidual", "dweight", "dbias", "dgate"), grads_y, grads_s, grads_ref, strict=True
    ):
        err = (gy.double() - rf).abs().max().item()
        base = (gs.double() - rf).abs().max().item()
        assert err <= 2 * base + ATOL[dtype] * max(1.0, rf.abs().max().item()), (name, err, base)


@pytest.mark.parametrize("backend", BOTH_BACKENDS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_post_ln_from_y_recomputes_s_exactly(backend, norm):
    """With every column unsafe, backward takes x_hat from the recomputed s in every column: the same
    bits as the saved s, so the gradients equal the saved-s path's (exactly where the formulas match)."""
    if backend == "triton" and not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, g = make_case(5, 33, torch.bfloat16, gate="vector", device=DEVICE)
    b = torch.full_like(b, 4.0)
    w = torch.where(torch.arange(33, device=DEVICE) % 2 == 0, 0.0, w * 1e-2)
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64).to(DEVICE)
    _, grads_y = run(_post_ln(backend, XHAT_FROM_Y, norm, 0.2), x, r, w, b, g, dy, None, False)
    _, grads_s = run(_post_ln(backend, XHAT_FROM_S, norm, 0.2), x, r, w, b, g, dy, None, False)
    for gy, gs in zip(grads_y, grads_s, strict=True):
        if backend == "triton" or norm == "rmsnorm":
            assert torch.equal(gy, gs)
        else:  # the saved-s LayerNorm backward is aten's kernel, the from-y one spells x_hat out
            torch.testing.assert_close(gy, gs, atol=1e-2, rtol=1e-2)
