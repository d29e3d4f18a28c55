"""``torch.library`` registration of the fused Add & Norm: two custom ops and their autograd.

``addnorm::add_norm_fwd`` and ``addnorm::add_norm_bwd`` work on 2-D (rows, hidden) tensors. Their
implementation picks a backend at run time (:func:`resolve_backend`): the Triton kernels
(``triton_add_norm``) or the eager torch path (``reference``). Fake (meta) implementations let
``torch.compile(fullgraph=True)`` trace them as opaque nodes, and the autograd formula calls the
backward op, which regenerates the dropout mask from the seed. In eager mode :func:`add_norm_2d` runs
the same implementations through a plain ``autograd.Function``, skipping the custom-op dispatch.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .reference import add_norm_bwd_torch, add_norm_fwd_autograd, add_norm_fwd_torch, compute_dtype

__all__ = ["BACKENDS", "MAX_FUSED_HIDDEN", "add_norm_2d", "add_norm_bwd", "add_norm_fwd", "resolve_backend"]

BACKENDS = ("auto", "torch", "triton")
MAX_FUSED_HIDDEN = 65536  # one row per pass in the Triton kernels; wider rows take the torch path
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned: set[str] = set()


def triton_available() -> bool:
    """Whether triton can be imported (without importing it)."""
    return importlib.util.find_spec("triton") is not None


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)


def resolve_backend(backend: str, device: torch.device, hidden: int, dtypes: tuple[torch.dtype, ...]) -> str:
    """``"torch"`` or ``"triton"`` for a call: an explicit ``backend`` wins, then the environment
    variable ``ADDNORM_BACKEND``, then auto (triton for CUDA tensors when triton imports).
    Rows wider than ``MAX_FUSED_HIDDEN`` and float64 fall back to torch."""
    if backend == "auto":
        backend = os.environ.get("ADDNORM_BACKEND", "auto").strip().lower() or "auto"
        if backend not in BACKENDS:
            raise ValueError(f"ADDNORM_BACKEND: expected one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            ok = device.type == "cuda" and triton_available()
            ok = ok and hidden <= MAX_FUSED_HIDDEN and all(d in TRITON_DTYPES for d in dtypes)
            return "triton" if ok else "torch"
    if backend == "torch":
        return "torch"
    if not triton_available():
        raise RuntimeError("backend='triton': triton is not installed (pip install 'addnorm[triton]')")
    if device.type != "cuda" and not _interpreting():
        raise RuntimeError(
            f"backend='triton': tensors are on {device.type}, and Triton kernels run on CUDA only, or on "
            "the CPU with TRITON_INTERPRET=1 set before triton is imported; use backend='torch' or 'auto'"
        )
    if device.type == "cpu":
        from .triton_add_norm import add_norm_fwd_kernel_is_interpreted

        if not add_norm_fwd_kernel_is_interpreted():
            raise RuntimeError(
                "backend='triton' on CPU tensors: the kernels were compiled before TRITON_INTERPRET=1 "
                "was set; set it before importing addnorm's Triton kernels"
            )
    bad = [d for d in dtypes if d not in TRITON_DTYPES]
    if bad:
        raise TypeError(f"backend='triton': supports float32, float16 and bfloat16 tensors, got {bad[0]}")
    if hidden > MAX_FUSED_HIDDEN:
        _warn_once(
            f"add_norm: hidden size {hidden} > {MAX_FUSED_HIDDEN} does not fit one Triton pass; "
            "using the torch path"
        )
        return "torch"
    return "triton"


# --- forward ------------------------------------------------------------------------------------


def add_norm_fwd_impl(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    gate: Tensor | None,
    seed: Tensor | None,
    norm: str,
    eps: float,
    alpha: float,
    dropout_p: float,
    s_dtype: torch.dtype,
    y_dtype: torch.dtype,
    prenorm: bool,
    recompute_from_y: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, s or empty, mean or empty, rstd) for 2-D x, residual. s is returned for ``prenorm``, and for
    Post-LN unless ``recompute_from_y`` (then s is never written: backward takes x_hat from y, or from
    s recomputed from x and residual where that is unsafe)."""
    store_s = prenorm or not recompute_from_y
    args = (x, residual, weight, bias, gate, seed, norm, eps, alpha, dropout_p, s_dtype, y_dtype, store_s)
    dtypes = (x.dtype, residual.dtype, s_dtype, y_dtype)
    if resolve_backend(backend, x.device, x.shape[-1], dtypes) == "triton":
        from .triton_add_norm import add_norm_fwd_triton

        return add_norm_fwd_triton(*args)
    return add_norm_fwd_torch(*args)


