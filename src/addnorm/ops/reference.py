"""Eager PyTorch Add & Norm: the CPU path of :func:`addnorm.ops.add_norm` and the test oracle.

    s = alpha * residual + gate * dropout(x)
    y = N(s),  N = LayerNorm (Ba et al. 2016): w * (s - mean) / sqrt(var + eps) + b
            or RMSNorm (Zhang & Sennrich 2019): w * s / sqrt(mean(s^2) + eps) (+ b)

The dropout mask is not drawn from torch's RNG but from a counter-based hash of (seed, row, column),
so it can be regenerated in backward instead of being stored, and the Triton kernels produce the same
mask bit for bit (:func:`dropout_keep_mask` is the definition both follow).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "HASH_COL",
    "HASH_M1",
    "HASH_M2",
    "HASH_ROW",
    "add_norm_reference",
    "dropout_keep_mask",
    "dropout_threshold",
    "hash32",
    "xhat_from_y_ok",
]

# Constants of the counter-based hash. Multipliers are odd and below 2**31 so that a 32-bit value
# times a multiplier fits in int64 (the torch side computes in int64 and keeps the low 32 bits; the
# Triton side computes in uint32, which wraps the same way).
_M32 = 0xFFFFFFFF
HASH_M1 = 0x7FEB352D
HASH_M2 = 0x1B873593
HASH_ROW = 0x632BE5AB
HASH_COL = 0x2545F491
_THRESHOLD_BITS = 24  # the mask compares the top 24 bits of the hash with round(p * 2**24)


def hash32(v: Tensor) -> Tensor:
    """A 32-bit integer mixing function (xorshift-multiply, two rounds) on int64 tensors holding
    values in [0, 2**32): returns values in [0, 2**32)."""
    v = v ^ (v >> 16)
    v = (v * HASH_M1) & _M32
    v = v ^ (v >> 15)
    v = (v * HASH_M2) & _M32
    return v ^ (v >> 16)


def dropout_threshold(p: float) -> int:
    """Elements whose hash's top 24 bits are below this threshold are dropped: P(drop) = thr / 2**24."""
    return int(round(float(p) * (1 << _THRESHOLD_BITS)))


def _seed_tensor(seed: int | Tensor, device: torch.device) -> Tensor:
    if isinstance(seed, Tensor):
        return seed.to(device=device, dtype=torch.int64).reshape(())
    return torch.tensor(int(seed), dtype=torch.int64, device=device)


def dropout_keep_mask(
    seed: int | Tensor, rows: int, cols: int, p: float, device: torch.device | str | None = None
) -> Tensor:
    """The (rows, cols) boolean keep mask of dropout rate ``p`` for ``seed`` (an int in [0, 2**63) or an
    int64 tensor of one element).

    With k0, k1 the low and high 32 bits of the seed (all arithmetic mod 2**32)::

        a[row]      = hash32(k0 ^ hash32(row * HASH_ROW + k1))
        h[row, col] = hash32(a[row] ^ (col * HASH_COL))
        keep        = (h >> 8) >= round(p * 2**24)
    """
    device = torch.device(device) if device is not None else None
    seed_t = _seed_tensor(seed, device if device is not None else torch.device("cpu"))
    device = seed_t.device
    k0 = seed_t & _M32
    k1 = (seed_t >> 32) & _M32
    row = torch.arange(rows, dtype=torch.int64, device=device)
    col = torch.arange(cols, dtype=torch.int64, device=device)
    a = hash32(k0 ^ hash32((row * HASH_ROW + k1) & _M32))  # (rows,)
    c = (col * HASH_COL) & _M32  # (cols,)
    # the (rows, cols) part in int32 (two's complement, wrapping multiplication): half the bytes of
    # int64, and equal bit for bit to hash32 (tests check it against a scalar Python definition)
    h = torch.bitwise_xor(_as_int32(a)[:, None], _as_int32(c)[None, :])
    _hash32_int32_(h, torch.empty_like(h))
    # unsigned h >= (threshold << 8), i.e. (h >> 8) >= threshold, as a signed comparison
    h.bitwise_xor_(-(2**31))
    return h >= (dropout_threshold(p) << 8) - 2**31


