"""Triton kernels of the tensor-parallel Add & Norm (:class:`addnorm.ops.sharded.TensorParallelAddNorm`):
each rank holds ``n`` of the ``hidden`` columns of every row, so a row's statistics need every rank's
columns. Four passes over (rows, n) tiles, column chunks for wide rows (the launch configurations of
:func:`~addnorm.ops.triton_add_norm.fwd_config` / ``bwd_config``), the collectives between them in
``sharded``::

    stats     s = alpha * r + g * dropout(x) (stored), per row: RMSNorm sum(s^2); LayerNorm (mean, M2)
              of this rank's columns (chunks merged as Chan et al. 1979)
    normalise y = w * x_hat + b, x_hat = (s - mean) * rstd (RMSNorm s * rstd), the whole rows' statistics
    sums      per row: sum(x_hat * w dy), and for LayerNorm sum(w dy), over this rank's columns
    grads     ds = rstd * (w dy - x_hat * c1 - c2) (+ the gradient at s), c = the whole rows' sums / hidden;
              dresidual, dx (dropout, gate), and per-program partial sums of dweight, dbias, dgate

The dropout mask hashes the global coordinates (row ids where the rows are a shard too, columns from
``col0``), so it is the whole tensor's mask (:func:`addnorm.ops.reference.dropout_keep_mask`). The
device helpers (``_stream``, ``_keep``, ``_dsum``, ``_store_dx``, ...) are the single-device kernels'.

This module imports triton at import time: import it lazily (``sharded`` does).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from .triton_add_norm import (
    S_CODES,
    _add_partial_sums,
    _dropout_args,
    _dsum,
    _gate_code,
    _keep,
    _merge_chunk,
    _row_ids,
    _rows,
    _store_dx,
    _stream,
    _vec,
    bwd_config,
    bwd_grid,
    bwd_register_heavy,
    fwd_config,
)

__all__ = ["grads", "normalise", "stats", "sums"]


@triton.jit
def _tp_stats_kernel(
    X,
    R,
    G,
    SEED,
    ROWS,
    S,
    STATS,
    stride_x,
    stride_r,
    n_rows,
    N,
    n_chunks,
    col0,
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    ROW_IDS: tl.constexpr,
    S_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    ids = _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    mean = tl.zeros((BLOCK_M,), tl.float32)
    m2 = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(n_chunks):
        cols = c * BLOCK_N + lane
        col_ok = cols < N
        m = row_ok & col_ok
        keep = _keep(SEED, ids, cols + col0, m, drop_thr, DROPOUT)
        s = _stream(
            X, R, G, keep, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_scale, GATE, DROPOUT,
            S_CODE,
        )  # fmt: skip
        tl.store(S + rows64 * N + cols, s.to(S.dtype.element_ty), mask=m)
        if IS_RMS:
            m2 += tl.sum(s * s, axis=1)
        else:
            mean, m2 = _merge_chunk(mean, m2, s, m, c, N, BLOCK_N)
    if IS_RMS:
        _store_per_row(STATS, m2, m2, n_rows, False, BLOCK_M)
    else:
        _store_per_row(STATS, mean, m2, n_rows, True, BLOCK_M)


@triton.jit
def _store_per_row(P, a, b, n_rows, PAIR: tl.constexpr, BLOCK_M: tl.constexpr):
    # this program's rows' a (one number a row), or (a, b) interleaved (PAIR)
    out = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = out < n_rows
    if PAIR:
        tl.store(P + 2 * out, a, mask=ok)
        tl.store(P + 2 * out + 1, b, mask=ok)
    else:
        tl.store(P + out, a, mask=ok)


@triton.jit
def _row_stats(MEAN, RSTD, rows, row_ok, IS_RMS: tl.constexpr):
    # the whole rows' (mean, rstd) as [BLOCK_M, 1] (mean 0 for RMSNorm)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    mean = rstd * 0.0
    if not IS_RMS:
        mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
    return mean, rstd


@triton.jit
def _tp_norm_kernel(
    S,
    W,
    B,
    MEAN,
    RSTD,
    Y,
    n_rows,
    N,
    n_chunks,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    mean, rstd = _row_stats(MEAN, RSTD, rows, row_ok, IS_RMS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    for c in range(n_chunks):
        cols = c * BLOCK_N + lane
        col_ok = cols < N
        m = row_ok & col_ok
        s = tl.load(S + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
        y = (s - mean) * rstd * _vec(W, cols, col_ok, 1.0, HAS_W) + _vec(B, cols, col_ok, 0.0, HAS_B)
        tl.store(Y + rows64 * N + cols, y.to(Y.dtype.element_ty), mask=m)


@triton.jit
def _tp_sums_kernel(
    DY,
    S,
    W,
    MEAN,
    RSTD,
    SUMS,
    stride_dy,
    n_rows,
    N,
    n_chunks,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    mean, rstd = _row_stats(MEAN, RSTD, rows, row_ok, IS_RMS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    c1 = tl.zeros((BLOCK_M,), tl.float32)
    c2 = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(n_chunks):
        cols = c * BLOCK_N + lane
        col_ok = cols < N
        m = row_ok & col_ok
        s = tl.load(S + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
        xhat = tl.where(m, (s - mean) * rstd, 0.0)
        wdy = tl.load(DY + rows64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
        wdy = wdy * _vec(W, cols, col_ok, 1.0, HAS_W)
        c1 += tl.sum(xhat * wdy, axis=1)
        c2 += tl.sum(wdy, axis=1)
    _store_per_row(SUMS, c1, c2, n_rows, not IS_RMS, BLOCK_M)


@triton.jit
def _tp_bwd_kernel(
    DY,
    DS,
    S,
    X,
    G,
    W,
    SEED,
    ROWS,
    MEAN,
    RSTD,
    SUMS,
    DX,
    DRES,
    DW_PART,
    DB_PART,
    DG_PART,
    stride_dy,
    stride_ds,
    stride_x,
    n_rows,
    N,
    n_chunks,
    tiles_per_program,
    col0,
    inv_hidden,
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_DS: tl.constexpr,
    ROW_IDS: tl.constexpr,
    WRITE_DX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK_N)[None, :]
    lane1 = tl.arange(0, BLOCK_N)
    part = pid.to(tl.int64) * N
    for t in range(tiles_per_program):
        rows = (pid * tiles_per_program + t) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
        row_ok = rows < n_rows
        rows64 = rows.to(tl.int64)
        ids = _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS)
        mean, rstd = _row_stats(MEAN, RSTD, rows, row_ok, IS_RMS)
        # the whole rows' means of x_hat * w dy and w dy
        if IS_RMS:
            c1 = tl.load(SUMS + rows, mask=row_ok, other=0.0) * inv_hidden
            c2 = c1 * 0.0
        else:
            c1 = tl.load(SUMS + 2 * rows, mask=row_ok, other=0.0) * inv_hidden
            c2 = tl.load(SUMS + 2 * rows + 1, mask=row_ok, other=0.0) * inv_hidden
        for c in range(n_chunks):
            cols = c * BLOCK_N + lane
            col_ok = cols < N
            m = row_ok & col_ok
            keep = _keep(SEED, ids, cols + col0, m, drop_thr, DROPOUT)
            w = _vec(W, cols, col_ok, 1.0, HAS_W)
            s = tl.load(S + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
            xhat = tl.where(m, (s - mean) * rstd, 0.0)
            dy = tl.load(DY + rows64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
            dsum = _dsum(dy, dy * w, xhat, c1, c2, rstd, DS, rows64, cols, m, stride_ds, IS_RMS, HAS_DS)
            gterm = _store_dx(
                dsum, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N, stride_x, alpha, drop_scale, GATE,
                DROPOUT, WRITE_DX,
            )  # fmt: skip
            _add_partial_sums(
                DW_PART, DB_PART, DG_PART, part, c * BLOCK_N + lane1, N, dy, xhat, gterm, HAS_W, HAS_B, GATE
            )


# --- launchers (2-D (rows, n) local tensors; ``call``: a :class:`addnorm.ops.sharded.TPCall`) ----------


def _f32(rows: int, two: bool, device) -> Tensor:
    return torch.empty((rows, 2) if two else (rows,), dtype=torch.float32, device=device)


def _dropout(call, seed, rows) -> tuple[Tensor | None, Tensor | None, int, float]:
    """(seed, row ids, threshold, scale) as the kernels take them (None, None, 0, 1 without dropout)."""
    dropout = seed is not None and call.p > 0
    ids = rows.reshape(-1) if dropout and rows is not None else None
    return (seed if dropout else None), ids, *_dropout_args(call.p, dropout)


def stats(call, x: Tensor, residual: Tensor, gate, seed, rows) -> tuple[Tensor, Tensor]:
    """(s (rows, n) in s's dtype, this rank's per-row statistics: RMSNorm sum(s^2) (rows,), LayerNorm
    (mean, M2) (rows, 2), fp32)."""
    nrows, n = x.shape
    s = torch.empty((nrows, n), dtype=call.s_dtype, device=x.device)
    st = _f32(nrows, not call.rms, x.device)
    if not n:  # no columns on this rank: nothing to add to the rows' statistics
        return s, st.zero_()
    if nrows:
        cfg = fwd_config(n)
        x, stride_x = _rows(x, n)
        residual, stride_r = _rows(residual, n)
        seed, ids, thr, scale = _dropout(call, seed, rows)
        _tp_stats_kernel[(triton.cdiv(nrows, cfg.block_m),)](
            x, residual, gate, seed, ids, s, st, stride_x, stride_r, nrows, n, triton.cdiv(n, cfg.block_n),
            call.col0, call.alpha, thr, scale, IS_RMS=call.rms, GATE=_gate_code(gate),
            DROPOUT=seed is not None, ROW_IDS=ids is not None, S_CODE=S_CODES[call.s_dtype],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        )  # fmt: skip
    return s, st


def normalise(call, s: Tensor, mean: Tensor | None, rstd: Tensor, weight, bias) -> Tensor:
    """y (rows, n) in y's dtype from s and the whole rows' statistics."""
    nrows, n = s.shape
    y = torch.empty((nrows, n), dtype=call.y_dtype, device=s.device)
    if nrows and n:
        cfg = fwd_config(n)
        _tp_norm_kernel[(triton.cdiv(nrows, cfg.block_m),)](
            s, weight, bias, mean, rstd, y, nrows, n, triton.cdiv(n, cfg.block_n), IS_RMS=call.rms,
            HAS_W=weight is not None, HAS_B=bias is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        )  # fmt: skip
    return y


def sums(call, dy: Tensor, s: Tensor, mean, rstd, weight) -> Tensor:
    """This rank's per-row sums of x_hat * w dy (RMSNorm, (rows,)), and w dy (LayerNorm, (rows, 2))."""
    nrows, n = s.shape
    out = _f32(nrows, not call.rms, s.device)
    if not n:
        return out.zero_()
    if nrows:
        cfg = fwd_config(n)
        dy, stride_dy = _rows(dy, n)
        _tp_sums_kernel[(triton.cdiv(nrows, cfg.block_m),)](
            dy, s, weight, mean, rstd, out, stride_dy, nrows, n, triton.cdiv(n, cfg.block_n), IS_RMS=call.rms,
            HAS_W=weight is not None, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            maxnreg=cfg.maxnreg,
        )  # fmt: skip
    return out


