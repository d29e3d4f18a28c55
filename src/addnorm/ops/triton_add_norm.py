"""Triton kernels of the fused Add & Norm and their launchers (CUDA, or the CPU interpreter).

Forward, per tile of ``BLOCK_M`` rows x ``BLOCK_N`` columns (rows of at most ``BLOCK_N`` columns: one
pass, the row in registers; wider rows in column chunks, two passes)::

    s = alpha * r + g * dropout(x)   (rounded to s's dtype)      y = N(s) = w * x_hat + b
    LayerNorm: x_hat = (s - mean) * rstd, rstd = 1 / sqrt(var + eps)   (Ba et al. 2016)
    RMSNorm:   x_hat = s * rstd,          rstd = 1 / sqrt(mean(s^2) + eps)   (Zhang & Sennrich 2019)

Chunked statistics merge per-chunk means and centred sums of squares (Chan et al. 1979), so the
variance never comes from E[s^2] - mean^2. The per-row statistics go to MEAN and RSTD, or (MEAN None,
the eager path) into one buffer, the rstds then the means; with RSTD None too (the eager path where
the backward has s and goes in one pass) nowhere: the backward recomputes them from s with the
forward's operations.

Backward, with g = w * dy and x_hat from s (saved), from y (x_hat = (y - b) / w where w_j != 0 and
|b_j| <= |w_j|, see ``reference.xhat_from_y_ok``) or from s recomputed from x and residual::

    LayerNorm: ds = rstd * (g - x_hat * mean(x_hat * g) - mean(g))
    RMSNorm:   ds = rstd * (g - x_hat * mean(x_hat * g))

Each program takes a contiguous run of row tiles and accumulates dweight / dbias / dgate over them in
fp32 (per-program partial sums, summed afterwards by torch: deterministic, no atomics; a single
program, for few rows, writes the gradients themselves); chunked rows accumulate each chunk's partial
sums in the program's row of the partial buffer. The dropout mask is
regenerated from the seed with the hash of :func:`addnorm.ops.reference.dropout_keep_mask`, bit for bit.

Launch configurations are chosen per hidden size and cached (:func:`fwd_config`, :func:`bwd_config`);
the kernel variants they map to are compiled for sm_80 / sm_90 by ``benchmarks/triton_variants.py``
(no spills).

This module imports triton at import time: import it lazily (``addnorm.ops`` does).
"""

from __future__ import annotations

import functools
import inspect
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton

from .args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y, BwdArgs, FwdArgs, interpreting
from .reference import HASH_COL, HASH_M1, HASH_M2, HASH_ROW, dropout_threshold

S_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
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
def _keep_mask(seed_ptr, rows, cols, drop_thr):
    # rows: [BLOCK_M, 1], cols: [1, BLOCK_N] -> [BLOCK_M, BLOCK_N] keep mask of reference.dropout_keep_mask
    seed = tl.load(seed_ptr)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = _hash32(k0 ^ _hash32(rows.to(tl.uint32) * _ROW + k1))
    h = _hash32(a ^ (cols.to(tl.uint32) * _COL))
    return (h >> 8).to(tl.int32) >= drop_thr


@triton.jit
def _keep(SEED, rows64, cols, m, drop_thr, DROPOUT: tl.constexpr):
    # a tile's dropout keep mask (computed once per tile and shared), or m without dropout
    if DROPOUT:
        keep = _keep_mask(SEED, rows64, cols, drop_thr)
    else:
        keep = m
    return keep


@triton.jit
def _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS: tl.constexpr):
    # the rows' indices for the dropout hash: their own, or given (x is a shard of a bigger tensor)
    if ROW_IDS:
        ids = tl.load(ROWS + rows, mask=row_ok, other=0)
    else:
        ids = rows64
    return ids


@triton.jit
def _merge_chunk(mean, m2, s, m, c, N, BLOCK_N: tl.constexpr):
    # the rows' running mean and centred sum of squares merged with chunk c's (Chan et al. 1979: no
    # E[s^2] - mean^2); s is 0 where m is False
    done = c * BLOCK_N * 1.0
    cnt = tl.minimum(N - c * BLOCK_N, BLOCK_N) * 1.0
    mean_c = tl.sum(s, axis=1) / cnt
    d = tl.where(m, s - mean_c[:, None], 0.0)
    delta = mean_c - mean
    mean += delta * (cnt / (done + cnt))
    m2 += tl.sum(d * d, axis=1) + delta * delta * (done * cnt / (done + cnt))
    return mean, m2


