"""The fused op's arguments, named once: :class:`FwdArgs` and :class:`BwdArgs` are what the registered
ops take (their schemas are generated from these fields), what the autograd glue builds and what the
torch path and the Triton launchers read. Also the few constants every backend shares."""

from __future__ import annotations

import inspect
import os
import types
import typing
from typing import NamedTuple, get_type_hints

import torch
from torch import Tensor

__all__ = [
    "BwdArgs",
    "BwdPlan",
    "FwdArgs",
    "MAX_FUSED_HIDDEN",
    "TRITON_DTYPES",
    "XHAT_FROM_S",
    "XHAT_FROM_XR",
    "XHAT_FROM_Y",
    "bwd_plan",
    "gate_code",
    "interpreting",
    "needs_dx",
    "op_signature",
    "recomputes_s",
    "xhat_source",
]

MAX_FUSED_HIDDEN = 65536  # the widest row the Triton kernels take; wider rows use the torch path
TRITON_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Where the backward takes x_hat from (``xhat_from``), for Post-LN; Pre-LN always keeps s (an output):
XHAT_FROM_S = 0  # s, stored by the forward: x_hat = (s - mean) * rstd
XHAT_FROM_Y = 1  # the output y: x_hat = (y - b) / w where that is exact, else s recomputed from x, r
XHAT_FROM_XR = 2  # s recomputed from x and residual in every column (y too coarse for the statistics)


# --- what the backward reads: each rule once (the plans, the registered op's autograd, the launch
# specs and the tensor-parallel path ask these) ------------------------------------------------------


def xhat_source(prenorm: bool, xhat_from: int) -> int:
    """Where the backward takes x_hat from: Pre-LN from s (an output, so the forward stores it
    anyway), Post-LN as ``xhat_from`` says."""
    return XHAT_FROM_S if prenorm else xhat_from


def recomputes_s(xhat_from: int, affine: bool) -> bool:
    """Whether the backward recomputes s from x and residual (the forward's operations, mask and
    rounding): in every column for ``XHAT_FROM_XR``; for ``XHAT_FROM_Y`` with an ``affine`` (a weight
    or a bias) in the columns where x_hat = (y - b) / w is not exact
    (:func:`addnorm.ops.reference.xhat_from_y_ok`)."""
    return xhat_from == XHAT_FROM_XR or (xhat_from == XHAT_FROM_Y and affine)


def needs_dx(dropout: bool, gated: bool, alpha: float, x_dtype: torch.dtype, res_dtype: torch.dtype) -> bool:
    """Whether dx is a tensor of its own: it equals dresidual only where the branch is the identity
    (no dropout, no gate, ``alpha`` 1) and x and residual have one dtype."""
    return dropout or gated or alpha != 1.0 or x_dtype != res_dtype


def gate_code(gate: Tensor | None) -> int:
    """The gate's kind as the kernels take it: 0 none, 1 one element (ReZero), 2 a vector (LayerScale)."""
    return 0 if gate is None else (1 if gate.numel() == 1 else 2)


class BwdPlan(NamedTuple):
    """What a call's backward reads and writes, decided once from its options (:func:`bwd_plan`)."""

    xhat_from: int  # where x_hat comes from (:func:`xhat_source`)
    store_s: bool  # the forward writes s (Pre-LN's output, or what the backward reads)
    save_y: bool  # y is kept: x_hat comes from it
    recompute: bool  # s is recomputed from x and residual (:func:`recomputes_s`)
    keep_x: bool  # x is kept: s is recomputed, or the gate's gradient sums ds * dropout(x)
    keep_r: bool  # residual is kept: s is recomputed
    need_dx: bool  # dx is a tensor of its own (:func:`needs_dx`)


def bwd_plan(
    prenorm: bool, xhat_from: int, affine: bool, gated: bool, dropout: bool, alpha: float,
    x_dtype: torch.dtype, res_dtype: torch.dtype,
) -> BwdPlan:  # fmt: skip
    """The backward's :class:`BwdPlan` for a call's options. x and residual are kept as references (the
    memory cost of one activation), never copied."""
    source = xhat_source(prenorm, xhat_from)
    recompute = recomputes_s(source, affine)
    return BwdPlan(
        source, source == XHAT_FROM_S, source == XHAT_FROM_Y, recompute, recompute or gated, recompute,
        needs_dx(dropout, gated, alpha, x_dtype, res_dtype),
    )  # fmt: skip


