"""The tensor-parallel Add & Norm's launchers (:class:`addnorm.ops.sharded.TensorParallelAddNorm` on
the Triton backend): the four passes of :mod:`addnorm.ops.triton.tp_kernels` on 2-D (rows, n) local
column shards, with the launch configurations of :mod:`addnorm.ops.launch_config` and the launch
helpers of :mod:`addnorm.ops.triton.launchers`; the collectives between the passes are ``sharded``'s.
``call`` is a :class:`addnorm.ops.sharded.TPCall`.

This module imports triton at import time: import it lazily (``sharded`` does).
"""

from __future__ import annotations

import torch
import triton
from torch import Tensor

from .. import launch_config as lc
from ..args import gate_code
from ..param_grads import param_grads
from .launchers import S_CODES, as_rows, dropout_args
from .tp_kernels import tp_bwd_kernel, tp_norm_kernel, tp_stats_kernel, tp_sums_kernel

__all__ = ["grads", "normalise", "stats", "sums"]


def _f32(rows: int, two: bool, device) -> Tensor:
    return torch.empty((rows, 2) if two else (rows,), dtype=torch.float32, device=device)


def _dropout(call, seed, rows) -> tuple[Tensor | None, Tensor | None, int, float]:
    """(seed, row ids, threshold, scale) as the kernels take them (None, None, 0, 1 without dropout)."""
    dropout = seed is not None and call.p > 0
    ids = rows.reshape(-1) if dropout and rows is not None else None
    return (seed if dropout else None), ids, *dropout_args(call.p, dropout)


def stats(call, x: Tensor, residual: Tensor, gate, seed, rows) -> tuple[Tensor, Tensor]:
    """(s (rows, n) in s's dtype, this rank's per-row statistics: RMSNorm sum(s^2) (rows,), LayerNorm
    (mean, M2) (rows, 2), fp32)."""
    nrows, n = x.shape
    s = torch.empty((nrows, n), dtype=call.s_dtype, device=x.device)
    st = _f32(nrows, not call.rms, x.device)
    if not n:  # no columns on this rank: nothing to add to the rows' statistics
        return s, st.zero_()
    if nrows:
        cfg = lc.fwd_config(n)
        x, stride_x = as_rows(x, n)
        residual, stride_r = as_rows(residual, n)
        seed, ids, thr, scale = _dropout(call, seed, rows)
        tp_stats_kernel[(triton.cdiv(nrows, cfg.block_m),)](
            x, residual, gate, seed, ids, s, st, stride_x, stride_r, nrows, n, triton.cdiv(n, cfg.block_n),
            call.col0, call.alpha, thr, scale, IS_RMS=call.rms, GATE=gate_code(gate),
            DROPOUT=seed is not None, ROW_IDS=ids is not None, S_CODE=S_CODES[call.s_dtype],
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
        )  # fmt: skip
    return s, st


def normalise(call, s: Tensor, mean: Tensor | None, rstd: Tensor, weight, bias) -> Tensor:
    """y (rows, n) in y's dtype from s and the whole rows' statistics."""
    nrows, n = s.shape
    y = torch.empty((nrows, n), dtype=call.y_dtype, device=s.device)
    if nrows and n:
        cfg = lc.fwd_config(n)
        tp_norm_kernel[(triton.cdiv(nrows, cfg.block_m),)](
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
        cfg = lc.fwd_config(n)
        dy, stride_dy = as_rows(dy, n)
        tp_sums_kernel[(triton.cdiv(nrows, cfg.block_m),)](
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
    gated = gate_code(gate)
    seed, ids, thr, scale = _dropout(call, seed, rows)
    cfg = lc.bwd_config(n, lc.bwd_register_heavy(call.s_dtype, seed is not None, gated)) if n else None
    programs, per_program = lc.bwd_grid(nrows, n, dev, (cfg.block_m, cfg.block_n)) if n else (0, 0)
    parts = [None if t is None else torch.zeros((max(programs, 1), n), dtype=torch.float32, device=dev)
             for t in (weight, bias, gate)]  # fmt: skip
    if programs:
        dy, stride_dy = as_rows(dy, n)
        ds, stride_ds = (None, 0) if ds is None else as_rows(ds, n)
        x, stride_x = (None, 0) if x is None else as_rows(x, n)
        tp_bwd_kernel[(triton.cdiv(n, cfg.block_n), programs)](  # column slices x runs of rows
            dy, ds, s, x, gate, weight, seed, ids, mean, rstd, row_sums, dx if need_dx else None, dres,
            *parts, stride_dy, stride_ds, stride_x, nrows, n, per_program, call.col0, 1.0 / call.hidden,
            call.alpha, thr, scale, IS_RMS=call.rms, HAS_W=weight is not None, HAS_B=bias is not None,
            GATE=gated, DROPOUT=seed is not None, HAS_DS=ds is not None, ROW_IDS=ids is not None,
            WRITE_DX=need_dx, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            maxnreg=cfg.maxnreg,
        )  # fmt: skip
    return (dx, dres, *param_grads(*parts, False, weight, bias, gate))
