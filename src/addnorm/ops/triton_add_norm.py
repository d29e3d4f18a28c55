"""Triton kernels of the fused Add & Norm (the CUDA path; ``TRITON_INTERPRET=1`` runs them on the CPU).

Forward, one program per row: s = alpha * r + g * dropout(x) (rounded to the stream's dtype), the
statistics of s in fp32, y = N(s) (LayerNorm, Ba et al. 2016; RMSNorm, Zhang & Sennrich 2019).
Backward, a fixed number of programs each looping over a block of rows: d/ds from x_hat, which is
(s - mean) * rstd (s * rstd for RMSNorm) from the saved s for Pre-LN. For Post-LN the forward writes
only y: x_hat = (y - b) / w where w_j != 0 and |b_j| <= |w_j|
(:func:`addnorm.ops.reference.xhat_from_y_ok`), else from s recomputed from x and residual (the
forward's own fp32 operations and rounding, bit for bit; x and residual are kept alive, the memory
cost of one activation, and are read only in those columns). Per-program partial sums of dweight /
dbias / dgate (fp32) are reduced afterwards by torch: deterministic, no atomics. The dropout mask is
regenerated from the seed with the hash of :func:`addnorm.ops.reference.dropout_keep_mask`, bit for bit.

This module imports triton at import time: import it lazily (``addnorm.ops`` does).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from .reference import HASH_COL, HASH_M1, HASH_M2, HASH_ROW, dropout_threshold

MAX_FUSED_HIDDEN = 65536
_S_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
# Triton kernels read module globals only as constexpr
_M1 = tl.constexpr(HASH_M1)
_M2 = tl.constexpr(HASH_M2)
_ROW = tl.constexpr(HASH_ROW)
_COL = tl.constexpr(HASH_COL)


@triton.jit
def _hash32(v):
    # v: uint32; same steps as reference.hash32 (uint32 multiplication wraps mod 2**32)
    v = v ^ (v >> 16)
    v = v * _M1
    v = v ^ (v >> 15)
    v = v * _M2
    return v ^ (v >> 16)


@triton.jit
def _keep_mask(seed_ptr, row, cols, drop_thr):
    seed = tl.load(seed_ptr)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _hash32(k0 ^ _hash32(row.to(tl.uint32) * _ROW + k1))
    h = _hash32(a ^ (cols.to(tl.uint32) * _COL))
    return (h >> 8).to(tl.int32) >= drop_thr


@triton.jit
def _round_to(v, S_CODE: tl.constexpr):
    if S_CODE == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif S_CODE == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _stream(
    x, r, g, keep, alpha, drop_scale, GATE: tl.constexpr, DROPOUT: tl.constexpr, S_CODE: tl.constexpr
):
    # s = alpha * r + g * dropout(x) rounded to the stream's dtype, in fp32: the forward's operations,
    # which the backward repeats where it recomputes s
    if DROPOUT:
        x = tl.where(keep, x * drop_scale, 0.0)
    if GATE != 0:
        x = x * g
    return _round_to(alpha * r + x, S_CODE)


@triton.jit
def _add_norm_fwd_kernel(
    X,
    R,
    W,
    B,
    G,
    SEED,
    Y,
    S,
    MEAN,
    RSTD,
    stride_x,
    stride_r,
    N,
    eps,
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,  # 0 none, 1 scalar, 2 vector
    DROPOUT: tl.constexpr,
    STORE_S: tl.constexpr,
    S_CODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inb = cols < N
    x = tl.load(X + row.to(tl.int64) * stride_x + cols, mask=inb, other=0.0).to(tl.float32)
    r = tl.load(R + row.to(tl.int64) * stride_r + cols, mask=inb, other=0.0).to(tl.float32)
    keep = inb
    if DROPOUT:
        keep = _keep_mask(SEED, row, cols, drop_thr)
    g = 1.0
    if GATE == 1:
        g = tl.load(G).to(tl.float32)
    elif GATE == 2:
        g = tl.load(G + cols, mask=inb, other=0.0).to(tl.float32)
    s = _stream(x, r, g, keep, alpha, drop_scale, GATE, DROPOUT, S_CODE)
    out = row.to(tl.int64) * N + cols
    if STORE_S:
        tl.store(S + out, s.to(S.dtype.element_ty), mask=inb)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / N + eps)
        xhat = s * rstd
    else:
        mean = tl.sum(s, axis=0) / N
        xc = tl.where(inb, s - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / N + eps)
        xhat = xc * rstd
        tl.store(MEAN + row, mean)
    tl.store(RSTD + row, rstd)
    y = xhat
    if HAS_W:
        y = y * tl.load(W + cols, mask=inb, other=0.0).to(tl.float32)
    if HAS_B:
        y = y + tl.load(B + cols, mask=inb, other=0.0).to(tl.float32)
    tl.store(Y + out, y.to(Y.dtype.element_ty), mask=inb)


@triton.jit
def _add_norm_bwd_kernel(
    DY,
    DS,
    SAVED,
    X,
    R,
    W,
    B,
    G,
    SEED,
    MEAN,
    RSTD,
    DX,
    DRES,
    DW_PART,
    DB_PART,
    DG_PART,
    stride_dy,
    stride_ds,
    stride_x,
    stride_r,
    n_rows,
    rows_per_program,
    N,
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_DS: tl.constexpr,
    SAVED_IS_Y: tl.constexpr,
    RECOMPUTE: tl.constexpr,  # SAVED_IS_Y with an affine: s recomputed where x_hat cannot come from y
    S_CODE: tl.constexpr,
    WRITE_DX: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    inb = cols < N
    w = tl.full((BLOCK_N,), 1.0, tl.float32)
    b = tl.zeros((BLOCK_N,), dtype=tl.float32)
    if HAS_W:
        w = tl.load(W + cols, mask=inb, other=1.0).to(tl.float32)
    if HAS_B:
        b = tl.load(B + cols, mask=inb, other=0.0).to(tl.float32)
    g = 1.0
    if GATE == 1:
        g = tl.load(G).to(tl.float32)
    elif GATE == 2:
        g = tl.load(G + cols, mask=inb, other=0.0).to(tl.float32)
    # reference.xhat_from_y_ok: x_hat = (y - b) / w where w != 0 and |b| <= |w|, else from s
    from_s = inb & ~((w != 0.0) & (tl.abs(b) <= tl.abs(w)))
    w_y = tl.where(from_s, 1.0, w)  # the divisor of (y - b) / w: never 0
    dw_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    db_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    dg_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    row_start = pid * rows_per_program
    for i in range(0, rows_per_program):
        row = row_start + i
        valid = row < n_rows
        m = inb & ((cols * 0 + row) < n_rows)  # (a scalar & a block confuses the interpreter)
        row64 = row.to(tl.int64)
        off = row64 * N + cols
        rstd = tl.load(RSTD + row, mask=valid, other=0.0)
        if not IS_RMS:
            mean = tl.load(MEAN + row, mask=valid, other=0.0)
        keep = m
        if DROPOUT:
            keep = _keep_mask(SEED, row, cols, drop_thr)
        v = tl.load(SAVED + off, mask=m, other=0.0).to(tl.float32)
        if SAVED_IS_Y:
            if HAS_B:
                v = v - b
            if HAS_W:
                v = v / w_y
            xhat = tl.where(m, v, 0.0)
            if RECOMPUTE:
                ms = m & from_s  # x and residual are read in these columns only
                xs = tl.load(X + row64 * stride_x + cols, mask=ms, other=0.0).to(tl.float32)
                rs = tl.load(R + row64 * stride_r + cols, mask=ms, other=0.0).to(tl.float32)
                s = _stream(xs, rs, g, keep, alpha, drop_scale, GATE, DROPOUT, S_CODE)
                if not IS_RMS:
                    s = s - mean
                xhat = tl.where(ms, s * rstd, xhat)
        elif IS_RMS:
            xhat = v * rstd
        else:
            xhat = tl.where(m, (v - mean) * rstd, 0.0)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        wdy = dy
        if HAS_W:
            wdy = dy * w
            dw_acc += dy * xhat
        if HAS_B:
            db_acc += dy
        c1 = tl.sum(xhat * wdy, axis=0) / N
        if IS_RMS:
            dsum = (wdy - xhat * c1) * rstd
        else:
            c2 = tl.sum(wdy, axis=0) / N
            dsum = (wdy - (xhat * c1 + c2)) * rstd
        if HAS_DS:
            dsum += tl.load(DS + row64 * stride_ds + cols, mask=m, other=0.0).to(tl.float32)
        tl.store(DRES + off, (alpha * dsum).to(DRES.dtype.element_ty), mask=m)
        if WRITE_DX:
            dx = dsum
            if GATE != 0:
                xd = tl.load(X + row64 * stride_x + cols, mask=m, other=0.0).to(tl.float32)
                if DROPOUT:
                    xd = tl.where(keep, xd * drop_scale, 0.0)
                dg_acc += dsum * xd
                dx = dx * g
            if DROPOUT:
                dx = tl.where(keep, dx * drop_scale, 0.0)
            tl.store(DX + off, dx.to(DX.dtype.element_ty), mask=m)
    part = pid.to(tl.int64) * N + cols
    if HAS_W:
        tl.store(DW_PART + part, dw_acc, mask=inb)
    if HAS_B:
        tl.store(DB_PART + part, db_acc, mask=inb)
    if GATE != 0:
        tl.store(DG_PART + part, dg_acc, mask=inb)


def interpreting() -> bool:
    """Whether triton runs its kernels in the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _launch_config(n: int, max_warps: int = 16) -> tuple[int, int]:
    """(BLOCK_N, num_warps): the whole row in one block, about 8 fp32 elements per thread per tensor up
    to ``max_warps`` warps (beyond, each thread holds more and the compiler may spill)."""
    block = triton.next_power_of_2(n)
    warps = min(max(block // 256, 1), max_warps)
    return block, warps


def _rows_view(t: Tensor) -> Tensor:
    """A 2-D view whose last dimension is unit-stride (rows may be strided)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _dummy(ref: Tensor) -> Tensor:
    return torch.empty(1, dtype=torch.float32, device=ref.device)


def add_norm_fwd_triton(
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
    """Forward on 2-D (rows, hidden) inputs; same contract as ``reference.add_norm_fwd_torch``."""
    rows, n = x.shape
    dev = x.device
    is_rms = norm == "rmsnorm"
    y = torch.empty(rows, n, dtype=y_dtype, device=dev)
    s = torch.empty(rows if store_s else 0, n, dtype=s_dtype, device=dev)
    mean = torch.empty(0 if is_rms else rows, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    if not store_s:
        s = s.reshape(0)
    if rows == 0:
        return y, s, mean, rstd
    x, residual = _rows_view(x), _rows_view(residual)
    dropout = seed is not None and dropout_p > 0
    block, warps = _launch_config(n)
    d = _dummy(x)
    _add_norm_fwd_kernel[(rows,)](
        x,
        residual,
        weight if weight is not None else d,
        bias if bias is not None else d,
        gate if gate is not None else d,
        seed if dropout else d,
        y,
        s if store_s else d,
        mean if not is_rms else d,
        rstd,
        x.stride(0),
        residual.stride(0),
        n,
        float(eps),
        float(alpha),
        dropout_threshold(dropout_p) if dropout else 0,
        1.0 / (1.0 - dropout_p) if dropout else 1.0,
        IS_RMS=is_rms,
        HAS_W=weight is not None,
        HAS_B=bias is not None,
        GATE=0 if gate is None else (1 if gate.numel() == 1 else 2),
        DROPOUT=dropout,
        STORE_S=store_s,
        S_CODE=_S_CODES[s_dtype],
        BLOCK_N=block,
        num_warps=warps,
    )
    return y, s, mean, rstd


def _num_programs(rows: int, block: int, device: torch.device) -> int:
    """Backward programs: enough to fill the GPU, few enough that the (programs, hidden) fp32 partial
    sums stay small (one per SM from 8192 columns up)."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(rows, sms * max(1, 8192 // block)))
    return max(1, min(rows, 4))  # interpreter: few programs, still more than one partial sum


def add_norm_bwd_triton(
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
    """Backward on 2-D inputs; same contract as ``reference.add_norm_bwd_torch``."""
    rows, n = saved.shape
    dev = saved.device
    dres = torch.empty(rows, n, dtype=res_dtype, device=dev)
    dx = torch.empty(rows if need_dx else 0, n, dtype=x_dtype, device=dev)
    block, warps = _launch_config(n, max_warps=32)
    programs = _num_programs(rows, block, dev)
    f32 = {"dtype": torch.float32, "device": dev}
    dw_part = torch.zeros(programs, n, **f32) if weight is not None else None
    db_part = torch.zeros(programs, n, **f32) if bias is not None else None
    dg_part = torch.zeros(programs, n, **f32) if gate is not None else None
    dropout = seed is not None and dropout_p > 0
    recompute = saved_is_y and (weight is not None or bias is not None)
    if recompute and (x is None or residual is None):
        raise ValueError("add_norm_bwd: x_hat from y with an affine needs x and residual")
    if rows > 0:
        dy = _rows_view(dy)
        ds = _rows_view(ds) if ds is not None else None
        x = _rows_view(x) if x is not None else None
        residual = _rows_view(residual) if recompute else None
        d = _dummy(saved)
        _add_norm_bwd_kernel[(programs,)](
            dy,
            ds if ds is not None else d,
            saved,
            x if x is not None else d,
            residual if residual is not None else d,
            weight if weight is not None else d,
            bias if bias is not None else d,
            gate if gate is not None else d,
            seed if dropout else d,
            mean if mean.numel() else d,
            rstd,
            dx if need_dx else d,
            dres,
            dw_part if dw_part is not None else d,
            db_part if db_part is not None else d,
            dg_part if dg_part is not None else d,
            dy.stride(0),
            ds.stride(0) if ds is not None else 0,
            x.stride(0) if x is not None else 0,
            residual.stride(0) if residual is not None else 0,
            rows,
            triton.cdiv(rows, programs),
            n,
            float(alpha),
            dropout_threshold(dropout_p) if dropout else 0,
            1.0 / (1.0 - dropout_p) if dropout else 1.0,
            IS_RMS=norm == "rmsnorm",
            HAS_W=weight is not None,
            HAS_B=bias is not None,
            GATE=0 if gate is None else (1 if gate.numel() == 1 else 2),
            DROPOUT=dropout,
            HAS_DS=ds is not None,
            SAVED_IS_Y=saved_is_y,
            RECOMPUTE=recompute,
            S_CODE=_S_CODES[s_dtype],
            WRITE_DX=need_dx,
            BLOCK_N=block,
            num_warps=warps,
        )
    if not need_dx:
        dx = dx.reshape(0)
    dw = dw_part.sum(0).to(weight.dtype) if dw_part is not None else dres.new_empty(0)
    db = db_part.sum(0).to(bias.dtype) if db_part is not None else dres.new_empty(0)
    if dg_part is not None:
        gsum = dg_part.sum(0)
        dg = (gsum.sum() if gate.numel() == 1 else gsum).reshape(gate.shape).to(gate.dtype)
    else:
        dg = dres.new_empty(0)
    return dx, dres, dw, db, dg


def add_norm_fwd_kernel_is_interpreted() -> bool:
    """Whether the kernels were built for the interpreter (TRITON_INTERPRET=1 at import time)."""
    return type(_add_norm_fwd_kernel).__name__ == "InterpretedFunction"
