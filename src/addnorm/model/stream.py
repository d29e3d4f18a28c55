"""The residual stream between sublayers, and how it passes each sublayer connection.

A layer's forward reads like its formula, one line per sublayer::

    x = self.self_attn_connection(x, attend)
    x = self.ff_connection(x, self.ff)

where ``x`` is a :class:`Stream` and each :class:`Connection` runs one :class:`~addnorm.AddNorm`
(N1, the sublayer, N2, the add, N3) on it. The stream is one object:

- the tensor s, or s held back as an add not yet done: s = alpha * residual + g * D(branch). The held
  add is the (hidden, residual) pair that fused-norm libraries pass between blocks, with the
  connection that owns its alpha, gate and dropout. The norm that next reads the stream (the next
  connection's input norm, or a stack's final norm) runs it with the add in one
  :func:`addnorm.ops.add_norm` call that returns both N(s) and s (``prenorm=True``);
- ResiDual's second stream xd, the sum of every branch as added (Xie et al. 2023);
- B2T's layer input, added before the layer's last norm (Takase et al. 2023).

Whether an add is held back, fused with its own output norm or run unfused is decided in one place,
:meth:`addnorm.AddNorm.add_fusion`, from the connection, the tensors and
:func:`addnorm.ops.policy.fused_op_preferred`; never from hooks. Every connection calls its three
observation points (``stream_in``, ``branch``, ``stream_out``) on every step; a held add calls its
connection's ``stream_out`` when it is done (see :class:`~addnorm.connection.ObservationPoint`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass

import torch
from torch import Tensor, nn

from ..connection import AddNorm, op_norm

__all__ = ["AUTOCAST_SUBLAYER_INPUT", "Connection", "HeldAdd", "Stream", "sublayer_dtype"]

# True: hand a sublayer that declares ``autocast_input`` its normed input in autocast's dtype where a
# fused op writes it (:func:`sublayer_dtype`). A candidate made without a GPU: it becomes the default
# where a GPU measures it no slower (the GPU suite's LM step times the fused step both ways: column
# "fused (autocast h)"); False, the default: in the stream's dtype, as before
AUTOCAST_SUBLAYER_INPUT = False


def sublayer_dtype(conn: AddNorm, sublayer: Callable[[Tensor], Tensor], t: Tensor) -> torch.dtype | None:
    """The dtype in which ``conn`` may hand ``sublayer`` its normed input h = N1(s) (None: s's own): under
    autocast for ``t``'s device, autocast's dtype, where the sublayer reads h only through one op that
    autocast casts to that dtype (``sublayer.autocast_input``: addnorm's attention and feed-forward read
    it through one linear layer) and h is not the residual too (``residual_from="normed_input"``).

    The sublayer computes the same values either way: its linear layer would round h to that dtype,
    and the gradient it hands back is in that dtype already (one reader: nothing to sum). A fused add &
    norm then writes h in that dtype (Pre-LN's held add: :class:`HeldAdd`), which saves the cast, its
    backward and their kernels at each connection, and a quarter of the op's bytes.
    """
    if (
        not AUTOCAST_SUBLAYER_INPUT
        or not getattr(sublayer, "autocast_input", False)
        or conn.placement.residual_from == "normed_input"
    ):
        return None
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


@dataclass(slots=True, eq=False)
class HeldAdd:
    """The add s = alpha * residual + g * D(branch) of ``conn``, held back until the stream is read.

    A dataclass, so that what crosses a module boundary is a container of tensors that module hooks
    can see (FSDP2 registers its pre-backward unshard on the tensors of a module's output, looking
    into dataclasses, tuples, lists and dicts only). ``gate``: g as the add applies it; a layer hands
    the stream on with :meth:`Stream.leaving`, which gives g its own storage, so that the next layer
    never reads this layer's parameters (resharded by then under FSDP2).
    """

    conn: AddNorm
    branch: Tensor
    residual: Tensor
    gate: Tensor | None = None

    def read(self, norm: nn.Module | None, y_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """(s, N(s)), N None: (s, s). One fused op where it computes ``norm`` (N(s) in ``y_dtype`` where
        given: :func:`sublayer_dtype`), else the add, then N."""
        conn = self.conn
        if op_norm(norm) is not None:
            point = conn.stream_out
            if not point.observed:  # nothing sees the point: s is all there is to hand on
                h, s = conn.add_then_norm(
                    self.branch, self.residual, norm, prenorm=True, gate=self.gate, y_dtype=y_dtype
                )
                return s, h
            # the op's own residual input: only the op reads it, so its gradient is alpha * dL/ds
            r = self.residual.view_as(self.residual)
            h, s = conn.add_then_norm(self.branch, r, norm, prenorm=True, gate=self.gate, y_dtype=y_dtype)
            point(s, grad_from=r, grad_scale=conn.alpha)
            return s, h
        s = conn.stream_out(conn.add(self.branch, self.residual, gate=self.gate)[0])
        return s, (s if norm is None else norm(s))


@dataclass(slots=True, eq=False)
class Stream:
    """The residual stream between sublayers (see the module docstring): ``value`` s, or ``held`` an add
    that gives s when read; ResiDual's ``second`` stream; B2T's ``layer_input``. A dataclass of tensors
    (and a :class:`HeldAdd`), so that module hooks see its tensors when it crosses a module boundary."""

    value: Tensor | None = None
    _: KW_ONLY
    held: HeldAdd | None = None
    second: Tensor | None = None
    layer_input: Tensor | None = None

    def leaving(self) -> Stream:
        """The stream as a layer hands it on: a held add's gate copied out of the layer's parameter
        (a differentiable copy), so the next layer reads no parameter of this one."""
        held = self.held
        if held is None or held.gate is None:
            return self
        gated = HeldAdd(held.conn, held.branch, held.residual, held.gate.clone())
        return Stream(self.value, held=gated, second=self.second, layer_input=self.layer_input)

    def read(self, norm: nn.Module | None, y_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        """(s, N(s)); N None gives (s, s). A held add is done here, fused with N where the op computes it
        (N(s) in ``y_dtype`` where given)."""
        if self.held is not None:
            return self.held.read(norm, y_dtype)
        return self.value, (self.value if norm is None else norm(self.value))

    def tensor(self) -> Tensor:
        """s as a tensor (a held add done unfused: no norm follows)."""
        return self.read(None)[0]

    def output(self, norm: nn.Module | None) -> Tensor:
        """A stack's output: N(s) with its final norm N (s without one); ResiDual's xa + N(xd)."""
        if self.second is not None:
            return self.tensor() + (self.second if norm is None else norm(self.second))
        return self.read(norm)[1]


class Connection:
    """How the stream passes one :class:`~addnorm.AddNorm` ``conn`` in a layer: ``x = connection(x, F)``.

    Reads the stream (doing a held add, fused with ``conn``'s input norm), runs the sublayer, and adds
    its branch back as :meth:`~addnorm.AddNorm.add_fusion` decides: held back for the next norm, fused
    with the output norm now, or unfused. In a B2T layer the first connection keeps the layer's input
    (``keeps_layer_input``) and the last adds it before its norm (``adds_layer_input``).
    """

    __slots__ = ("conn", "keeps_layer_input", "adds_layer_input")

    def __init__(
        self, conn: AddNorm, *, keeps_layer_input: bool = False, adds_layer_input: bool = False
    ) -> None:
        self.conn = conn
        self.keeps_layer_input, self.adds_layer_input = keeps_layer_input, adds_layer_input

    def __call__(self, x: Stream, sublayer: Callable[[Tensor], Tensor]) -> Stream:
        conn = self.conn
        held = x.held
        s, h = x.read(conn.input_norm, None if held is None else sublayer_dtype(conn, sublayer, held.branch))
        s = conn.stream_in(s)
        f, base = conn.branch_of(s, h, sublayer)
        layer_input = s if self.keeps_layer_input else x.layer_input
        extra = layer_input if self.adds_layer_input else None
        how = conn.add_fusion(f, base) if x.second is None and extra is None else None
        if how == "next":
            return Stream(held=HeldAdd(conn, f, base, conn.gate), layer_input=layer_input)
        y, d = conn.add_and_norm(f, base, extra, fuse=how == "now")
        second = None if x.second is None else x.second + d
        return Stream(y, second=second, layer_input=None if self.adds_layer_input else layer_input)

    def __repr__(self) -> str:
        roles = [r for r in ("keeps_layer_input", "adds_layer_input") if getattr(self, r)]
        return f"Connection({self.conn!r}{''.join(', ' + r for r in roles)})"
