"""The fused kernels' tile helpers: the ``@triton.jit`` device functions that the single-device
kernels (:mod:`addnorm.ops.triton.kernels`) and the tensor-parallel ones
(:mod:`addnorm.ops.triton.tp_kernels`) share, each rule of the op written once on a tile of
``[BLOCK_M, BLOCK_N]`` (rows x columns)::

    s = alpha * r + g * dropout(x)   (rounded to s's dtype)            stream_tile, chunk_stream
    the rows' statistics over column chunks                           chunk_stats, stats_pass
    LayerNorm x_hat = (s - mean) * rstd, RMSNorm x_hat = s * rstd       normalize, xhat_of, xhat_tile
    y = w * x_hat + b                                                   store_y
    ds = rstd * (w dy - x_hat * mean(x_hat * w dy) - mean(w dy))        dsum_tile (RMSNorm: no last term)
    dresidual = alpha * ds, dx = dropout'(g * ds), dgate = sum(ds * dropout(x))   store_dx
    dweight = sum(dy * x_hat), dbias = sum(dy), dgate over a slice's rows   param_sums, input_grads
    the programs' partial sums added up in the kernel ("kernel_sums")      finish_col_sums

A program's rows (:func:`row_tile`) and a chunk or slice of its columns (:func:`col_tile`) are found the
same way in every kernel; tiles of s, y and the gradients load and store with :func:`load_tile` and
:func:`store_tile`.

The dropout keep mask is the hash of (seed, row, column) of
:func:`addnorm.ops.reference.dropout_keep_mask`, bit for bit (:func:`keep_mask`). Chunked statistics
merge per-chunk means and centred sums of squares (Chan et al. 1979, :func:`chunk_stats`).

Every function here is public to the kernel modules (no ``__all__``: a list would only repeat the
definitions). This module imports triton at import time: import it lazily (only ``ops/triton*`` modules do).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..reference import HASH_COL, HASH_M1, HASH_M2, HASH_ROW

# Triton kernels read module globals only as constexpr
_M1 = tl.constexpr(HASH_M1)
_M2 = tl.constexpr(HASH_M2)
_ROW = tl.constexpr(HASH_ROW)
_COL = tl.constexpr(HASH_COL)
# partial-sum rows a program finishing the in-kernel sums loads at once ("kernel_sums": finish_col_sums);
# with the heavy backward's 8 values per thread a row, 64 fp32 registers a thread
FINISH_ROWS = tl.constexpr(8)


@triton.jit
def hash32(v):
    # v: uint32; same steps as reference.hash32 (uint32 multiplication wraps mod 2**32)
    v = v ^ (v >> 16)
    v = v * _M1
    v = v ^ (v >> 15)
    v = v * _M2
    return v ^ (v >> 16)


@triton.jit
def keep_mask(SEED, rows, cols, drop_thr):
    # rows: [BLOCK_M, 1], cols: [1, BLOCK_N] -> [BLOCK_M, BLOCK_N] keep mask of reference.dropout_keep_mask;
    # SEED: a pointer to the int64 seed, or the seed itself (an i64 argument: addnorm.ops.seeds)
    if SEED.dtype.is_ptr():
        seed = tl.load(SEED)
    else:
        seed = SEED
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    a = hash32(k0 ^ hash32(rows.to(tl.uint32) * _ROW + k1))
    h = hash32(a ^ (cols.to(tl.uint32) * _COL))
    return (h >> 8).to(tl.int32) >= drop_thr


@triton.jit
def tile_keep(SEED, rows64, cols, m, drop_thr, DROPOUT: tl.constexpr):
    # a tile's dropout keep mask (computed once per tile and shared), or m without dropout
    if DROPOUT:
        keep = keep_mask(SEED, rows64, cols, drop_thr)
    else:
        keep = m
    return keep


@triton.jit
def hash_rows(ROWS, rows, row_ok, rows64, ROW_IDS: tl.constexpr):
    # the rows' indices for the dropout hash: their own, or given (x is a shard of a bigger tensor)
    if ROW_IDS:
        ids = tl.load(ROWS + rows, mask=row_ok, other=0)
    else:
        ids = rows64
    return ids


@triton.jit
def row_tile(tile, n_rows, BLOCK_M: tl.constexpr):
    # row tile ``tile``'s rows as [BLOCK_M, 1]: their indices, which of them exist, the indices as int64
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)[:, None]
    row_ok = rows < n_rows
    return rows, row_ok, rows.to(tl.int64)


@triton.jit
def col_tile(c, lane, N, row_ok, BLOCK_N: tl.constexpr):
    # column chunk (or slice) c as [1, BLOCK_N] (lane: 0 .. BLOCK_N - 1): its columns, which of them
    # exist, and the [BLOCK_M, BLOCK_N] mask of the tile it makes with the rows row_ok
    cols = c * BLOCK_N + lane
    col_ok = cols < N
    return cols, col_ok, row_ok & col_ok


@triton.jit
def program_slice(N, BLOCK_N: tl.constexpr):
    # a backward program (j, pid): its column slice j (lane, columns, which exist) and its run pid of rows
    j = tl.program_id(0)
    pid = tl.program_id(1)
    lane = tl.arange(0, BLOCK_N)[None, :]
    cols = j * BLOCK_N + lane
    return j, pid, lane, cols, cols < N


@triton.jit
def zero_col_sums(BLOCK_N: tl.constexpr):
    # a slice's dweight, dbias and dgate sums, accumulated in registers over a program's rows
    return (
        tl.zeros((BLOCK_N,), tl.float32),
        tl.zeros((BLOCK_N,), tl.float32),
        tl.zeros((BLOCK_N,), tl.float32),
    )


@triton.jit
def load_tile(P, rows64, stride, cols, m):
    # a [BLOCK_M, BLOCK_N] tile of rows ``stride`` apart, in fp32 (0 where masked out)
    return tl.load(P + rows64 * stride + cols, mask=m, other=0.0).to(tl.float32)


@triton.jit
def store_tile(P, v, rows64, stride, cols, m):
    tl.store(P + rows64 * stride + cols, v.to(P.dtype.element_ty), mask=m)


@triton.jit
def chunk_stats(mean, m2, s, m, c, N, IS_RMS: tl.constexpr, BLOCK_N: tl.constexpr):
    # the rows' statistics so far merged with chunk c's, s 0 where m is False: RMSNorm the sum of
    # squares (in m2); LayerNorm the running mean and centred sum of squares (Chan et al. 1979: no
    # E[s^2] - mean^2)
    if IS_RMS:
        m2 += tl.sum(s * s, axis=1)
    else:
        done = c * BLOCK_N * 1.0
        cnt = tl.minimum(N - c * BLOCK_N, BLOCK_N) * 1.0
        mean_c = tl.sum(s, axis=1) / cnt
        d = tl.where(m, s - mean_c[:, None], 0.0)
        delta = mean_c - mean
        mean += delta * (cnt / (done + cnt))
        m2 += tl.sum(d * d, axis=1) + delta * delta * (done * cnt / (done + cnt))
    return mean, m2


@triton.jit
def round_to(v, S_CODE: tl.constexpr):
    if S_CODE == 1:
        v = v.to(tl.float16).to(tl.float32)
    elif S_CODE == 2:
        v = v.to(tl.bfloat16).to(tl.float32)
    return v


@triton.jit
def stream_tile(
    X, R, G, keep, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_scale, GATE: tl.constexpr,
    DROPOUT: tl.constexpr, S_CODE: tl.constexpr,
):  # fmt: skip
    # s = alpha * r + g * dropout(x) on a [BLOCK_M, BLOCK_N] tile (masked-out elements 0), rounded to
    # the stream's dtype, in fp32: the forward's operations, which the backward repeats where it
    # recomputes s
    x = load_tile(X, rows64, stride_x, cols, m)
    r = load_tile(R, rows64, stride_r, cols, m)
    if DROPOUT:
        x = tl.where(keep, x * drop_scale, 0.0)
    if GATE == 1:
        x = x * tl.load(G).to(tl.float32)
    elif GATE == 2:
        x = x * tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
    return round_to(alpha * r + x, S_CODE)


@triton.jit
def chunk_stream(
    X, R, G, SEED, ids, hash_cols, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_thr, drop_scale,
    GATE: tl.constexpr, DROPOUT: tl.constexpr, S_CODE: tl.constexpr,
):  # fmt: skip
    # s on a tile with the tile's own keep mask (hashed at rows ids, columns hash_cols): the passes that
    # compute s and need the mask for nothing else
    keep = tile_keep(SEED, ids, hash_cols, m, drop_thr, DROPOUT)
    return stream_tile(
        X, R, G, keep, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_scale, GATE, DROPOUT, S_CODE
    )  # fmt: skip


@triton.jit
def stats_pass(
    X, R, G, SEED, S, ids, rows64, row_ok, lane, N, n_chunks, col0, stride_x, stride_r, alpha, drop_thr,
    drop_scale, IS_RMS: tl.constexpr, GATE: tl.constexpr, DROPOUT: tl.constexpr, STORE_S: tl.constexpr,
    S_CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # the first pass over a row tile in column chunks (the chunked forward's, the tensor-parallel stats
    # pass's; this rank's columns start at col0): s chunk by chunk, stored where STORE_S, and the rows'
    # statistics merged across chunks (chunk_stats): (mean, M2), RMSNorm (0, sum of squares)
    mean = tl.zeros((BLOCK_M,), tl.float32)
    m2 = tl.zeros((BLOCK_M,), tl.float32)
    for c in range(n_chunks):
        cols, col_ok, m = col_tile(c, lane, N, row_ok, BLOCK_N)
        s = chunk_stream(
            X, R, G, SEED, ids, cols + col0, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_thr,
            drop_scale, GATE, DROPOUT, S_CODE,
        )  # fmt: skip
        if STORE_S:
            store_tile(S, s, rows64, N, cols, m)
        mean, m2 = chunk_stats(mean, m2, s, m, c, N, IS_RMS, BLOCK_N)
    return mean, m2


@triton.jit
def load_vec(P, cols, col_ok, other, HAS: tl.constexpr):
    # a per-column vector (weight, bias, gate) as a [1, BLOCK_N] fp32 row, or the constant ``other``
    if HAS:
        v = tl.load(P + cols, mask=col_ok, other=other).to(tl.float32)
    else:
        v = tl.full(cols.shape, other, tl.float32)
    return v


@triton.jit
def store_y(Y, xhat, W, B, rows64, cols, col_ok, m, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # y = w * x_hat + b on a tile (w 1 and b 0 where the norm has none)
    y = xhat * load_vec(W, cols, col_ok, 1.0, HAS_W) + load_vec(B, cols, col_ok, 0.0, HAS_B)
    store_tile(Y, y, rows64, N, cols, m)


@triton.jit
def normalize(s, m, N, eps, IS_RMS: tl.constexpr):
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
def xhat_of(s, mean, rstd, m, other, IS_RMS: tl.constexpr):
    # x_hat of a tile of s from the rows' statistics where m, ``other`` elsewhere (RMSNorm: no mean)
    if not IS_RMS:
        s = s - mean
    return tl.where(m, s * rstd, other)


@triton.jit
def mean_at(MEAN, RSTD, n_rows):
    # where the rows' means live: MEAN, or with MEAN None (the eager path's one statistics buffer, an
    # allocation fewer per call) after the n_rows rstds in RSTD's buffer
    if MEAN is None:
        p = RSTD + n_rows
    else:
        p = MEAN
    return p


@triton.jit
def xhat_tile(
    SAVED, X, R, G, keep, rows64, cols, col_ok, m, N, w, b, mean, rstd, stride_x, stride_r, alpha, drop_scale,
    IS_RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, GATE: tl.constexpr, DROPOUT: tl.constexpr,
    XHAT_FROM: tl.constexpr, RECOMPUTE: tl.constexpr, S_CODE: tl.constexpr,
):  # fmt: skip
    # x_hat on a [BLOCK_M, BLOCK_N] tile (0 where masked out), from s saved, y saved, or s recomputed
    if XHAT_FROM == 0:
        xhat = xhat_of(load_tile(SAVED, rows64, N, cols, m), mean, rstd, m, 0.0, IS_RMS)
    elif XHAT_FROM == 2:
        s = stream_tile(
            X, R, G, keep, rows64, cols, col_ok, m, stride_x, stride_r, alpha, drop_scale, GATE, DROPOUT,
            S_CODE,
        )  # fmt: skip
        xhat = xhat_of(s, mean, rstd, m, 0.0, IS_RMS)
    else:
        v = load_tile(SAVED, rows64, N, cols, m)
        # reference.xhat_from_y_ok: x_hat = (y - b) / w where w != 0 and |b| <= |w|, else from s
        from_s = col_ok & ~((w != 0.0) & (tl.abs(b) <= tl.abs(w)))
        if HAS_B:
            v = v - b
        if HAS_W:
            v = v / tl.where(from_s, 1.0, w)
        xhat = tl.where(m, v, 0.0)
        if RECOMPUTE:
            ms = m & from_s  # x and residual are read in these columns only
            s = stream_tile(
                X, R, G, keep, rows64, cols, col_ok, ms, stride_x, stride_r, alpha, drop_scale, GATE, DROPOUT,
                S_CODE,
            )  # fmt: skip
            xhat = xhat_of(s, mean, rstd, ms, xhat, IS_RMS)
    return xhat


@triton.jit
def dsum_tile(
    dy, wdy, xhat, c1, c2, rstd, DS, rows64, cols, m, stride_ds, IS_RMS: tl.constexpr, HAS_DS: tl.constexpr
):
    # d/ds of the norm (plus the gradient arriving at s itself, Pre-LN) on a tile
    if IS_RMS:
        dsum = (wdy - xhat * c1) * rstd
    else:
        dsum = (wdy - (xhat * c1 + c2)) * rstd
    if HAS_DS:
        dsum += load_tile(DS, rows64, stride_ds, cols, m)
    return dsum


@triton.jit
def store_dx(
    dsum, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N, stride_x, alpha, drop_scale, GATE: tl.constexpr,
    DROPOUT: tl.constexpr, WRITE_DX: tl.constexpr,
):  # fmt: skip
    # dresidual = alpha * dsum; dx = dropout'(gate * dsum); returns dsum * dropout(x), the gate's term
    # (the address before alpha * dsum: the op order the kernels' register counts were measured with)
    tl.store(DRES + rows64 * N + cols, (alpha * dsum).to(DRES.dtype.element_ty), mask=m)
    gterm = dsum
    if WRITE_DX:
        dx = dsum
        if GATE != 0:
            xd = load_tile(X, rows64, stride_x, cols, m)
            if DROPOUT:
                xd = tl.where(keep, xd * drop_scale, 0.0)
            gterm = dsum * xd
            if GATE == 1:
                dx = dx * tl.load(G).to(tl.float32)
            else:
                dx = dx * tl.load(G + cols, mask=col_ok, other=0.0).to(tl.float32)
        if DROPOUT:
            dx = tl.where(keep, dx * drop_scale, 0.0)
        store_tile(DX, dx, rows64, N, cols, m)
    return gterm


@triton.jit
def param_sums(dy, xhat, dw_acc, db_acc, HAS_W: tl.constexpr, HAS_B: tl.constexpr):
    # a slice's dweight = sum(dy * x_hat) and dbias = sum(dy) with this tile's rows added
    if HAS_W:
        dw_acc += tl.sum(dy * xhat, axis=0)
    if HAS_B:
        db_acc += tl.sum(dy, axis=0)
    return dw_acc, db_acc


@triton.jit
def input_grads(
    dy, wdy, xhat, c1, c2, rstd, dg_acc, DS, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N, stride_ds,
    stride_x, alpha, drop_scale, IS_RMS: tl.constexpr, GATE: tl.constexpr, DROPOUT: tl.constexpr,
    HAS_DS: tl.constexpr, WRITE_DX: tl.constexpr,
):  # fmt: skip
    # a tile's dresidual and dx stored (c1 and c2: the rows' means of x_hat * w dy and w dy), and the
    # slice's dgate sum returned with this tile's rows added
    dsum = dsum_tile(dy, wdy, xhat, c1, c2, rstd, DS, rows64, cols, m, stride_ds, IS_RMS, HAS_DS)
    gterm = store_dx(
        dsum, X, G, keep, DX, DRES, rows64, cols, col_ok, m, N, stride_x, alpha, drop_scale, GATE, DROPOUT,
        WRITE_DX,
    )  # fmt: skip
    if GATE != 0:
        dg_acc += tl.sum(gterm, axis=0)
    return dg_acc


@triton.jit
def row_stats(MEAN, RSTD, rows, row_ok, n_rows, IS_RMS: tl.constexpr):
    # the rows' (mean, rstd) as the forward stored them (mean 0 for RMSNorm; see mean_at)
    rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
    mean = rstd * 0.0
    if not IS_RMS:
        mean = tl.load(mean_at(MEAN, RSTD, n_rows) + rows, mask=row_ok, other=0.0)
    return mean, rstd


@triton.jit
def store_per_row(P, a, b, n_rows, PAIR: tl.constexpr, BLOCK_M: tl.constexpr):
    # this program's rows' a (one number a row), or (a, b) interleaved (PAIR)
    out = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    ok = out < n_rows
    if PAIR:
        tl.store(P + 2 * out, a, mask=ok)
        tl.store(P + 2 * out + 1, b, mask=ok)
    else:
        tl.store(P + out, a, mask=ok)


@triton.jit
def row_slices_sums(
    j, n_slices, SAVED, X, R, W, B, G, SEED, DY, ids, row_ok, rows64, lane, N, mean, rstd, stride_dy,
    stride_x, stride_r, alpha, drop_thr, drop_scale, IS_RMS: tl.constexpr, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, GATE: tl.constexpr, DROPOUT: tl.constexpr, XHAT_FROM: tl.constexpr,
    RECOMPUTE: tl.constexpr, S_CODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # the row sums sum(x_hat * w dy) and sum(w dy) of rows in n_slices slices, as [BLOCK_M, 1], read by
    # the program of slice j: the other slices first, each while its own program reads it (the
    # siblings start one slice apart, so a slice comes from memory once and from L2 to the others),
    # slice j last (still in L1 when its gradients are computed). The row-sums pre-pass reads every
    # slice (chunk) in order: j = n_slices - 1
    c1 = tl.zeros((BLOCK_M, 1), tl.float32)
    c2 = tl.zeros((BLOCK_M, 1), tl.float32)
    for k in range(1, n_slices + 1):
        cols, col_ok, m = col_tile((j + k) % n_slices, lane, N, row_ok, BLOCK_N)
        if DROPOUT and (XHAT_FROM == 2 or RECOMPUTE):  # the mask only where s is recomputed
            keep = tile_keep(SEED, ids, cols, m, drop_thr, DROPOUT)
        else:
            keep = m
        w = load_vec(W, cols, col_ok, 1.0, HAS_W)
        b = load_vec(B, cols, col_ok, 0.0, HAS_B)
        xhat = xhat_tile(
            SAVED, X, R, G, keep, rows64, cols, col_ok, m, N, w, b, mean, rstd, stride_x, stride_r, alpha,
            drop_scale, IS_RMS, HAS_W, HAS_B, GATE, DROPOUT, XHAT_FROM, RECOMPUTE, S_CODE,
        )  # fmt: skip
        wdy = load_tile(DY, rows64, stride_dy, cols, m) * w
        c1 += tl.sum(xhat * wdy, axis=1)[:, None]
        c2 += tl.sum(wdy, axis=1)[:, None]
    return c1, c2


@triton.jit
def store_col_sums(
    DW_PART, DB_PART, DG_PART, pid, j, N, dw, db, dg, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    GATE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # a program's column sums over its rows (dy * x_hat, dy, the gate's term) of its slice j, into row
    # pid of the partial-sum buffers: written once, no read-modify-write
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    at = pid.to(tl.int64) * N + cols
    if HAS_W:
        tl.store(DW_PART + at, dw, mask=ok)
    if HAS_B:
        tl.store(DB_PART + at, db, mask=ok)
    if GATE != 0:
        tl.store(DG_PART + at, dg, mask=ok)


@triton.jit
def store_row_sums(SUMS, rows64, row_ok, c1, c2, IS_RMS: tl.constexpr):
    # the rows' sums of x_hat * w dy and w dy ([BLOCK_M, 1] each), as the row-sums pre-pass leaves them
    # for the backward's slices: RMSNorm one number a row (c1), LayerNorm the pair (c1, c2)
    if IS_RMS:
        tl.store(SUMS + rows64, c1, mask=row_ok)
    else:
        tl.store(SUMS + 2 * rows64, c1, mask=row_ok)
        tl.store(SUMS + 2 * rows64 + 1, c2, mask=row_ok)


@triton.jit
def load_row_sums(SUMS, rows64, row_ok, IS_RMS: tl.constexpr):
    # the rows' sums that store_row_sums left ([BLOCK_M, 1] each; RMSNorm's c2 0)
    if IS_RMS:
        c1 = tl.load(SUMS + rows64, mask=row_ok, other=0.0)
        c2 = c1 * 0.0
    else:
        c1 = tl.load(SUMS + 2 * rows64, mask=row_ok, other=0.0)
        c2 = tl.load(SUMS + 2 * rows64 + 1, mask=row_ok, other=0.0)
    return c1, c2


@triton.jit
def sum_part_rows(PART, row0, count, step, cols, ok, N, BLOCK_N: tl.constexpr):
    # sum over rows row0, row0 + step, ... (count of them) of the (programs, N) fp32 partial sums, at the
    # columns cols: FINISH_ROWS rows per load (their loads in flight together), added in a fixed order
    # (deterministic); read past L1 (".cg"): other programs wrote them
    acc = tl.zeros((BLOCK_N,), tl.float32)
    ks = tl.arange(0, FINISH_ROWS)
    for k0 in range(0, count, FINISH_ROWS):
        k = k0 + ks
        at = (row0 + k * step).to(tl.int64)[:, None] * N + cols[None, :]
        v = tl.load(PART + at, mask=(k < count)[:, None] & ok[None, :], other=0.0, cache_modifier=".cg")
        acc += tl.sum(v, axis=0)
    return acc


@triton.jit
def sum_part_into(PART, OUT, row0, count, step, out, cols, ok, N, BLOCK_N: tl.constexpr):
    # one parameter's partial sums of rows row0, row0 + step, ... added up: into the partial sums at
    # ``out`` (OUT None: a group's sum, left for the last group) or into its gradient OUT
    v = sum_part_rows(PART, row0, count, step, cols, ok, N, BLOCK_N)
    if OUT is None:
        tl.store(PART + out, v, mask=ok)
    else:
        tl.store(OUT + cols, v, mask=ok)


@triton.jit
def sum_parts(
    DW_PART, DB_PART, DG_PART, DW, DB, DG, row0, count, step, to_row, j, N, HAS_W: tl.constexpr,
    HAS_B: tl.constexpr, GATE: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # slice j's partial sums of every parameter, rows row0, row0 + step, ... added up: into row to_row of
    # the partial sums (DW None: a group's sum) or into the gradients DW / DB / DG (to_row then unused)
    cols = j * BLOCK_N + tl.arange(0, BLOCK_N)
    ok = cols < N
    out = to_row.to(tl.int64) * N + cols
    if HAS_W:
        sum_part_into(DW_PART, DW, row0, count, step, out, cols, ok, N, BLOCK_N)
    if HAS_B:
        sum_part_into(DB_PART, DB, row0, count, step, out, cols, ok, N, BLOCK_N)
    if GATE != 0:
        sum_part_into(DG_PART, DG, row0, count, step, out, cols, ok, N, BLOCK_N)


@triton.jit
def finish_col_sums(
    DW_PART, DB_PART, DG_PART, DW, DB, DG, COUNT, pid, j, N, HAS_W: tl.constexpr, HAS_B: tl.constexpr,
    GATE: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    # the backward's variant "kernel_sums": programs (j, 0..P-1) each wrote row pid of slice j's partial
    # sums. The last of each group of GROUP programs to get here adds its group's rows up into the group's
    # first row; the last group to finish adds those rows up into the gradients. Fixed groups and orders:
    # deterministic. COUNT holds per slice a counter per group and one for the groups (int32, zero before
    # the launch); whoever read a counter last sets it back to zero, so it is zero after the launch too.
    programs = tl.num_programs(1)
    n_groups = tl.cdiv(programs, GROUP)
    g = pid // GROUP
    first = g * GROUP
    size = tl.minimum(GROUP, programs - first)
    counters = COUNT + j * (n_groups + 1)
    tl.debug_barrier()  # every thread's partial sums stored before the release below
    if tl.atomic_add(counters + g, 1, sem="acq_rel", scope="gpu") == size - 1:
        tl.store(counters + g, 0)
        sum_parts(
            DW_PART, DB_PART, DG_PART, None, None, None, first, size, 1, first, j, N, HAS_W, HAS_B, GATE,
            BLOCK_N,
        )  # fmt: skip
        tl.debug_barrier()  # the group's sum stored before the release below
        if tl.atomic_add(counters + n_groups, 1, sem="acq_rel", scope="gpu") == n_groups - 1:
            tl.store(counters + n_groups, 0)
            sum_parts(
                DW_PART, DB_PART, DG_PART, DW, DB, DG, 0, n_groups, GROUP, first, j, N, HAS_W, HAS_B, GATE,
                BLOCK_N,
            )  # fmt: skip
