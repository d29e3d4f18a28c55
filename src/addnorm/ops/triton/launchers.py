"""The fused kernels' launches: what a call's options fix, decided once per option set (the launch
specs :class:`FwdSpec` / :class:`BwdSpec`: grid, column chunks, the kernels' trailing arguments and
constexprs, launch options), and the launchers made for each spec, which allocate a call's outputs
and launch :mod:`addnorm.ops.triton.kernels`' kernels with the configuration
:mod:`addnorm.ops.launch_config` gives the hidden size.

The eager path (:mod:`addnorm.ops.triton.eager`) calls a spec's launcher directly; the registered
op's body calls :mod:`addnorm.ops.triton.op_launchers`'s (through ``wrap_triton`` where it may be traced,
so torch.compile launches the kernels itself). The tensor-parallel launchers
(:mod:`addnorm.ops.triton.tp_launchers`) share :func:`as_rows`, :func:`dropout_args` and :data:`S_CODES`
(and :mod:`addnorm.ops.param_grads`).

This module imports triton at import time: import it lazily (only ``ops/triton*`` modules do).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from triton.runtime.jit import JITFunction

from .. import launch_config as lc
from ..args import XHAT_FROM_Y, bwd_plan
from ..param_grads import counters, param_grads
from ..reference import dropout_threshold
from .direct_launch import SUPPORTED as DIRECT
from .direct_launch import DirectLaunch, defaults_of, int_kind
from .kernels import bwd_kernel, bwd_sums_kernel, fwd_kernel, kernels_are_interpreted

__all__ = [
    "S_CODES",
    "BwdSpec",
    "FwdSpec",
    "SumsSpec",
    "as_rows",
    "bwd_kernel",
    "bwd_spec",
    "clear_caches",
    "dropout_args",
    "fwd_kernel",
    "fwd_launcher",
    "fwd_spec",
    "kernels_are_interpreted",
    "launch_bwd",
    "launch_fwd",
]

# the stream's dtype as the kernels' S_CODE constexpr (the rounding of s, ``triton.tiles.round_to``)
S_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def clear_caches() -> None:
    """Forget the cached launch configurations and specs (after changing a constant of
    :mod:`addnorm.ops.launch_config`; cached plans hold specs too: clear them as well,
    ``addnorm.ops.policy.invalidate``)."""
    lc.clear_caches()
    for cache in (fwd_spec, _bwd_spec):
        cache.cache_clear()


def as_rows(t: Tensor, n: int) -> tuple[Tensor, int]:
    """``t`` as rows of ``n`` unit-stride columns: the tensor the kernel reads and its row stride. A
    contiguous tensor of any rank is passed as it is (no view: the kernel reads pointers)."""
    if t.is_contiguous():
        return t, n
    t = t.reshape(-1, n)
    if t.stride(1) != 1:
        t = t.contiguous()
    return t, t.stride(0)


_F32 = torch.float32


class FwdSpec(NamedTuple):
    """The forward's launch for one set of options: grid rows per program, column chunks, the
    kernel's trailing arguments (``tail``: the scalars, then the constexprs, positional), the launch
    options (``options``: warps, register budget) and ``launch``, the launcher made for the spec
    (:func:`fwd_launcher`)."""

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
    launch: Callable | None = None  # the launcher for this spec (:func:`launch_fwd`'s body)


class SumsSpec(NamedTuple):
    """The row-sums pre-pass of the backward's variant "row_sums" (``launch_config.BWD_VARIANTS``): rows
    per program, column chunks, the kernel's trailing arguments (alpha, dropout threshold and scale,
    the constexprs) and launch options."""

    block_m: int
    n_chunks: int
    tail: tuple
    options: dict


class BwdSpec(NamedTuple):
    """The backward's launch for one set of options (see :class:`FwdSpec`); ``sums``: its row-sums
    pre-pass (variant "row_sums", rows in slices), else None."""

    n: int
    n_slices: int  # programs per row tile: column slices of ``block[1]`` (one: the row in one pass)
    split: bool  # rows in several slices (the forward must keep the statistics)
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
    sums: SumsSpec | None = None
    launch: Callable | None = None  # the launcher for this spec (:func:`launch_bwd`'s body)
    finish: int = 0  # variant "kernel_sums": the in-kernel sums' group size (0: torch sums the partials)


def dropout_args(p: float, dropout: bool) -> tuple[int, float]:
    """The kernels' dropout scalars: (threshold of the hash's 24 bits, 1 / (1 - p)), or (0, 1)."""
    return (dropout_threshold(p), 1.0 / (1.0 - p)) if dropout else (0, 1.0)


# the kernels' parameter names (from the Python function both a JITFunction and the interpreter's
# kernel wrap), read before anything can replace the kernels (a benchmark's stub)
# (those without a default: the ones with one, row indices for a shard's dropout, go as keywords)
def _required_params(kernel) -> tuple[str, ...]:
    params = inspect.signature(kernel.fn).parameters.values()
    return tuple(p.name for p in params if p.default is inspect.Parameter.empty)


_FWD_PARAMS = _required_params(fwd_kernel)
_BWD_PARAMS = _required_params(bwd_kernel)
_SUMS_PARAMS = _required_params(bwd_sums_kernel)
_FWD_KW, _BWD_KW, _SUMS_KW = (defaults_of(k) for k in (fwd_kernel, bwd_kernel, bwd_sums_kernel))
_FWD_DEFAULTS, _BWD_DEFAULTS, _SUMS_DEFAULTS = (tuple(kw.values()) for kw in (_FWD_KW, _BWD_KW, _SUMS_KW))


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
    cfg = lc.fwd_config(n)
    is_rms = norm == "rmsnorm"
    constexprs = {
        "IS_RMS": is_rms, "HAS_W": has_w, "HAS_B": has_b, "GATE": gate_code, "DROPOUT": p > 0,
        "STORE_S": store_s, "S_CODE": S_CODES[s_dtype], "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "CHUNKED": cfg.chunked,
    }  # fmt: skip
    tail = _tail(_FWD_PARAMS, (eps, alpha, *dropout_args(p, p > 0)), constexprs)
    n_chunks = -(-n // cfg.block_n)
    mean_apart = not is_rms and stats == "apart"
    per_row = 0 if stats == "none" else (2 if stats == "packed" and not is_rms else 1)
    sp = FwdSpec(n, cfg.block_m, n_chunks, mean_apart, per_row, store_s, y_dtype, s_dtype, tail, cfg.options)
    return sp._replace(launch=fwd_launcher(sp))


def bwd_spec(
    n: int, norm: str, alpha: float, p: float, has_w: bool, has_b: bool, gate_code: int, has_ds: bool,
    xhat_from: int, s_dtype: torch.dtype, x_dtype: torch.dtype, res_dtype: torch.dtype, need_dx: bool,
    eps: float = 0.0, variant: str | None = None,
) -> BwdSpec:  # fmt: skip
    """The backward's launch spec (``has_ds``: a gradient arrives at s; ``eps``: the norm's, read only
    where the kernel is given no statistics and recomputes them; ``variant``: one of
    ``launch_config.BWD_VARIANTS``, default ``launch_config.BWD_VARIANT`` as it is now). Cached per
    options and variant."""
    return _bwd_spec(
        n, norm, alpha, p, has_w, has_b, gate_code, has_ds, xhat_from, s_dtype, x_dtype, res_dtype, need_dx,
        eps, variant or lc.BWD_VARIANT,
    )  # fmt: skip


@functools.lru_cache(maxsize=1024)
def _bwd_spec(
    n, norm, alpha, p, has_w, has_b, gate_code, has_ds, xhat_from, s_dtype, x_dtype, res_dtype, need_dx, eps,
    variant,
) -> BwdSpec:  # fmt: skip
    if variant not in lc.BWD_VARIANTS:
        raise ValueError(f"bwd_spec: variant must be one of {lc.BWD_VARIANTS}, got {variant!r}")
    cfg = lc.bwd_config(n, lc.bwd_register_heavy(s_dtype, p > 0, gate_code), variant)
    bp = bwd_plan(False, xhat_from, has_w or has_b, gate_code != 0, p > 0, alpha, x_dtype, res_dtype)
    constexprs = {
        "IS_RMS": norm == "rmsnorm", "HAS_W": has_w, "HAS_B": has_b, "GATE": gate_code, "DROPOUT": p > 0,
        "HAS_DS": has_ds, "XHAT_FROM": xhat_from, "RECOMPUTE": bp.recompute and xhat_from == XHAT_FROM_Y,
        "S_CODE": S_CODES[s_dtype], "WRITE_DX": need_dx, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n,
        "SPLIT": cfg.chunked,
    }  # fmt: skip
    sums = None
    if variant != "slices" and cfg.chunked:  # the pre-pass: the same options, the forward's tiles
        pre = lc.bwd_sums_config(n)
        pre_const = {k: v for k, v in constexprs.items() if k not in ("HAS_DS", "WRITE_DX", "SPLIT")}
        pre_const |= {"BLOCK_M": pre.block_m, "BLOCK_N": pre.block_n}
        pre_tail = _tail(_SUMS_PARAMS, (alpha, *dropout_args(p, p > 0)), pre_const)
        sums = SumsSpec(pre.block_m, -(-n // pre.block_n), pre_tail, pre.options)
    sp = BwdSpec(
        n, -(-n // cfg.block_n), cfg.chunked, norm == "rmsnorm", xhat_from, bp.recompute, bp.keep_x,
        need_dx, x_dtype, res_dtype, (cfg.block_m, cfg.block_n),
        _tail(_BWD_PARAMS, (eps, alpha, *dropout_args(p, p > 0)), constexprs), cfg.options, sums,
        finish=lc.BWD_FINISH_GROUP if variant == "kernel_sums" else 0,
    )  # fmt: skip
    return sp._replace(launch=_bwd_launcher(sp))


# --- launchers -----------------------------------------------------------------------------------


def _ptr_bits(*tensors) -> int:
    """The low 4 bits of the tensors' addresses, OR-ed (None taken as aligned): 0 where every one is
    16-byte aligned (what Triton specialises a pointer on; not the kernels' SEED, which they mark
    ``do_not_specialize``: a tensor or a host seed, one kernel whatever its address or value)."""
    bits = 0
    for t in tensors:
        if t is not None:
            bits |= t.data_ptr()
    return bits & 15


def _dtype(t: Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def _finish_kw(outs: tuple, count: Tensor, group: int) -> dict:
    """The in-kernel sums' keywords (variant "kernel_sums"): the gradients, the counters, the group."""
    return {"DW": outs[0], "DB": outs[1], "DG": outs[2], "COUNT": count, "FINISH_GROUP": group}