@triton.jit
def _round_to(v, S_CODE: tl.constexpr):
    if S_CODE == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif S_CODE == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def _stream(
    X,
    R,
    G,
    keep,
    rows64,
    cols,
    col_ok,
    m,
    stride_x,
    stride_r,
    alpha,
    drop_scale,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    S_CODE: tl.constexpr,
):
    # s = alpha * r + g * dropout(x) on a [BLOCK_M, BLOCK_N] tile (masked-out elements 0), rounded to
    # the stream's dtype, in fp32: the forward's operations, which the backward repeats where it
    # recomputes s
    x = tl.load(X + rows64 * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    r = tl.load(R + rows64 * stride_r + cols, mask=m, other=0.0).to(tl.float32)
    if DROPOUT:
        x = tl.where(keep, x * drop_scale, 0.0)
    if GATE == 1:
        x = x * tl.load(G).to(tl.float32)
    elif GATE == 2:
        x = x * tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
    return _round_to(alpha * r + x, S_CODE)


@triton.jit
def _vec(P, cols, col_ok, other, HAS: tl.constexpr):
    # a per-column vector (weight, bias, gate) as a [1, BLOCK_N] fp32 row, or the constant ``other``
    if HAS:
        v = tl.load(P + cols, mask=col_ok, other=other).to(tl.float32)
    else:
        v = tl.full(cols.shape, other, tl.float32)
    return v


@triton.jit
def _normalize(s, m, N, eps, IS_RMS: tl.constexpr):
    # the one-pass statistics of a [BLOCK_M, BLOCK_N] tile of s (0 where masked out) and its x_hat:
    # the forward's, and the backward's where it recomputes them from s (the same operations)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(tl.sum(s * s, axis=1) / N + eps)
        mean = rstd * 0.0
        xhat = s * rstd[:, None]
    else:
        mean = tl.sum(s, axis=1) / N
        xc = tl.where(m, s - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)
        xhat = xc * rstd[:, None]
    return mean, rstd, xhat


@triton.jit
def _mean_at(MEAN, RSTD, n_rows):
    # where the rows' means live: MEAN, or with MEAN None (the eager path's one statistics buffer, an
    # allocation fewer per call) after the n_rows rstds in RSTD's buffer
    if MEAN is None:
        p = RSTD + n_rows
    else:
        p = MEAN
    return p


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
    n_rows,
    N,
    n_chunks,
    eps,
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,  # 0 none, 1 scalar (ReZero), 2 vector (LayerScale)
    DROPOUT: tl.constexpr,
    STORE_S: tl.constexpr,
    S_CODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,  # rows wider than BLOCK_N: n_chunks column chunks, two passes
    ROWS=None,  # the rows' indices for the dropout hash (int64, one per row) where ROW_IDS
    ROW_IDS: tl.constexpr = False,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]  # [BLOCK_M, 1]
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    ids = _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS)
    lane = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    if not CHUNKED:
        col_ok = lane < N
        m = row_ok & col_ok
        keep = _keep(SEED, ids, lane, m, drop_thr, DROPOUT)
        s = _stream(
            X,
            R,
            G,
            keep,
            rows64,
            lane,
            col_ok,
            m,
            stride_x,
            stride_r,
            alpha,
            drop_scale,
            GATE,
            DROPOUT,
            S_CODE,
        )
        if STORE_S:
            tl.store(S + rows64 * N + lane, s.to(S.dtype.element_ty), mask=m)
        mean, rstd, xhat = _normalize(s, m, N, eps, IS_RMS)
        y = xhat * _vec(W, lane, col_ok, 1.0, HAS_W) + _vec(B, lane, col_ok, 0.0, HAS_B)
        tl.store(Y + rows64 * N + lane, y.to(Y.dtype.element_ty), mask=m)
    else:
        # pass 1: s chunk by chunk (stored when STORE_S), statistics merged across chunks
        mean = tl.zeros((BLOCK_M,), tl.float32)
        m2 = tl.zeros((BLOCK_M,), tl.float32)
        for c in range(n_chunks):
            cols = c * BLOCK_N + lane
            col_ok = cols < N
            m = row_ok & col_ok
            keep = _keep(SEED, ids, cols, m, drop_thr, DROPOUT)
            s = _stream(
                X,
                R,
                G,
                keep,
                rows64,
                cols,
                col_ok,
                m,
                stride_x,
                stride_r,
                alpha,
                drop_scale,
                GATE,
                DROPOUT,
                S_CODE,
            )
            if STORE_S:
                tl.store(S + rows64 * N + cols, s.to(S.dtype.element_ty), mask=m)
            if IS_RMS:
                m2 += tl.sum(s * s, axis=1)
            else:
                mean, m2 = _merge_chunk(mean, m2, s, m, c, N, BLOCK_N)
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        if STORE_S:
            tl.debug_barrier()  # pass 2 reads s written by other threads of this program
        # pass 2: s again (reloaded, or recomputed from x and r: both L2-resident by now), then y
        for c in range(n_chunks):
            cols = c * BLOCK_N + lane
            col_ok = cols < N
            m = row_ok & col_ok
            if STORE_S:
                s = tl.load(S + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
            else:
                keep = _keep(SEED, ids, cols, m, drop_thr, DROPOUT)
                s = _stream(
                    X,
                    R,
                    G,
                    keep,
                    rows64,
                    cols,
                    col_ok,
                    m,
                    stride_x,
                    stride_r,
                    alpha,
                    drop_scale,
                    GATE,
                    DROPOUT,
                    S_CODE,
                )
            if IS_RMS:
                xhat = s * rstd[:, None]
            else:
                xhat = (s - mean[:, None]) * rstd[:, None]
            y = xhat * _vec(W, cols, col_ok, 1.0, HAS_W) + _vec(B, cols, col_ok, 0.0, HAS_B)
            tl.store(Y + rows64 * N + cols, y.to(Y.dtype.element_ty), mask=m)
    if RSTD is not None:  # None: the backward recomputes the statistics from s
        stat_rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        if not IS_RMS:
            tl.store(_mean_at(MEAN, RSTD, n_rows) + stat_rows, mean, mask=stat_rows < n_rows)
        tl.store(RSTD + stat_rows, rstd, mask=stat_rows < n_rows)


@triton.jit
def _xhat(
    SAVED,
    X,
    R,
    G,
    keep,
    rows64,
    cols,
    col_ok,
    m,
    N,
    w,
    b,
    mean,
    rstd,
    stride_x,
    stride_r,
    alpha,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    XHAT_FROM: tl.constexpr,
    RECOMPUTE: tl.constexpr,
    S_CODE: tl.constexpr,
):
    # x_hat on a [BLOCK_M, BLOCK_N] tile (0 where masked out), from s saved, y saved, or s recomputed
    if XHAT_FROM == 0:
        s = tl.load(SAVED + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
        if not IS_RMS:
            s = s - mean
        xhat = tl.where(m, s * rstd, 0.0)
    elif XHAT_FROM == 2:
        s = _stream(
            X,
            R,
            G,
            keep,
            rows64,
            cols,
            col_ok,
            m,
            stride_x,
            stride_r,
            alpha,
            drop_scale,
            GATE,
            DROPOUT,
            S_CODE,
        )
        if not IS_RMS:
            s = s - mean
        xhat = tl.where(m, s * rstd, 0.0)
    else:
        v = tl.load(SAVED + rows64 * N + cols, mask=m, other=0.0).to(tl.float32)
        # reference.xhat_from_y_ok: x_hat = (y - b) / w where w != 0 and |b| <= |w|, else from s
        from_s = col_ok & ~((w != 0.0) & (tl.abs(b) <= tl.abs(w)))
        if HAS_B:
            v = v - b
        if HAS_W:
            v = v / tl.where(from_s, 1.0, w)
        xhat = tl.where(m, v, 0.0)
        if RECOMPUTE:
            ms = m & from_s  # x and residual are read in these columns only
            s = _stream(
                X,
                R,
                G,
                keep,
                rows64,
                cols,
                col_ok,
                ms,
                stride_x,
                stride_r,
                alpha,
                drop_scale,
                GATE,
                DROPOUT,
                S_CODE,
            )
            if not IS_RMS:
                s = s - mean
            xhat = tl.where(ms, s * rstd, xhat)
    return xhat


@triton.jit
def _dsum(
    dy, wdy, xhat, c1, c2, rstd, DS, rows64, cols, m, stride_ds, IS_RMS: tl.constexpr, HAS_DS: tl.constexpr
):
    # d/ds of the norm (plus the gradient arriving at s itself, Pre-LN) on a tile
    if IS_RMS:
        dsum = (wdy - xhat * c1) * rstd
    else:
        dsum = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DS:
        dsum += tl.load(DS + rows64 * stride_ds + cols, mask=m, other=0.0).to(tl.float32)
    return dsum


@triton.jit
def _add_partial_sums(
    DW_PART,
    DB_PART,
    DG_PART,
    part,
    cols1,
    N,
    dy,
    xhat,
    gterm,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,
):
    # a chunk's column sums of dy * x_hat, dy and the gate's term added into this program's row
    # (``part``) of the partial-sum buffers
    ok1 = cols1 < N
    tl.debug_barrier()  # the previous tile's read-modify-write of these columns is done
    if HAS_W:
        p = DW_PART + part + cols1
        tl.store(p, tl.load(p, mask=ok1, other=0.0) + tl.sum(dy * xhat, axis=0), mask=ok1)
    if HAS_B:
        p = DB_PART + part + cols1
        tl.store(p, tl.load(p, mask=ok1, other=0.0) + tl.sum(dy, axis=0), mask=ok1)
    if GATE != 0:
        p = DG_PART + part + cols1
        tl.store(p, tl.load(p, mask=ok1, other=0.0) + tl.sum(gterm, axis=0), mask=ok1)


@triton.jit
def _store_dx(
    dsum,
    X,
    G,
    keep,
    DX,
    DRES,
    rows64,
    cols,
    col_ok,
    m,
    N,
    stride_x,
    alpha,
    drop_scale,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    WRITE_DX: tl.constexpr,
):
    # dresidual = alpha * dsum; dx = dropout'(gate * dsum); returns dsum * dropout(x), the gate's term
    tl.store(DRES + rows64 * N + cols, (alpha * dsum).to(DRES.dtype.element_ty), mask=m)
    gterm = dsum
    if WRITE_DX:
        dx = dsum
        if GATE != 0:
            xd = tl.load(X + rows64 * stride_x + cols, mask=m, other=0.0).to(tl.float32)
            if DROPOUT:
                xd = tl.where(keep, xd * drop_scale, 0.0)
            gterm = dsum * xd
            if GATE == 1:
                dx = dx * tl.load(G).to(tl.float32)
            else:
                dx = dx * tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
        if DROPOUT:
            dx = tl.where(keep, dx * drop_scale, 0.0)
        tl.store(DX + rows64 * N + cols, dx.to(DX.dtype.element_ty), mask=m)
    return gterm


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
    N,
    n_chunks,
    tiles_per_program,
    eps,  # read only where the statistics are recomputed (RSTD None)
    alpha,
    drop_thr,
    drop_scale,
    IS_RMS: tl.constexpr,
    HAS_W: tl.constexpr,
    HAS_B: tl.constexpr,
    GATE: tl.constexpr,
    DROPOUT: tl.constexpr,
    HAS_DS: tl.constexpr,
    XHAT_FROM: tl.constexpr,  # 0: s saved, 1: y saved (s recomputed where unsafe), 2: s recomputed
    RECOMPUTE: tl.constexpr,  # XHAT_FROM 1 with an affine: some columns recompute s
    S_CODE: tl.constexpr,
    WRITE_DX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNKED: tl.constexpr,  # rows wider than BLOCK_N: n_chunks column chunks, two passes per tile
    ROWS=None,  # the rows' indices for the dropout hash (int64, one per row) where ROW_IDS
    ROW_IDS: tl.constexpr = False,
):
    pid = tl.program_id(0)
    lane = tl.arange(0, BLOCK_N)[None, :]
    lane1 = tl.arange(0, BLOCK_N)
    part = pid.to(tl.int64) * N
    if not CHUNKED:
        col_ok = lane < N
        w = _vec(W, lane, col_ok, 1.0, HAS_W)
        b = _vec(B, lane, col_ok, 0.0, HAS_B)
        dw_acc = tl.zeros((BLOCK_N,), tl.float32)
        db_acc = tl.zeros((BLOCK_N,), tl.float32)
        dg_acc = tl.zeros((BLOCK_N,), tl.float32)
        for t in range(tiles_per_program):
            rows = (pid * tiles_per_program + t) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            row_ok = rows < n_rows
            rows64 = rows.to(tl.int64)
            m = row_ok & col_ok
            ids = _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS)
            keep = _keep(SEED, ids, lane, m, drop_thr, DROPOUT)
            if RSTD is None:  # no statistics kept: from s (saved or recomputed), as the forward did
                tl.static_assert(XHAT_FROM != 1, "x_hat from y needs the forward's statistics")
                if XHAT_FROM == 0:
                    s = tl.load(SAVED + rows64 * N + lane, mask=m, other=0.0).to(tl.float32)
                else:
                    s = _stream(
                        X,
                        R,
                        G,
                        keep,
                        rows64,
                        lane,
                        col_ok,
                        m,
                        stride_x,
                        stride_r,
                        alpha,
                        drop_scale,
                        GATE,
                        DROPOUT,
                        S_CODE,
                    )
                _, rstd, xhat = _normalize(s, m, N, eps, IS_RMS)
                rstd = rstd[:, None]
            else:
                rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
                mean = rstd * 0.0
                if not IS_RMS:
                    mean = tl.load(_mean_at(MEAN, RSTD, n_rows) + rows, mask=row_ok, other=0.0)
                xhat = _xhat(
                    SAVED,
                    X,
                    R,
                    G,
                    keep,
                    rows64,
                    lane,
                    col_ok,
                    m,
                    N,
                    w,
                    b,
                    mean,
                    rstd,
                    stride_x,
                    stride_r,
                    alpha,
                    drop_scale,
                    IS_RMS,
                    HAS_W,
                    HAS_B,
                    GATE,
                    DROPOUT,
                    XHAT_FROM,
                    RECOMPUTE,
                    S_CODE,
                )
            dy = tl.load(DY + rows64 * stride_dy + lane, mask=m, other=0.0).to(tl.float32)
            wdy = dy * w
            c1 = tl.sum(xhat * wdy, axis=1)[:, None] / N
            c2 = tl.sum(wdy, axis=1)[:, None] / N
            dsum = _dsum(dy, wdy, xhat, c1, c2, rstd, DS, rows64, lane, m, stride_ds, IS_RMS, HAS_DS)
            gterm = _store_dx(
                dsum,
                X,
                G,
                keep,
                DX,
                DRES,
                rows64,
                lane,
                col_ok,
                m,
                N,
                stride_x,
                alpha,
                drop_scale,
                GATE,
                DROPOUT,
                WRITE_DX,
            )
            if HAS_W:
                dw_acc += tl.sum(dy * xhat, axis=0)
            if HAS_B:
                db_acc += tl.sum(dy, axis=0)
            if GATE != 0:
                dg_acc += tl.sum(gterm, axis=0)
        ok1 = lane1 < N
        if HAS_W:
            tl.store(DW_PART + part + lane1, dw_acc, mask=ok1)
        if HAS_B:
            tl.store(DB_PART + part + lane1, db_acc, mask=ok1)
        if GATE != 0:
            tl.store(DG_PART + part + lane1, dg_acc, mask=ok1)
    else:
        tl.static_assert(RSTD is not None, "rows in column chunks need the forward's statistics")
        for t in range(tiles_per_program):
            rows = (pid * tiles_per_program + t) * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
            row_ok = rows < n_rows
            rows64 = rows.to(tl.int64)
            ids = _row_ids(ROWS, rows, row_ok, rows64, ROW_IDS)
            rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
            mean = rstd * 0.0
            if not IS_RMS:
                mean = tl.load(_mean_at(MEAN, RSTD, n_rows) + rows, mask=row_ok, other=0.0)
            c1 = tl.zeros((BLOCK_M, 1), tl.float32)
            c2 = tl.zeros((BLOCK_M, 1), tl.float32)
            # pass 0: the row sums mean(x_hat * w dy), mean(w dy); pass 1 (the tile's rows are
            # L2-resident by now): the gradients, partial sums into this program's row
            for pas in tl.static_range(2):
                if pas == 1:
                    c1 = c1 / N
                    c2 = c2 / N
                for c in range(n_chunks):
                    cols = c * BLOCK_N + lane
                    col_ok = cols < N
                    m = row_ok & col_ok
                    keep = _keep(SEED, ids, cols, m, drop_thr, DROPOUT)
                    w = _vec(W, cols, col_ok, 1.0, HAS_W)
                    b = _vec(B, cols, col_ok, 0.0, HAS_B)
                    xhat = _xhat(
                        SAVED,
                        X,
                        R,
                        G,
                        keep,
                        rows64,
                        cols,
                        col_ok,
                        m,
                        N,
                        w,
                        b,
                        mean,
                        rstd,
                        stride_x,
                        stride_r,
                        alpha,
                        drop_scale,
                        IS_RMS,
                        HAS_W,
                        HAS_B,
                        GATE,
                        DROPOUT,
                        XHAT_FROM,
                        RECOMPUTE,
                        S_CODE,
                    )
                    dy = tl.load(DY + rows64 * stride_dy + cols, mask=m, other=0.0).to(tl.float32)
                    if pas == 0:
                        c1 += tl.sum(xhat * dy * w, axis=1)[:, None]
                        c2 += tl.sum(dy * w, axis=1)[:, None]
                    else:
                        dsum = _dsum(
                            dy, dy * w, xhat, c1, c2, rstd, DS, rows64, cols, m, stride_ds, IS_RMS, HAS_DS
                        )
                        gterm = _store_dx(
                            dsum,
                            X,
                            G,
                            keep,
                            DX,
                            DRES,
                            rows64,
                            cols,
                            col_ok,
                            m,
                            N,
                            stride_x,
                            alpha,
                            drop_scale,
                            GATE,
                            DROPOUT,
                            WRITE_DX,
                        )
                        _add_partial_sums(
                            DW_PART, DB_PART, DG_PART, part, c * BLOCK_N + lane1, N, dy, xhat, gterm, HAS_W,
                            HAS_B, GATE,
                        )  # fmt: skip