def _as_int32(v: Tensor) -> Tensor:
    """int64 values in [0, 2**32) to the int32 of the same bits."""
    return (v - ((v >> 31) << 32)).to(torch.int32)


def _hash32_int32_(v: Tensor, tmp: Tensor) -> Tensor:
    """:func:`hash32` in place on int32 bits (``tmp``: scratch of v's shape). Right shifts are
    arithmetic on int32, so the shifted-in sign bits are masked off to make them logical."""
    for shift, mult in ((16, HASH_M1), (15, HASH_M2), (16, None)):
        torch.bitwise_right_shift(v, shift, out=tmp)
        tmp.bitwise_and_((1 << (32 - shift)) - 1)
        v.bitwise_xor_(tmp)
        if mult is not None:
            v.mul_(mult)
    return v


def _canonical_norm(norm: str) -> str:
    name = str(norm).lower()
    if name in ("layernorm", "layer_norm", "ln"):
        return "layernorm"
    if name in ("rmsnorm", "rms_norm", "rms"):
        return "rmsnorm"
    raise ValueError(f"norm: expected 'layernorm' or 'rmsnorm', got {norm!r}")


def add_norm_reference(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    *,
    norm: str = "layernorm",
    eps: float = 1e-5,
    prenorm: bool = False,
    alpha: float = 1.0,
    gate: Tensor | None = None,
    dropout_p: float = 0.0,
    mask: Tensor | None = None,
    seed: int | Tensor | None = None,
    dtype: torch.dtype | None = torch.float64,
) -> Tensor | tuple[Tensor, Tensor]:
    """The Add & Norm formula in plain differentiable torch ops, computed in ``dtype`` (float64 by
    default; ``None`` keeps the inputs' dtype): the oracle the fused op is tested against.

    s = alpha * residual + gate * (x * mask / (1 - dropout_p)); y = N(s). Dropout is applied when
    ``mask`` (a keep mask of x's shape) or ``seed`` (the mask of :func:`dropout_keep_mask` over x
    flattened to rows) is given; with neither, no dropout. Returns (y, s) if ``prenorm`` else y.
    """
    norm = _canonical_norm(norm)

    def cast(t: Tensor | None) -> Tensor | None:
        return t if t is None or dtype is None else t.to(dtype)

    xc, rc, w, b, g = cast(x), cast(residual), cast(weight), cast(bias), cast(gate)
    if mask is None and seed is not None and dropout_p > 0:
        hidden = x.shape[-1]
        mask = dropout_keep_mask(seed, x.numel() // max(hidden, 1), hidden, dropout_p, x.device)
        mask = mask.reshape(x.shape)
    if mask is not None and dropout_p > 0:
        xc = xc * mask.to(xc.dtype) / (1.0 - dropout_p)
    if g is not None:
        xc = xc * (g.reshape(()) if g.numel() == 1 else g)
    s = alpha * rc + xc
    if norm == "layernorm":
        mean = s.mean(-1, keepdim=True)
        var = ((s - mean) ** 2).mean(-1, keepdim=True)
        y = (s - mean) / torch.sqrt(var + eps)
    else:
        y = s / torch.sqrt((s * s).mean(-1, keepdim=True) + eps)
    if w is not None:
        y = y * w
    if b is not None:
        y = y + b
    return (y, s) if prenorm else y


# --- the CPU path of the op (torch kernels with explicit backward) --------------------------------


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Statistics and accumulation dtype: float32, or float64 when an input is float64."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def xhat_from_y_ok(weight: Tensor | None, bias: Tensor | None) -> Tensor | None:
    """The columns where Post-LN backward may take x_hat = (y - b) / w from the output y:

        ok_j = w_j != 0 and |b_j| <= |w_j|     (no weight: w = 1; no bias: b = 0)

    There y's rounding error u |y| <= u (|w_j x_hat| + |b_j|) (u: unit roundoff of y's dtype) is at
    most u (|x_hat| + 1) in x_hat; elsewhere backward recomputes s from x and residual. A boolean
    (hidden,) mask, or None without an affine (every column ok). The Triton backward computes the same
    predicate inline."""
    if weight is None and bias is None:
        return None
    if weight is None:
        return bias.abs() <= 1.0
    ok = weight != 0
    return ok if bias is None else ok & (bias.abs() <= weight.abs())


def _stream(
    x: Tensor,
    residual: Tensor,
    gate: Tensor | None,
    keep: Tensor | None,
    alpha: float,
    dropout_p: float,
    cdt: torch.dtype,
    s_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """s = alpha * residual + gate * dropout(x) in ``cdt`` (``keep``: the dropout keep mask or None):
    returns (s in s_dtype, s rounded to s_dtype and back in cdt). Forward and backward (recomputing s)
    both call this, so the two agree bit for bit."""
    xf = x if x.dtype == cdt else x.to(cdt)
    if keep is not None:
        xf = torch.where(keep, xf * (1.0 / (1.0 - dropout_p)), 0.0)
    if gate is not None:
        xf = xf * gate.to(cdt)
    rf = residual if residual.dtype == cdt else residual.to(cdt)
    s = torch.add(xf, rf, alpha=alpha) if alpha != 1.0 else xf + rf
    s_out = s.to(s_dtype)
    return s_out, s if s_dtype == cdt else s_out.to(cdt)  # the stream is rounded as stored


def _keep(seed: Tensor | None, rows: int, hidden: int, p: float, device: torch.device) -> Tensor | None:
    """The dropout keep mask, or None without dropout."""
    if seed is None or p <= 0:
        return None
    return dropout_keep_mask(seed, rows, hidden, p, device)


def add_norm_fwd_torch(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    gate: Tensor | None,
    seed: Tensor | None,
    norm: str,
    eps: float,
    alpha: float,
    dropout_p: float,
    s_dtype: torch.dtype,
    y_dtype: torch.dtype,
    store_s: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward on 2-D (rows, hidden) inputs: returns (y, s or an empty tensor, mean or empty, rstd)."""
    rows, hidden = x.shape
    cdt = compute_dtype(x.dtype, residual.dtype, s_dtype)
    keep = _keep(seed, rows, hidden, dropout_p, x.device)
    s_out, s = _stream(x, residual, gate, keep, alpha, dropout_p, cdt, s_dtype)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    if norm == "layernorm":
        y, mean, rstd = torch.native_layer_norm(s, [hidden], w, b, eps)
        mean = mean.reshape(rows)
    else:
        y, rstd = torch.ops.aten._fused_rms_norm(s, [hidden], w, eps)
        if b is not None:
            y = y + b
        mean = s.new_empty(0)
    y = y.to(y_dtype)
    if not store_s:
        s_out = s_out.new_empty(0)
    return y, s_out, mean, rstd.reshape(rows)


def add_norm_fwd_autograd(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    gate: Tensor | None,
    alpha: float,
    eps: float,
    s_dtype: torch.dtype,
    y_dtype: torch.dtype,
    store_s: bool,
) -> tuple[Tensor, Tensor]:
    """:func:`add_norm_fwd_torch`'s LayerNorm without dropout, left to torch's autograd: (y, s or empty).

    Its backward is the one :func:`add_norm_bwd_torch` computes (``native_layer_norm_backward`` plus
    the add's), run by the C++ engine: for small CPU tensors the Python of an explicit backward costs
    more than the kernels. With dropout the mask must be regenerated rather than kept, and for RMSNorm
    the explicit backward is faster than torch's composite one: both stay with the explicit path."""
    cdt = compute_dtype(x.dtype, residual.dtype, s_dtype)
    s_out, s = _stream(x, residual, gate, None, alpha, 0.0, cdt, s_dtype)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    y = torch.nn.functional.layer_norm(s, (s.shape[-1],), w, b, eps).to(y_dtype)
    return y, s_out if store_s else s_out.new_empty(0)


def add_norm_bwd_torch(
    dy: Tensor,
    ds: Tensor | None,
    saved: Tensor,
    saved_is_y: bool,
    x: Tensor | None,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    gate: Tensor | None,
    seed: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm: str,
    alpha: float,
    dropout_p: float,
    x_dtype: torch.dtype,
    res_dtype: torch.dtype,
    s_dtype: torch.dtype,
    need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on 2-D inputs. ``saved`` is s (``saved_is_y=False``: x_hat = (s - mean) * rstd, or
    s * rstd for RMSNorm) or the output y (memory-efficient LayerNorm: s is never stored). From y,
    x_hat = (y - b) / w where w_j != 0 and |b_j| <= |w_j| (:func:`xhat_from_y_ok`), else from s
    recomputed from x and residual exactly as the forward computed it (same ops, dropout mask and
    rounding to ``s_dtype``). Returns (dx or empty, dresidual, dweight or empty, dbias or empty,
    dgate or empty)."""
    rows, hidden = saved.shape
    cdt = rstd.dtype
    r = rstd.reshape(rows, 1)
    dyf = dy.to(cdt)
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    keep = _keep(seed, rows, hidden, dropout_p, saved.device)
    xhat = None
    if saved_is_y:
        xhat = saved.to(cdt)
        if b is not None:
            xhat = xhat - b
        if w is not None:
            xhat = xhat / w
        ok = xhat_from_y_ok(w, b)
        if ok is not None:  # pure ops, no sync: s is recomputed in every column, used where not ok
            if x is None or residual is None:
                raise ValueError("add_norm_bwd: x_hat from y with an affine needs x and residual")
            s = _stream(x, residual, gate, keep, alpha, dropout_p, cdt, s_dtype)[1]
            xhat = torch.where(ok, xhat, (s - mean.reshape(rows, 1) if norm == "layernorm" else s) * r)
    if norm == "rmsnorm":
        # x_hat = s * rstd; d/ds = rstd * (w dy - x_hat * mean(x_hat * w dy))
        if xhat is None:
            xhat = saved.to(cdt) * r
        wdy = dyf * w if w is not None else dyf
        c1 = (xhat * wdy).mean(-1, keepdim=True)
        dsum = torch.addcmul(wdy, xhat, c1, value=-1.0).mul_(r)
        dw = (dyf * xhat).sum(0) if w is not None else None
        db = dyf.sum(0) if b is not None else None
    else:
        mask = [True, w is not None, b is not None]
        if xhat is not None:
            # the native kernel sees x_hat with mean 0 and rstd 1 and returns the gradient with
            # respect to x_hat, which rstd turns into d/ds
            mu = torch.zeros(rows, 1, dtype=cdt, device=saved.device)
            one = torch.ones(rows, 1, dtype=cdt, device=saved.device)
            dsum, dw, db = torch.ops.aten.native_layer_norm_backward(dyf, xhat, [hidden], mu, one, w, b, mask)
            dsum = dsum * r
        else:
            dsum, dw, db = torch.ops.aten.native_layer_norm_backward(
                dyf, saved.to(cdt), [hidden], mean.reshape(rows, 1), r, w, b, mask
            )
    if ds is not None:
        dsum = dsum + ds.to(cdt)
    dres = (dsum * alpha if alpha != 1.0 else dsum).to(res_dtype)
    dgate = dsum.new_empty(0)
    if need_dx:
        dx = dsum
        if gate is not None:
            xd = x.to(cdt)
            if keep is not None:
                xd = torch.where(keep, xd * (1.0 / (1.0 - dropout_p)), 0.0)
            gsum = (dsum * xd).sum(0)
            dgate = (gsum.sum() if gate.numel() == 1 else gsum).reshape(gate.shape).to(gate.dtype)
            dx = dx * gate.to(cdt)
        if keep is not None:
            dx = torch.where(keep, dx * (1.0 / (1.0 - dropout_p)), 0.0)
        dx = dx.to(x_dtype)
        if dx is dres:
            dx = dx.clone()
    else:
        dx = dsum.new_empty(0)
    dw = dsum.new_empty(0) if w is None or dw is None else dw.to(weight.dtype)
    db = dsum.new_empty(0) if b is None or db is None else db.to(bias.dtype)
    return dx, dres, dw, db, dgate
