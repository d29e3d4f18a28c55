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

This module imports triton (through ``triton.launchers``): import it lazily.
"""

from __future__ import annotations

import torch

from ..args import XHAT_FROM_Y, bwd_plan
from .launchers import bwd_spec, fwd_launcher, fwd_spec

__all__ = ["EagerLaunch", "TritonAddNorm"]


class EagerLaunch:
    """One plan's eager launch for one gate kind (0 none, 1 one element, 2 a vector): the forward's
    spec, the backward's with and without a gradient at s, what the forward keeps (the plan's
    :func:`~addnorm.ops.args.bwd_plan` for this gate kind), and ``apply``, the call:
    ``apply(x, residual, weight, bias[, gate[, seed]])`` -> y or (y, s), the seed an int64 tensor or a
    host seed (an int, :mod:`addnorm.ops.seeds`)."""

    __slots__ = (
        "apply",
        "bwd",
        "bwd_ds",
        "dropout",
        "fwd",
        "keep_r",
        "keep_x",
        "native",
        "prenorm",
        "save_y",
    )

    def __init__(self, plan, x_dtype, res_dtype, has_w: bool, has_b: bool, gate_code: int):
        n, p, prenorm = plan.hidden, plan.p, plan.prenorm
        bp = bwd_plan(
            prenorm, plan.xhat_from, has_w or has_b, gate_code != 0, p > 0, plan.alpha, x_dtype, res_dtype
        )
        self.prenorm, self.keep_x, self.keep_r, self.save_y = prenorm, bp.keep_x, bp.keep_r, bp.save_y
        self.dropout = p > 0
        args = (n, plan.norm, plan.alpha, p, has_w, has_b, gate_code)
        rest = (bp.xhat_from, plan.s_dtype, x_dtype, res_dtype, bp.need_dx, plan.eps)
        self.bwd = bwd_spec(*args, False, *rest)
        self.bwd_ds = bwd_spec(*args, True, *rest) if prenorm else self.bwd
        # the statistics in one buffer where the backward reads them: x_hat from y, or rows in column
        # slices; else none (the backward recomputes them from s: an allocation fewer per call)
        stats = "packed" if bp.xhat_from == XHAT_FROM_Y or self.bwd.split else "none"
        self.fwd = fwd_spec(
            n, plan.norm, plan.eps, plan.alpha, p, has_w, has_b, gate_code, bp.store_s, plan.s_dtype,
            plan.y_dtype, stats,
        )  # fmt: skip
        self.apply = _function_for(self)
        self.native = None  # the native call where it replaces ``apply`` (:mod:`addnorm.ops.native`)


class TritonAddNorm(torch.autograd.Function):
    """The Triton launchers under autograd (eager calls). Each :class:`EagerLaunch` gets a subclass of
    its own (:func:`_function_for`) whose ``forward``/``backward`` hold the launch's specs and choices
    as constants: ``apply`` then takes only the tensors (each argument costs ``apply`` time) and the
    call looks nothing up. The ``forward`` is the forward spec's launcher itself
    (:func:`~addnorm.ops.triton.launchers.fwd_launcher`, told what the backward keeps: it saves
    (x, residual, weight, bias, gate, seed, y or s, the statistics), x and residual None where not
    kept), so a call runs one Python frame of ours inside ``apply``. The old-style ``forward(ctx,
    ...)``: a ``setup_context`` method would make ``apply`` inspect the signature on every call."""


def _function_for(launch: EagerLaunch):
    """``apply`` of a :class:`TritonAddNorm` made for ``launch``: ``apply(x, residual, weight,
    bias[, gate[, seed]])``, ``Function.apply`` without its per-call extras (the signature binding,
    only with setup_context, and the functorch dead-wrapper unwrapping over every argument:
    ``add_norm`` sends calls under functorch transforms to the composite, so none arrive here)."""
    # the forward is the launcher itself (it saves what the backward reads: ``fwd_launcher``); the
    # backward calls its specs' launchers directly (launch_bwd without its frame)
    forward = fwd_launcher(launch.fwd, (launch.keep_x, launch.keep_r, launch.save_y, launch.prenorm))
    bwd, bwd_ds, dropout = launch.bwd.launch, launch.bwd_ds.launch, launch.dropout

    def backward(ctx, dy, ds=None):
        x, residual, weight, bias, gate, seed, saved, stats = ctx.saved_tensors
        if dropout and seed is None:  # a host seed, an int (addnorm.ops.seeds): kept on ctx
            seed = ctx.seed
        if dy is None:  # only s was used (Pre-LN: saved is s)
            dy = torch.zeros_like(saved)
        dx, dres, dw, db, dg = (bwd if ds is None else bwd_ds)(
            dy, ds, saved, x, residual, weight, bias, gate, seed, None, stats
        )
        # gradients beyond the inputs given must be None (autograd drops them)
        return dres if dx is None else dx, dres, dw, db, dg, None

    body = {"forward": staticmethod(forward), "backward": staticmethod(backward), "__module__": __name__}
    function = type("TritonAddNorm", (TritonAddNorm,), body)
    # the engine calls the node's ``apply(*grads)``: ``backward`` itself, not BackwardCFunction.apply's
    # two frames that look up the user's backward (or vjp) on every call
    function._backward_cls.apply = backward
    return super(torch.autograd.Function, function).apply
