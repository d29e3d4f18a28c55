"""One eager launch's native call (:class:`NativeLaunch`): the C++ ``NativePlan`` for an
:class:`~addnorm.ops.triton.eager.EagerLaunch` (a plan and gate kind), told the launch specs' shapes
and what the backward keeps, its Python launchers (today's, for calls whose kernel is not registered
yet), and the registration of each kernel those launchers compile (from their direct launches'
compiled kernels, :mod:`addnorm.ops.triton.direct_launch`), after which calls with that specialisation
launch from C++.

This module imports triton (through ``ops/triton``): import it lazily.
"""

from __future__ import annotations

import logging

from .. import launch_config as lc
from ..triton.eager import EagerLaunch
from .layout import PER_PROGRAM, ROWS, SEED, TENSOR, Var, layout

__all__ = ["NativeLaunch", "bwd_args", "fwd_args"]

log = logging.getLogger("addnorm.ops.native")
_T = [Var(TENSOR, i) for i in range(17)]


def fwd_args(sp, seed_int: bool, defaults: tuple) -> tuple:
    """The forward kernel's arguments as :func:`~addnorm.ops.triton.launchers.fwd_launcher`'s direct
    launch passes them, :class:`~addnorm.ops.native.layout.Var` where they vary per call (slots: x,
    residual, weight, bias, gate, seed, y, s, mean, rstd)."""
    n = sp.n
    seed = Var(SEED) if seed_int else _T[5]
    return (*_T[:5], seed, *_T[6:10], n, n, Var(ROWS), n, sp.n_chunks, *sp.tail, *defaults)


def bwd_args(sp, has_ds: bool, seed_int: bool, defaults: tuple) -> tuple:
    """The backward kernel's arguments as ``_bwd_launcher``'s direct launch passes them (slots: dy, ds,
    saved, x, residual, weight, bias, gate, seed, mean, rstd, sums, dx, dres, dw, db, dg partials)."""
    n = sp.n
    seed = Var(SEED) if seed_int else _T[8]
    strides = (n, n if has_ds else 0, n if sp.need_x else 0, n if sp.recompute else 0)
    return (
        *_T[:8], seed, *_T[9:17], *strides, Var(ROWS), n, sp.n_slices, Var(PER_PROGRAM), *sp.tail, *defaults,
    )  # fmt: skip


def _grid_target(sp, device) -> int:
    """The backward's program target beyond one program (``launch_config._bwd_grid``'s)."""
    bm, bn = sp.block
    if device.type != "cuda":
        return 4
    per_sm = max(1, 8192 // (bm * min(bn, sp.n)))
    return max(1, lc._sm_count(device) * per_sm // -(-sp.n // bn))


class NativeLaunch:
    """The native call for ``launch`` (an EagerLaunch): ``call`` is its ``apply``. ``py_forward`` /
    ``py_backward`` replace today's launchers (a test's CPU kernel); ``native`` False registers no
    kernel (every launch through them)."""

    def __init__(self, ext, launch: EagerLaunch, device, py_forward=None, py_backward=None, native=True):
        self.ext, self.launch, self.native = ext, launch, native
        fwd, bwd, bwd_ds = launch.fwd, launch.bwd, launch.bwd_ds
        self.specs = (bwd, bwd_ds)
        p = self.plan = ext.NativePlan()
        p.n, p.block_m, p.per_row, p.store_s = fwd.n, fwd.block_m, fwd.stats_per_row, fwd.store_s
        p.s_like_y = fwd.s_dtype is fwd.y_dtype
        p.keep_x, p.keep_r, p.save_y, p.prenorm = launch.keep_x, launch.keep_r, launch.save_y, launch.prenorm
        p.set_dtypes(fwd.y_dtype, fwd.s_dtype, bwd.x_dtype, bwd.res_dtype)
        for which, sp in enumerate(self.specs):
            ok = native and sp.sums is None and not sp.finish  # no pre-pass, torch sums the partials
            p.set_backward(
                which, ok, sp.n_slices, sp.block[0], lc.BWD_ONE_PROGRAM_TILES * sp.block[0],
                _grid_target(sp, device), sp.need_dx, sp.need_x, sp.recompute,
            )  # fmt: skip
        p.py_forward = py_forward or self._py_forward
        p.py_backward = py_backward or self._py_backward
        ext.register_plan(p)
        self.registered: set = set()
        self.refused: dict = {}
        self.call = p.call

    def _code(self, dtype) -> int:
        return -1 if dtype is None else self.ext.dtype_code(dtype)

    def _py_forward(self, x, residual, weight, bias, gate, seed):
        sp = self.launch.fwd
        y, s, _, rstd = sp.launch(None, x, residual, weight, bias, gate, seed)
        if self.native:
            self._sync_fwd(sp)
        return y, s, rstd

    def _py_backward(self, which, dy, ds, saved, x, residual, weight, bias, gate, seed, stats):
        sp = self.specs[which]
        out = sp.launch(dy, ds, saved, x, residual, weight, bias, gate, seed, None, stats)
        if self.native and sp.sums is None and not sp.finish:
            self._sync_bwd(which, sp)
        return out

    def _sync_fwd(self, sp) -> None:
        direct = getattr(sp.launch, "direct", None)
        for (device, key), ck in list(getattr(direct, "compiled", {}).items()):
            if ("f", device, key) in self.registered:
                continue
            self.registered.add(("f", device, key))
            seed_int = key[6]
            got = layout(ck, fwd_args(sp, seed_int, direct.defaults))
            ckey = [device, *(self._code(d) for d in key[:5]), key[5], int(seed_int), 0, 0, 0, 0]
            self._add(0, ckey, ck, got)

    def _sync_bwd(self, which: int, sp) -> None:
        direct = getattr(sp.launch, "direct", None)
        for (device, key), ck in list(getattr(direct, "compiled", {}).items()):
            if ("b", which, device, key) in self.registered:
                continue
            self.registered.add(("b", which, device, key))
            seed_int = key[10]
            got = layout(ck, bwd_args(sp, key[1] is not None, seed_int, direct.defaults))
            codes = [self._code(d) for d in key[:8]]
            ckey = [device, which, *codes, key[8] | (key[9] << 3), int(seed_int)]
            self._add(which + 1, ckey, ck, got)

    def _add(self, which: int, ckey: list, ck, got) -> None:
        if isinstance(got, str):  # this specialisation stays on the Python launchers
            self.refused[tuple(ckey)] = got
            log.info("addnorm native call: %s; that launch stays on today's launcher", got)
            return
        params, block, smem = got
        self.plan.add_kernel(which, ckey, int(ck.function), block, smem, params)
