"""The eager Triton path: a call plan's launch specs and the autograd function that runs the kernels
with no op dispatch, at the least host cost per call.

What a call's options fix (the kernels' constexprs, block sizes, which tensors the backward keeps) is
decided once per plan and gate kind (:class:`EagerLaunch`, cached on the plan); a call then allocates
its outputs and launches. :class:`TritonAddNorm` takes x and residual in any shape (..., hidden) (the
kernels read contiguous tensors as rows without a view), returns ``y`` (Post-LN) or ``(y, s)``
(Pre-LN), and keeps for backward what ``xhat_from`` says (see :mod:`addnorm.ops.args`): the same
contract and gradients as the registered op ``addnorm::add_norm_fwd``, without its dispatch, its
schema's sixteen arguments or separate mean/rstd outputs (the statistics stay in one buffer, or
where the backward has s, nowhere: it recomputes them).

This module imports triton (through ``triton_add_norm``): import it lazily.
"""

from __future__ import annotations

import torch

from .args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y
from .triton_add_norm import bwd_spec, fwd_spec, launch_bwd, launch_fwd

__all__ = ["EagerLaunch", "TritonAddNorm"]


class EagerLaunch:
    """One plan's eager launch for one gate kind (0 none, 1 one element, 2 a vector): the forward's
    spec, the backward's with and without a gradient at s, what the forward keeps, and ``apply``, the
    call: ``apply(x, residual, weight, bias[, gate[, seed]])`` -> y or (y, s)."""

    __slots__ = ("apply", "bwd", "bwd_ds", "fwd", "keep_r", "keep_x", "prenorm", "save_y")

    def __init__(self, plan, x_dtype, res_dtype, has_w: bool, has_b: bool, gate_code: int):
        n, p, prenorm = plan.hidden, plan.p, plan.prenorm
        xhat_from = XHAT_FROM_S if prenorm else plan.xhat_from
        self.prenorm = prenorm
        # x and residual are kept where s is recomputed from them (references: the memory cost of
        # one activation), x also for the gate's gradient; y is kept where x_hat comes from it
        keep_xr = xhat_from == XHAT_FROM_XR or (xhat_from == XHAT_FROM_Y and (has_w or has_b))
        self.keep_x, self.keep_r = keep_xr or gate_code != 0, keep_xr
        self.save_y = xhat_from == XHAT_FROM_Y
        # dx differs from dresidual unless the branch is the identity and the dtypes agree
        need_dx = p > 0 or gate_code != 0 or plan.alpha != 1.0 or x_dtype != res_dtype
        args = (n, plan.norm, plan.alpha, p, has_w, has_b, gate_code)
        rest = (xhat_from, plan.s_dtype, x_dtype, res_dtype, need_dx, plan.eps)
        self.bwd = bwd_spec(*args, False, *rest)
        self.bwd_ds = bwd_spec(*args, True, *rest) if prenorm else self.bwd
        # the statistics in one buffer where the backward reads them: x_hat from y, or rows in column
        # chunks; else none (the backward recomputes them from s: an allocation fewer per call)
        stats = "packed" if xhat_from == XHAT_FROM_Y or self.bwd.chunked else "none"
        self.fwd = fwd_spec(
            n, plan.norm, plan.eps, plan.alpha, p, has_w, has_b, gate_code,
            prenorm or xhat_from == XHAT_FROM_S, plan.s_dtype, plan.y_dtype, stats,
        )  # fmt: skip
        self.apply = _function_for(self)


class TritonAddNorm(torch.autograd.Function):
    """The Triton launchers under autograd (eager calls). Each :class:`EagerLaunch` gets a subclass of
    its own (:func:`_function_for`) whose ``forward``/``backward`` hold the launch's specs and choices
    as constants: ``apply`` then takes only the tensors (each argument costs ``apply`` time) and the
    call looks nothing up. The old-style ``forward(ctx, ...)``: a ``setup_context`` method would make
    ``apply`` inspect the signature on every call."""


def _function_for(launch: EagerLaunch):
    """``apply`` of a :class:`TritonAddNorm` made for ``launch``: ``apply(x, residual, weight,
    bias[, gate[, seed]])``, ``Function.apply`` without its per-call extras (the signature binding,
    only with setup_context, and the functorch dead-wrapper unwrapping over every argument:
    ``add_norm`` sends calls under functorch transforms to the composite, so none arrive here)."""
    fwd, bwd, bwd_ds, prenorm = launch.fwd, launch.bwd, launch.bwd_ds, launch.prenorm
    keep_x, keep_r, save_y = launch.keep_x, launch.keep_r, launch.save_y

    def forward(ctx, x, residual, weight, bias, gate=None, seed=None):
        # the statistics in one buffer or none (see EagerLaunch): mean is None
        y, s, _, stats = launch_fwd(fwd, x, residual, weight, bias, gate, seed)
        # what ``save_for_backward`` sets, without its frame; the statistics too (created here, they
        # are kept as they are: no reference cycle), so that ctx needs no attribute dict
        ctx.to_save = (
            x if keep_x else None,
            residual if keep_r else None,
            weight,
            bias,
            gate,
            seed,
            y if save_y else s,
            stats,
        )
        if prenorm:
            # ``set_materialize_grads(False)`` without its frame: no zero-filled gradient for an
            # output that goes unused (one output: backward runs only with its gradient)
            ctx.materialize_grads = False
            return y, s
        return y

    def backward(ctx, dy, ds=None):
        x, residual, weight, bias, gate, seed, saved, stats = ctx.saved_tensors
        if dy is None:  # only s was used (Pre-LN: saved is s)
            dy = torch.zeros_like(saved)
        dx, dres, dw, db, dg = launch_bwd(
            bwd if ds is None else bwd_ds, dy, ds, saved, x, residual, weight, bias, gate, seed, None,
            stats,
        )  # fmt: skip
        # gradients beyond the inputs given must be None (autograd drops them)
        return dres if dx is None else dx, dres, dw, db, dg, None

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__}
    return super(torch.autograd.Function, type("TritonAddNorm", (TritonAddNorm,), body)).apply
