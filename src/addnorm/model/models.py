"""Whole models: the encoder-decoder Transformer and a decoder-only language model."""

from __future__ import annotations

from torch import Tensor, nn

from .config import TransformerConfig
from .embedding import PositionalEncoding, _Embedding
from .init import Depth
from .ngpt import NGPTHead, ngpt_normalize_
from .stacks import Decoder, Encoder


def reset_buffers(model: nn.Module) -> nn.Module:
    """Recompute every buffer of ``model`` that its state dict does not carry (the sinusoidal position
    table); returns it. Call after ``model.to_empty(device=...)`` on a model built on the meta device,
    before or after loading its state dict."""
    for module in model.modules():
        if isinstance(module, PositionalEncoding):
            module.reset_buffers()
    return model


def _padding_mask(ids: Tensor, pad_id: int | None, given: Tensor | None) -> Tensor | None:
    if given is not None or pad_id is None:
        return given
    return ids == pad_id


def _head(stack: Encoder | Decoder) -> type[nn.Linear]:
    """The logit head's class: nGPT's scaled logits (s_z) after an nGPT stack, else a Linear."""
    return NGPTHead if stack.stream == "ngpt" else nn.Linear


def _stacks(cfg: TransformerConfig, device, dtype) -> tuple[Encoder, Decoder]:
    """The encoder and decoder of an encoder-decoder model, each knowing both depths (DeepNorm, Sub-LN)."""
    n, m = cfg.encoder_layers, cfg.decoder_layers
    return (
        Encoder(cfg, depth=Depth("encoder", n, m), device=device, dtype=dtype),
        Decoder(cfg, depth=Depth("decoder", n, m), device=device, dtype=dtype),
    )


class EncoderDecoder(nn.Module):
    """Encoder and decoder stacks without embeddings: the call signature and layout of ``nn.Transformer``.

    ``forward(src, tgt, src_mask, tgt_mask, memory_mask, src_key_padding_mask, tgt_key_padding_mask,
    memory_key_padding_mask, src_is_causal, tgt_is_causal, memory_is_causal)``: memory =
    encoder(src), output = decoder(tgt, memory), in ``cfg.batch_first``'s layout. What
    ``from_torch(nn.Transformer(...))`` returns and ``to_torch`` converts back.
    """

    def __init__(self, cfg: TransformerConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder, self.decoder = _stacks(cfg, device, dtype)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_mask: Tensor | None = None,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        src_is_causal: bool | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        if isinstance(src, Tensor) and isinstance(tgt, Tensor) and src.ndim == tgt.ndim == 3:
            dim = 0 if self.cfg.batch_first else 1
            if src.shape[dim] != tgt.shape[dim]:
                raise ValueError(
                    f"tgt: batch size {tgt.shape[dim]} must equal src's {src.shape[dim]} "
                    f"(dimension {dim} with batch_first={self.cfg.batch_first})"
                )
        memory = self.encoder(src, src_mask, src_key_padding_mask, src_is_causal)
        return self.decoder(
            tgt,
            memory,
            tgt_mask,
            memory_mask,
            tgt_key_padding_mask,
            memory_key_padding_mask,
            tgt_is_causal,
            memory_is_causal,
        )


class Transformer(nn.Module):
    """Encoder-decoder Transformer (Vaswani et al. 2017) for token ids in the batch-first layout.

    ``forward(src (B, S), tgt (B, T)) -> logits (B, T, tgt_vocab)``; the decoder's self-attention is
    causal; with ``pad_id`` the padding masks are derived from the ids.
    """

    def __init__(
        self,
        cfg: TransformerConfig,
        src_vocab: int,
        tgt_vocab: int,
        *,
        pad_id: int | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        self.cfg, self.pad_id = cfg, pad_id
        self.src_embed = _Embedding(src_vocab, cfg, device, dtype, vocab_arg="src_vocab")
        self.tgt_embed = _Embedding(tgt_vocab, cfg, device, dtype, vocab_arg="tgt_vocab")
        self.encoder, self.decoder = _stacks(cfg, device, dtype)
        self.head = _head(self.decoder)(cfg.d_model, tgt_vocab, device=device, dtype=dtype)
        if self.decoder.stream == "ngpt":
            ngpt_normalize_(self)

    def encode(self, src: Tensor, src_key_padding_mask: Tensor | None = None) -> Tensor:
        """Encoder memory (B, S, d)."""
        kpm = _padding_mask(src, self.pad_id, src_key_padding_mask)
        return self.encoder(self.src_embed(src, "src"), None, kpm, batch_first=True)

    def decode(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        """Next-token logits (B, T, tgt_vocab) given the memory."""
        kpm = _padding_mask(tgt, self.pad_id, tgt_key_padding_mask)
        x = self.decoder(
            self.tgt_embed(tgt, "tgt"),
            memory,
            None,
            None,
            kpm,
            memory_key_padding_mask,
            tgt_is_causal=True,
            batch_first=True,
        )
        return self.head(x)

    def forward(
        self,
        src: Tensor,
        tgt: Tensor,
        src_key_padding_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
    ) -> Tensor:
        src_kpm = _padding_mask(src, self.pad_id, src_key_padding_mask)
        memory = self.encode(src, src_kpm)
        return self.decode(tgt, memory, tgt_key_padding_mask, src_kpm)


class LanguageModel(nn.Module):
    """Decoder-only language model: embeddings, a causal stack of self-attention layers, a final norm
    where the placement needs one, and a linear head. ``forward(tokens (B, T)) -> logits (B, T, vocab)``.

    Args:
        cfg: the model's dimensions, placement, norm and initialisation.
        vocab: the vocabulary size (the embedding's rows and the head's outputs).
        tie_embeddings: the head shares the token embedding's weight.
        device: where the parameters are created.
        dtype: the parameters' dtype.
    """

    def __init__(
        self, cfg: TransformerConfig, vocab: int, *, tie_embeddings: bool = False, device=None, dtype=None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = _Embedding(vocab, cfg, device, dtype)
        self.stack = Encoder(cfg, depth=Depth("decoder", 0, cfg.n_layers), device=device, dtype=dtype)
        self.head = _head(self.stack)(cfg.d_model, vocab, bias=False, device=device, dtype=dtype)
        if tie_embeddings:
            self.head.weight = self.embed.tokens.weight
        if self.stack.stream == "ngpt":
            ngpt_normalize_(self)  # nGPT's embeddings and matrices start on the unit sphere

    @property
    def layers(self) -> nn.ModuleList:
        return self.stack.layers

    @property
    def norm(self) -> nn.Module | None:
        return self.stack.norm

    def forward(
        self, tokens: Tensor, key_padding_mask: Tensor | None = None, positions: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, vocab) for ``tokens`` (B, T) at positions 0..T-1, or at ``positions`` ((T,) or
        (B, T) indices into the position table: a shard's own positions under context parallelism)."""
        x = self.embed(tokens, "tokens", positions)
        return self.head(self.stack(x, None, key_padding_mask, is_causal=True, batch_first=True))
