"""Executors run planned runs and hand results back to the driver, which alone writes the store.

The interface every executor implements (a cluster executor such as Ray included):

- ``submit(run)`` queues a :class:`PlannedRun`; nothing runs before ``results`` is iterated is fine.
- ``results(on_step=None)`` yields ``(run, result)`` pairs **in completion order** until everything
  submitted has come back, then releases its workers. ``on_step(run, step, loss)`` is called in the
  driver's thread (never from a worker) for every completed step of a run, in step order, before the
  run's result is yielded: live as far as the executor can pass them back (in batches, at a bounded
  rate), the rest from the result (:class:`StepRelay`). Trackers log the loss curve from it.
  ``on_progress(run, phase, done, total)``, likewise in the driver, says what a run does between
  steps (``build``: its model; ``eval``: held-out batch ``done`` of ``total``, see
  :func:`~addnorm.train.train`), the latest at most twice a second; the progress display shows it.
- A run's exception never escapes: it comes back as a ``failed`` :class:`RunResult` with its message,
  and so does a worker that died. The driver stores failed runs and tries them again next time.
- Each result carries ``provenance`` (versions, commit, device, threads, date) of the process that
  trained it: :func:`execute` fills it in.
- ``threads`` torch threads per worker: an executor sets them in every process it trains in, and
  ``workers x threads`` should not exceed the cores it may use (:func:`plan_workers`).

``LocalExecutor`` runs in this process; ``ProcessExecutor`` uses a pool of spawned processes;
``RayExecutor`` (``ray_executor.py``, the ``ray`` extra) runs Ray tasks on a cluster. :data:`EXECUTORS`
names them for ``addnorm study --executor``.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import math
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures.process import BrokenProcessPool

import torch

from ..train import FAILED, RunConfig, RunResult, train
from ..train.launch import die_with_parent, launch
from .provenance import provenance
from .spec import PlannedRun

StepCallback = Callable[[PlannedRun, int, float], None]
ProgressCallback = Callable[[PlannedRun, str, int, int], None]  # (run, phase, done, total)


def cuda_available() -> bool:
    """Whether runs started here train on a GPU (``device: auto`` picks CUDA where this process sees one)."""
    return torch.cuda.is_available()


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def plan_workers(
    workers: int | str = "auto", threads: int | None = None, runs: int | None = None, nproc: int = 1
) -> tuple[int, int]:
    """(workers, torch threads per worker). ``"auto"``: one worker per usable core, no more than there
    are ``runs``. Threads default to 1 per worker: the small models of a study gain little from
    intra-op threads, and multi-threaded processes stall each other as soon as anything else runs on
    the machine (a quick study took 6x longer beside one busy process). So by default
    workers x threads <= usable cores; ``threads`` raises it for large models on an idle machine.
    Where CUDA is available, ``"auto"`` is one worker here; ``addnorm study`` packs several runs on the
    GPU instead, as many as its memory, the cores and the measured gain allow (:mod:`.packing`).

    ``nproc``: the most processes one run trains on (its ``distributed`` setting). On a GPU machine a
    run takes one GPU per process, so ``nproc`` may not exceed the GPUs; on the CPU each process
    takes ``threads`` cores, and ``workers x nproc x threads`` above the usable cores is refused."""
    cores = usable_cores()
    cuda = cuda_available()
    if workers == "auto":
        # on a GPU machine one (the study packs several: packing.choose; several GPUs: the Ray executor)
        cores = 1 if cuda else max(1, cores // nproc)
        workers = max(1, min(cores, runs if runs else cores))
    elif isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"workers: expected a positive integer or 'auto', got {workers!r}")
    if threads is None:
        threads = 1
    elif isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected a positive integer, got {threads!r}")
    if nproc > 1 and cuda and workers > 1:
        raise ValueError(
            f"workers: a run on {nproc} processes takes {nproc} GPUs of this machine, so runs go one at a "
            "time (--workers 1); several at once: --executor ray"
        )
    if nproc > 1 and cuda and nproc > torch.cuda.device_count():
        raise ValueError(
            f"distributed.nproc: a run on {nproc} processes takes {nproc} GPUs (one each); "
            f"this machine has {torch.cuda.device_count()}"
        )
    if nproc > 1 and not cuda and workers * nproc * threads > usable_cores():
        raise ValueError(
            f"workers: {workers} worker(s) x {nproc} processes per run (distributed.nproc) x {threads} "
            f"thread(s) need {workers * nproc * threads} cores, this machine has {usable_cores()}; "
            f"use --workers {max(1, usable_cores() // (nproc * threads))} or fewer processes"
        )
    return workers, threads


def max_nproc(runs: Iterable[PlannedRun]) -> int:
    """The most processes any of ``runs`` trains on (1 for runs without ``distributed``)."""
    return max((r.config.distributed["nproc"] for r in runs if r.config.distributed), default=1)


def execute(
    config: dict,
    on_step: Callable[[int, float], None] | None = None,
    on_progress: Callable[[str, int, int], None] | None = None,
) -> RunResult:
    """Run one config (on the processes torchrun starts when it has ``distributed``, see
    :func:`~addnorm.train.launch.launch`, which passes steps back but no ``on_progress``); an
    exception becomes a ``failed`` result carrying its message. The result's ``provenance`` describes
    this process."""
    try:
        cfg = RunConfig(**config)
        if cfg.distributed:
            result = launch(cfg, on_step, threads=torch.get_num_threads())
        else:
            observers = {"on_progress": on_progress} if on_progress is not None else {}
            result = train(cfg, on_step=on_step, **observers)
    except Exception as err:  # noqa: BLE001 - recorded, and the study goes on
        tail = traceback.format_exc(limit=3).strip().splitlines()[-1]
        result = RunResult(status=FAILED, error=f"{type(err).__name__}: {err}" if str(err) else tail)
    result.provenance = {**provenance(), **result.provenance}
    return result


class StepRelay:
    """Passes each run's steps to ``on_step`` once each and in step order: batches as workers send them,
    then, when the result is in, the steps it holds that never came (a batch still in flight, or an
    executor that sends none), and its progress events to ``on_progress``. Batches and events for a
    run whose result is in are ignored."""

    def __init__(self, on_step: StepCallback | None, on_progress: ProgressCallback | None = None) -> None:
        self.on_step, self.on_progress = on_step, on_progress
        self._last: dict[str, int] = {}
        self._done: set[str] = set()
        self._event: dict[str, tuple[str, int, int]] = {}  # the last progress event passed on, per run

    def progress(self, run: PlannedRun, phase: str, done: int, total: int) -> None:
        if self.on_progress is not None and run.run_id not in self._done:
            self._event[run.run_id] = (phase, done, total)
            self.on_progress(run, phase, done, total)

    def deliver(self, run: PlannedRun, steps: Iterable[tuple[int, float]]) -> None:
        if self.on_step is None or run.run_id in self._done:
            return
        last = self._last.get(run.run_id, -1)
        for step, loss in steps:
            if step > last:
                self.on_step(run, step, loss)
                last = step
        self._last[run.run_id] = last

    def complete(self, run: PlannedRun, result: RunResult, last_event: tuple | None = None) -> None:
        """Deliver the completed steps of ``result`` not yet passed on, and the run's ``last_event`` of
        progress if it has not come (a worker's queue can deliver it after the result); later batches
        and events are dropped."""
        done = [(s, v) for s, name, v in result.metrics if name == "train_loss" and s < result.steps_done]
        self.deliver(run, done)
        if last_event is not None and self._event.get(run.run_id) != tuple(last_event):
            self.progress(run, *last_event)
        self._done.add(run.run_id)
        self._last.pop(run.run_id, None)
        self._event.pop(run.run_id, None)


class ProgressThrottle:
    """In a worker: passes a run's progress events to ``send``, the first of each phase and the last
    of a phase's count at once, the others at most every ``every`` seconds (the latest then)."""

    def __init__(self, send: Callable[[str, int, int], None], every: float) -> None:
        self.send, self.every = send, every
        self._phase: str | None = None
        self._last = -math.inf
        self.sent: tuple[str, int, int] | None = None  # the last event sent

    def __call__(self, phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != self._phase or done >= total or now - self._last >= self.every:
            self._phase, self._last = phase, now
            self.sent = (phase, done, total)
            self.send(phase, done, total)


class StepBatcher:
    """In a worker: collects a run's (step, loss) pairs and hands them to ``send`` as one list at most
    every ``every`` seconds (the first step at once), so progress costs a bounded message rate."""

    def __init__(self, send: Callable[[list[tuple[int, float]]], None], every: float) -> None:
        self.send, self.every = send, every
        self._batch: list[tuple[int, float]] = []
        self._last = -math.inf

    def __call__(self, step: int, loss: float) -> None:
        self._batch.append((step, loss))
        now = time.monotonic()
        if now - self._last >= self.every:
            self._last = now
            self.flush()

    def flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.send(batch)


class Executor:
    """Base of every executor: ``submit`` runs, iterate ``results``; ``map`` is both at once.
    ``workers`` says how many runs are in flight at once and ``gpu`` whether they train on GPUs (the
    progress display's ETA uses both); ``cancel`` drops every run not yet yielded (an interrupt
    between ``submit`` and ``results``). ``on_this_machine``: the study hands it a run when a worker is
    free and counts how many runs share the device (not for a cluster's executor, which gets them all)."""

    workers: int = 1
    gpu: bool = False
    packing = None  # the Packing that chose how many runs at once (``--workers auto`` on a GPU), else None
    on_this_machine = (
        True  # a submitted run starts at once on a free worker here (the driver's count is true)
    )

    def submit(self, run: PlannedRun) -> None:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError

    def results(
        self, on_step: StepCallback | None = None, on_progress: ProgressCallback | None = None
    ) -> Iterator[tuple[PlannedRun, RunResult]]:
        raise NotImplementedError

    def map(
        self,
        runs: Iterable[PlannedRun],
        on_step: StepCallback | None = None,
        on_progress: ProgressCallback | None = None,
    ) -> Iterator[tuple[PlannedRun, RunResult]]:
        for run in runs:
            self.submit(run)
        return self.results(on_step, on_progress)


class LocalExecutor(Executor):
    """Runs one after another in this process, lazily: a run starts when its result is asked for, so
    an interrupted study has at most one run in flight. Uses ``threads`` torch threads while it runs
    (default 1, see :func:`plan_workers`) and restores the previous setting after."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = plan_workers(1, threads)[1]
        self.gpu = cuda_available()
        self._queue: list[PlannedRun] = []

    def submit(self, run: PlannedRun) -> None:
        self._queue.append(run)

    def cancel(self) -> None:
        self._queue.clear()

    def results(self, on_step=None, on_progress=None):
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        relay = StepRelay(on_step, on_progress)
        try:
            while self._queue:
                run = self._queue.pop(0)
                progress = functools.partial(relay.progress, run) if on_progress is not None else None
                result = execute(
                    run.config.to_dict(),
                    lambda step, loss, run=run: relay.deliver(run, [(step, loss)]),
                    progress,
                )
                relay.complete(run, result)
                yield run, result
        finally:
            torch.set_num_threads(before)


# --- the process pool: each worker sets its threads once and reports progress through a queue --------
_progress: mp.Queue | None = None
BREAKS_ALLOWED = 2  # a run in flight when a worker dies is tried again once in a new pool, then failed
PROGRESS_EVERY = 0.5  # seconds between a worker's progress messages


def _init_worker(threads: int, progress: mp.Queue | None, parent: int | None = None) -> None:
    global _progress
    die_with_parent()
    torch.set_num_threads(threads)
    _progress = progress
    threading.Thread(target=_exit_with_parent, args=(parent or os.getppid(),), daemon=True).start()


def _exit_with_parent(parent: int) -> None:
    """A worker whose driver died (even by ``kill -9``, even while the worker was still starting: the
    driver's pid is passed in, so a worker already reparented exits at once) exits instead of
    lingering as an orphan holding the output pipe."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


def _execute_in_worker(config: dict, run_id: str) -> tuple[RunResult, tuple | None]:
    """One run in a pool worker; its steps and progress go to the driver through the queue, as
    ``(run_id, "steps", [(step, loss), ...])`` and ``(run_id, "progress", (phase, done, total))``.
    Returns the result and the last progress event sent (the queue may deliver it after the result:
    the driver passes it on then, see :meth:`StepRelay.complete`)."""

    def put(kind: str, payload) -> None:
        if _progress is not None:
            _progress.put((run_id, kind, payload))

    batcher = StepBatcher(lambda steps: put("steps", steps), PROGRESS_EVERY)
    throttle = ProgressThrottle(lambda *event: put("progress", event), PROGRESS_EVERY)
    result = execute(config, batcher, throttle)
    batcher.flush()
    return result, throttle.sent


class ProcessExecutor(Executor):
    """A pool of ``workers`` spawned processes with ``threads`` torch threads each (default 1). Per-step
    losses travel back through a queue in batches, at most two a second per run."""

    def __init__(self, workers: int, threads: int | None = None) -> None:
        self.workers, self.threads = plan_workers(workers, threads)
        self.gpu = cuda_available()
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
                initargs=(self.threads, self._queue, os.getpid()),
            )
        self._futures[self._pool.submit(_execute_in_worker, run.config.to_dict(), run.run_id)] = run

    @staticmethod
    def _outcome(future: cf.Future) -> tuple[RunResult, tuple | None]:
        """The run's result and its last progress event (none for a worker that died)."""
        try:
            return future.result()
        except Exception as err:  # noqa: BLE001 - a worker that died (out of memory, killed)
            return RunResult(status=FAILED, error=f"worker died: {type(err).__name__}: {err}"), None

    def _broken(self, breaks: dict[str, int]) -> set[cf.Future]:
        """A worker died and broke the pool, failing every run the pool held. Shut it down; the runs that
        finished before are returned as done; the others are resubmitted to a new pool, unless a run
        already broke ``BREAKS_ALLOWED - 1`` pools (the likely culprit): that one is returned failed."""
        old, self._pool = self._pool, None
        if old is not None:
            old.shutdown(wait=True, cancel_futures=True)
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        finished = set()
        for future, run in list(self._futures.items()):
            if future.done() and not future.cancelled() and future.exception() is None:
                finished.add(future)
                continue
            breaks[run.run_id] = breaks.get(run.run_id, 0) + 1
            if breaks[run.run_id] >= BREAKS_ALLOWED:
                finished.add(future)
                continue
            del self._futures[future]
            self.submit(run)
        return finished

    def _drain(self, relay: StepRelay) -> None:
        by_id = {run.run_id: run for run in self._futures.values()}
        while self._queue is not None:
            try:
                run_id, kind, payload = self._queue.get_nowait()
            except queue.Empty:
                return
            if run_id in by_id:
                if kind == "steps":
                    relay.deliver(by_id[run_id], payload)
                else:
                    relay.progress(by_id[run_id], *payload)

    def results(self, on_step=None, on_progress=None):
        relay = StepRelay(on_step, on_progress)
        try:
            breaks: dict[str, int] = {}
            while self._futures:
                done, _ = cf.wait(set(self._futures), timeout=0.25, return_when=cf.FIRST_COMPLETED)
                self._drain(relay)
                if any(isinstance(f.exception(), BrokenProcessPool) for f in done if not f.cancelled()):
                    done = self._broken(breaks)  # every run of the pool is back: done, or to retry
                for future in done:
                    run = self._futures.pop(future)
                    result, last_event = self._outcome(future)
                    relay.complete(run, result, last_event)
                    yield run, result
        except BaseException:  # interrupted (Ctrl-C) or abandoned: the runs in flight are not waited for
            self.close(kill=True)
            raise
        finally:
            self.close()

    def cancel(self) -> None:
        self.close(kill=True)

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
    workers: int | str = "auto", threads: int | None = None, runs: int | None = None, nproc: int = 1
) -> Executor:
    """The executor for :func:`plan_workers`' choice: in-process for one worker, else a process pool."""
    workers, threads = plan_workers(workers, threads, runs, nproc)
    return LocalExecutor(threads) if workers == 1 else ProcessExecutor(workers, threads)
