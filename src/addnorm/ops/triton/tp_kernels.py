"""Triton kernels of the tensor-parallel Add & Norm (:class:`addnorm.ops.sharded.TensorParallelAddNorm`,
launched by :mod:`addnorm.ops.triton.tp_launchers`): each rank holds ``n`` of the ``hidden`` columns of
every row, so a row's statistics need every rank's columns. Four passes over (rows, n) tiles, column
chunks for wide rows, the collectives between them in ``sharded``::

    stats     s = alpha * r + g * dropout(x) (stored), per row: RMSNorm sum(s^2); LayerNorm (mean, M2)
              of this rank's columns (chunks merged as Chan et al. 1979)
    normalise y = w * x_hat + b, x_hat = (s - mean) * rstd (RMSNorm s * rstd), the whole rows' statistics
    sums      per row: sum(x_hat * w dy), and for LayerNorm sum(w dy), over this rank's columns
    grads     ds = rstd * (w dy - x_hat * c1 - c2) (+ the gradient at s), c = the whole rows' sums / hidden;
              dresidual, dx (dropout, gate), and per-program partial sums of dweight, dbias, dgate (each
              program one column slice of a run of rows, its sums in registers, written once)

The dropout mask hashes the global coordinates (row ids where the rows are a shard too, columns from
``col0``), so it is the whole tensor's mask (:func:`addnorm.ops.reference.dropout_keep_mask`). The
tile helpers are the single-device kernels' (:mod:`addnorm.ops.triton.tiles`).

This module imports triton at import time: import it lazily (only ``ops/triton*`` modules do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    col_tile,
    hash_rows,
    input_grads,
    load_tile,
    load_vec,
    param_sums,
    program_slice,
    row_stats,
    row_tile,
    stats_pass,
    store_col_sums,
    store_per_row,
    store_y,
    tile_keep,
    xhat_of,
    zero_col_sums,
)

__all__ = ["tp_bwd_kernel", "tp_norm_kernel", "tp_stats_kernel", "tp_sums_kernel"]


@triton.jit
def tp_stats_kernel(
    X, R, G, SEED, ROWS, S, STATS, stride_x, stride_r, n_rows, N, n_chunks, col0, alpha, drop_thr, drop_scale,
    IS_RMS: tl.constexpr, GATE: tl.constexpr, DROPOUT: tl.constexpr, ROW_IDS: tl.constexpr,
    S_CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows, row_ok, rows64 = row_tile(tl.program_id(0), n_rows, BLOCK_M)
    ids = hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    mean, m2 = stats_pass(
        X, R, G, SEED, S, ids, rows64, row_ok, lane, N, n_chunks, col0, stride_x, stride_r, alpha, drop_thr,
        drop_scale, IS_RMS, GATE, DROPOUT, True, S_CODE, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if IS_RMS:
        store_per_row(STATS, m2, m2, n_rows, False, BLOCK_M)
    else:
        store_per_row(STATS, mean, m2, n_rows, True, BLOCK_M)


@triton.jit
def tp_norm_kernel(
    S, W, B, MEAN, RSTD, Y, n_rows, N, n_chunks, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows, row_ok, rows64 = row_tile(tl.program_id(0), n_rows, BLOCK_M)
    mean, rstd = row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    for c in range(n_chunks):
        cols, col_ok, m = col_tile(c, lane, N, row_ok, BLOCK_N)
        s = load_tile(S, rows64, N, cols, m)
        store_y(Y, (s - mean) * rstd, W, B, rows64, cols, col_ok, m, N, HAS_W, HAS_B)


@triton.jit
def tp_sums_kernel(
    DY, S, W, MEAN, RSTD, SUMS, stride_dy, n_rows, N, n_chunks, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    rows, row_ok, rows64 = row_tile(tl.program_id(0), n_rows, BLOCK_M)
    mean, rstd = row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS)
    lane = tl.arange(0, BLOCK_N)[None, :]
    c1 = tl.zeros((BLOCK_M,), tl.float32)
    c2 = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(n_chunks):
        cols, col_ok, m = col_tile(c, lane, N, row_ok, BLOCK_N)
        xhat = xhat_of(load_tile(S, rows64, N, cols, m), mean, rstd, m, 0.0, False)
        wdy = load_tile(DY, rows64, stride_dy, cols, m) * load_vec(W, cols, col_ok, 1.0, HAS_W)
        c1 += tl.sum(xhat * wdy, axis=1)
        c2 += tl.sum(wdy, axis=1)
    store_per_row(SUMS, c1, c2, n_rows, not IS_RMS, BLOCK_M)


@triton.jit
def tp_bwd_kernel(
    DY, DS, S, X, G, W, SEED, ROWS, MEAN, RSTD, SUMS, DX, DRES, DW_PART, DB_PART, DG_PART,
    stride_dy, stride_ds, stride_x, n_rows, N, tiles_per_program, col0, inv_hidden, alpha, drop_thr,
    drop_scale, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GATE: tl.constexpr,
    DROPOUT: tl.constexpr, HAS_DS: tl.constexpr, ROW_IDS: tl.constexpr, WRITE_DX: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # program (j, pid): column slice j of pid's run of row tiles, as the single-device backward's
    # slices (the row sums come from the all-reduce); the slice's parameter-gradient sums accumulate in
    # registers and are written once
    j, pid, lane, cols, col_ok = program_slice(N, BLOCK_N)
    w = load_vec(W, cols, col_ok, 1.0, HAS_W)
    dw_acc, db_acc, dg_acc = zero_col_sums(BLOCK_N)
    for t in range(tiles_per_program):
        rows, row_ok, rows64 = row_tile(pid * tiles_per_program + t, n_rows, BLOCK_M)
        m = row_ok & col_ok
        ids = hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS)
        mean, rstd = row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS)
        # the whole rows' means of x_hat * w dy and w dy
        if IS_RMS:
            c1 = tl.load(SUMS + rows, mask=row_ok, other=0.0) * inv_hidden
            c2 = c1 * 0.0
        else:
            c1 = tl.load(SUMS + 2 * rows, mask=row_ok, other=0.0) * inv_hidden
            c2 = tl.load(SUMS + 2 * rows + 1, mask=row_ok, other=0.0) * inv_hidden
        keep = tile_keep(SEED, ids, cols + col0, m, drop_thr, DROPOUT)
        xhat = xhat_of(load_tile(S, rows64, N, cols, m), mean, rstd, m, 0.0, False)
        dy = load_tile(DY, rows64, stride_dy, cols, m)
        dw_acc, db_acc = param_sums(dy, xhat, dw_acc, db_acc, HAS_W, HAS_B)
        dg_acc = input_grads(
            dy, dy * w, xhat, c1, c2, rstd, dg_acc, DS, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N,
            stride_ds, stride_x, alpha, drop_scale, IS_RMS, GATE, DROPOUT, HAS_DS, WRITE_DX,
        )  # fmt: skip
    store_col_sums(DW_PART, DB_PART, DG_PART, pid, j, N, dw_acc, db_acc, dg_acc, HAS_W, HAS_B, GATE, BLOCK_N)
