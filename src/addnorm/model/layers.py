"""Encoder and decoder layers: each sublayer (self-attention, cross-attention, FFN) inside its own AddNorm."""

from __future__ import annotations

from torch import Tensor, nn

from ..addnorm import AddNorm
from ..placements import Placement
from .attention import MultiHeadAttention
from .config import TransformerConfig
from .feedforward import FeedForward
from .init import init_layer


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


class _Layer(nn.Module):
    def _connection(self, cfg: TransformerConfig, placement: Placement | str, device, dtype) -> AddNorm:
        return AddNorm(
            cfg.d_model,
            placement,
            cfg.norm,
            cfg.dropout,
            residual=cfg.residual,
            dropout_at=cfg.dropout_at,
            device=device,
            dtype=dtype,
            **cfg.norm_kwargs(),
        )

    def _attention(self, cfg: TransformerConfig, device, dtype) -> MultiHeadAttention:
        return MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attn_dropout, cfg.bias, device, dtype)

    def _feedforward(self, cfg: TransformerConfig, device, dtype) -> FeedForward:
        return FeedForward(cfg.d_model, cfg.d_ff, cfg.activation, cfg.act_dropout, cfg.bias, device, dtype)

    @property
    def placement(self) -> Placement:
        return self.ff_block.placement

    @placement.setter
    def placement(self, value: Placement | str) -> None:
        for block in self.blocks():
            block.placement = value

    def blocks(self) -> list[AddNorm]:
        return [m for m in self.children() if isinstance(m, AddNorm)]


class EncoderLayer(_Layer):
    """Self-attention then FFN, each wrapped in an AddNorm of the layer's placement.

    Post: x = N(x + D(SA(x))); x = N(x + D(FFN(x))).  Pre: x = x + D(SA(N(x))); x = x + D(FFN(N(x))).
    Call signature and mask conventions of ``nn.TransformerEncoderLayer``.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        placement: Placement | str | None = None,
        *,
        n_layers: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        placement = placement if placement is not None else cfg.placements_for(1)[0]
        self.self_attn = self._attention(cfg, device, dtype)
        self.ff = self._feedforward(cfg, device, dtype)
        self.self_attn_block = self._connection(cfg, placement, device, dtype)
        self.ff_block = self._connection(cfg, placement, device, dtype)
        init_layer(self, cfg.init, n_layers or cfg.encoder_layers)

    def forward_batch_first(
        self,
        x: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        def attend(h: Tensor) -> Tensor:
            return self.self_attn(
                h,
                attn_mask=src_mask,
                key_padding_mask=src_key_padding_mask,
                is_causal=is_causal,
                mask_names=("src_mask", "src_key_padding_mask"),
            )

        x = self.self_attn_block(x, attend)
        return self.ff_block(x, self.ff)

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        check_input(src, "src", self.cfg.d_model)
        x, unbatched = to_batch_first(src, self.cfg.batch_first)
        y = self.forward_batch_first(x, src_mask, _unbatch_mask(src_key_padding_mask, unbatched), is_causal)
        return from_batch_first(y, self.cfg.batch_first, unbatched)


class DecoderLayer(_Layer):
    """Causal self-attention, cross-attention to the encoder memory, then FFN, each in its own AddNorm.

    Call signature and mask conventions of ``nn.TransformerDecoderLayer``.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        placement: Placement | str | None = None,
        *,
        n_layers: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        placement = placement if placement is not None else cfg.placements_for(1)[0]
        self.self_attn = self._attention(cfg, device, dtype)
        self.cross_attn = self._attention(cfg, device, dtype)
        self.ff = self._feedforward(cfg, device, dtype)
        self.self_attn_block = self._connection(cfg, placement, device, dtype)
        self.cross_attn_block = self._connection(cfg, placement, device, dtype)
        self.ff_block = self._connection(cfg, placement, device, dtype)
        init_layer(self, cfg.init, n_layers or cfg.decoder_layers)

    def forward_batch_first(
        self,
        x: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        def self_attend(h: Tensor) -> Tensor:
            return self.self_attn(
                h,
                attn_mask=tgt_mask,
                key_padding_mask=tgt_key_padding_mask,
                is_causal=tgt_is_causal,
                mask_names=("tgt_mask", "tgt_key_padding_mask"),
            )

        def cross_attend(h: Tensor) -> Tensor:
            return self.cross_attn(
                h,
                memory,
                attn_mask=memory_mask,
                key_padding_mask=memory_key_padding_mask,
                is_causal=memory_is_causal,
                mask_names=("memory_mask", "memory_key_padding_mask"),
            )

        x = self.self_attn_block(x, self_attend)
        x = self.cross_attn_block(x, cross_attend)
        return self.ff_block(x, self.ff)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        d = self.cfg.d_model
        check_input(tgt, "tgt", d)
        check_input(memory, "memory", d)
        x, unbatched = to_batch_first(tgt, self.cfg.batch_first)
        mem, _ = to_batch_first(memory, self.cfg.batch_first)
        y = self.forward_batch_first(
            x,
            mem,
            tgt_mask,
            memory_mask,
            _unbatch_mask(tgt_key_padding_mask, unbatched),
            _unbatch_mask(memory_key_padding_mask, unbatched),
            tgt_is_causal,
            memory_is_causal,
        )
        return from_batch_first(y, self.cfg.batch_first, unbatched)