# --- launch configuration ------------------------------------------------------------------------


class Launch(NamedTuple):
    """A kernel's launch configuration: tiles of ``block_m`` rows x ``block_n`` columns, rows wider
    than ``block_n`` in column chunks (``chunked``), ``num_warps`` warps per program."""

    block_m: int
    block_n: int
    chunked: bool
    num_warps: int

    @property
    def maxnreg(self) -> int:
        """The register budget given to ptxas: all a program may use (65,536 per SM, at most 255 per
        thread). Left to itself ptxas may choose fewer registers and spill a few bytes."""
        return min(255, 65536 // (32 * self.num_warps))

    @property
    def options(self) -> dict:
        """The launch's options (keywords of a launch, not kernel arguments)."""
        return {"num_warps": self.num_warps, "maxnreg": self.maxnreg}


# Rows up to these widths stay in registers in one pass; wider rows go in column chunks. Forward: narrow
# rows share a program (tiles of TILE elements), about 16 fp32 values per thread per tile tensor
# (ELEMS_PER_WARP 512). Backward: one row at a time (BLOCK_M 1), 8 values per thread (256), one pass up
# to 4096 columns (2048 for the register-heavy variants: dropout or a gate, :func:`bwd_register_heavy`),
# chunks of 4096 with 16 warps beyond. Measured on an H100 (bf16, rows = 2**27 / hidden,
# ``benchmarks/sweep_launch_config.py``, ``benchmarks/results/gpu_h100.md``): a backward tile of several
# rows (BLOCK_M 2-8, its dw/db column sums reduced across the tile's rows) ran 2.6-4.7x slower than one
# row per step at hidden 256-8192; the forward's multi-row tiles were as fast as one row or faster. One
# pass at 4096 (0.77 ms against about 1.0 chunked) spills 12-340 bytes a thread in the variants with
# dropout or a gate, so those take the chunks; one pass at 8192 (0.76 ms against 1.18) spills with
# dropout alone, so 8192 is chunked for every variant.
# No spills and at most ~130 registers on sm_80 / sm_90 for every variant
# (``benchmarks/triton_variants.py``, the compile-time test).
FWD_MAX_ONE_PASS = 8192
BWD_MAX_ONE_PASS = 4096
BWD_MAX_ONE_PASS_HEAVY = 2048
FWD_CHUNK = Launch(1, 2048, True, 8)
BWD_CHUNK = Launch(1, 4096, True, 16)
TILE = 2048
MIN_BLOCK_N = 16


def _one_pass(n: int, elems_per_warp: int, tile: int = TILE) -> Launch:
    block_n = max(MIN_BLOCK_N, triton.next_power_of_2(n))
    block_m = max(1, tile // block_n)
    warps = min(max(block_m * block_n // elems_per_warp, 1), 16)
    return Launch(block_m, block_n, False, warps)


@functools.lru_cache(maxsize=256)
def fwd_config(n: int) -> Launch:
    """The forward's launch configuration for rows of ``n`` columns."""
    return _one_pass(n, 512) if n <= FWD_MAX_ONE_PASS else FWD_CHUNK


@functools.lru_cache(maxsize=256)
def bwd_config(n: int, heavy: bool = False) -> Launch:
    """The backward's launch configuration for rows of ``n`` columns: one row per step; ``heavy``
    (:func:`bwd_register_heavy`) variants go in column chunks from narrower rows."""
    return (
        _one_pass(n, 256, tile=1)
        if n <= (BWD_MAX_ONE_PASS_HEAVY if heavy else BWD_MAX_ONE_PASS)
        else BWD_CHUNK
    )


def bwd_register_heavy(s_dtype: torch.dtype, dropout: bool, gate_code: int) -> bool:
    """Whether a backward variant holds so many values live that one pass over a wide row spills:
    dropout or a gate, in any dtype (``benchmarks/results/kernel_compile_full.md``; with 16 warps a
    thread has 128 registers). ``s_dtype``, the stream's dtype, is part of the rule's signature: the
    spills were measured per dtype and fp32 spills most."""
    return dropout or gate_code != 0


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


# A backward of at most this many tiles runs as one program, which writes dweight / dbias / dgate
# itself: no partial sums, so no torch reduction after the kernel (one per parameter, each a launch:
# on a small call the largest host cost of the backward); its tiles then run one after another,
# ~1 us of GPU time each, hidden behind the host time of a call this small.
BWD_ONE_PROGRAM_TILES = 16


@functools.lru_cache(maxsize=1024)
def _bwd_grid(tiles: int, n: int, device: torch.device, block_m: int, block_n: int) -> tuple[int, int]:
    if device.type == "cuda":
        per_sm = max(1, 8192 // (block_m * min(block_n, n)))
        target = _sm_count(device) * per_sm
    else:
        target = 4
    per_program = -(-tiles // max(1, min(tiles, target)))
    return -(-tiles // per_program), per_program


def bwd_grid(
    rows: int, n: int, device: torch.device, block: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(programs, tiles per program) of the backward: one program up to ``BWD_ONE_PROGRAM_TILES``
    tiles (it writes the parameter gradients themselves), beyond that enough programs to fill the GPU
    (about 8192 elements per tile's worth of work each), few enough that the (programs, hidden) fp32
    partial sums stay small. The interpreter takes at most 4 (still more than one partial sum).
    ``block``: the launch's (rows, columns) per tile, ``bwd_config(n)``'s by default. Cached per
    shape."""
    if not rows:
        return 0, 0
    if block is None:
        cfg = bwd_config(n)
        block = (cfg.block_m, cfg.block_n)
    tiles = -(-rows // block[0])
    if tiles <= BWD_ONE_PROGRAM_TILES:
        return 1, tiles
    # traced with a symbolic row count (torch.compile's dynamic shapes): computed, not cached
    grid = _bwd_grid if type(rows) is int else _bwd_grid.__wrapped__
    return grid(tiles, n, device, *block)


def clear_caches() -> None:
    """Forget the cached launch configurations and specs (after changing the configuration constants;
    cached plans hold specs too: clear them as well, ``addnorm.ops.policy.invalidate``)."""
    for cache in (fwd_config, bwd_config, _bwd_grid, fwd_spec, bwd_spec):
        cache.cache_clear()


def _rows(t: Tensor, n: int) -> tuple[Tensor, int]:
    """``t`` as rows of ``n`` unit-stride columns: the tensor the kernel reads and its row stride. A
    contiguous tensor of any rank is passed as it is (no view: the kernel reads pointers)."""
    if t.is_contiguous():
        return t, n
    t = t.reshape(-1, n)
    if t.stride(1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


def _gate_code(gate: Tensor | None) -> int:
    return 0 if gate is None else (1 if gate.numel() == 1 else 2)


_F32 = torch.float32


# --- launch specs: what a call's options fix, decided once --------------------------------------


class FwdSpec(NamedTuple):
    """The forward's launch for one set of options: grid rows per program, column chunks, the
    kernel's trailing arguments (``tail``: the scalars, then the constexprs, positional) and the launch
    options (``options``: warps, register budget)."""

    n: int
    block_m: int
    n_chunks: int
    mean_apart: bool  # LayerNorm, the means in a buffer of their own (the registered op's outputs)
    stats_per_row: int  # RSTD's values per row: 1, 2 (the rstds, then the means: MEAN None), 0 (none)
    store_s: bool
    y_dtype: torch.dtype
    s_dtype: torch.dtype
    tail: tuple  # eps, alpha, dropout threshold, dropout scale, then the constexprs
    options: dict


class BwdSpec(NamedTuple):
    """The backward's launch for one set of options (see :class:`FwdSpec`)."""

    n: int
    n_chunks: int
    chunked: bool
    is_rms: bool
    xhat_from: int
    recompute: bool  # s recomputed from x and residual (XR, or Y with an affine)
    need_x: bool  # x is read (recompute, or the gate's gradient)
    need_dx: bool
    x_dtype: torch.dtype
    res_dtype: torch.dtype
    block: tuple[int, int]  # a tile's rows and columns (the grid's unit)
    tail: tuple  # eps, alpha, dropout threshold, dropout scale, then the constexprs
    options: dict


def _dropout_args(p: float, dropout: bool) -> tuple[int, float]:
    return (dropout_threshold(p), 1.0 / (1.0 - p)) if dropout else (0, 1.0)


# the kernels' parameter names (from the Python function both a JITFunction and the interpreter's
# kernel wrap), read before anything can replace the kernels (a benchmark's stub)
# (those without a default: the ones with one, row indices for a shard's dropout, go as keywords)
def _required_params(kernel) -> tuple[str, ...]:
    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if p.default is inspect.Parameter.empty)


_FWD_PARAMS = _required_params(_add_norm_fwd_kernel)
_BWD_PARAMS = _required_params(_add_norm_bwd_kernel)


def _tail(params: tuple[str, ...], scalars: tuple, constexprs: dict) -> tuple:
    """A launch's trailing arguments, positional: the scalars, then the constexprs in the order of
    the kernel's last parameters (``params``), which they must be (a name that is not one is a
    KeyError). Keywords would cost a dict per launch, more host time than the rest of a small call's
    argument handling."""
    return (*scalars, *(constexprs[name] for name in params[len(params) - len(constexprs) :]))


@functools.lru_cache(maxsize=1024)
def fwd_spec(
    n: int, norm: str, eps: float, alpha: float, p: float, has_w: bool, has_b: bool, gate_code: int,
    store_s: bool, s_dtype: torch.dtype, y_dtype: torch.dtype, stats: str = "apart",
) -> FwdSpec:  # fmt: skip
    """The forward's launch spec (``p`` > 0: dropout from the seed). ``stats``: where the per-row
    statistics go: ``"apart"`` (mean and rstd, the registered op's outputs), ``"packed"`` (one buffer,
    LayerNorm's means after the rstds) or ``"none"`` (not stored: the backward recomputes them from
    s, which needs s saved or recomputed and a one-pass backward)."""
    if stats not in ("apart", "packed", "none"):
        raise ValueError(f"fwd_spec: stats must be 'apart', 'packed' or 'none', got {stats!r}")
    cfg = fwd_config(n)
    is_rms = norm == "rmsnorm"
    constexprs = {
        "IS_RMS": is_rms, "HAS_W": has_w, "HAS_B": has_b, "GATE": gate_code, "DROPOUT": p > 0,
        "STORE_S": store_s, "S_CODE": S_CODES[s_dtype], "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "CHUNKED": cfg.chunked,
    }  # fmt: skip
    tail = _tail(_FWD_PARAMS, (eps, alpha, *_dropout_args(p, p > 0)), constexprs)
    n_chunks = -(-n // cfg.block_n)
    mean_apart = not is_rms and stats == "apart"
    per_row = 0 if stats == "none" else (2 if stats == "packed" and not is_rms else 1)
    return FwdSpec(
        n, cfg.block_m, n_chunks, mean_apart, per_row, store_s, y_dtype, s_dtype, tail, cfg.options
    )


@functools.lru_cache(maxsize=1024)
def bwd_spec(
    n: int, norm: str, alpha: float, p: float, has_w: bool, has_b: bool, gate_code: int, has_ds: bool,
    xhat_from: int, s_dtype: torch.dtype, x_dtype: torch.dtype, res_dtype: torch.dtype, need_dx: bool,
    eps: float = 0.0,
) -> BwdSpec:  # fmt: skip
    """The backward's launch spec (``has_ds``: a gradient arrives at s; ``eps``: the norm's, read only
    where the kernel is given no statistics and recomputes them)."""
    cfg = bwd_config(n, bwd_register_heavy(s_dtype, p > 0, gate_code))
    recompute = xhat_from == XHAT_FROM_XR or (xhat_from == XHAT_FROM_Y and (has_w or has_b))
    constexprs = {
        "IS_RMS": norm == "rmsnorm", "HAS_W": has_w, "HAS_B": has_b, "GATE": gate_code, "DROPOUT": p > 0,
        "HAS_DS": has_ds, "XHAT_FROM": xhat_from, "RECOMPUTE": recompute and xhat_from == XHAT_FROM_Y,
        "S_CODE": S_CODES[s_dtype], "WRITE_DX": need_dx, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "CHUNKED": cfg.chunked,
    }  # fmt: skip
    return BwdSpec(
        n, -(-n // cfg.block_n), cfg.chunked, norm == "rmsnorm", xhat_from, recompute,
        recompute or gate_code != 0, need_dx, x_dtype, res_dtype, (cfg.block_m, cfg.block_n),
        _tail(_BWD_PARAMS, (eps, alpha, *_dropout_args(p, p > 0)), constexprs), cfg.options,
    )  # fmt: skip


# --- launchers -----------------------------------------------------------------------------------


def _empty_like(t: Tensor, contiguous: bool, dtype: torch.dtype) -> Tensor:
    """A contiguous empty tensor of ``t``'s shape and ``dtype``: ``empty_like`` where ``t``'s layout and
    dtype fit (a third of ``torch.empty``'s host time with keywords)."""
    if contiguous and t.dtype is dtype:
        return torch.empty_like(t)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def _with_row_ids(options: dict, row_ids: Tensor | None) -> dict:
    """A launch's keywords, with the row indices for the dropout hash where given (a shard,
    :mod:`addnorm.ops.sharded`): the common call passes the spec's own dict, no new one."""
    return options if row_ids is None else {**options, "ROWS": row_ids.reshape(-1), "ROW_IDS": True}


def launch_fwd(sp: FwdSpec, x, residual, weight, bias, gate, seed, kernel=None, row_ids=None):
    """The forward on x and residual of any shape (..., n): (y, s or None, mean or None, rstd), y and
    s contiguous of x's shape, the statistics one per row in fp32 (the means, if any, in ``mean`` or,
    ``sp.stats_per_row`` 2, after the rstds in ``rstd``; none, rstd None, for ``stats_per_row`` 0).
    ``kernel``: the kernel to launch (default the module's: ``wrap_triton``'s where the call is
    traced); ``row_ids``: the rows' indices for the dropout hash (int64, one per row) where x is a
    shard of a bigger tensor."""
    # the common case inline (contiguous x, no casts): every frame and keyword is host time per call
    n, x_dtype = sp.n, x.dtype
    rows = x.numel() // n
    xc = x.is_contiguous()
    y = torch.empty_like(x) if xc and x_dtype is sp.y_dtype else _empty_like(x, xc, sp.y_dtype)
    if sp.store_s:
        s = torch.empty_like(y) if sp.s_dtype is sp.y_dtype else _empty_like(y, True, sp.s_dtype)
    else:
        s = None
    per_row = sp.stats_per_row
    if x_dtype is _F32:  # no keywords: a third less host time
        mean = x.new_empty(rows) if sp.mean_apart else None
        rstd = x.new_empty(per_row * rows) if per_row else None
    else:
        mean = x.new_empty(rows, dtype=_F32) if sp.mean_apart else None
        rstd = x.new_empty(per_row * rows, dtype=_F32) if per_row else None
    if rows:
        x, stride_x = (x, n) if xc else _rows(x, n)
        residual, stride_r = (residual, n) if residual.is_contiguous() else _rows(residual, n)
        (_add_norm_fwd_kernel if kernel is None else kernel)[(-(-rows // sp.block_m),)](
            x, residual, weight, bias, gate, seed, y, s, mean, rstd, stride_x, stride_r, rows, n,
            sp.n_chunks, *sp.tail, **_with_row_ids(sp.options, row_ids),
        )  # fmt: skip
    return y, s, mean, rstd


def launch_bwd(
    sp: BwdSpec, dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, kernel=None, row_ids=None
):
    """The backward (``dy`` of any shape (..., n), ``saved`` s or y contiguous of that shape, None for
    XR): (dx or None, dresidual, dweight or None, dbias or None, dgate or None). ``row_ids`` as for
    :func:`launch_fwd`."""
    n = sp.n
    rows = dy.numel() // n
    dyc = dy.is_contiguous()
    dres = torch.empty_like(dy) if dyc and dy.dtype is sp.res_dtype else _empty_like(dy, dyc, sp.res_dtype)
    dx = _empty_like(dres, True, sp.x_dtype) if sp.need_dx else None
    programs, per_program = bwd_grid(rows, n, dy.device, sp.block)
    # per-program partial sums of dweight / dbias / dgate in fp32, summed below; one program (few
    # rows) writes the sums themselves; chunked rows add into them (zeros)
    part = n if programs == 1 else (programs, n)
    alloc = dy.new_zeros if sp.chunked else dy.new_empty
    if dy.dtype is _F32:  # no keywords: a third less host time
        dw_part = None if weight is None else alloc(part)
        db_part = None if bias is None else alloc(part)
        dg_part = None if gate is None else alloc(part)
    else:
        dw_part = None if weight is None else alloc(part, dtype=_F32)
        db_part = None if bias is None else alloc(part, dtype=_F32)
        dg_part = None if gate is None else alloc(part, dtype=_F32)
    if sp.recompute and (x is None or residual is None):
        raise ValueError("add_norm_bwd: recomputing s needs x and residual")
    if rows:
        dy, stride_dy = (dy, n) if dyc else _rows(dy, n)
        if ds is None:
            stride_ds = 0
        else:
            ds, stride_ds = (ds, n) if ds.is_contiguous() else _rows(ds, n)
        if sp.need_x:
            x, stride_x = (x, n) if x.is_contiguous() else _rows(x, n)
        else:
            x, stride_x = None, 0
        if sp.recompute:
            residual, stride_r = (residual, n) if residual.is_contiguous() else _rows(residual, n)
        else:
            residual, stride_r = None, 0
        (_add_norm_bwd_kernel if kernel is None else kernel)[(programs,)](
            dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, dx, dres, dw_part, db_part,
            dg_part, stride_dy, stride_ds, stride_x, stride_r, rows, n, sp.n_chunks, per_program,
            *sp.tail, **_with_row_ids(sp.options, row_ids),
        )  # fmt: skip
    if programs == 1:  # the kernel wrote the sums
        dw, db, dg = dw_part, db_part, dg_part
    else:
        dw = None if dw_part is None else dw_part.sum(0)
        db = None if db_part is None else db_part.sum(0)
        dg = None if dg_part is None else dg_part.sum(0)
    if dw is not None and weight.dtype is not _F32:
        dw = dw.to(weight.dtype)
    if db is not None and bias.dtype is not _F32:
        db = db.to(bias.dtype)
    if dg is not None:
        dg = (dg.sum() if gate.numel() == 1 else dg).reshape(gate.shape).to(gate.dtype)
    return dx, dres, dw, db, dg


# --- the registered op's launchers (FwdArgs / BwdArgs on (..., hidden) tensors) -----------------------


def add_norm_fwd_triton(a: FwdArgs, *, traceable: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward on (..., hidden) inputs; same contract as ``torch_path.add_norm_fwd_torch``."""
    n = a.x.shape[-1]
    dropout = a.dropout
    sp = fwd_spec(
        n, a.norm, a.eps, a.alpha, a.dropout_p if dropout else 0.0, a.weight is not None,
        a.bias is not None, _gate_code(a.gate), a.store_s, a.s_dtype, a.y_dtype,
    )  # fmt: skip
    # through wrap_triton where the call may be traced (the registered op's body: torch.compile then
    # launches the kernel itself; named here, where triton_op's analysis of the body finds it)
    kernel = wrap_triton(_add_norm_fwd_kernel) if traceable and not interpreting() else None
    seed, row_ids = (a.seed, a.rows) if dropout else (None, None)
    y, s, mean, rstd = launch_fwd(sp, a.x, a.residual, a.weight, a.bias, a.gate, seed, kernel, row_ids)
    dev, lead = a.x.device, a.x.shape[:-1]
    return (
        y,
        a.x.new_empty((0,), dtype=a.s_dtype, device=dev) if s is None else s,
        a.x.new_empty((0,), dtype=_F32, device=dev) if mean is None else mean.reshape(lead),
        rstd.reshape(lead),
    )


def add_norm_bwd_triton(
    a: BwdArgs, *, traceable: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on (..., hidden) inputs; same contract as ``torch_path.add_norm_bwd_torch``."""
    n = a.dy.shape[-1]
    dropout = a.dropout
    sp = bwd_spec(
        n, a.norm, a.alpha, a.dropout_p if dropout else 0.0, a.weight is not None, a.bias is not None,
        _gate_code(a.gate), a.ds is not None, a.xhat_from, a.s_dtype, a.x_dtype, a.res_dtype, a.need_dx,
    )  # fmt: skip
    kernel = wrap_triton(_add_norm_bwd_kernel) if traceable and not interpreting() else None
    dx, dres, dw, db, dg = launch_bwd(
        sp, a.dy, a.ds, a.saved if a.xhat_from != XHAT_FROM_XR else None, a.x, a.residual, a.weight,
        a.bias, a.gate, a.seed if dropout else None, a.mean if a.norm != "rmsnorm" else None, a.rstd,
        kernel, a.rows if dropout else None,
    )  # fmt: skip
    # the op returns every slot, an empty tensor of its own where there is no gradient (outputs of a
    # custom op may not alias each other)
    return (
        dres.new_empty(0) if dx is None else dx,
        dres,
        dres.new_empty(0) if dw is None else dw,
        dres.new_empty(0) if db is None else db,
        dres.new_empty(0) if dg is None else dg,
    )


_INTERPRETED = type(_add_norm_fwd_kernel).__name__ == "InterpretedFunction"


def kernels_are_interpreted() -> bool:
    """Whether the kernels were built for the interpreter (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRETED


__all__ = [
    "BWD_CHUNK",
    "BWD_ONE_PROGRAM_TILES",
    "FWD_CHUNK",
    "BwdSpec",
    "FwdSpec",
    "Launch",
    "XHAT_FROM_S",
    "add_norm_bwd_triton",
    "add_norm_fwd_triton",
    "bwd_config",
    "bwd_grid",
    "bwd_register_heavy",
    "bwd_spec",
    "clear_caches",
    "fwd_config",
    "fwd_spec",
    "kernels_are_interpreted",
    "launch_bwd",
    "launch_fwd",
]
