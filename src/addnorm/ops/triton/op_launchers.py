"""The registered op's launchers: its bodies' :class:`~addnorm.ops.args.FwdArgs` /
:class:`~addnorm.ops.args.BwdArgs` on (..., hidden) tensors to the launch specs of
:mod:`addnorm.ops.triton.launchers`, the kernels through ``wrap_triton`` where the call may be traced (the
registered op's body: torch.compile then launches them itself, compile path "kernel").

This module imports triton at import time: import it lazily (only ``ops/triton*`` modules and the
registered op do).
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import wrap_triton

from ..args import XHAT_FROM_XR, BwdArgs, FwdArgs, gate_code, interpreting
from .launchers import bwd_kernel, bwd_spec, bwd_sums_kernel, fwd_kernel, fwd_spec, launch_bwd, launch_fwd

_F32 = torch.float32

__all__ = ["add_norm_bwd_triton", "add_norm_fwd_triton"]


def add_norm_fwd_triton(a: FwdArgs, *, traceable: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward on (..., hidden) inputs; same contract as ``torch_path.add_norm_fwd_torch``."""
    n = a.x.shape[-1]
    dropout = a.dropout
    sp = fwd_spec(
        n, a.norm, a.eps, a.alpha, a.dropout_p if dropout else 0.0, a.weight is not None,
        a.bias is not None, gate_code(a.gate), a.store_s, a.s_dtype, a.y_dtype,
    )  # fmt: skip
    # through wrap_triton where the call may be traced (the registered op's body: torch.compile then
    # launches the kernel itself; named here, where triton_op's analysis of the body finds it)
    kernel = wrap_triton(fwd_kernel) if traceable and not interpreting() else None
    seed, row_ids = (a.seed, a.rows) if dropout else (None, None)
    y, s, mean, rstd = launch_fwd(sp, a.x, a.residual, a.weight, a.bias, a.gate, seed, kernel, row_ids)
    dev, lead = a.x.device, a.x.shape[:-1]
    return (
        y,
        a.x.new_empty((0,), dtype=a.s_dtype, device=dev) if s is None else s,
        a.x.new_empty((0,), dtype=_F32, device=dev) if mean is None else mean.reshape(lead),
        rstd.reshape(lead),
    )


def add_norm_bwd_triton(
    a: BwdArgs, *, traceable: bool = False
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on (..., hidden) inputs; same contract as ``torch_path.add_norm_bwd_torch``."""
    n = a.dy.shape[-1]
    dropout = a.dropout
    sp = bwd_spec(
        n, a.norm, a.alpha, a.dropout_p if dropout else 0.0, a.weight is not None, a.bias is not None,
        gate_code(a.gate), a.ds is not None, a.xhat_from, a.s_dtype, a.x_dtype, a.res_dtype, a.need_dx,
    )  # fmt: skip
    wrap = traceable and not interpreting()
    kernel = wrap_triton(bwd_kernel) if wrap else None
    sums_kernel = wrap_triton(bwd_sums_kernel) if wrap and sp.sums is not None else None
    dx, dres, dw, db, dg = launch_bwd(
        sp, a.dy, a.ds, a.saved if a.xhat_from != XHAT_FROM_XR else None, a.x, a.residual, a.weight,
        a.bias, a.gate, a.seed if dropout else None, a.mean if a.norm != "rmsnorm" else None, a.rstd,
        kernel, a.rows if dropout else None, sums_kernel,
    )  # fmt: skip
    # the op returns every slot, an empty tensor of its own where there is no gradient (outputs of a
    # custom op may not alias each other)
    return (
        dres.new_empty(0) if dx is None else dx,
        dres,
        dres.new_empty(0) if dw is None else dw,
        dres.new_empty(0) if db is None else db,
        dres.new_empty(0) if dg is None else dg,
    )
