"""The fused Add & Norm as registered ops and their autograd: ``addnorm::add_norm_fwd`` /
``addnorm::add_norm_bwd``.

The two ops take :class:`~addnorm.ops.args.FwdArgs` / :class:`~addnorm.ops.args.BwdArgs` (their
schemas are generated from those fields) on (..., hidden) tensors, their statistics shaped like x
without its last dimension, so a DTensor sharded on any leading dimension runs them locally
(:mod:`addnorm.ops.sharded` registers their sharding rules). Where CUDA and triton are
present they are ``torch.library.triton_op``s: under torch.compile their body is traced and Inductor
launches the Triton kernels itself (``wrap_triton``), with no Python per call; elsewhere they are
``custom_op``s running the torch path. Either way the autograd formula calls the backward op, which
regenerates the dropout mask from the seed. The backend rule is :mod:`addnorm.ops.policy`'s. Eager
calls on the Triton backend skip the op dispatch and run the same launchers through
:class:`addnorm.ops.triton.eager.TritonAddNorm` (``addnorm.ops.functional`` decides).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .args import BwdArgs, FwdArgs, bwd_plan, op_signature
from .policy import resolve_backend, use_triton_op
from .torch_path import add_norm_bwd_torch, add_norm_fwd_torch

__all__ = ["TRITON_OP", "add_norm_bwd", "add_norm_fwd"]


def _on_triton(
    backend: str, t: Tensor, dtypes: tuple[torch.dtype, ...], norm=None, prenorm=None, dropout=None
) -> bool:
    """Whether an op body runs the Triton launchers: the backend resolves to triton (for this norm and
    placement where known), and on the CPU (interpreter) only for real tensors (fake or functional
    ones, while tracing, take the torch path, which has the same outputs' metadata)."""
    if resolve_backend(backend, t.device, t.shape[-1], dtypes, norm, prenorm, dropout) != "triton":
        return False
    return t.device.type == "cuda" or type(t) is Tensor


# --- the registered ops --------------------------------------------------------------------------


TRITON_OP = use_triton_op()
if TRITON_OP:  # imported here, so that triton_op's analysis of the op bodies finds the kernels
    from .triton.op_launchers import add_norm_bwd_triton, add_norm_fwd_triton
else:  # imported on first use: only where the Triton backend runs (the CPU interpreter)

    def add_norm_fwd_triton(a: FwdArgs, *, traceable: bool = False) -> tuple[Tensor, ...]:
        from .triton import op_launchers

        return op_launchers.add_norm_fwd_triton(a, traceable=traceable)

    def add_norm_bwd_triton(a: BwdArgs, *, traceable: bool = False) -> tuple[Tensor, ...]:
        from .triton import op_launchers

        return op_launchers.add_norm_bwd_triton(a, traceable=traceable)


def _fwd_body(a: FwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s or empty, mean or empty, rstd) for (..., hidden) x and residual."""
    dtypes = (a.x.dtype, a.residual.dtype, a.s_dtype, a.y_dtype)
    if _on_triton(a.backend, a.x, dtypes, a.norm, a.prenorm, a.dropout):
        return add_norm_fwd_triton(a, traceable=True)
    return add_norm_fwd_torch(a)


def _bwd_body(a: BwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx or empty, dresidual, dweight or empty, dbias or empty, dgate or empty)."""
    dtypes = (a.dy.dtype, a.saved.dtype, a.x_dtype, a.res_dtype, a.s_dtype)
    if a.rstd.dtype == torch.float32 and _on_triton(a.backend, a.dy, dtypes):
        return add_norm_bwd_triton(a, traceable=True)
    return add_norm_bwd_torch(a)


def add_norm_fwd_op(*args):
    return _fwd_body(FwdArgs._make(args))


def add_norm_bwd_op(*args):
    return _bwd_body(BwdArgs._make(args))


def _register(name: str, body, args_type, returns: int):
    body.__signature__ = op_signature(args_type, returns)
    if TRITON_OP:
        return torch.library.triton_op(name, body, mutates_args=())
    op = torch.library.custom_op(name, body, mutates_args=())
    op.register_fake(body)  # the torch path runs on fake tensors as well
    return op


add_norm_fwd = _register("addnorm::add_norm_fwd", add_norm_fwd_op, FwdArgs, 4)
add_norm_bwd = _register("addnorm::add_norm_bwd", add_norm_bwd_op, BwdArgs, 5)


# --- autograd ------------------------------------------------------------------------------------


def _setup_context(ctx, inputs: tuple, output: tuple) -> None:
    a = FwdArgs._make(inputs)
    y, s, mean, rstd = output
    # what the backward reads (args.bwd_plan): s, y, x and residual as its x_hat source needs
    bp = bwd_plan(
        a.prenorm, a.xhat_from, a.weight is not None or a.bias is not None, a.gate is not None, a.dropout,
        a.alpha, a.x.dtype, a.residual.dtype,
    )  # fmt: skip
    ctx.save_for_backward(
        a.x if bp.keep_x else None,
        a.residual if bp.keep_r else None,
        a.weight,
        a.bias,
        a.gate,
        a.seed,
        a.rows,
        y if bp.save_y else s,
        mean,
        rstd,
    )
    ctx.meta = (a.norm, a.alpha, a.dropout_p, a.prenorm, bp.xhat_from, a.x.dtype, a.residual.dtype, a.s_dtype)
    ctx.need_dx = bp.need_dx
    ctx.backend = a.backend
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs that go unused


def _grads(bwd, ctx, dy: Tensor | None, ds: Tensor | None) -> tuple:
    """The gradients of add_norm_fwd's inputs, computed by ``bwd`` (the backward op or a launcher)."""
    x, residual, weight, bias, gate, seed, rows, saved, mean, rstd = ctx.saved_tensors
    norm, alpha, p, prenorm, xhat_from, x_dtype, res_dtype, s_dtype = ctx.meta
    if dy is None:  # only s was used (Pre-LN: saved is s)
        dy = torch.zeros_like(saved)
    need_dx = ctx.need_dx
    a = BwdArgs(
        dy, ds if prenorm else None, saved, x, residual, weight, bias, gate, seed, rows, mean, rstd,
        xhat_from, norm, alpha, p, x_dtype, res_dtype, s_dtype, need_dx, ctx.backend,
    )  # fmt: skip
    dx, dres, dw, db, dg = bwd(a)
    if not need_dx:
        dx = dres
    return (
        dx,
        dres,
        dw if weight is not None else None,
        db if bias is not None else None,
        dg if gate is not None else None,
        *([None] * (len(FwdArgs._fields) - 5)),
    )


def _backward(ctx, dy, ds, _dmean, _drstd):
    return _grads(lambda a: add_norm_bwd(*a), ctx, dy, ds)


add_norm_fwd.register_autograd(_backward, setup_context=_setup_context)
