"""Token and position embeddings of addnorm's own models (a module of its own so that :mod:`.ngpt`, which
keeps token embeddings on the unit sphere, can name them without importing the models built on it)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


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
        with torch.no_grad():  # a replicated DTensor table (addnorm.parallelize): its local copy
            (self.pe.to_local() if hasattr(self.pe, "to_local") else self.pe).copy_(pe)

    def forward(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        """x (B, T, d) plus the encoding of positions 0..T-1, or of ``positions`` ((T,) or (B, T)
        integer indices: a sequence shard's own positions under context parallelism)."""
        if self.kind == "none":
            return x
        table = self.pe if self.kind == "sinusoidal" else self.table.weight
        return x + (table[: x.shape[1]] if positions is None else table[positions])


class _Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model) (Vaswani et al. 2017), entries ~ N(0, 1/d_model) so the
    scaled vectors have unit variance, plus positions and dropout (``cfg``: a TransformerConfig)."""

    def __init__(self, vocab: int, cfg, device=None, dtype=None, *, vocab_arg: str = "vocab") -> None:
        super().__init__()
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab <= 0:
            raise ValueError(f"{vocab_arg}: expected a positive int, got {vocab!r}")
        self.vocab, self.max_len, self.vocab_arg = vocab, cfg.max_len, vocab_arg
        self.tokens = nn.Embedding(vocab, cfg.d_model, device=device, dtype=dtype)
        nn.init.normal_(self.tokens.weight, std=cfg.d_model**-0.5)
        self.scale = math.sqrt(cfg.d_model)
        self.positions = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.positional, device, dtype)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, ids: Tensor, name: str, positions: Tensor | None = None) -> Tensor:
        """Embedded ``ids`` (B, T) at positions 0..T-1, or at ``positions`` ((T,) or (B, T))."""
        _check_ids(ids, name, "token ids", (2,))
        if positions is None and ids.shape[1] > self.max_len:
            raise ValueError(f"{name}: sequence length {ids.shape[1]} exceeds max_len={self.max_len}")
        _check_below(ids, name, "token id", self.vocab, f"the vocabulary of {self.vocab} ids", self.vocab_arg)
        if positions is not None:
            _check_ids(positions, "positions", "positions", (1, 2), ids.shape)
            table = f"the table of {self.max_len} positions"
            _check_below(positions, "positions", "position", self.max_len, table, "max_len")
        return self.dropout(self.positions(self.tokens(ids) * self.scale, positions))


def _check_ids(ids: object, name: str, what: str, ndims: tuple[int, ...], like: tuple | None = None) -> None:
    """An int32/int64 tensor of ``ndims`` dimensions (``like``'s trailing shape), else a one-line error."""
    shape = "(batch, seq)" if ndims == (2,) else f"(seq,) or (batch, seq) like the tokens' {tuple(like)}"
    ok = isinstance(ids, Tensor) and ids.dtype in (torch.int64, torch.int32) and ids.ndim in ndims
    if ok and like is not None:
        ok = tuple(ids.shape) == tuple(like)[-ids.ndim :]
    if not ok:
        got = type(ids).__name__
        if isinstance(ids, Tensor):
            got = f"dtype {ids.dtype}, shape {tuple(ids.shape)}"
        raise ValueError(f"{name}: expected integer {what} of shape {shape}, got {got}")


def _check_below(ids: Tensor, name: str, noun: str, limit: int, within: str, limit_arg: str) -> None:
    """Ids in [0, limit), else a one-line ValueError instead of ``nn.Embedding``'s IndexError.

    Checked on CPU tensors only, with one fused min/max reduction (``torch.aminmax``) whose ``.item()``
    costs no device sync there. On an accelerator ``.item()`` would stall the host every step (and
    break CUDA graphs), so there the lookup's own device-side bounds assertion is left to catch it;
    under ``torch.compile`` the check is skipped so that it adds no graph break."""
    if ids.device.type != "cpu" or ids.numel() == 0 or torch.compiler.is_compiling():
        return
    low, high = (int(v) for v in torch.aminmax(ids))
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise ValueError(
            f"{name}: {noun} {bad} is outside {within} ({limit_arg}={limit}: expected 0 <= id < {limit})"
        )
