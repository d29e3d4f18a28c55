"""Executors run planned runs and hand results back to the driver, which alone writes the store.

``LocalExecutor`` runs in-process; ``ProcessExecutor`` uses a process pool (``--workers N``). A cluster
executor implements the same ``map`` (an iterator of (run, result) in completion order).
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol

from ..train import FAILED, RunConfig, RunResult, train
from .spec import PlannedRun

StepCallback = Callable[[PlannedRun, int, float], None]


def execute(config: dict, on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Run one config; an exception becomes a ``failed`` result carrying its message."""
    try:
        return train(RunConfig(**config), on_step=on_step)
    except Exception as err:  # noqa: BLE001 - recorded, and the study goes on
        tail = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return RunResult(status=FAILED, error=f"{type(err).__name__}: {err}" if str(err) else tail)


class Executor(Protocol):
    def map(
        self, runs: Iterable[PlannedRun], on_step: StepCallback | None = None
    ) -> Iterator[tuple[PlannedRun, RunResult]]: ...


class LocalExecutor:
    """Runs one after another in this process (the default)."""

    def map(self, runs, on_step=None):
        for run in runs:
            callback = None if on_step is None else (lambda step, loss, run=run: on_step(run, step, loss))
            yield run, execute(run.config.to_dict(), callback)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class ProcessExecutor:
    """A pool of ``workers`` processes (spawned, one torch thread each by default)."""

    def __init__(self, workers: int, threads_per_worker: int = 1) -> None:
        if workers < 1:
            raise ValueError(f"workers: expected a positive integer, got {workers}")
        self.workers, self.threads = workers, threads_per_worker

    def map(self, runs, on_step=None):
        ctx = mp.get_context("spawn")
        with cf.ProcessPoolExecutor(
            self.workers, mp_context=ctx, initializer=_init_worker, initargs=(self.threads,)
        ) as pool:
            futures = {pool.submit(execute, run.config.to_dict()): run for run in runs}
            for future in cf.as_completed(futures):
                yield futures[future], future.result()


def make_executor(workers: int = 1) -> Executor:
    return LocalExecutor() if workers <= 1 else ProcessExecutor(workers)