def _summed(alloc, n: int, weight, bias, gate) -> tuple:
    """The gradients the in-kernel sums write (variant "kernel_sums"): dweight and dbias in the
    parameters' dtypes, dgate per column in fp32 (a one-element gate's summed after)."""
    return (
        None if weight is None else alloc(n, dtype=weight.dtype),
        None if bias is None else alloc(n, dtype=bias.dtype),
        None if gate is None else alloc(n, dtype=_F32),
    )


def _empty_like(t: Tensor, contiguous: bool, dtype: torch.dtype) -> Tensor:
    """A contiguous empty tensor of ``t``'s shape and ``dtype``: ``empty_like`` where ``t`` is contiguous
    (a third of ``torch.empty``'s host time with keywords without ``dtype``, under half with it: 1.1 and
    1.4 us against 3.2 on the 2-core CPU), else ``torch.empty``."""
    if contiguous:
        return torch.empty_like(t) if t.dtype is dtype else torch.empty_like(t, dtype=dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device)


def _with_row_ids(full: dict, row_ids: Tensor) -> dict:
    """A launch's keywords (``full``, :func:`_given_defaults`'s) with the row indices for the dropout hash
    (a shard, :mod:`addnorm.ops.sharded`)."""
    return {**full, "ROWS": row_ids.reshape(-1), "ROW_IDS": True}


