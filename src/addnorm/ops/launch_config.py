"""The fused kernels' launch tables: which tile shape, column chunking and warp count each hidden size
gets (:func:`fwd_config`, :func:`bwd_config`, the row-sums pre-pass's :func:`bwd_sums_config`), how
many programs the backward runs (:func:`bwd_grid`), and which of its variants wide rows take
(``BWD_VARIANTS``, :func:`use_bwd_variant`). Plain Python, no Triton: the numbers a GPU session tunes
(``benchmarks/op/sweep_launch_config.py``) and the compile-time check reads
(``benchmarks/kernels/triton_variants.py``).

Every rule reads this module's constants at call time and is cached per hidden size: after changing a
constant, clear the caches (:func:`addnorm.ops.triton.launchers.clear_caches`, which also forgets the
launch specs built from them) and the call plans (:func:`addnorm.ops.policy.invalidate`).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = [
    "BWD_CANDIDATES",
    "BWD_FINISH_GROUP",
    "BWD_MAX_ONE_PASS",
    "BWD_MAX_ONE_PASS_HEAVY",
    "BWD_ONE_PROGRAM_TILES",
    "BWD_ROW_SUMS_MIN",
    "BWD_ROW_SUMS_MIN_HEAVY",
    "BWD_ROW_SUMS_SLICE",
    "BWD_SLICE",
    "BWD_SLICE_NARROW",
    "BWD_VARIANT",
    "BWD_VARIANTS",
    "FWD_CHUNK",
    "FWD_MAX_ONE_PASS",
    "MIN_BLOCK_N",
    "TILE",
    "Launch",
    "bwd_config",
    "bwd_grid",
    "bwd_register_heavy",
    "bwd_sums_config",
    "clear_caches",
    "fwd_config",
    "next_power_of_2",
    "use_bwd_variant",
]


class Launch(NamedTuple):
    """A kernel's launch configuration: tiles of ``block_m`` rows x ``block_n`` columns, rows wider
    than ``block_n`` in column chunks (``chunked``: the forward loops over them in each program, the
    backward gives each slice a program), ``num_warps`` warps per program."""

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


# Rows up to these widths stay in registers in one pass. Forward: narrow rows share a program (tiles of
# TILE elements), about 16 fp32 values per thread per tile tensor (ELEMS_PER_WARP 512); wider rows in
# column chunks of FWD_CHUNK, two passes. Measured on an H100 (bf16, rows = 2**27 / hidden,
# ``benchmarks/op/sweep_launch_config.py``, ``benchmarks/results/h100/2026-11-24-fcabca7/gpu_h100.md``): the
# forward's multi-row tiles were as fast as one row or faster.
#
# Backward: one row per step (BLOCK_M 1: a tile of several rows ran 2.6-4.7x slower on the H100 at hidden
# 256-8192), 8 values per thread (256 per warp), one pass up to BWD_MAX_ONE_PASS columns
# (BWD_MAX_ONE_PASS_HEAVY for the register-heavy variants: dropout or a gate, :func:`bwd_register_heavy`).
# A wider row is split into column slices of BWD_SLICE (BWD_SLICE_NARROW for the heavy variants and for
# widths that are not a multiple of 16), one program per slice and run of rows: each holds its slice's
# dweight / dbias / dgate sums in registers over its rows and reads the other slices only for the row sums
# (from L2: their own programs read them at the same time), so the row's data comes from memory once and
# no partial sum is read back (the column-chunked backward this replaced read every row twice and read-
# modify-wrote the partial sums per row: 1.18-1.24 ms at 8192-16384 on the H100 against 0.76 for one
# pass). Compiled for sm_80 / sm_90 (``benchmarks/results/cpu/2026-11-28-afab0e4/kernel_compile_full.md``):
# one pass at 4096 with 16 warps holds at most 128 registers with no spill in every variant, slices of 4096
# with 16 warps in the light ones on aligned widths (unaligned fp32 spilled 12-36 bytes on sm_80), slices of
# 2048 with 16 warps in every variant (at most 125; the heavy ones spilled 12-168 bytes at 4096 in their
# unaligned and mixed-precision variants); one pass or slices of 8192 spill (16-1072 bytes). The heavy
# variants' one pass stops at 2048, as measured with the old kernel (which spilled at 4096); with this one a
# GPU session should time one pass at 4096 against two slices (neither spills).
FWD_MAX_ONE_PASS = 8192
BWD_MAX_ONE_PASS = 4096
BWD_MAX_ONE_PASS_HEAVY = 2048
FWD_CHUNK = Launch(1, 2048, True, 8)
BWD_SLICE = Launch(1, 4096, True, 16)
BWD_SLICE_NARROW = Launch(1, 2048, True, 16)
TILE = 2048
MIN_BLOCK_N = 16
# A backward of at most this many tiles runs as one program (per column slice), which writes dweight /
# dbias / dgate itself: no partial sums, so no torch reduction after the kernel (one per parameter,
# each a launch: on a small call the largest host cost of the backward); its tiles then run one after
# another, ~1 us of GPU time each, hidden behind the host time of a call this small.
BWD_ONE_PROGRAM_TILES = 16

# The backward's variants for wide rows, both selectable (BWD_VARIANT, :func:`use_bwd_variant`). The
# default is the one the measurements chose: an H200 timed both side by side in one run at 7722722
# (``results/h200/2026-11-28-7722722/add_norm_h200.md``, bf16; ``benchmarks/op/add_norm.py``'s column
# "addnorm", then "slices", beside "addnorm_row_sums"). On the 28 shapes where "row_sums" engages
# (hidden >= 4096, or >= 2048 with dropout) its fwd+bwd beat "slices"'s on 27 (0.96x-4.26x; Post-LN
# RMSNorm with dropout at 16384 3.86 -> 1.07 ms) and torch.compile's on 25 (on the others both run the
# same kernels); over all 56 shapes its column's fwd+bwd was no slower than torch.compile's on 44,
# "slices"'s on 25. "slices" stays selectable, and ``benchmarks/op/add_norm.py`` times it beside the default
# in every run (column ``addnorm_slices``: each variant that is not the default gets a column).
# - "slices": the rules above. Each slice's program reads the row's other slices for the row
#   sums, so with n_slices slices a row is read n_slices times (once from DRAM if its siblings run in
#   step, the rest from L2) and, where s is recomputed (Post-LN from x and residual), the dropout mask
#   hashed n_slices + 1 times per element (8 + 1 at 16384 columns in 2048-wide slices). The H200
#   (``results/h200/2026-11-27-fb82146/add_norm_h200.md``, fb82146) timed it at 0.15x-0.94x
#   torch.compile's fwd+bwd from 4096 columns, about twice as slow with dropout.
# - "row_sums" (default): rows of at least BWD_ROW_SUMS_MIN columns (BWD_ROW_SUMS_MIN_HEAVY for dropout
#   or a gate) go in two kernels (narrower ones in one pass, as in "slices"). A pre-pass with the
#   forward's tiles (:func:`bwd_sums_config`) reads dy and x_hat's source once and writes each row's
#   sum(x_hat * w dy) and sum(w dy) (8 bytes a row); then the sliced kernel (BWD_ROW_SUMS_SLICE, its
#   program's dweight / dbias / dgate sums in registers over its rows, written once: deterministic, no
#   atomics) reads only its own slice. Per element from DRAM:
#   dy and x_hat's source twice (pre-pass, then the gradients), ds and x once, dresidual and dx written
#   once; no L2 re-reads; the mask hashed once per element (in the gradients' tile, shared by s and dx),
#   twice where s is recomputed from x and residual (the pre-pass needs s too). Bytes per element,
#   bf16, dx and dresidual both written: Pre-LN (dy, ds, s) 10 minimal, "slices" 10 from DRAM + 4 x
#   (n_slices - 1) from L2, "row_sums" 14; Post-LN from x and residual (dy, x, r) 10 minimal, "slices"
#   10 + 6 x (n_slices - 1) from L2, "row_sums" 16. Registers (sm_80 / sm_90, no spill):
#   ``results/cpu/2026-11-28-afab0e4/kernel_compile_full.md``.
# - "kernel_sums" (made without a GPU; timed beside "row_sums" by an H200 at 81f67f7, which kept "row_sums":
#   ``results/h200/2026-11-28-81f67f7/``): "row_sums"'s kernels, and the programs' partial parameter gradients
#   added up inside the backward kernel (``triton.tiles.finish_col_sums``): the last program of each group of
#   BWD_FINISH_GROUP to finish adds its group's rows up, the last group's finisher the groups' rows into the
#   gradients (in the parameters' dtypes), in fixed groups and order (deterministic), with int32 counters per
#   device and stream that the kernel sets back to zero (:func:`addnorm.ops.param_grads.counters`). It removes
#   the aten sum per parameter (and the cast of a bf16 one) after every backward of more than one program: a
#   launch each, the largest host cost of the op's backward at the GPU's sizes in the CPU proxy
#   (``benchmarks/host/step_host.py``). Its GPU cost is a tail: the last finisher reads BWD_FINISH_GROUP
#   rows, then one row per group (at 8192 rows of 768, 1171 programs: 32 + 37 rows of 3 KB per parameter,
#   from L2), where the aten sums read all 1171 rows in a kernel of their own each. Measured: its fwd+bwd
#   was slower than "row_sums"'s on 55 of the 56 shapes (median 1.06x; the finishers' tail costs more GPU
#   time than the host time it saves at these sizes), level in the LM step (1.006x, 0.998x); selectable, no
#   longer timed each run.
BWD_VARIANTS = ("slices", "row_sums", "kernel_sums")
BWD_VARIANT = "row_sums"
# the variants that the GPU suite times beside the default in every run (``benchmarks/op/add_norm.py``'s
# ``addnorm_<variant>`` columns) until a measurement decides: none pending. "slices" lost to "row_sums"
# on 27 of 28 shapes at 7722722, "kernel_sums" on 55 of 56 at 81f67f7; both stay selectable
# (``benchmarks/op/add_norm.py --impls addnorm addnorm_slices addnorm_kernel_sums``)
BWD_CANDIDATES: tuple[str, ...] = ()
BWD_FINISH_GROUP = 32
BWD_ROW_SUMS_MIN = 4096
BWD_ROW_SUMS_MIN_HEAVY = 2048
BWD_ROW_SUMS_SLICE = Launch(1, 2048, True, 8)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (``triton.next_power_of_2`` without importing Triton)."""
    return 1 << max(0, n - 1).bit_length()


