"""The eager Triton path: a call plan's launch specs and the autograd function that runs the kernels
with no op dispatch, at the least host cost per call.

What a call's options fix (the kernels' constexprs, block sizes, which tensors the backward keeps) is
decided once per plan and gate kind (:class:`EagerLaunch`, cached on the plan); a call then allocates
its outputs and launches. :class:`TritonAddNorm` takes x and residual in any shape (..., hidden) (the
kernels read contiguous tensors as rows without a view), returns ``y`` (Post-LN) or ``(y, s)``
(Pre-LN), and keeps for backward what ``xhat_from`` says (see :mod:`addnorm.ops.args`): the same
contract and gradients as the registered op ``addnorm::add_norm_fwd``, without its dispatch, its
schema's sixteen arguments or the unused mean/rstd outputs.

This module imports triton (through ``triton_add_norm``): import it lazily.
"""

from __future__ import annotations

import torch

from .args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y
from .triton_add_norm import bwd_spec, fwd_spec, launch_bwd, launch_fwd

__all__ = ["EagerLaunch", "TritonAddNorm", "apply"]


class EagerLaunch:
    """One plan's eager launch for one gate kind (0 none, 1 one element, 2 a vector): the forward's
    spec, the backward's with and without a gradient at s, and what the forward keeps."""

    __slots__ = ("apply", "bwd", "bwd_ds", "fwd", "keep_r", "keep_x", "prenorm", "save_y")

    def __init__(self, plan, x_dtype, res_dtype, has_w: bool, has_b: bool, gate_code: int):
        n, p, prenorm = plan.hidden, plan.p, plan.prenorm
        xhat_from = XHAT_FROM_S if prenorm else plan.xhat_from
        self.prenorm = prenorm
        self.fwd = fwd_spec(
            n, plan.norm, plan.eps, plan.alpha, p, has_w, has_b, gate_code,
            prenorm or xhat_from == XHAT_FROM_S, plan.s_dtype, plan.y_dtype,
        )  # fmt: skip
        # x and residual are kept where s is recomputed from them (references: the memory cost of
        # one activation), x also for the gate's gradient; y is kept where x_hat comes from it
        keep_xr = xhat_from == XHAT_FROM_XR or (xhat_from == XHAT_FROM_Y and (has_w or has_b))
        self.keep_x, self.keep_r = keep_xr or gate_code != 0, keep_xr
        self.save_y = xhat_from == XHAT_FROM_Y
        # dx differs from dresidual unless the branch is the identity and the dtypes agree
        need_dx = p > 0 or gate_code != 0 or plan.alpha != 1.0 or x_dtype != res_dtype
        args = (n, plan.norm, plan.alpha, p, has_w, has_b, gate_code)
        rest = (xhat_from, plan.s_dtype, x_dtype, res_dtype, need_dx)
        self.bwd = bwd_spec(*args, False, *rest)
        self.bwd_ds = bwd_spec(*args, True, *rest) if prenorm else self.bwd
        # the call: apply(x, residual, weight, bias, gate, seed, self) -> y or (y, s)
        self.apply = apply


class TritonAddNorm(torch.autograd.Function):
    """The Triton launchers under autograd (eager calls). The old-style ``forward(ctx, ...)``: a
    ``setup_context`` method would make ``apply`` inspect the signature on every call."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, gate, seed, launch: EagerLaunch):
        y, s, mean, rstd = launch_fwd(launch.fwd, x, residual, weight, bias, gate, seed)
        ctx.save_for_backward(
            x if launch.keep_x else None,
            residual if launch.keep_r else None,
            weight,
            bias,
            gate,
            seed,
            y if launch.save_y else s,
        )
        # the statistics are neither inputs nor outputs: kept as attributes (no reference cycle, no
        # version counter to check)
        ctx.stats = mean, rstd
        ctx.launch = launch
        ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs that go unused
        return (y, s) if launch.prenorm else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        launch = ctx.launch
        x, residual, weight, bias, gate, seed, saved = ctx.saved_tensors
        mean, rstd = ctx.stats
        if dy is None:  # only s was used (Pre-LN: saved is s)
            dy = torch.zeros_like(saved)
        sp = launch.bwd if ds is None else launch.bwd_ds
        dx, dres, dw, db, dg = launch_bwd(
            sp, dy, ds, saved, x, residual, weight, bias, gate, seed, mean, rstd
        )
        return dres if dx is None else dx, dres, dw, db, dg, None, None


# ``Function.apply`` without its per-call extras: the signature binding (only with setup_context)
# and the functorch dead-wrapper unwrapping over every argument (``add_norm`` sends calls under
# functorch transforms to the composite, so none arrive here)
apply = super(torch.autograd.Function, TritonAddNorm).apply
