"""Encoder and decoder layers: each sublayer (self-attention, cross-attention, FFN) inside its own AddNorm."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from torch import Tensor, nn

from ..connection import AddNorm, ConnectionRole
from ..norms import build_norm
from ..placement_spec import ConnectionSpec, LayerSpec, layer_spec
from ..placements import Placement, get_placement
from .attention import MultiHeadAttention
from .config import TransformerConfig
from .feedforward import FeedForward
from .init import Depth, init_layer, init_placement
from .stream import Connection, Stream


def check_input(x: object, name: str, d_model: int) -> Tensor:
    """A (batch, seq, d_model) or unbatched (seq, d_model) tensor, else a clear error."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a Tensor, got {type(x).__name__}")
    if x.ndim not in (2, 3) or x.shape[-1] != d_model:
        raise ValueError(
            f"{name}: expected shape (batch, seq, {d_model}), (seq, batch, {d_model}) or (seq, {d_model}), "
            f"got {tuple(x.shape)}"
        )
    return x


def enter(x: object, name: str, d_model: int, batch_first: bool) -> tuple[Tensor, bool]:
    """Check ``x`` (:func:`check_input`) and return its batch-first view and whether it was unbatched."""
    return to_batch_first(check_input(x, name, d_model), batch_first)


def to_batch_first(x: Tensor, batch_first: bool) -> tuple[Tensor, bool]:
    """(B, L, d) view of x for the configured layout; unbatched (L, d) becomes (1, L, d)."""
    if x.ndim == 2:
        return x.unsqueeze(0), True
    return (x if batch_first else x.transpose(0, 1)), False


def from_batch_first(x: Tensor, batch_first: bool, unbatched: bool) -> Tensor:
    if unbatched:
        return x.squeeze(0)
    return x if batch_first else x.transpose(0, 1)


def _unbatch_mask(mask: Tensor | None, unbatched: bool) -> Tensor | None:
    return mask.unsqueeze(0) if (unbatched and mask is not None and mask.ndim == 1) else mask


def default_depth(part: str, cfg: TransformerConfig, n_layers: int | None = None) -> Depth:
    """Where a layer or stack of ``cfg``'s encoder or decoder (``part``) sits when no depth is given:
    both stacks' layer counts, ``n_layers`` replacing this stack's."""
    if part == "encoder":
        return Depth("encoder", cfg.encoder_layers if n_layers is None else n_layers, 0)
    return Depth("decoder", cfg.encoder_layers, cfg.decoder_layers if n_layers is None else n_layers)


# the layer arguments an attention's mask errors name: (attention mask, key padding mask)
_SRC_MASKS = ("src_mask", "src_key_padding_mask")
_TGT_MASKS = ("tgt_mask", "tgt_key_padding_mask")
_MEMORY_MASKS = ("memory_mask", "memory_key_padding_mask")


def attending(attn, memory, mask, key_padding_mask, is_causal, names) -> Callable[[Tensor], Tensor]:
    """The sublayer F of an attention connection: ``attn`` (a :class:`MultiHeadAttention`) from h, to
    ``memory`` for cross-attention, with this call's masks, which its errors name as ``names``."""

    memory_arg = () if memory is None else (memory,)  # self-attention: called with h alone

    def attend(h: Tensor) -> Tensor:
        return attn(
            h,
            *memory_arg,
            attn_mask=mask,
            key_padding_mask=key_padding_mask,
            is_causal=is_causal,
            mask_names=names,
        )

    attend.autocast_input = getattr(attn, "autocast_input", False)  # it reads h as attn does
    return attend


class _Layout(NamedTuple):
    """How a layer was called: with a :class:`Stream` from a stack (batch-first; it gives one back), or
    with a tensor in ``batch_first`` layout, ``unbatched`` or not (it gives a tensor back)."""

    stream: bool
    batch_first: bool = True
    unbatched: bool = False

    def mask(self, key_padding_mask: Tensor | None) -> Tensor | None:
        return _unbatch_mask(key_padding_mask, self.unbatched)

    def leave(self, x: Stream) -> Tensor | Stream:
        return x.leaving() if self.stream else from_batch_first(x.tensor(), self.batch_first, self.unbatched)


_FROM_STACK = _Layout(stream=True)