def _given_defaults(options: dict, defaults: dict) -> dict:
    """A launch's keywords with the kernel's defaulted parameters given (``defaults``, name -> default):
    Inductor's launcher of a ``wrap_triton`` kernel takes every parameter the kernel declares, so a call
    leaving defaults out came short (torch 2.11: "launcher() missing ... '_grid_1' and '_grid_2'")."""
    return {**options, **defaults}


def launch_fwd(sp: FwdSpec, x, residual, weight, bias, gate, seed, kernel=None, row_ids=None):
    """The forward on x and residual of any shape (..., n): (y, s or None, mean or None, rstd), y and
    s contiguous of x's shape, the statistics one per row in fp32 (the means, if any, in ``mean`` or,
    ``sp.stats_per_row`` 2, after the rstds in ``rstd``; none, rstd None, for ``stats_per_row`` 0).
    ``kernel``: the kernel to launch (default the module's: ``wrap_triton``'s where the call is
    traced); ``row_ids``: the rows' indices for the dropout hash (int64, one per row) where x is a
    shard of a bigger tensor. The spec's own launcher (``sp.launch``, which the eager path calls
    directly) does it."""
    return sp.launch(None, x, residual, weight, bias, gate, seed, kernel, row_ids)


def launch_bwd(
    sp: BwdSpec, dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, kernel=None, row_ids=None,
    sums_kernel=None,
):  # fmt: skip
    """The backward (``dy`` of any shape (..., n), ``saved`` s or y contiguous of that shape, None for
    XR): (dx or None, dresidual, dweight or None, dbias or None, dgate or None). ``row_ids`` as for
    :func:`launch_fwd`; ``sums_kernel``: the row-sums pre-pass's kernel where the spec has one (default
    the module's). The spec's own launcher (``sp.launch``) does it."""
    return sp.launch(
        dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, kernel, row_ids, sums_kernel
    )


