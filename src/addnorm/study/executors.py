"""Executors run planned runs and hand results back to the driver, which alone writes the store.

The interface every executor implements (a cluster executor such as Ray included):

- ``submit(run)`` queues a :class:`PlannedRun`; nothing runs before ``results`` is iterated is fine.
- ``results(on_step=None)`` yields ``(run, result)`` pairs **in completion order** until everything
  submitted has come back, then releases its workers. ``on_step(run, step, loss)`` is called in the
  driver's thread (never from a worker) as runs progress; an executor may call it rarely or never.
- A run's exception never escapes: it comes back as a ``failed`` :class:`RunResult` with its message,
  and so does a worker that died. The driver stores failed runs and tries them again next time.
- Each result carries ``provenance`` (versions, commit, device, threads, date) of the process that
  trained it: :func:`execute` fills it in.
- ``threads`` torch threads per worker: an executor sets them in every process it trains in, and
  ``workers x threads`` should not exceed the cores it may use (:func:`plan_workers`).

``LocalExecutor`` runs in this process; ``ProcessExecutor`` uses a pool of spawned processes.
"""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator

import torch

from ..train import FAILED, RunConfig, RunResult, train
from .provenance import provenance
from .spec import PlannedRun

StepCallback = Callable[[PlannedRun, int, float], None]


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_workers(
    workers: int | str = "auto", threads: int | None = None, runs: int | None = None
) -> tuple[int, int]:
    """(workers, torch threads per worker). ``"auto"``: one worker per usable core, no more than there
    are ``runs``. Threads default to 1 per worker: the small models of a study gain little from
    intra-op threads, and multi-threaded processes stall each other as soon as anything else runs on
    the machine (a quick study took 6x longer beside one busy process). So by default
    workers x threads <= usable cores; ``threads`` raises it for large models on an idle machine."""
    cores = usable_cores()
    if workers == "auto":
        workers = max(1, min(cores, runs if runs else cores))
    elif isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected a positive integer or 'auto', got {workers!r}")
    if threads is None:
        threads = 1
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected a positive integer, got {threads!r}")
    return workers, threads


def execute(config: dict, on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Run one config; an exception becomes a ``failed`` result carrying its message. The result's
    ``provenance`` describes this process."""
    try:
        result = train(RunConfig(**config), on_step=on_step)
    except Exception as err:  # noqa: BLE001 - recorded, and the study goes on
        tail = traceback.format_exc(limit=3).strip().splitlines()[-1]
        result = RunResult(status=FAILED, error=f"{type(err).__name__}: {err}" if str(err) else tail)
    result.provenance = provenance()
    return result


class Executor:
    """Base of every executor: ``submit`` runs, iterate ``results``; ``map`` is both at once.
    ``workers`` says how many runs are in flight at once (the progress display's ETA uses it)."""

    workers: int = 1

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
    an interrupted study has at most one run in flight. Uses ``threads`` torch threads while it runs
    (default 1, see :func:`plan_workers`) and restores the previous setting after."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = plan_workers(1, threads)[1]
        self._queue: list[PlannedRun] = []

    def submit(self, run: PlannedRun) -> None:
        self._queue.append(run)

    def results(self, on_step=None):
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            while self._queue:
                run = self._queue.pop(0)
                callback = None if on_step is None else (lambda step, loss, run=run: on_step(run, step, loss))
                yield run, execute(run.config.to_dict(), callback)
        finally:
            torch.set_num_threads(before)


# --- the process pool: each worker sets its threads once and reports progress through a queue --------
_progress: mp.Queue | None = None
PROGRESS_EVERY = 0.5  # seconds between a worker's progress messages


def _init_worker(threads: int, progress: mp.Queue | None) -> None:
    global _progress
    torch.set_num_threads(threads)
    _progress = progress
    threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose driver died (even by ``kill -9``) exits instead of lingering as an orphan."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _execute_in_worker(config: dict, run_id: str) -> RunResult:
    last = [0.0]

    def report(step: int, loss: float) -> None:
        now = time.monotonic()
        if _progress is not None and now - last[0] >= PROGRESS_EVERY:
            last[0] = now
            _progress.put((run_id, step, loss))

    return execute(config, report)


class ProcessExecutor(Executor):
    """A pool of ``workers`` spawned processes with ``threads`` torch threads each (default 1). Per-step
    progress travels back through a queue, at most twice a second per run."""

    def __init__(self, workers: int, threads: int | None = None) -> None:
        self.workers, self.threads = plan_workers(workers, threads)
        self._pool: cf.ProcessPoolExecutor | None = None
        self._queue: mp.Queue | None = None
        self._futures: dict[cf.Future, PlannedRun] = {}

    def submit(self, run: PlannedRun) -> None:
        if self._pool is None:
            context = mp.get_context("spawn")
            self._queue = context.Queue()
            self._pool = cf.ProcessPoolExecutor(
                self.workers,
                mp_context=context,
                initializer=_init_worker,
                initargs=(self.threads, self._queue),
            )
        self._futures[self._pool.submit(_execute_in_worker, run.config.to_dict(), run.run_id)] = run

    def _drain(self, on_step: StepCallback | None) -> None:
        by_id = {run.run_id: run for run in self._futures.values()}
        while self._queue is not None:
            try:
                run_id, step, loss = self._queue.get_nowait()
            except queue.Empty:
                return
            if on_step is not None and run_id in by_id:
                on_step(by_id[run_id], step, loss)

    def results(self, on_step=None):
        try:
            pending = set(self._futures)
            while pending:
                done, pending = cf.wait(pending, timeout=0.25, return_when=cf.FIRST_COMPLETED)
                self._drain(on_step)
                for future in done:
                    run = self._futures.pop(future)
                    try:
                        result = future.result()
                    except Exception as err:  # noqa: BLE001 - a worker that died (e.g. out of memory)
                        result = RunResult(status=FAILED, error=f"worker died: {type(err).__name__}: {err}")
                    yield run, result
        except BaseException:  # interrupted (Ctrl-C) or abandoned: the runs in flight are not waited for
            self.close(kill=True)
            raise
        finally:
            self.close()

    def close(self, kill: bool = False) -> None:
        """Cancel what has not started and shut the pool down; ``kill`` stops the runs in flight too."""
        if self._pool is not None:
            if kill:
                for process in list(
                    getattr(self._pool, "_processes", {}).values()
                ):  # no public API before 3.14
                    process.terminate()
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        self._futures.clear()


def make_executor(
    workers: int | str = "auto", threads: int | None = None, runs: int | None = None
) -> Executor:
    """The executor for :func:`plan_workers`' choice: in-process for one worker, else a process pool."""
    workers, threads = plan_workers(workers, threads, runs)
    return LocalExecutor(threads) if workers == 1 else ProcessExecutor(workers, threads)
