"""Learning-rate schedules by name: the multiplier of the base learning rate at a step."""

from __future__ import annotations

import math

from ..registry import Registry

SCHEDULES: Registry = Registry("schedule")


@SCHEDULES.register("constant")
def constant(step: int, warmup: int, total: int) -> float:
    """1 after a linear warmup of ``warmup`` steps (none when 0)."""
    return min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0


@SCHEDULES.register("linear_warmup", aliases=("warmup",))
def linear_warmup(step: int, warmup: int, total: int) -> float:
    """Linear warmup to 1 over ``warmup`` steps, then linear decay to 0 at ``total``."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


@SCHEDULES.register("cosine", aliases=("warmup_cosine",))
def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """Linear warmup, then cosine decay to 0: 0.5 (1 + cos(pi t)), t the fraction after warmup."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, t)))


@SCHEDULES.register("inverse_sqrt", aliases=("noam", "rsqrt"))
def inverse_sqrt(step: int, warmup: int, total: int) -> float:
    """The original Transformer's min(s^-0.5, s * w^-1.5) (Vaswani et al. 2017), normalised to peak at
    1 at s = w; without warmup, 1/sqrt(s)."""
    s = step + 1
    if warmup <= 0:
        return 1.0 / math.sqrt(s)
    return min(s**-0.5, s * warmup**-1.5) * math.sqrt(warmup)


def lr_multiplier(name: str, step: int, warmup: int, total: int) -> float:
    return SCHEDULES[name](step, warmup, total)
