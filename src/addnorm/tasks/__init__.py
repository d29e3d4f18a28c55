"""Tasks a study trains on: algorithmic sequence-to-sequence (copy, reverse, sort) and byte-level
language modelling on a text corpus. Each task builds its model and computes loss and metrics."""

from . import algorithmic  # noqa: F401  (registers copy, reverse, sort)
from .base import TASKS, Batch, Task, build_task
from .corpus import read_corpus, stdlib_corpus

__all__ = ["TASKS", "Batch", "Task", "build_task", "read_corpus", "stdlib_corpus"]