def _one_pass(n: int, elems_per_warp: int, tile: int = TILE) -> Launch:
    block_n = max(MIN_BLOCK_N, next_power_of_2(n))
    block_m = max(1, tile // block_n)
    warps = min(max(block_m * block_n // elems_per_warp, 1), 16)
    return Launch(block_m, block_n, False, warps)


@functools.lru_cache(maxsize=256)
def fwd_config(n: int) -> Launch:
    """The forward's launch configuration for rows of ``n`` columns."""
    return _one_pass(n, 512) if n <= FWD_MAX_ONE_PASS else FWD_CHUNK


@functools.lru_cache(maxsize=256)
def bwd_config(n: int, heavy: bool = False, variant: str = "slices") -> Launch:
    """The backward's launch configuration for rows of ``n`` columns: one row per step, in one pass or
    (``chunked``) in column slices of ``block_n``; ``heavy`` (:func:`bwd_register_heavy`) variants go
    in slices from narrower rows, and they and widths that are not a multiple of 16 (no vector loads:
    more registers) in narrower slices. ``variant`` "row_sums": from ``BWD_ROW_SUMS_MIN`` columns
    (``BWD_ROW_SUMS_MIN_HEAVY`` for the heavy variants) the slices of ``BWD_ROW_SUMS_SLICE`` after the
    row-sums pre-pass (see ``BWD_VARIANTS``)."""
    if variant != "slices" and n >= (BWD_ROW_SUMS_MIN_HEAVY if heavy else BWD_ROW_SUMS_MIN):
        return BWD_ROW_SUMS_SLICE
    if n <= (BWD_MAX_ONE_PASS_HEAVY if heavy else BWD_MAX_ONE_PASS):
        return _one_pass(n, 256, tile=1)
    return BWD_SLICE_NARROW if heavy or n % 16 else BWD_SLICE


def bwd_sums_config(n: int) -> Launch:
    """The row-sums pre-pass's configuration (variant "row_sums"): the forward's (:func:`fwd_config`),
    whose first pass it resembles (two or three tensors read, a sum per row; ``chunked``: a loop over
    column chunks in each program)."""
    return fwd_config(n)


def use_bwd_variant(variant: str) -> str:
    """Select the backward variant (``BWD_VARIANTS``) for the launches made from now on and return the
    previous one. Cached call plans hold launch specs, so a change makes every plan anew on its next call
    (:func:`addnorm.ops.policy.invalidate`); the launch specs of both variants stay cached side by side
    (``triton.launchers.bwd_spec`` keys them on the variant), so flipping back and forth between calls
    (``benchmarks/op/add_norm.py``) compiles and builds nothing twice. A graph torch.compile traced
    through the registered op (compile path "kernel") keeps the variant it was traced with."""
    global BWD_VARIANT
    if variant not in BWD_VARIANTS:
        raise ValueError(f"variant: expected one of {BWD_VARIANTS}, got {variant!r}")
    previous, BWD_VARIANT = BWD_VARIANT, variant
    if variant != previous:
        from .policy import invalidate  # launch_config imports nothing of the package at import time

        invalidate()
    return previous


def bwd_register_heavy(s_dtype: torch.dtype, dropout: bool, gate_code: int) -> bool:
    """Whether a backward variant holds so many values live that one pass over a wide row spills:
    dropout or a gate, in any dtype (``benchmarks/results/cpu/2026-11-28-afab0e4/kernel_compile_full.md``;
    with 16 warps a thread has 128 registers). ``s_dtype``, the stream's dtype, is part of the rule's
    signature: the spills were measured per dtype and fp32 spills most."""
    return dropout or gate_code != 0


@functools.lru_cache(maxsize=16)
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=1024)
def _bwd_grid(tiles: int, n: int, device: torch.device, block_m: int, block_n: int) -> tuple[int, int]:
    slices = -(-n // block_n)
    if device.type == "cuda":
        per_sm = max(1, 8192 // (block_m * min(block_n, n)))
        target = max(1, _sm_count(device) * per_sm // slices)
    else:
        target = 4
    per_program = -(-tiles // max(1, min(tiles, target)))
    return -(-tiles // per_program), per_program


def bwd_grid(
    rows: int, n: int, device: torch.device, block: tuple[int, int] | None = None
) -> tuple[int, int]:
    """(programs, tiles per program) of the backward, per column slice (a launch runs ``programs`` x
    the row's slices): one program up to ``BWD_ONE_PROGRAM_TILES`` tiles (it writes the parameter
    gradients themselves), beyond that enough programs to fill the GPU (about 8192 elements per tile's
    worth of work each, over all slices), few enough that the (programs, hidden) fp32 partial sums stay
    small. The interpreter takes at most 4 (still more than one partial sum). ``block``: the launch's
    (rows, columns) per tile, ``bwd_config(n)``'s by default. Cached per shape."""
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
    """Forget the cached launch configurations (after changing a constant of this module; the launch
    specs built from them too: :func:`addnorm.ops.triton.launchers.clear_caches`)."""
    for cache in (fwd_config, bwd_config, _bwd_grid):
        cache.cache_clear()
