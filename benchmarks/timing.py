"""How the benchmarks time implementations against each other on a shared machine: interleaved, each
implementation a timer (a call returning the seconds it measured), such as a training step."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["interleaved", "training_step"]


def interleaved(
    timers: dict[str, Callable[[], float]], reps: int, warmup: int = 0
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Call every timer (a call that returns the seconds it measured) ``warmup`` times, then ``reps``
    times in alternation, the order reversed every other round, so that drifts in machine load hit
    every implementation alike. Returns the measured seconds per name, and the CPU seconds this process
    spent in each call (``time.process_time``: time the process waited while others ran is left out)."""
    for _ in range(warmup):
        for timer in timers.values():
            timer()
    names = list(timers)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        for name in names if i % 2 == 0 else names[::-1]:
            t0 = time.process_time()
            wall[name].append(timers[name]())
            cpu[name].append(time.process_time() - t0)
    return wall, cpu


def training_step(model, loss_of: Callable[[], object], lr: float = 1e-4) -> Callable[[], float]:
    """A timer of one training step of ``model`` (put in training mode): gradients zeroed, ``loss_of()``
    computed and backpropagated, one AdamW step at ``lr``; it returns the step's wall seconds."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()
        return time.perf_counter() - t0

    return step
