"""One rank's view of a run that trains on several processes: the strategy that wraps the model (DDP
or FSDP2), the rank's shard of every batch, and the mean of a value over the ranks.

Contract (what makes N processes train like one): every rank draws the same global batch from the
same seeded generator and keeps rows ``[rank * B/N, (rank + 1) * B/N)``; its loss is the mean over its
rows, and both strategies average gradients over the ranks, so with equal shards the update is the
one-process update on the whole batch (``mean of shard means = mean``). Reported losses are the
ranks' mean (:meth:`Ranks.mean`), identical on every rank, so every rank stops at the same step.
Steps that observe the model (probes) run the whole batch on every rank: the averaged gradient of N
identical gradients is that gradient, so probes read the one-process numbers.
(DDP: Li et al. 2020, "PyTorch Distributed", VLDB; FSDP: Zhao et al. 2023, "PyTorch FSDP", VLDB.)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from torch import nn

STRATEGY_NAMES = ("ddp", "fsdp2")
DISTRIBUTED_KEYS = ("strategy", "nproc")


def parse_distributed(value: Any, batch_size: int) -> dict | None:
    """The canonical ``distributed`` setting: ``{"strategy": ..., "nproc": N}``, or None for one
    process (``None`` or ``nproc: 1``, the same run as no setting). ``batch_size`` must split evenly."""
    if value is None or value is False:
        return None
    if not isinstance(value, dict):
        raise ValueError(
            f"distributed: expected a mapping {{strategy: {' | '.join(STRATEGY_NAMES)}, nproc: N}}, "
            f"got {value!r}"
        )
    for key in value:
        if key not in DISTRIBUTED_KEYS:
            raise ValueError(f"distributed.{key}: unknown key; allowed keys: {', '.join(DISTRIBUTED_KEYS)}")
    strategy = value.get("strategy", "ddp")
    if strategy not in STRATEGY_NAMES:
        raise ValueError(
            f"distributed.strategy: expected one of {', '.join(STRATEGY_NAMES)}, got {strategy!r}"
        )
    nproc = value.get("nproc")
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"distributed.nproc: expected a positive integer (processes), got {nproc!r}")
    if nproc == 1:
        return None
    if batch_size % nproc:
        raise ValueError(
            f"distributed.nproc: {nproc} processes cannot share batch_size={batch_size} evenly; "
            f"expected a batch size divisible by {nproc}"
        )
    return {"strategy": strategy, "nproc": nproc}


def full(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor: a DTensor (FSDP2's sharded parameters and gradients) gathered whole."""
    gather = getattr(t, "full_tensor", None)
    return gather() if gather is not None else t


def _ddp(model: nn.Module, device: torch.device) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    ids = [device.index] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _fsdp2(model: nn.Module, device: torch.device) -> nn.Module:
    """``fully_shard`` each layer of every ``*layers`` ModuleList (addnorm's stacks, an HF model's
    decoder layers), then the root; the model is sharded in place and keeps its parameter names."""
    from torch.distributed.fsdp import fully_shard

    for name, module in list(model.named_modules()):
        if isinstance(module, nn.ModuleList) and name.split(".")[-1].endswith("layers"):
            for layer in module:
                fully_shard(layer)
    fully_shard(model)
    return model


STRATEGIES: dict[str, Callable[[nn.Module, torch.device], nn.Module]] = {"ddp": _ddp, "fsdp2": _fsdp2}


@dataclass(frozen=True)
class Ranks:
    """This process's place in a multi-process run (see the module docstring)."""

    rank: int
    world: int
    strategy: str

    @classmethod
    def current(cls, distributed: dict | None) -> Ranks | None:
        """This process's ranks for a run's ``distributed`` setting; None for a one-process run. A
        distributed run needs the process group its launcher set up (:mod:`addnorm.train.launch`)."""
        if distributed is None:
            return None
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                "distributed: this run trains on several processes; run it through a study "
                "(addnorm study) or addnorm.train.launch.launch, which start them with torchrun"
            )
        if dist.get_world_size() != distributed["nproc"]:
            raise RuntimeError(
                f"distributed.nproc: the run asks for {distributed['nproc']} processes, "
                f"the process group has {dist.get_world_size()}"
            )
        return cls(dist.get_rank(), dist.get_world_size(), distributed["strategy"])

    def wrap(self, model: nn.Module, device: torch.device) -> nn.Module:
        """The model under the strategy (DDP: a wrapper around it; FSDP2: the model, sharded)."""
        return STRATEGIES[self.strategy](model, device)

    def shard(self, batch: Any) -> Any:
        """This rank's rows of a batch (a dataclass of (batch, ...) tensors, None fields kept)."""
        rows = batch.inputs.shape[0] // self.world
        lo = self.rank * rows
        values = {
            f.name: None if getattr(batch, f.name) is None else getattr(batch, f.name)[lo : lo + rows]
            for f in fields(batch)
        }
        return replace(batch, **values)

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of ``value`` over the ranks (a new tensor, the same on every rank)."""
        out = value.detach().float().clone()
        torch.distributed.all_reduce(out)
        return out / self.world
