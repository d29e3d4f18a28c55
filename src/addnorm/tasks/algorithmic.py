"""Algorithmic sequence-to-sequence tasks for the encoder-decoder model: copy, reverse, sort."""

from __future__ import annotations

import torch
from torch import nn

from ..model import Transformer
from .base import TASKS, Batch, Task

PAD, BOS, FIRST_SYMBOL = 0, 1, 2


class _SequenceTask(Task):
    """Random symbol sequences mapped to a target; decoder input is BOS + target[:-1]. The validation
    split draws from a generator offset so it never repeats the training stream. Metric: token accuracy
    with teacher forcing."""

    metric = "accuracy"

    def __init__(self, symbols: int = 10) -> None:
        if symbols < 2:
            raise ValueError(f"symbols: expected at least 2, got {symbols}")
        self.symbols = symbols
        self.vocab = symbols + FIRST_SYMBOL

    def target(self, src: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def batch(self, split, batch_size, seq_len, generator, device=None):
        src = torch.randint(FIRST_SYMBOL, self.vocab, (batch_size, seq_len), generator=generator)
        tgt = self.target(src)
        inputs = torch.cat([torch.full((batch_size, 1), BOS, dtype=torch.long), tgt[:, :-1]], dim=1)
        return Batch(src, inputs, tgt).to(device)

    def build_model(self, cfg) -> nn.Module:
        return Transformer(cfg, self.vocab, self.vocab, pad_id=PAD)

    def metric_value(self, loss, logits, batch) -> float:
        return (logits.argmax(-1) == batch.targets).float().mean().item()


@TASKS.register("copy")
class Copy(_SequenceTask):
    name = "copy"

    def target(self, src):
        return src.clone()


@TASKS.register("reverse")
class Reverse(_SequenceTask):
    name = "reverse"

    def target(self, src):
        return src.flip(1)


@TASKS.register("sort")
class Sort(_SequenceTask):
    name = "sort"

    def target(self, src):
        return src.sort(dim=1).values