def grads(call, dy, ds, s, x, weight, bias, gate, seed, rows, mean, rstd, row_sums, need_dx):
    """(dx or empty, dresidual, dweight, dbias, dgate) from the whole rows' sums ``row_sums``."""
    nrows, n = s.shape
    dev = s.device
    dres = torch.empty((nrows, n), dtype=call.res_dtype, device=dev)
    dx = torch.empty((nrows, n), dtype=call.x_dtype, device=dev) if need_dx else dres.new_empty(0)
    gate_code = _gate_code(gate)
    seed, ids, thr, scale = _dropout(call, seed, rows)
    cfg = bwd_config(n, bwd_register_heavy(call.s_dtype, seed is not None, gate_code)) if n else None
    programs, per_program = bwd_grid(nrows, n, dev, (cfg.block_m, cfg.block_n)) if n else (0, 0)
    parts = [None if t is None else torch.zeros((max(programs, 1), n), dtype=torch.float32, device=dev)
             for t in (weight, bias, gate)]  # fmt: skip
    if programs:
        dy, stride_dy = _rows(dy, n)
        ds, stride_ds = (None, 0) if ds is None else _rows(ds, n)
        x, stride_x = (None, 0) if x is None else _rows(x, n)
        _tp_bwd_kernel[(programs,)](
            dy, ds, s, x, gate, weight, seed, ids, mean, rstd, row_sums, dx if need_dx else None, dres,
            *parts,
            stride_dy, stride_ds, stride_x, nrows, n, triton.cdiv(n, cfg.block_n), per_program, call.col0,
            1.0 / call.hidden, call.alpha, thr, scale, IS_RMS=call.rms, HAS_W=weight is not None,
            HAS_B=bias is not None, GATE=gate_code, DROPOUT=seed is not None, HAS_DS=ds is not None,
            ROW_IDS=ids is not None, WRITE_DX=need_dx, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        )  # fmt: skip
    dw, db, dg = (None if p is None else p.sum(0) for p in parts)
    dw = None if dw is None else dw.to(weight.dtype)
    db = None if db is None else db.to(bias.dtype)
    if dg is not None:
        dg = (dg.sum() if gate.numel() == 1 else dg).reshape(gate.shape).to(gate.dtype)
    return dx, dres, dw, db, dg
