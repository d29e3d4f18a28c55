"""Executors run planned runs and hand results back to the driver, which alone writes the store.

The interface is two calls: ``submit(run)`` queues a run, ``results(on_step)`` yields ``(run, result)``
pairs in completion order until everything submitted has come back; ``map`` does both. A run's
exception never escapes: it comes back as a ``failed`` result with its message.

``LocalExecutor`` runs in this process (the default); ``ProcessExecutor`` uses a process pool
(``--workers N``). A cluster executor (Ray) implements the same two calls.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import traceback
from collections.abc import Callable, Iterable, Iterator

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


class Executor:
    """Base of every executor: ``submit`` runs, iterate ``results``; ``map`` is both at once."""

    def submit(self, run: PlannedRun) -> None:
        raise NotImplementedError

    def results(self, on_step: StepCallback | None = None) -> Iterator[tuple[PlannedRun, RunResult]]:
        raise NotImplementedError

    def map(
        self, runs: Iterable[PlannedRun], on_step: StepCallback | None = None
    ) -> Iterator[tuple[PlannedRun, RunResult]]:
        for run in runs:
            self.submit(run)
        return self.results(on_step)


class LocalExecutor(Executor):
    """Runs one after another in this process, lazily: a run starts when its result is asked for, so
    an interrupted study has at most one run in flight."""

    def __init__(self) -> None:
        self._queue: list[PlannedRun] = []

    def submit(self, run: PlannedRun) -> None:
        self._queue.append(run)

    def results(self, on_step=None):
        while self._queue:
            run = self._queue.pop(0)
            callback = None if on_step is None else (lambda step, loss, run=run: on_step(run, step, loss))
            yield run, execute(run.config.to_dict(), callback)


def _init_worker(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


class ProcessExecutor(Executor):
    """A pool of ``workers`` spawned processes (one torch thread each by default). Results travel back
    to the driver; per-step progress does not (only finished runs are reported)."""

    def __init__(self, workers: int, threads_per_worker: int = 1) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"workers: expected a positive integer, got {workers!r}")
        self.workers, self.threads = workers, threads_per_worker
        self._pool: cf.ProcessPoolExecutor | None = None
        self._futures: dict[cf.Future, PlannedRun] = {}

    def submit(self, run: PlannedRun) -> None:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(
                self.workers,
                mp_context=mp.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.threads,),
            )
        self._futures[self._pool.submit(execute, run.config.to_dict())] = run

    def results(self, on_step=None):
        try:
            for future in cf.as_completed(list(self._futures)):
                run = self._futures.pop(future)
                try:
                    result = future.result()
                except Exception as err:  # noqa: BLE001 - a worker that died (e.g. out of memory)
                    result = RunResult(status=FAILED, error=f"{type(err).__name__}: {err}")
                yield run, result
        finally:
            self.close()

    def close(self) -> None:
        """Cancel what has not started and shut the pool down."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        self._futures.clear()


def make_executor(workers: int = 1) -> Executor:
    """In-process for ``workers <= 1``, else a process pool of ``workers``."""
    return LocalExecutor() if workers <= 1 else ProcessExecutor(workers)
