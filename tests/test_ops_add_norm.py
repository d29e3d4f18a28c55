"""The fused Add & Norm op: torch (CPU) and Triton (interpreted on CPU, or CUDA) paths against a float64
oracle, dropout-mask properties, torch.library registration, torch.compile, errors."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    # the Triton kernels run in the interpreter on CPU; must be set before they are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

from addnorm.ops import (  # noqa: E402
    MAX_FUSED_HIDDEN,
    add_norm,
    add_norm_reference,
    dropout_keep_mask,
    policy,
    resolve_backend,
)
from addnorm.ops import library as lib  # noqa: E402
from addnorm.ops.args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y  # noqa: E402

HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if HAS_CUDA else "cpu"
ATOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float64: 1e-10}


def _triton_ready() -> bool:
    if not HAS_TRITON:
        return False
    if HAS_CUDA:
        return True
    from addnorm.ops.triton_kernels import kernels_are_interpreted

    return kernels_are_interpreted()


needs_triton = pytest.mark.skipif(
    not HAS_TRITON or not (HAS_CUDA or os.environ.get("TRITON_INTERPRET") == "1"),
    reason="triton not importable, or no CUDA and TRITON_INTERPRET is not 1",
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


def _unsafe_affine(w, b, every=3):
    """Columns where x_hat = (y - b) / w is lost or ill-conditioned: exact zeros in w (every
    ``every``-th column from 0) and |w| = 1e-3 << |b| = 1 (every ``every``-th column from 1)."""
    w, b = w.clone(), b.clone()
    w[::every] = 0.0
    w[1::every] = 1e-3
    w[1 :: 2 * every] = -1e-3  # both signs
    b[1::every] = 1.0
    return w, b


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


# --- torch (CPU) path ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_torch_path_matches_float64_oracle(case):
    check_against_oracle("torch", **case)


def test_float64_gradcheck_through_cpu_path():
    x, r, w, b, g = make_case(3, 6, torch.float64, gate="vector")
    for norm in ("layernorm", "rmsnorm"):
        for prenorm in (True, False):

            def f(x, r, w, b, g, norm=norm, prenorm=prenorm):
                return add_norm(
                    x,
                    r,
                    w,
                    b,
                    norm=norm,
                    prenorm=prenorm,
                    alpha=0.8,
                    gate=g,
                    dropout_p=0.3,
                    seed=11,
                    training=True,
                )

            args = [t.clone().requires_grad_(True) for t in (x, r, w, b, g)]
            assert torch.autograd.gradcheck(f, args)
    gs = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    args = [t.clone().requires_grad_(True) for t in (x, r, w)]
    assert torch.autograd.gradcheck(lambda x, r, w, g: add_norm(x, r, w, norm="rmsnorm", gate=g), (*args, gs))


def test_dropout_gradient_uses_the_forward_mask():
    """Finite differences through the float64 oracle with the same fixed seed agree with our backward."""
    x, r, w, b, _ = make_case(4, 9, torch.float64)
    x.requires_grad_(True)
    kw = {"norm": "layernorm", "prenorm": False, "dropout_p": 0.4}
    y = add_norm(x, r, w, b, seed=99, training=True, **kw)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * dy).sum(), x)
    h = 1e-6
    num = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            e = torch.zeros_like(x)
            e[i, j] = h
            f = lambda t: (add_norm_reference(t, r, w, b, seed=99, **kw) * dy).sum()  # noqa: E731
            num[i, j] = (f(x.detach() + e) - f(x.detach() - e)) / (2 * h)
    torch.testing.assert_close(gx, num, atol=1e-6, rtol=1e-5)
    dropped = ~dropout_keep_mask(99, 4, 9, 0.4)
    assert dropped.any() and (gx[dropped] == 0).all()


def test_no_dropout_in_eval_and_defaults():
    x, r, w, b, _ = make_case(3, 8)
    y_eval = add_norm(x, r, w, b, dropout_p=0.5, training=False)
    torch.testing.assert_close(y_eval, add_norm_reference(x, r, w, b, dtype=None))
    y_tr = add_norm(x, r, w, b, dropout_p=0.5, training=True, seed=1)
    assert not torch.allclose(y_tr, y_eval)


def test_out_dtype_and_mixed_dtypes():
    x, _, w, b, _ = make_case(4, 16, torch.bfloat16)
    r = torch.randn(4, 16, dtype=torch.float32)
    y, s = add_norm(x, r, w, b, prenorm=True, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    ref_y, ref_s = add_norm_reference(x, r, w, b, prenorm=True)
    torch.testing.assert_close(s.double(), ref_s, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y.double(), ref_y, atol=1e-4, rtol=1e-4)
    y2, s2 = add_norm(x, x, w, b, prenorm=True, residual_in_fp32=True)
    assert y2.dtype == torch.bfloat16 and s2.dtype == torch.float32


def test_hidden_beyond_one_pass_falls_back_to_torch():
    hidden = MAX_FUSED_HIDDEN + 8
    x, r = torch.randn(2, hidden), torch.randn(2, hidden)
    policy._warned.clear()
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.warns(RuntimeWarning, match="torch path"):
            assert resolve_backend("triton", x.device, hidden, (torch.float32,)) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), hidden, (torch.float32,)) == "torch"
    y = add_norm(x, r, None, norm="rmsnorm")
    torch.testing.assert_close(y, add_norm_reference(x, r, norm="rmsnorm", dtype=None))


# --- dropout mask -------------------------------------------------------------------------------


def _py_hash(v: int) -> int:
    m = 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & m
    v ^= v >> 15
    v = (v * 0x1B873593) & m
    return v ^ (v >> 16)


def test_mask_matches_scalar_python_definition():
    seed, rows, cols, p = (123 << 32) + 456789, 5, 11, 0.3
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    expected = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        a = _py_hash(k0 ^ _py_hash((i * 0x632BE5AB + k1) & 0xFFFFFFFF))
        for j in range(cols):
            h = _py_hash(a ^ ((j * 0x2545F491) & 0xFFFFFFFF))
            expected[i, j] = (h >> 8) >= round(p * 2**24)
    assert torch.equal(dropout_keep_mask(seed, rows, cols, p), expected)
    assert torch.equal(dropout_keep_mask(torch.tensor(seed), rows, cols, p), expected)


@pytest.mark.parametrize("seed", [0, 5, 2**40 + 7, 2**63 - 1])
def test_fast_mask_equals_int64_hash_composition(seed):
    """dropout_keep_mask computes its (rows, cols) part in int32; the int64 hash32 spells the definition."""
    from addnorm.ops.reference import HASH_COL, HASH_ROW, hash32

    m = 0xFFFFFFFF
    for rows, cols in ((300, 257), (1, 1), (3, 65)):
        row, col = torch.arange(rows), torch.arange(cols)
        a = hash32((seed & m) ^ hash32((row * HASH_ROW + (seed >> 32)) & m))
        h = hash32(a[:, None] ^ ((col * HASH_COL) & m)[None, :])
        for p in (1e-4, 0.1, 0.5, 0.9):
            assert torch.equal(dropout_keep_mask(seed, rows, cols, p), (h >> 8) >= round(p * 2**24))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_keep_rate_and_independence(p):
    rows, cols = 256, 512
    keep = dropout_keep_mask(2024, rows, cols, p).double()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # per-row rates stay within bounds too (no row is all kept / all dropped)
    row_sigma = (p * (1 - p) / cols) ** 0.5
    assert ((keep.mean(1) - (1 - p)).abs() < 6 * row_sigma).all()
    # neighbours (along columns, along rows) and another seed are uncorrelated
    c = keep - keep.mean()
    var = (c * c).mean()
    for a, bb in ((c[:, 1:], c[:, :-1]), (c[1:], c[:-1])):
        assert abs((a * bb).mean() / var) < 5 / n**0.5 * 2
    other = dropout_keep_mask(2025, rows, cols, p).double() - (1 - p)
    assert abs((c * other).mean() / var) < 10 / n**0.5


def test_seeds_reproduce_and_differ():
    x, r, w, b, _ = make_case(8, 64)
    kw = {"dropout_p": 0.3, "training": True}
    assert torch.equal(add_norm(x, r, w, b, seed=5, **kw), add_norm(x, r, w, b, seed=5, **kw))
    assert not torch.equal(add_norm(x, r, w, b, seed=5, **kw), add_norm(x, r, w, b, seed=6, **kw))
    torch.manual_seed(3)
    a = add_norm(x, r, w, b, **kw)
    torch.manual_seed(3)
    assert torch.equal(a, add_norm(x, r, w, b, **kw))
    assert not torch.equal(a, add_norm(x, r, w, b, **kw))


def test_dropout_scales_kept_elements():
    x = torch.ones(64, 256)
    _, s = add_norm(
        x, torch.zeros_like(x), None, prenorm=True, alpha=0.0, dropout_p=0.25, seed=8, training=True
    )
    keep = dropout_keep_mask(8, 64, 256, 0.25)
    torch.testing.assert_close(s, keep.float() / 0.75)


# --- registration, compile ----------------------------------------------------------------------


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


class _TwoSublayers(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f1, self.f2 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.w1, self.b1 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))
        self.w2 = torch.nn.Parameter(torch.ones(d))
        self.gate = torch.nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x, dropout_p=0.0):
        # Pre-LN boundary (y, s), then a Post-LN add & norm with LayerScale
        h, s = add_norm(
            self.f1(x), x, self.w1, self.b1, prenorm=True, dropout_p=dropout_p, training=self.training
        )
        return add_norm(self.f2(h), s, self.w2, norm="rmsnorm", gate=self.gate, alpha=1.2)


def test_torch_compile_fullgraph_cpu():
    torch.manual_seed(0)
    model = _TwoSublayers(16)
    x = torch.randn(2, 3, 16)
    eager = model(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)
    # with dropout the seed is drawn inside the graph: still no graph break
    out = compiled(x, 0.1)
    assert torch.isfinite(out).all()


# --- backend choice and errors ------------------------------------------------------------------


def test_backend_resolution(backend_env):
    cpu = torch.device("cpu")
    backend_env(None)
    assert resolve_backend("auto", cpu, 64, (torch.float32,)) == "torch"
    assert resolve_backend("torch", cpu, 64, (torch.float32,)) == "torch"
    if HAS_TRITON:
        assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float32,)) == "triton"
        assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float64,)) == "torch"
    backend_env("torch")
    assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float32,)) == "torch"
    backend_env("cuda-please")
    with pytest.raises(ValueError, match="ADDNORM_BACKEND"):
        resolve_backend("auto", cpu, 64, (torch.float32,))
    with pytest.raises(ValueError, match="ADDNORM_BACKEND"):
        add_norm(torch.randn(2, 4), torch.randn(2, 4), None)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if HAS_CUDA:
        pytest.skip("interpreter setting irrelevant with CUDA")
    monkeypatch.setattr(policy, "interpreting", lambda: False)
    policy.invalidate()  # no plan cached under the real interpreter setting
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET|not installed"):
        add_norm(x, x, None, backend="triton")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"residual": torch.randn(3, 5)}, ValueError, "residual: expected the shape"),
        ({"weight": torch.ones(7)}, ValueError, r"weight: expected shape \(8,\)"),
        ({"bias": torch.ones(8, 1)}, ValueError, "bias"),
        ({"gate": torch.ones(3)}, ValueError, "gate: expected None, a one-element"),
        ({"norm": "batchnorm"}, ValueError, "norm: expected 'layernorm' or 'rmsnorm', got 'batchnorm'"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p: expected a probability in \[0, 1\), got 1.0"),
        ({"dropout_p": -0.1}, ValueError, "dropout_p"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"backend": "cuda"}, ValueError, "backend: expected one of"),
        ({"x": torch.ones(3, 8, dtype=torch.int64)}, TypeError, "x: expected a float32"),
        ({"residual": [1.0]}, TypeError, "residual: expected a Tensor"),
        ({"x": torch.ones(3, 0), "residual": torch.ones(3, 0), "weight": None}, ValueError, "x: expected"),
        ({"out_dtype": torch.int32}, TypeError, "out_dtype"),
        ({"alpha": torch.tensor(1.0)}, TypeError, "alpha"),
        ({"seed": -1, "dropout_p": 0.1}, ValueError, "seed"),
    ],
)
def test_errors_name_the_argument(kwargs, exc, match):
    args = {"x": torch.randn(3, 8), "residual": torch.randn(3, 8), "weight": torch.ones(8), **kwargs}
    x, r, w = args.pop("x"), args.pop("residual"), args.pop("weight")
    with pytest.raises(exc, match=match):
        add_norm(x, r, w, **args, training=True)


# --- Triton kernels (interpreter on CPU, or CUDA) -----------------------------------------------


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_float64_oracle(case):
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    check_against_oracle("triton", device=DEVICE, **case)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", [c for c in CASES if c.get("hidden", 123) <= 200], ids=_case_id)
def test_triton_backward_in_column_slices_matches_float64_oracle(small_chunks, case):
    """Every case up to 200 columns (wider rows in the stand-ins' 16-column slices take the interpreter
    minutes: each slice's program reads every other) with rows from 16 columns in column slices (the
    launch tables' small stand-ins), in each backward variant: the slices reading each other's columns
    for the row sums, and the row-sums pre-pass before the slices."""
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    check_against_oracle("triton", device=DEVICE, **case)


@pytest.mark.triton
@needs_triton
def test_triton_and_torch_masks_are_identical():
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x = torch.ones(9, 300, device=DEVICE)
    zeros = torch.zeros_like(x)
    seed = (77 << 32) + 12345
    out = {}
    for backend in ("torch", "triton"):
        _, s = add_norm(x, zeros, None, prenorm=True, alpha=0.0, dropout_p=0.3, seed=seed, backend=backend)
        out[backend] = s
    assert torch.equal(out["torch"], out["triton"])
    keep = dropout_keep_mask(seed, 9, 300, 0.3, device=DEVICE)
    assert torch.equal(out["triton"] != 0, keep)


@pytest.mark.triton
@needs_triton
def test_triton_dweight_is_deterministic_and_env_selects_triton(backend_env):
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, _ = make_case(40, 24, device=DEVICE)  # 40 rows: several programs' partial sums
    backend_env("triton")
    grads = []
    for _ in range(2):
        wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = add_norm(x, r, wl, bl, norm="layernorm")
        grads.append(torch.autograd.grad(y.square().sum(), (wl, bl)))
    assert all(torch.equal(a, c) for a, c in zip(grads[0], grads[1], strict=True))


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.triton
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 65536])
def test_gpu_triton_matches_oracle_on_large_shapes(dtype, hidden):
    rows = max(1, 2**20 // hidden)
    for norm, prenorm in (("layernorm", False), ("rmsnorm", True)):
        check_against_oracle(
            "triton",
            dtype=dtype,
            norm=norm,
            prenorm=prenorm,
            rows=rows,
            hidden=hidden,
            dropout_p=0.1,
            device="cuda",
        )


@pytest.mark.gpu
@pytest.mark.triton
@needs_gpu
@pytest.mark.parametrize("variant", ["slices", "row_sums"])
def test_gpu_backward_variants_match_oracle_on_wide_rows(variant):
    """Each backward variant (launch_config.BWD_VARIANTS) as compiled for the GPU, on rows in column
    slices: Pre-LN and Post-LN (s recomputed from x and residual in bf16), dropout and a gate."""
    from addnorm.ops import launch_config as lc

    previous = lc.use_bwd_variant(variant)
    try:
        for dtype, norm, prenorm in ((torch.bfloat16, "layernorm", False), (torch.float32, "rmsnorm", True)):
            kw = {"rows": 64, "hidden": 8192, "dropout_p": 0.1, "gate": "vector", "device": "cuda"}
            check_against_oracle("triton", dtype=dtype, norm=norm, prenorm=prenorm, **kw)
    finally:
        lc.use_bwd_variant(previous)


@pytest.mark.gpu
@needs_gpu
def test_gpu_compile_fullgraph():
    model = _TwoSublayers(256).cuda()
    x = torch.randn(4, 8, 256, device="cuda")
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), atol=1e-4, rtol=1e-4)


def test_no_triton_import_from_addnorm():
    code = "import sys, addnorm, addnorm.ops; print('triton' in sys.modules)"
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dropout_p", [0.2, 0.0])
@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_eager_path_equals_the_registered_op(norm, prenorm, dropout_p):
    """In eager mode a CPU call runs the composite of torch ops under torch's autograd (its dropout
    multiplier from the NumPy mask); the registered custom op (what make_fx and dispatch modes record)
    runs the explicit torch path: same outputs bit for bit, same gradients to rounding."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, r, w, b, g = make_case(6, 40, gate="vector")
    kw = {"norm": norm, "prenorm": prenorm, "alpha": 1.3, "dropout_p": dropout_p, "seed": 9}

    def f(x, r, w, b, g):
        return add_norm(x, r, w, b, gate=g, **kw)

    traced = make_fx(f)(x, r, w, b, g)
    assert "addnorm.add_norm_fwd.default" in [str(n.target) for n in traced.graph.nodes]
    results = []
    for fn in (f, traced):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b, g)]
        out = fn(*leaves)
        y, s = out if prenorm else (out, out)
        loss = (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum() + s.square().sum()
        results.append((y.detach(), s.detach(), torch.autograd.grad(loss, leaves)))
    (y0, s0, g0), (y1, s1, g1) = results
    assert torch.equal(s0, s1)
    torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-6)
    for a, c in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_tracing_sees_the_registered_op():
    """make_fx (a dispatch mode) records addnorm::add_norm_fwd, not the eager path's torch ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, r, w, b, _ = make_case(4, 16)
    gm = make_fx(lambda x, r, w, b: add_norm(x, r, w, b, norm="rmsnorm"))(x, r, w, b)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "addnorm.add_norm_fwd.default" in targets
    torch.testing.assert_close(gm(x, r, w, b), add_norm(x, r, w, b, norm="rmsnorm"))