add_norm_fwd = torch.library.custom_op("addnorm::add_norm_fwd", add_norm_fwd_impl, mutates_args=())


@add_norm_fwd.register_fake
def _add_norm_fwd_fake(
    x,
    residual,
    weight,
    bias,
    gate,
    seed,
    norm,
    eps,
    alpha,
    dropout_p,
    s_dtype,
    y_dtype,
    prenorm,
    recompute_from_y,
    backend,
):
    rows, hidden = x.shape
    store_s = prenorm or not recompute_from_y
    stat = compute_dtype(x.dtype, residual.dtype, s_dtype)
    y = x.new_empty(rows, hidden, dtype=y_dtype)
    s = x.new_empty(rows, hidden, dtype=s_dtype) if store_s else x.new_empty(0, dtype=s_dtype)
    mean = x.new_empty(rows if norm == "layernorm" else 0, dtype=stat)
    return y, s, mean, x.new_empty(rows, dtype=stat)


# --- backward -----------------------------------------------------------------------------------


def add_norm_bwd_impl(
    dy: Tensor,
    ds: Tensor | None,
    saved: Tensor,
    saved_is_y: bool,
    x: Tensor | None,
    residual: Tensor | None,
    weight: Tensor | None,
    bias: Tensor | None,
    gate: Tensor | None,
    seed: Tensor | None,
    mean: Tensor,
    rstd: Tensor,
    norm: str,
    alpha: float,
    dropout_p: float,
    x_dtype: torch.dtype,
    res_dtype: torch.dtype,
    s_dtype: torch.dtype,
    need_dx: bool,
    backend: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx or empty, dresidual, dweight or empty, dbias or empty, dgate or empty). x is needed for dgate
    and, with residual, where x_hat cannot come from y (``saved_is_y``; see ``reference.xhat_from_y_ok``)."""
    args = (dy, ds, saved, saved_is_y, x, residual, weight, bias, gate, seed, mean, rstd, norm, alpha)
    args = (*args, dropout_p, x_dtype, res_dtype, s_dtype, need_dx)
    dtypes = (dy.dtype, saved.dtype, x_dtype, res_dtype, s_dtype)
    if rstd.dtype == torch.float32 and resolve_backend(backend, dy.device, dy.shape[-1], dtypes) == "triton":
        from .triton_add_norm import add_norm_bwd_triton

        return add_norm_bwd_triton(*args)
    return add_norm_bwd_torch(*args)


add_norm_bwd = torch.library.custom_op("addnorm::add_norm_bwd", add_norm_bwd_impl, mutates_args=())


@add_norm_bwd.register_fake
def _add_norm_bwd_fake(
    dy,
    ds,
    saved,
    saved_is_y,
    x,
    residual,
    weight,
    bias,
    gate,
    seed,
    mean,
    rstd,
    norm,
    alpha,
    dropout_p,
    x_dtype,
    res_dtype,
    s_dtype,
    need_dx,
    backend,
):
    rows, hidden = saved.shape
    dx = dy.new_empty(rows, hidden, dtype=x_dtype) if need_dx else dy.new_empty(0, dtype=x_dtype)
    dres = dy.new_empty(rows, hidden, dtype=res_dtype)
    dw = weight.new_empty(weight.shape) if weight is not None else dy.new_empty(0, dtype=rstd.dtype)
    db = bias.new_empty(bias.shape) if bias is not None else dy.new_empty(0, dtype=rstd.dtype)
    dg = gate.new_empty(gate.shape) if gate is not None else dy.new_empty(0, dtype=rstd.dtype)
    return dx, dres, dw, db, dg


# --- autograd -----------------------------------------------------------------------------------


class FwdArgs(NamedTuple):
    """``add_norm_fwd``'s arguments by name (autograd receives them as a tuple)."""

    x: Tensor
    residual: Tensor
    weight: Tensor | None
    bias: Tensor | None
    gate: Tensor | None
    seed: Tensor | None
    norm: str
    eps: float
    alpha: float
    dropout_p: float
    s_dtype: torch.dtype
    y_dtype: torch.dtype
    prenorm: bool
    recompute: bool
    backend: str


