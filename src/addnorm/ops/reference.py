"""The definition of the fused Add & Norm: the float64 oracle the op is tested against, and its
dropout mask.

    s = alpha * residual + gate * dropout(x)
    y = N(s),  N = LayerNorm (Ba et al. 2016): w * (s - mean) / sqrt(var + eps) + b
            or RMSNorm (Zhang & Sennrich 2019): w * s / sqrt(mean(s^2) + eps) (+ b)

The dropout mask is not drawn from torch's RNG but from a counter-based hash of (seed, row, column),
so it can be regenerated in backward instead of being stored, and the Triton kernels produce the same
mask bit for bit (:func:`dropout_keep_mask` is the definition every backend follows; the eager CPU
path computes it with NumPy, :func:`dropout_keep_mask_numpy`, a few times faster on small tensors).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "HASH_COL",
    "HASH_M1",
    "HASH_M2",
    "HASH_ROW",
    "add_norm_reference",
    "dropout_keep_mask",
    "dropout_keep_mask_numpy",
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
    seed: int | Tensor,
    rows: int,
    cols: int,
    p: float,
    device: torch.device | str | None = None,
    *,
    row_ids: Tensor | None = None,
    col0: int = 0,
) -> Tensor:
    """The (rows, cols) boolean keep mask of dropout rate ``p`` for ``seed`` (an int in [0, 2**63) or an
    int64 tensor of one element).

    With k0, k1 the low and high 32 bits of the seed (all arithmetic mod 2**32)::

        a[row]      = hash32(k0 ^ hash32(row * HASH_ROW + k1))
        h[row, col] = hash32(a[row] ^ (col * HASH_COL))
        keep        = (h >> 8) >= round(p * 2**24)

    row = 0 .. rows - 1 and col = 0 .. cols - 1, or, for a shard of a bigger tensor, the shard's
    coordinates in the whole one: ``row_ids`` (``rows`` integers: each row's index in the whole
    tensor flattened to rows) and columns ``col0`` .. ``col0 + cols - 1``. So a shard's mask is its
    block of the whole tensor's mask (:mod:`addnorm.ops.sharded`).
    """
    device = torch.device(device) if device is not None else None
    seed_t = _seed_tensor(seed, device if device is not None else torch.device("cpu"))
    device = seed_t.device
    k0 = seed_t & _M32
    k1 = (seed_t >> 32) & _M32
    if row_ids is None:
        row = torch.arange(rows, dtype=torch.int64, device=device)
    else:
        row = row_ids.reshape(rows).to(device=device, dtype=torch.int64)
    col = torch.arange(col0, col0 + cols, dtype=torch.int64, device=device)
    a = hash32(k0 ^ hash32((row * HASH_ROW + k1) & _M32))  # (rows,)
    c = (col * HASH_COL) & _M32  # (cols,)
    # the (rows, cols) part in int32 (two's complement, wrapping multiplication): half the bytes of
    # int64, and equal bit for bit to hash32 (tests check it against a scalar Python definition)
    h = torch.bitwise_xor(_as_int32(a)[:, None], _as_int32(c)[None, :])
    _hash32_int32_(h, torch.empty_like(h))
    # unsigned h >= (threshold << 8), i.e. (h >> 8) >= threshold, as a signed comparison
    bound = dropout_threshold(p) << 8
    if bound > _M32:  # p within 2**-25 of 1: every element dropped
        return torch.zeros(rows, cols, dtype=torch.bool, device=device)
    h.bitwise_xor_(-(2**31))
    return h >= bound - 2**31


@functools.lru_cache(maxsize=64)
def _line_hash_base(n: int, mult: int) -> np.ndarray:
    """(i * mult) mod 2**32 for i < n, uint32 (read-only: shared between calls)."""
    v = (np.arange(n, dtype=np.uint64) * np.uint64(mult)).astype(np.uint32)
    v.flags.writeable = False
    return v


_NP_STEPS = tuple(
    (np.uint32(shift), None if m is None else np.uint32(m))
    for shift, m in ((16, HASH_M1), (15, HASH_M2), (16, None))
)


def _hash32_numpy_(v: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """:func:`hash32` in place on uint32 (wrapping multiplication, logical shifts)."""
    for shift, mult in _NP_STEPS:
        np.right_shift(v, shift, out=tmp)
        np.bitwise_xor(v, tmp, out=v)
        if mult is not None:
            np.multiply(v, mult, out=v)
    return v


def dropout_keep_mask_numpy(seed: int, rows: int, cols: int, p: float) -> np.ndarray:
    """:func:`dropout_keep_mask` for an int ``seed`` as a NumPy bool array: the same bits, computed in
    uint32 (fewer, cheaper operations than torch's int64/int32 ones: the eager CPU path's mask)."""
    k0, k1 = np.uint32(seed & _M32), np.uint32((seed >> 32) & _M32)
    a = _line_hash_base(rows, HASH_ROW) + k1
    tmp = np.empty_like(a)
    _hash32_numpy_(a, tmp)
    np.bitwise_xor(a, k0, out=a)
    _hash32_numpy_(a, tmp)
    h = np.bitwise_xor(a[:, None], _line_hash_base(cols, HASH_COL)[None, :])
    _hash32_numpy_(h, np.empty_like(h))
    bound = dropout_threshold(p) << 8
    if bound > _M32:
        return np.zeros((rows, cols), dtype=bool)
    return h >= np.uint32(bound)


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
