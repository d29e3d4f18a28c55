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

    def to(self, device: torch.device | str | None) -> Batch:
        """On ``device``; host tensors bound for a GPU go through pinned memory without blocking."""
        return Batch(*(to_device(t, device) for t in (self.src, self.inputs, self.targets)))


def to_device(t: Tensor | None, device: torch.device | str | None) -> Tensor | None:
    """``t`` on ``device`` (None: where it is). A CPU tensor bound for CUDA is pinned and copied
    asynchronously, so the host goes on queueing work while it travels."""
    if t is None or device is None:
        return t
    device = torch.device(device)
    if t.device == device:
        return t
    if t.device.type == "cpu" and device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class Task:
    """A data source plus the model it trains and how its loss and metric are computed."""

    name: str = ""
    metric: str = ""  # the held-out metric: "accuracy" or "bits_per_byte"
    vocab: int = 0

    def batch(
        self,
        split: str,
        batch_size: int,
        seq_len: int,
        generator: torch.Generator,
        device: torch.device | None = None,
    ) -> Batch:
        """A batch drawn with ``generator`` (a CPU generator: the same seed gives the same batch on
        every device), on ``device`` (None: the CPU)."""
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