def _setup_context(ctx, inputs, output) -> None:
    a = FwdArgs(*inputs)
    y, s, mean, rstd = output
    # Pre-LN keeps s (an output anyway). Post-LN keeps s (the CPU policy, where recomputing costs time)
    # or y (the CUDA policy: the forward writes only y): backward takes x_hat = (y - b) / w where
    # w_j != 0 and |b_j| <= |w_j|, else from s recomputed from x and residual, which are kept alive
    # (references, not copies: the memory cost of one activation).
    from_y = a.recompute and not a.prenorm
    keep_xr = from_y and (a.weight is not None or a.bias is not None)  # no affine: x_hat = y everywhere
    ctx.save_for_backward(
        a.x if a.gate is not None or keep_xr else None,
        a.residual if keep_xr else None,
        a.weight,
        a.bias,
        a.gate,
        a.seed,
        y if from_y else s,
        mean,
        rstd,
    )
    ctx.meta = (
        a.norm,
        a.alpha,
        a.dropout_p,
        a.prenorm,
        from_y,
        a.backend,
        a.x.dtype,
        a.residual.dtype,
        a.s_dtype,
    )
    ctx.dropout = a.seed is not None and a.dropout_p > 0
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the outputs that go unused


def _grads(bwd, ctx, dy, ds):
    """The gradients of add_norm_fwd's inputs, computed by ``bwd`` (the backward op or its impl)."""
    x, residual, weight, bias, gate, seed, saved, mean, rstd = ctx.saved_tensors
    norm, alpha, p, prenorm, from_y, backend, x_dtype, res_dtype, s_dtype = ctx.meta
    if dy is None:
        dy = torch.zeros_like(saved)
    # dx differs from dresidual unless the branch is the identity and the dtypes agree
    need_dx = ctx.dropout or gate is not None or alpha != 1.0 or x_dtype != res_dtype
    dx, dres, dw, db, dg = bwd(
        dy,
        ds if prenorm else None,
        saved,
        from_y,
        x,
        residual,
        weight,
        bias,
        gate,
        seed,
        mean,
        rstd,
        norm,
        alpha,
        p,
        x_dtype,
        res_dtype,
        s_dtype,
        need_dx,
        backend,
    )
    if not need_dx:
        dx = dres
    return (
        dx,
        dres,
        dw if weight is not None else None,
        db if bias is not None else None,
        dg if gate is not None else None,
        *([None] * 10),
    )


def _backward(ctx, dy, ds, _dmean, _drstd):
    return _grads(add_norm_bwd, ctx, dy, ds)


add_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _EagerAddNorm(torch.autograd.Function):
    """The same forward, context and backward as the registered op, without its dispatch: in eager
    mode the custom-op machinery costs about 0.3 ms a call in Python, as much as the kernels of a
    small model's add and norm. (The old-style ``forward(ctx, ...)``: a ``setup_context`` method would
    make ``apply`` inspect the signature on every call.)"""

    @staticmethod
    def forward(ctx, *args):
        out = add_norm_fwd_impl(*args)
        _setup_context(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, dy, ds, _dmean, _drstd):
        return _grads(add_norm_bwd_impl, ctx, dy, ds)


def add_norm_2d(*args) -> tuple[Tensor, Tensor]:
    """(y, s or empty) of ``add_norm_fwd(*args)`` with autograd: the registered op wherever something
    traces (Dynamo / torch.compile, a dispatch mode such as make_fx or fake tensors, a tensor
    subclass), plain autograd otherwise: LayerNorm without dropout on CPU tensors through torch's own
    autograd (:func:`reference.add_norm_fwd_autograd`), the rest through the op's implementations."""
    if (
        torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or type(args[0]) is not Tensor
    ):
        return add_norm_fwd(*args)[:2]
    a = FwdArgs(*args)
    if (
        a.norm == "layernorm"
        and (a.seed is None or a.dropout_p == 0)
        and a.x.device.type == "cpu"
        and resolve_backend(a.backend, a.x.device, a.x.shape[-1], (a.x.dtype, a.residual.dtype, a.s_dtype))
        == "torch"
    ):
        store_s = a.prenorm or not a.recompute  # as add_norm_fwd returns it
        return add_norm_fwd_autograd(
            a.x, a.residual, a.weight, a.bias, a.gate, a.alpha, a.eps, a.s_dtype, a.y_dtype, store_s
        )
    return _EagerAddNorm.apply(*args)[:2]
