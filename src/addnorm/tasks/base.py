"""The Task interface and its registry."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..registry import Registry

TASKS: Registry = Registry("task")


@dataclass
class Batch:
    """Model inputs and targets; ``src`` is None for language modelling."""

    src: Tensor | None
    inputs: Tensor
    targets: Tensor

    def to(self, device) -> Batch:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Batch(move(self.src), move(self.inputs), move(self.targets))


class Task:
    """A data source plus the model it trains and how its loss and metric are computed."""

    name: str = ""
    metric: str = ""  # the held-out metric: "accuracy" or "bits_per_byte"
    vocab: int = 0

    def batch(self, split: str, batch_size: int, seq_len: int, generator: torch.Generator) -> Batch:
        raise NotImplementedError

    def build_model(self, cfg) -> nn.Module:
        raise NotImplementedError

    def model_inputs(self, batch: Batch) -> tuple:
        """The positional arguments of the model's forward for ``batch``."""
        return (batch.inputs,) if batch.src is None else (batch.src, batch.inputs)

    def logits(self, model: nn.Module, batch: Batch) -> Tensor:
        return model(*self.model_inputs(batch))

    def loss(self, model: nn.Module, batch: Batch) -> tuple[Tensor, Tensor]:
        """(mean cross-entropy in nats, logits)."""
        logits = self.logits(model, batch)
        loss = nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), batch.targets.reshape(-1)
        )
        return loss, logits

    def metric_value(self, loss: float, logits: Tensor, batch: Batch) -> float:
        raise NotImplementedError


def build_task(name: str, **options) -> Task:
    """A task by registry name (``lm``, ``copy``, ``reverse``, ``sort``)."""
    return TASKS[name](**options)