# The launchers, one made per spec: the spec's fields bound as closure constants, so that a call reads
# no attribute (a NamedTuple field costs ~25 ns, a global ~20: a small call's launch had ~40 such reads
# and three frames, ~1 us of host time). The kernels are looked up at each call (a benchmark may replace
# them).


def fwd_launcher(sp: FwdSpec, keep: tuple[bool, bool, bool, bool] | None = None) -> Callable:
    """The forward's launcher for ``sp``: ``launch(ctx, x, residual, weight, bias, gate=None, seed=None,
    kernel=None, row_ids=None)``. With ``ctx`` None (:func:`launch_fwd`, the spec's own ``launch``):
    (y, s or None, mean or None, rstd or None). With an autograd context it is the eager path's
    ``autograd.Function.forward`` itself (:mod:`addnorm.ops.triton.eager` makes one per launch, one frame
    fewer per call), ``keep`` saying what the backward needs: (x, residual, y (else s), prenorm). It sets
    ``ctx.to_save`` to (x or None, residual or None, weight, bias, gate, seed, y or s, the statistics)
    and returns y, or with ``prenorm`` (y, s) and no zero-filled gradient for an unused output."""
    n, block_m, n_chunks, tail, options = sp.n, sp.block_m, sp.n_chunks, sp.tail, sp.options
    mean_apart, per_row, y_dtype, s_dtype = sp.mean_apart, sp.stats_per_row, sp.y_dtype, sp.s_dtype
    s_kind = 0 if not sp.store_s else (1 if s_dtype is y_dtype else 2)  # s: none, like y, in its dtype
    keep_x, keep_r, save_y, prenorm = keep or (False, False, False, False)
    empty_like = torch.empty_like
    direct = DirectLaunch(_FWD_DEFAULTS)  # this launcher's compiled kernels, by specialisation
    full = _given_defaults(options, _FWD_KW)

    def launch(ctx, x, residual, weight, bias, gate=None, seed=None, kernel=None, row_ids=None):
        x_in, r_in, x_dtype = x, residual, x.dtype
        seed_value = type(seed) is int  # a host seed (addnorm.ops.seeds), not a tensor
        rows = x.numel() // n
        if x.is_contiguous():  # read as rows without a view
            stride_x = n
            y = empty_like(x) if x_dtype is y_dtype else _empty_like(x, True, y_dtype)
        else:
            y = _empty_like(x, False, y_dtype)
            x, stride_x = as_rows(x, n)
        if s_kind:
            s = empty_like(y) if s_kind == 1 else _empty_like(y, True, s_dtype)
        else:
            s = None
        if x_dtype is _F32:  # no keywords: a third less host time
            mean = x.new_empty(rows) if mean_apart else None
            rstd = x.new_empty(per_row * rows) if per_row else None
        else:
            mean = x.new_empty(rows, dtype=_F32) if mean_apart else None
            rstd = x.new_empty(per_row * rows, dtype=_F32) if per_row else None
        if rows:
            if residual.is_contiguous():
                stride_r = n
            else:
                residual, stride_r = as_rows(residual, n)
            k = fwd_kernel if kernel is None else kernel
            grid = (-(-rows // block_m),)
            if (  # the compiled kernel launched directly: a JIT kernel, rows of n columns, 16-byte aligned
                type(k) is JITFunction
                and DIRECT
                and row_ids is None
                and stride_x == stride_r == n
                and not _ptr_bits(x, residual, weight, bias, gate)  # not SEED: do_not_specialize
            ):
                key = (  # dtypes inline: a helper call each would cost more than the test
                    x_dtype, residual.dtype, None if weight is None else weight.dtype,
                    None if bias is None else bias.dtype, None if gate is None else gate.dtype,
                    int_kind(rows), seed_value,
                )  # fmt: skip
                args = (
                    x, residual, weight, bias, gate, seed, y, s, mean, rstd, n, n, rows, n, n_chunks, *tail,
                )  # fmt: skip
                direct.launch(k, key, grid, args, options)
            else:  # the same arguments (the direct launch's test compares them with run()'s)
                k[grid](
                    x, residual, weight, bias, gate, seed, y, s, mean, rstd, stride_x, stride_r, rows, n,
                    n_chunks, *tail, **(full if row_ids is None else _with_row_ids(full, row_ids)),
                )  # fmt: skip
        if ctx is None:
            return y, s, mean, rstd
        # what ``save_for_backward`` sets, without its frame; the statistics too (created here, they
        # are kept as they are: no reference cycle), so that ctx needs no attribute dict but for a host
        # seed, which is no tensor
        ctx.to_save = (
            x_in if keep_x else None, r_in if keep_r else None, weight, bias, gate,
            None if seed_value else seed, y if save_y else s, rstd,
        )  # fmt: skip
        if seed_value:
            ctx.seed = seed
        if prenorm:
            ctx.materialize_grads = False  # ``set_materialize_grads(False)`` without its frame
            return y, s
        return y

    launch.direct = direct  # its compiled kernels, which the native call registers (ops/native)
    return launch


def _sums_launcher(sp: BwdSpec) -> Callable | None:
    """The row-sums pre-pass's launcher for ``sp`` (None where the spec has none): ``pre(dy, saved, x,
    residual, weight, bias, gate, seed, mean, rstd, stride_dy, stride_x, stride_r, rows, kernel,
    row_ids, aligned)`` (``aligned``: the backward's test that its inputs are rows of n columns at
    16-byte addresses, made once for both launches) returns the rows' sums (fp32: one a row for
    RMSNorm, two for LayerNorm), which the backward's slices read (their ``SUMS``)."""
    if sp.sums is None:
        return None
    n, (block_m, n_chunks, tail, options) = sp.n, sp.sums
    per_row = 1 if sp.is_rms else 2
    direct = DirectLaunch(_SUMS_DEFAULTS)
    full = _given_defaults(options, _SUMS_KW)

    def pre(dy, saved, x, residual, weight, bias, gate, seed, mean, rstd, stride_dy, stride_x, stride_r, rows,
            kernel, row_ids, aligned):  # fmt: skip
        sums = dy.new_empty(per_row * rows, dtype=_F32)
        k = bwd_sums_kernel if kernel is None else kernel
        grid = (-(-rows // block_m),)
        args = (
            dy, saved, x, residual, weight, bias, gate, seed, mean, rstd, sums, stride_dy, stride_x, stride_r,
            rows, n, n_chunks, *tail,
        )  # fmt: skip
        if type(k) is JITFunction and aligned:  # as the backward's own launch
            key = (
                dy.dtype, _dtype(saved), _dtype(x), _dtype(residual), _dtype(weight), _dtype(bias),
                _dtype(gate), int_kind(rows), type(seed) is int,
            )  # fmt: skip
            direct.launch(k, key, grid, args, options)
        else:
            k[grid](*args, **(full if row_ids is None else _with_row_ids(full, row_ids)))
        return sums

    return pre


def _bwd_launcher(sp: BwdSpec) -> Callable:
    """``launch(dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, kernel=None,
    row_ids=None, sums_kernel=None)`` for ``sp``: see :func:`launch_bwd`."""
    n, n_slices, need_dx, recompute, need_x = sp.n, sp.n_slices, sp.need_dx, sp.recompute, sp.need_x
    x_dtype, res_dtype, block, tail, options = sp.x_dtype, sp.res_dtype, sp.block, sp.tail, sp.options
    block_m = sp.block[0]
    one_program_rows = lc.BWD_ONE_PROGRAM_TILES * block_m  # bwd_grid's one program, without its frame
    empty_like = torch.empty_like
    direct = DirectLaunch(_BWD_DEFAULTS)
    full = _given_defaults(options, _BWD_KW)
    pre = _sums_launcher(sp)  # the row-sums pre-pass (variants "row_sums", "kernel_sums"), or None
    finish = sp.finish  # "kernel_sums": the partial sums added up in the kernel (its launches: direct_sum)
    direct_sum = DirectLaunch(())  # their arguments given in full (the defaulted ones too)

    def launch(
        dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, kernel=None, row_ids=None,
        sums_kernel=None,
    ):  # fmt: skip
        dy_dtype = dy.dtype
        rows = dy.numel() // n
        if dy.is_contiguous():
            stride_dy = n
            dres = empty_like(dy) if dy_dtype is res_dtype else _empty_like(dy, True, res_dtype)
        else:
            dres = _empty_like(dy, False, res_dtype)
            dy, stride_dy = as_rows(dy, n)
        dx = _empty_like(dres, True, x_dtype) if need_dx else None
        if 0 < rows <= one_program_rows:
            programs, per_program, part = 1, -(-rows // block_m), n
        else:
            programs, per_program = lc.bwd_grid(rows, n, dy.device, block)
            part = (programs, n)
        # "kernel_sums" on several programs, eager (a traced launch's partials are summed by torch, which
        # Inductor fuses): the counters (None while a graph is captured without any made), the gradients
        count = (
            counters(dy, n_slices * (-(-programs // finish) + 1))
            if finish and programs > 1 and kernel is None
            else None
        )
        alloc = dy.new_empty
        outs = None if count is None else _summed(alloc, n, weight, bias, gate)
        # per-program partial sums of dweight / dbias / dgate in fp32 (each program writes its slice of
        # its row once), summed below; one program (few rows) writes the sums themselves
        if dy_dtype is _F32:  # no keywords: a third less host time
            dw_part = None if weight is None else alloc(part)
            db_part = None if bias is None else alloc(part)
            dg_part = None if gate is None else alloc(part)
        else:
            dw_part = None if weight is None else alloc(part, dtype=_F32)
            db_part = None if bias is None else alloc(part, dtype=_F32)
            dg_part = None if gate is None else alloc(part, dtype=_F32)
        if recompute and (x is None or residual is None):
            raise ValueError("add_norm_bwd: recomputing s needs x and residual")
        if rows:
            # each input as rows of n columns (a copy only where its layout needs one), or absent: inline
            # conditionals, not a helper call a tensor, on this hot path
            ds, stride_ds = (None, 0) if ds is None else (ds, n) if ds.is_contiguous() else as_rows(ds, n)
            x, stride_x = (None, 0) if not need_x else (x, n) if x.is_contiguous() else as_rows(x, n)
            residual, stride_r = (
                (None, 0)
                if not recompute
                else (residual, n)
                if residual.is_contiguous()
                else as_rows(residual, n)
            )
            # as the forward's test, made once for the pre-pass and this launch: rows of n columns,
            # 16-byte aligned (not SEED: do_not_specialize)
            aligned = (
                DIRECT
                and row_ids is None
                and stride_dy == n
                and stride_x in (0, n)
                and stride_r in (0, n)
                and not _ptr_bits(dy, saved, x, residual, weight, bias, gate, mean, rstd)
            )
            sums = None if pre is None else pre(
                dy, saved, x, residual, weight, bias, gate, seed, mean, rstd, stride_dy, stride_x, stride_r,
                rows, sums_kernel, row_ids, aligned,
            )  # fmt: skip
            k = bwd_kernel if kernel is None else kernel
            grid = (n_slices, programs)  # column slices x runs of rows
            seed_value = type(seed) is int  # a host seed (addnorm.ops.seeds), not a tensor
            if (  # a JIT kernel and ds (the pre-pass reads none) aligned too
                type(k) is JITFunction
                and aligned
                and (ds is None or (stride_ds == n and not ds.data_ptr() & 15))
            ):
                key = (  # dtypes inline: a helper call each would cost more than the test
                    dy_dtype, None if ds is None else ds.dtype, None if saved is None else saved.dtype,
                    None if x is None else x.dtype, None if residual is None else residual.dtype,
                    None if weight is None else weight.dtype, None if bias is None else bias.dtype,
                    None if gate is None else gate.dtype, int_kind(rows), int_kind(per_program), seed_value,
                )  # fmt: skip
                args = (
                    dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, sums, dx, dres, dw_part,
                    db_part, dg_part, stride_dy, stride_ds, stride_x, stride_r, rows, n, n_slices,
                    per_program, *tail,
                )  # fmt: skip
                if count is None:
                    direct.launch(k, key, grid, args, options)
                else:
                    direct_sum.launch(k, key, grid, (*args, None, False, *outs, count, finish), options)
            else:  # the same arguments (the direct launch's test compares them with run()'s)
                kw = full if row_ids is None else _with_row_ids(full, row_ids)
                k[grid](
                    dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd, sums, dx, dres, dw_part,
                    db_part, dg_part, stride_dy, stride_ds, stride_x, stride_r, rows, n, n_slices,
                    per_program, *tail, **(kw if count is None else kw | _finish_kw(outs, count, finish)),
                )  # fmt: skip
        if count is not None:  # the kernel added the partial sums up
            return (dx, dres, *param_grads(*outs, True, weight, bias, gate))
        return (dx, dres, *param_grads(dw_part, db_part, dg_part, programs == 1, weight, bias, gate))

    launch.direct = direct  # as the forward's
    return launch