def _structure(p: Placement) -> tuple:
    """What a layer builds from its placement beyond its connections: equal for switchable placements."""
    return (
        p.stream,
        p.sublayer_norm,
        p.attention_norm,
        p.ffn_scale,
        p.layer_gate,
        p.attention_connection,
        p.init,
    )


class _Layer(nn.Module):
    """What encoder and decoder layers share: building sublayers and their connections for a placement
    at a given depth, and taking a tensor or a stack's :class:`Stream` in.

    A layer class names its ``part`` (the stack of its default depth) and its ``SUBLAYERS`` in order, each
    (attribute, kind): the sublayer (attention, cross-attention or FFN) is the attribute, its
    :class:`~addnorm.AddNorm` ``<attribute>_block`` and the stream's way through it
    ``<attribute>_connection``."""

    part: str
    SUBLAYERS: tuple[tuple[str, str], ...]

    def __init__(
        self,
        cfg: TransformerConfig,
        placement: Placement | str | None = None,
        *,
        depth: Depth | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        depth = depth or default_depth(self.part, cfg)
        self._setup(cfg, placement, device, dtype)
        for name, kind in self.SUBLAYERS:
            sublayer = (
                self._feedforward() if kind == "ffn" else self._attention(cross=kind == "cross_attention")
            )
            setattr(self, name, sublayer)
        spec = self._spec(depth, tuple(kind for _, kind in self.SUBLAYERS))
        blocks = []
        for connection, (name, kind) in zip(spec.connections, self.SUBLAYERS, strict=True):
            blocks.append(self._connection(connection, ConnectionRole(name, kind)))
            setattr(self, f"{name}_block", blocks[-1])
        for (name, _), way in zip(self.SUBLAYERS, self._connections(spec, *blocks), strict=True):
            setattr(self, f"{name}_connection", way)
        self._initialise(spec, depth)

    def _setup(self, cfg: TransformerConfig, placement, device, dtype) -> None:
        self.cfg = cfg
        self._p = get_placement(placement if placement is not None else cfg.placements_for(1)[0])
        if self._p.layers is not None:
            raise ValueError(
                f"placement: {self._p.name!r} assigns placements per layer; give it to a stack, not a layer"
            )
        self._kw = {"device": device, "dtype": dtype}

    def _norm(self, size: int) -> nn.Module:
        return build_norm(
            self._p.norm or self.cfg.norm, size, **self.cfg.norm_kwargs(), **self._kw, **self.cfg.norm_options
        )

    def _spec(self, depth: Depth, kinds: tuple[str, ...]) -> LayerSpec:
        """The layer's spec, shared with addnorm.hf: its connections (one per sublayer kind, in order),
        whether they share a gate, its init."""
        return layer_spec(self._p, depth, kinds)

    def _connection(self, spec: ConnectionSpec, role: ConnectionRole) -> AddNorm:
        cfg = self.cfg
        block = AddNorm(
            cfg.d_model,
            spec.placement,
            spec.norm or cfg.norm,
            cfg.dropout,
            residual=cfg.residual,
            dropout_at=cfg.dropout_at,
            alpha=spec.alpha,
            gate_init=spec.gate_init,
            norm_options=cfg.norm_options,
            **cfg.norm_kwargs(),
            **self._kw,
        )
        block.connection_role = role
        return block

    def _attention(self, cross: bool = False) -> MultiHeadAttention:
        """Self- or cross-attention; Sub-LN's inner norm only in self-attention (as torchscale)."""
        cfg, p = self.cfg, self._p
        normalize = p.attention_norm or ("qk" if cfg.qk_norm else None)
        return MultiHeadAttention(
            cfg.d_model,
            cfg.n_heads,
            cfg.attn_dropout,
            cfg.bias,
            **self._kw,
            normalize=normalize,
            qkv_norm=self._norm,
            inner_norm=self._norm(cfg.d_model) if p.sublayer_norm and not cross else None,
        )

    def _feedforward(self) -> FeedForward:
        cfg, p = self.cfg, self._p
        return FeedForward(
            cfg.d_model,
            cfg.d_ff,
            cfg.activation,
            cfg.act_dropout,
            cfg.bias,
            **self._kw,
            inner_norm=self._norm(cfg.d_ff) if p.sublayer_norm else None,
            scale_hidden=p.ffn_scale,
        )

    def _initialise(self, spec: LayerSpec, depth: Depth) -> None:
        init_layer(self, self.cfg.init, depth.n_layers)
        init_placement(self, spec.init)

    def _connections(self, spec: LayerSpec, *blocks: AddNorm) -> list[Connection]:
        """The stream's way through each connection, in order; B2T's layer input skips to the last.
        Where the spec says so (ReZero) the connections share the first one's gate: one per layer."""
        spec.share_gates(blocks)
        b2t = spec.b2t
        return [
            Connection(block, keeps_layer_input=b2t and i == 0, adds_layer_input=b2t and i == len(blocks) - 1)
            for i, block in enumerate(blocks)
        ]

    def _enter(self, x: Tensor | Stream, name: str, batch_first: bool | None) -> tuple[Stream, _Layout]:
        """The stream for input ``x`` and how to give the result back (see :class:`_Layout`)."""
        if isinstance(x, Stream):
            return x, _FROM_STACK
        bf = self.cfg.batch_first if batch_first is None else batch_first
        t, unbatched = enter(x, name, self.cfg.d_model, bf)
        return Stream(t), _Layout(False, bf, unbatched)

    @property
    def placement(self) -> Placement:
        return self._p

    @placement.setter
    def placement(self, value: Placement | str) -> None:
        new = get_placement(value)
        if _structure(new) != _structure(self._p):
            raise ValueError(
                f"placement: cannot switch a layer from {self._p.name!r} to {new.name!r} at run time"
            )
        for block in self.blocks():
            block.placement = new
        self._p = new

    def blocks(self) -> list[AddNorm]:
        return [m for m in self.children() if isinstance(m, AddNorm)]


class EncoderLayer(_Layer):
    """Self-attention then FFN, each wrapped in an AddNorm of the layer's placement.

    Post: x = N(x + D(SA(x))); x = N(x + D(FFN(x))).  Pre: x = x + D(SA(N(x))); x = x + D(FFN(N(x))).
    Call signature and mask conventions of ``nn.TransformerEncoderLayer``.
    """

    part = "encoder"
    SUBLAYERS = (("self_attn", "attention"), ("ff", "ffn"))
    self_attn: MultiHeadAttention
    ff: FeedForward

    def forward(
        self,
        src: Tensor | Stream,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        *,
        batch_first: bool | None = None,
    ) -> Tensor | Stream:
        """Same arguments as ``nn.TransformerEncoderLayer.forward``; ``batch_first`` overrides the
        config's layout for this call. A stack passes the batch-first :class:`Stream` and gets it back."""
        x, layout = self._enter(src, "src", batch_first)
        key_padding_mask = layout.mask(src_key_padding_mask)

        attend = attending(self.self_attn, None, src_mask, key_padding_mask, is_causal, _SRC_MASKS)
        x = self.self_attn_connection(x, attend)
        x = self.ff_connection(x, self.ff)
        return layout.leave(x)


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention to the encoder memory, then FFN, each in its own AddNorm.

    Call signature and mask conventions of ``nn.TransformerDecoderLayer``.
    """

    part = "decoder"
    SUBLAYERS = (("self_attn", "attention"), ("cross_attn", "cross_attention"), ("ff", "ffn"))
    self_attn: MultiHeadAttention
    cross_attn: MultiHeadAttention
    ff: FeedForward

    def forward(
        self,
        tgt: Tensor | Stream,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
        *,
        batch_first: bool | None = None,
    ) -> Tensor | Stream:
        """Same arguments as ``nn.TransformerDecoderLayer.forward``; ``batch_first`` overrides the
        config's layout for this call. A stack passes the batch-first :class:`Stream` (and memory) and
        gets the stream back."""
        x, layout = self._enter(tgt, "tgt", batch_first)
        if not layout.stream:
            memory = enter(memory, "memory", self.cfg.d_model, layout.batch_first)[0]
        tgt_key_padding_mask = layout.mask(tgt_key_padding_mask)
        memory_key_padding_mask = layout.mask(memory_key_padding_mask)

        self_attend = attending(
            self.self_attn, None, tgt_mask, tgt_key_padding_mask, tgt_is_causal, _TGT_MASKS
        )
        cross_attend = attending(
            self.cross_attn, memory, memory_mask, memory_key_padding_mask, memory_is_causal, _MEMORY_MASKS
        )
        x = self.self_attn_connection(x, self_attend)
        x = self.cross_attn_connection(x, cross_attend)
        x = self.ff_connection(x, self.ff)
        return layout.leave(x)
