"""Training: run configuration, optimiser groups, learning-rate schedules, and the loop."""

from .config import RunConfig
from .loop import DIVERGED, DONE, FAILED, RunResult, evaluate, train
from .optim import build_optimizer, param_groups
from .schedules import SCHEDULES, lr_multiplier

__all__ = [
    "DIVERGED",
    "DONE",
    "FAILED",
    "SCHEDULES",
    "RunConfig",
    "RunResult",
    "build_optimizer",
    "evaluate",
    "lr_multiplier",
    "param_groups",
    "train",
]