class FwdArgs(NamedTuple):
    """``add_norm_fwd``'s arguments on (..., hidden) tensors; the op returns y, s (or empty), and the
    statistics mean (or empty) and rstd of shape ``x.shape[:-1]``.

    s = alpha * residual + gate * dropout(x) (rounded to ``s_dtype``), y = N(s) in ``y_dtype``;
    dropout with rate ``dropout_p`` from the hash of (``seed``, row, column) when ``seed`` is given,
    the rows numbered as x flattened to (-1, hidden), or by ``rows`` (int64 of shape ``x.shape[:-1]``:
    each row's index in a bigger tensor of which x is a shard, see :mod:`addnorm.ops.sharded`).

    ``xhat_from`` is the first non-tensor argument on purpose: DTensor's sharding cache
    (``register_sharding``) keys on the non-tensor arguments from the first ``int`` on, and every
    option after it changes the outputs."""

    x: Tensor
    residual: Tensor
    weight: Tensor | None
    bias: Tensor | None
    gate: Tensor | None
    seed: Tensor | None
    rows: Tensor | None
    xhat_from: int
    norm: str
    eps: float
    alpha: float
    dropout_p: float
    s_dtype: torch.dtype
    y_dtype: torch.dtype
    prenorm: bool
    backend: str

    @property
    def store_s(self) -> bool:
        """Whether the forward writes s: Pre-LN returns it, and Post-LN backward may read it."""
        return xhat_source(self.prenorm, self.xhat_from) == XHAT_FROM_S

    @property
    def dropout(self) -> bool:
        return self.seed is not None and self.dropout_p > 0


class BwdArgs(NamedTuple):
    """``add_norm_bwd``'s arguments: the output gradients and what the forward left for the backward.

    ``saved`` is s (``xhat_from`` S), y (Y) or empty (XR); x and residual are given where s is
    recomputed from them (Y with an affine, XR), x also for the gate's gradient. ``rows``, ``mean`` and
    ``rstd`` as the forward had them; ``xhat_from`` first among the non-tensors, as in :class:`FwdArgs`."""

    dy: Tensor
    ds: Tensor | None
    saved: Tensor
    x: Tensor | None
    residual: Tensor | None
    weight: Tensor | None
    bias: Tensor | None
    gate: Tensor | None
    seed: Tensor | None
    rows: Tensor | None
    mean: Tensor
    rstd: Tensor
    xhat_from: int
    norm: str
    alpha: float
    dropout_p: float
    x_dtype: torch.dtype
    res_dtype: torch.dtype
    s_dtype: torch.dtype
    need_dx: bool
    backend: str

    @property
    def dropout(self) -> bool:
        return self.seed is not None and self.dropout_p > 0

    @property
    def recompute_s(self) -> bool:
        """Whether s is recomputed from x and residual (in some columns for Y, all for XR)."""
        return recomputes_s(self.xhat_from, self.weight is not None or self.bias is not None)


def op_signature(args: type[NamedTuple], returns: int) -> inspect.Signature:
    """The Python signature of an op taking ``args``' fields in order and returning ``returns`` tensors,
    from which ``torch.library`` infers the op's schema."""
    hints = {n: _typing_union(h) for n, h in get_type_hints(args).items()}
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    params = [inspect.Parameter(n, kind, annotation=hints[n]) for n in args._fields]
    return inspect.Signature(params, return_annotation=tuple[(Tensor,) * returns])


def _typing_union(hint: object) -> object:
    """``Tensor | None`` as ``typing.Optional[Tensor]``, the spelling every torch release's schema
    inference knows."""
    if isinstance(hint, types.UnionType):
        return typing.Union[hint.__args__]  # noqa: UP007
    return hint


def interpreting() -> bool:
    """Whether Triton runs its kernels in the CPU interpreter (``TRITON_INTERPRET=1``). Read at each
    call (a few hundred ns, on the CPU path and at trace time only): Dynamo traces through a
    ``functools`` cache, and warns a compiling user that it does."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
