"""Whole models: the encoder-decoder Transformer and a decoder-only language model."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from .config import TransformerConfig
from .init import Depth
from .ngpt import NGPTHead, ngpt_normalize_
from .stacks import Decoder, Encoder


class PositionalEncoding(nn.Module):
    """Adds position information: sinusoidal PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)
    (Vaswani et al. 2017), a learned table, or nothing."""

    def __init__(self, d_model: int, max_len: int, kind: str = "sinusoidal", device=None, dtype=None) -> None:
        super().__init__()
        self.kind, self.max_len = kind, max_len
        self.table = None
        if kind == "sinusoidal":
            pe = torch.empty(max_len, d_model, dtype=dtype or torch.get_default_dtype(), device=device)
            self.register_buffer("pe", pe, persistent=False)
            self.reset_buffers()
        elif kind == "learned":
            self.table = nn.Embedding(max_len, d_model, device=device, dtype=dtype)
            nn.init.normal_(self.table.weight, std=0.02)

    def reset_buffers(self) -> None:
        """(Re)compute the sinusoidal table in place, on its device and in its dtype: a state dict does
        not carry it, so a model built on the meta device needs this after ``to_empty``."""
        if self.kind != "sinusoidal" or self.pe.is_meta:
            return
        max_len, d_model = self.pe.shape
        pos = torch.arange(max_len, dtype=torch.float64).unsqueeze(1)
        freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, d_model, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)[:, : d_model // 2]
        with torch.no_grad():
            self.pe.copy_(pe)

    def forward(self, x: Tensor) -> Tensor:  # x: (B, T, d)
        t = x.shape[1]
        if self.kind == "sinusoidal":
            return x + self.pe[:t]
        if self.kind == "learned":
            return x + self.table.weight[:t]
        return x


class _Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) (Vaswani et al. 2017), entries ~ N(0, 1/d_model) so the
    scaled vectors have unit variance, plus positions and dropout."""

    def __init__(
        self, vocab: int, cfg: TransformerConfig, device=None, dtype=None, *, vocab_arg: str = "vocab"
    ) -> None:
        super().__init__()
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"{vocab_arg}: expected a positive int, got {vocab!r}")
        self.vocab, self.max_len, self.vocab_arg = vocab, cfg.max_len, vocab_arg
        self.tokens = nn.Embedding(vocab, cfg.d_model, device=device, dtype=dtype)
        nn.init.normal_(self.tokens.weight, std=cfg.d_model**-0.5)
        self.scale = math.sqrt(cfg.d_model)
        self.positions = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.positional, device, dtype)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, name: str) -> Tensor:
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32) or ids.ndim != 2:
            got = (
                f"dtype {ids.dtype}, shape {tuple(ids.shape)}"
                if isinstance(ids, Tensor)
                else type(ids).__name__
            )
            raise ValueError(f"{name}: expected integer token ids of shape (batch, seq), got {got}")
        if ids.shape[1] > self.max_len:
            raise ValueError(f"{name}: sequence length {ids.shape[1]} exceeds max_len={self.max_len}")
        _check_vocab(ids, name, self.vocab, self.vocab_arg)
        return self.dropout(self.positions(self.tokens(ids) * self.scale))


def reset_buffers(model: nn.Module) -> nn.Module:
    """Recompute every buffer of ``model`` that its state dict does not carry (the sinusoidal position
    table); returns it. Call after ``model.to_empty(device=...)`` on a model built on the meta device,
    before or after loading its state dict."""
    for module in model.modules():
        if isinstance(module, PositionalEncoding):
            module.reset_buffers()
    return model


def _check_vocab(ids: Tensor, name: str, vocab: int, vocab_arg: str) -> None:
    """Token ids in [0, vocab), else a one-line ValueError instead of ``nn.Embedding``'s IndexError.

    Checked on CPU tensors only, with one fused min/max reduction (``torch.aminmax``) whose ``.item()``
    costs no device sync there. On an accelerator ``.item()`` would stall the host every step (and
    break CUDA graphs), so there the lookup's own device-side bounds assertion is left to catch it;
    under ``torch.compile`` the check is skipped so that it adds no graph break."""
    if ids.device.type != "cpu" or ids.numel() == 0 or torch.compiler.is_compiling():
        return
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= vocab:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name}: token id {bad} is outside the vocabulary of {vocab} ids ({vocab_arg}={vocab}: "
            f"expected 0 <= id < {vocab})"
        )


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
    where the placement needs one, and a linear head. ``forward(tokens (B, T)) -> logits (B, T, vocab)``."""

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

    def forward(self, tokens: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = self.stack(self.embed(tokens, "tokens"), None, key_padding_mask, is_causal=True, batch_first=True)
        return self.head(x)
