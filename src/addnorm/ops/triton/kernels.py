"""The fused Add & Norm's Triton kernels (CUDA, or the CPU interpreter): the forward and the backward
of one device, built from the tile helpers of :mod:`addnorm.ops.triton.tiles`.

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

The backward's program (j, p) takes column slice j of a contiguous run p of row tiles (one slice, the
whole row, up to ``launch_config.BWD_MAX_ONE_PASS`` columns) and accumulates that slice's dweight /
dbias / dgate over its rows in registers, in fp32, written once as row p of per-program partial sums
(summed afterwards by torch: deterministic, no atomics; a single program per slice, for few rows,
writes the gradients themselves). A row of several slices needs the row sums mean(x_hat * g) and
mean(g) of every slice: each slice's program reads the row's other slices for them (only the sums,
not the gradients), each while that slice's own program reads it, so the row's data comes from memory
once and from L2 after; per element the backward then reads dy, x_hat's source (s, y, or x and
residual) and the gradient at s once, writes dresidual (and dx) once, and reads back no partial sum.
The dropout mask is regenerated from the seed with the hash of
:func:`addnorm.ops.reference.dropout_keep_mask`, bit for bit. That is the backward's variant "slices"
(``launch_config.BWD_VARIANTS``), which stays selectable.

The default variant, "row_sums" (an H200 timed both in one run and chose it: ``launch_config``), gives
the row sums to the slices instead: a pre-pass (:data:`bwd_sums_kernel`, in the forward's tiles) reads
dy and x_hat's source once and writes each row's sum(x_hat * w dy) and sum(w dy) to ``SUMS``, and the
backward given them reads its own slice only. Per element from DRAM: dy and x_hat's source
twice (pre-pass, gradients), ds and x once, no re-read from L2; the dropout mask hashed once (the
gradients' tile: s and dx share it), twice where s is recomputed from x and residual (the pre-pass
needs s too).

Which configuration a launch uses is :mod:`addnorm.ops.launch_config`'s; the launches themselves are
:mod:`addnorm.ops.triton.launchers`'s. The kernels keep the names they have in profiler traces and in
``torch.library.triton_op``'s kernel list (``_add_norm_fwd_kernel``, ``_add_norm_bwd_kernel``,
``_add_norm_bwd_sums_kernel``); the other modules use the public names :data:`fwd_kernel`,
:data:`bwd_kernel` and :data:`bwd_sums_kernel`.

This module imports triton at import time: import it lazily (only ``ops/triton*`` modules do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .tiles import (
    chunk_stream,
    col_tile,
    finish_col_sums,
    hash_rows,
    input_grads,
    load_row_sums,
    load_tile,
    load_vec,
    mean_at,
    normalize,
    param_sums,
    program_slice,
    row_slices_sums,
    row_stats,
    row_tile,
    stats_pass,
    store_col_sums,
    store_per_row,
    store_row_sums,
    store_tile,
    store_y,
    stream_tile,
    tile_keep,
    xhat_tile,
    zero_col_sums,
)

__all__ = ["bwd_kernel", "bwd_sums_kernel", "fwd_kernel", "kernels_are_interpreted"]


@triton.jit(do_not_specialize=["SEED"])  # a host seed is a value: see addnorm.ops.seeds
def _add_norm_fwd_kernel(
    X, R, W, B, G, SEED, Y, S, MEAN, RSTD, stride_x, stride_r, n_rows, N, n_chunks, eps, alpha, drop_thr,
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
):  # fmt: skip
    rows, row_ok, rows64 = row_tile(tl.program_id(0), n_rows, BLOCK_M)  # [BLOCK_M, 1]
    ids = hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS)
    lane = tl.arange(0, BLOCK_N)[None, :]  # [1, BLOCK_N]
    if not CHUNKED:
        cols, col_ok, m = col_tile(0, lane, N, row_ok, BLOCK_N)
        s = chunk_stream(
            X, R, G, SEED, ids, cols, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_thr,
            drop_scale, GATE, DROPOUT, S_CODE,
        )  # fmt: skip
        if STORE_S:
            store_tile(S, s, rows64, N, cols, m)
        mean, rstd, xhat = normalize(s, m, N, eps, IS_RMS)
        store_y(Y, xhat, W, B, rows64, cols, col_ok, m, N, HAS_W, HAS_B)
    else:
        # pass 1: s chunk by chunk (stored when STORE_S), statistics merged across chunks
        mean, m2 = stats_pass(
            X, R, G, SEED, S, ids, rows64, row_ok, lane, N, n_chunks, 0, stride_x, stride_r, alpha, drop_thr,
            drop_scale, IS_RMS, GATE, DROPOUT, STORE_S, S_CODE, BLOCK_M, BLOCK_N,
        )  # fmt: skip
        rstd = 1.0 / tl.sqrt(m2 / N + eps)
        if STORE_S:
            tl.debug_barrier()  # pass 2 reads s written by other threads of this program
        # pass 2: s again (reloaded, or recomputed from x and r: both L2-resident by now), then y
        for c in range(n_chunks):
            cols, col_ok, m = col_tile(c, lane, N, row_ok, BLOCK_N)
            if STORE_S:
                s = load_tile(S, rows64, N, cols, m)
            else:
                s = chunk_stream(
                    X, R, G, SEED, ids, cols, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_thr,
                    drop_scale, GATE, DROPOUT, S_CODE,
                )  # fmt: skip
            if IS_RMS:
                xhat = s * rstd[:, None]
            else:
                xhat = (s - mean[:, None]) * rstd[:, None]
            store_y(Y, xhat, W, B, rows64, cols, col_ok, m, N, HAS_W, HAS_B)
    if RSTD is not None:  # None: the backward recomputes the statistics from s
        if not IS_RMS:
            store_per_row(mean_at(MEAN, RSTD, n_rows), mean, mean, n_rows, False, BLOCK_M)
        store_per_row(RSTD, rstd, rstd, n_rows, False, BLOCK_M)


@triton.jit(do_not_specialize=["SEED"])  # a host seed is a value: see addnorm.ops.seeds
def _add_norm_bwd_kernel(
    DY, DS, SAVED, X, R, W, B, G, SEED, MEAN, RSTD,
    SUMS,  # None, or the rows' sums from the row-sums pre-pass (variant "row_sums": no slice reads another)
    DX, DRES, DW_PART, DB_PART, DG_PART,
    stride_dy, stride_ds, stride_x, stride_r, n_rows, N, n_slices, tiles_per_program,
    eps,  # read only where the statistics are recomputed (RSTD None)
    alpha, drop_thr, drop_scale,
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
    SPLIT: tl.constexpr,  # rows wider than BLOCK_N: n_slices programs per row tile, one slice each
    ROWS=None,  # the rows' indices for the dropout hash (int64, one per row) where ROW_IDS
    ROW_IDS: tl.constexpr = False,
    DW=None,  # with FINISH_GROUP: the gradients, which the last programs add the partial sums up into
    DB=None,
    DG=None,
    COUNT=None,  # with FINISH_GROUP: int32 counters, zero (finish_col_sums)
    FINISH_GROUP: tl.constexpr = 0,  # > 0: the partial sums added up in the kernel, in groups of this size
):  # fmt: skip
    # program (j, pid): column slice j of the rows of pid's run of tiles. Its slice's dweight / dbias /
    # dgate accumulate in registers over the run and are written once (row pid of the partial sums).
    j, pid, lane, cols, col_ok = program_slice(N, BLOCK_N)
    dw_acc, db_acc, dg_acc = zero_col_sums(BLOCK_N)
    for t in range(tiles_per_program):
        rows, row_ok, rows64 = row_tile(pid * tiles_per_program + t, n_rows, BLOCK_M)
        m = row_ok & col_ok
        ids = hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS)
        keep = tile_keep(SEED, ids, cols, m, drop_thr, DROPOUT)
        # the slice's weight and bias, read per tile (L1-resident) rather than held across the rows
        w = load_vec(W, cols, col_ok, 1.0, HAS_W)
        b = load_vec(B, cols, col_ok, 0.0, HAS_B)
        if RSTD is None:  # no statistics kept: from s (saved or recomputed), as the forward did
            tl.static_assert(XHAT_FROM != 1, "x_hat from y needs the forward's statistics")
            tl.static_assert(not SPLIT, "a row in slices needs the forward's statistics")
            if XHAT_FROM == 0:
                s = load_tile(SAVED, rows64, N, cols, m)
            else:
                s = stream_tile(
                    X, R, G, keep, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_scale, GATE,
                    DROPOUT, S_CODE,
                )  # fmt: skip
            _, rstd, xhat = normalize(s, m, N, eps, IS_RMS)
            rstd = rstd[:, None]
        else:
            mean, rstd = row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS)
            if SPLIT:  # the row's sums first, over every slice (this one last: in L1 for what follows)
                if SUMS is None:
                    c1, c2 = row_slices_sums(
                        j, n_slices, SAVED, X, R, W, B, G, SEED, DY, ids, row_ok, rows64, lane, N, mean,
                        rstd, stride_dy, stride_x, stride_r, alpha, drop_thr, drop_scale, IS_RMS, HAS_W,
                        HAS_B, GATE, DROPOUT, XHAT_FROM, RECOMPUTE, S_CODE, BLOCK_M, BLOCK_N,
                    )  # fmt: skip
                else:  # or the pre-pass's (variant "row_sums"): only this slice is read
                    c1, c2 = load_row_sums(SUMS, rows64, row_ok, IS_RMS)
            xhat = xhat_tile(
                SAVED, X, R, G, keep, rows64, cols, col_ok, m, N, w, b, mean, rstd, stride_x, stride_r,
                alpha, drop_scale, IS_RMS, HAS_W, HAS_B, GATE, DROPOUT, XHAT_FROM, RECOMPUTE, S_CODE,
            )  # fmt: skip
        dy = load_tile(DY, rows64, stride_dy, cols, m)
        wdy = dy * w
        dw_acc, db_acc = param_sums(dy, xhat, dw_acc, db_acc, HAS_W, HAS_B)
        if not SPLIT:  # the row is this slice
            c1 = tl.sum(xhat * wdy, axis=1)[:, None]
            c2 = tl.sum(wdy, axis=1)[:, None]
        dg_acc = input_grads(
            dy, wdy, xhat, c1 / N, c2 / N, rstd, dg_acc, DS, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N,
            stride_ds, stride_x, alpha, drop_scale, IS_RMS, GATE, DROPOUT, HAS_DS, WRITE_DX,
        )  # fmt: skip
    store_col_sums(DW_PART, DB_PART, DG_PART, pid, j, N, dw_acc, db_acc, dg_acc, HAS_W, HAS_B, GATE, BLOCK_N)
    if FINISH_GROUP > 0:
        finish_col_sums(
            DW_PART, DB_PART, DG_PART, DW, DB, DG, COUNT, pid, j, N, HAS_W, HAS_B, GATE, FINISH_GROUP, BLOCK_N
        )


@triton.jit(do_not_specialize=["SEED"])  # a host seed is a value: see addnorm.ops.seeds
def _add_norm_bwd_sums_kernel(
    DY, SAVED, X, R, W, B, G, SEED, MEAN, RSTD, SUMS, stride_dy, stride_x, stride_r, n_rows, N, n_chunks,
    alpha, drop_thr, drop_scale, IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    GATE: tl.constexpr, DROPOUT: tl.constexpr, XHAT_FROM: tl.constexpr, RECOMPUTE: tl.constexpr,
    S_CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS=None,
    ROW_IDS: tl.constexpr = False,
):  # fmt: skip
    # the row-sums pre-pass of the backward's variant "row_sums": per row tile, sum(x_hat * w dy) and
    # sum(w dy) over the row's n_chunks column chunks (x_hat from s, y or s recomputed, as the backward's
    # slices take it; the mask hashed only where s is recomputed), into SUMS
    rows, row_ok, rows64 = row_tile(tl.program_id(0), n_rows, BLOCK_M)
    ids = hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS)
    mean, rstd = row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS)
    c1, c2 = row_slices_sums(
        n_chunks - 1, n_chunks, SAVED, X, R, W, B, G, SEED, DY, ids, row_ok, rows64,
        tl.arange(0, BLOCK_N)[None, :], N, mean, rstd, stride_dy, stride_x, stride_r, alpha, drop_thr,
        drop_scale, IS_RMS, HAS_W, HAS_B, GATE, DROPOUT, XHAT_FROM, RECOMPUTE, S_CODE, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    store_row_sums(SUMS, rows64, row_ok, c1, c2, IS_RMS)


fwd_kernel = _add_norm_fwd_kernel
bwd_kernel = _add_norm_bwd_kernel
bwd_sums_kernel = _add_norm_bwd_sums_kernel
_INTERPRETED = type(_add_norm_fwd_kernel).__name__ == "InterpretedFunction"


def kernels_are_interpreted() -> bool:
    """Whether the kernels were built for the interpreter (TRITON_INTERPRET=1 at import time)."""
    return _INTERPRETED
