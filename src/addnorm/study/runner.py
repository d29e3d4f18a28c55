"""Drive a study: expand the spec, record its plan, skip what the store already has, run the rest,
write each result as it arrives, report."""

from __future__ import annotations

import contextlib
import pickle
import sqlite3
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..train import FAILED, RunResult
from .cost_model import (
    POOL_START_S,
    Budget,
    BudgetTooSmall,
    Estimator,
    Timing,
    fmt_time,
    report_reserve,
    window,
)
from .executors import (
    Executor,
    LocalExecutor,
    ProcessExecutor,
    cuda_available,
    make_executor,
    max_nproc,
    usable_cores,
)
from .limits import check_eval, check_plan
from .lock import folder_lock
from .packing import Packing, Sharing, choose, memory_need
from .progress import StudyProgress
from .report import build_report
from .resume import check_resumable, timings
from .spec import PlannedRun, StudySpec
from .store import FINISHED, Store, stored_runs, write_atomic
from .trackers import Tracker, TrackerGroup


@dataclass
class StudyOutcome:
    out_dir: Path
    total: int
    skipped: int
    ran: int
    failed: list[str] = field(default_factory=list)  # "experiment: label (error)" of the failed runs
    stale: int = 0  # stored runs that are not part of this spec
    pruned: int = 0
    report: Path | None = None
    left: int = 0  # runs not started because the budget had no room for them (the next invocation's)
    stored: int = 0  # the plan's runs with a stored result once this invocation is over


UNSAVED = "unsaved"  # <out>/unsaved/<run id>.pkl: a finished run whose save to the database failed


def _save(store: Store, out: Path, *row) -> None:
    """Store a finished run; when the database write fails (full disk, locked or corrupt database),
    keep the run in a side file that the next study on the folder stores first, then re-raise."""
    try:
        store.save_run(*row)
    except (OSError, sqlite3.Error):
        try:
            (out / UNSAVED).mkdir(exist_ok=True)
            write_atomic(out / UNSAVED / f"{row[1]}.pkl", pickle.dumps(row))  # whole, or not there
        except OSError:
            pass  # nowhere to keep it: the run is trained again on the next resume
        raise


def _store_unsaved(store: Store, out: Path, stream: TextIO) -> None:
    """Store the runs a previous study kept in side files (see :func:`_save`), then drop the files. A
    side file that cannot be read (not written whole by an older version) is dropped with a warning:
    its run is trained again."""
    for path in sorted((out / UNSAVED).glob("*.pkl")):
        try:
            row = pickle.loads(path.read_bytes())  # noqa: S301 - written by this module
        except (EOFError, pickle.UnpicklingError, ValueError, TypeError, AttributeError) as err:
            stream.write(f"warning: {path} cannot be read ({type(err).__name__}); its run is trained again\n")
        else:
            store.save_run(*row)
        path.unlink()


def estimator_for(stored: list[dict], gpu: bool, packed: int = 1) -> Estimator:
    """The run-time estimates of this machine (its device: the GPU's name where runs train on one, else
    the CPU model) from the runs ``stored`` (``Store.measurements``) measured on it, for ``packed`` runs
    at once (a GPU is one device they share; on the CPU each has a core of its own)."""
    from ..train.device import device_name

    return Estimator(device_name(), gpu, timings(stored), packed, slots=1 if gpu else usable_cores())


def pack_this_gpu(todo: list[PlannedRun], stored: list[dict], budget: Budget | None, planned: int) -> Packing:
    """``--workers auto`` on a CUDA machine: how many of the runs ``todo`` train at once on its GPU
    (:func:`~.packing.choose`: its free memory, this host's cores less one, the budget, the gain measured
    in ``stored``)."""
    import torch

    room = budget.left() - report_reserve(planned) if budget is not None else None
    return choose(
        todo,
        estimator_for(stored, gpu=True),
        free_bytes=torch.cuda.mem_get_info()[0],
        cores=max(1, usable_cores() - 1),
        room=room,
        start_s=POOL_START_S,
    )


def _first_cost(executor: Executor, started: int) -> float:
    """A run's start-up beyond its own time: a new worker process of a pool (spawn and imports)."""
    return POOL_START_S if isinstance(executor, ProcessExecutor) and started < executor.workers else 0.0


def check_budget(
    todo: list[PlannedRun], estimator: Estimator, budget: Budget, planned: int, executor
) -> None:
    """Refuse a ``budget`` in which not even the cheapest of the runs ``todo`` fits (after the report's
    reserve, :func:`~.budget.report_reserve`): :class:`~.budget.BudgetTooSmall`, nothing started."""
    if not todo:
        return
    room = budget.left() - report_reserve(planned)
    cheapest = min(todo, key=lambda r: estimator.needs(r.config))
    need = estimator.needs(cheapest.config) + _first_cost(executor, 0)
    if need > room:
        raise BudgetTooSmall(
            f"--budget: {fmt_time(budget.seconds)} leaves {fmt_time(max(room, 0))} for runs after the "
            f"report's {fmt_time(report_reserve(planned))}; the cheapest of the {len(todo)} runs left "
            f"needs about {fmt_time(need)} ({estimator.source(cheapest.config)}); nothing was started"
        )


def prepare(
    spec: StudySpec,
    out_dir: str | Path,
    workers: int | str = "auto",
    threads: int | None = None,
    executor: Executor | None = None,
    memory_limit: str | None = None,
    budget: Budget | None = None,
) -> Executor:
    """The study's executor (``executor``, or one for ``workers`` x ``threads``), once the runs still to
    train (as far as a read-only look at ``out_dir``'s database tells) are checked against what this
    machine can run (:mod:`.limits`; a cluster's nodes are not known here: evaluation only), the database
    against this spec and version (:func:`~.resume.check_resumable`) and, with a ``budget``, the budget
    against the cheapest run left (:func:`check_budget`). Raises a one-line ``ValueError``
    (:class:`~addnorm.study.spec.SpecError`, :class:`~.resume.NotResumable`,
    :class:`~.budget.BudgetTooSmall`) without touching the folder. :func:`run_study` calls it."""
    db = Path(out_dir) / "study.sqlite"
    stored = stored_runs(db)
    plan = spec.resolved()
    check_resumable(stored, plan, db)
    finished = {row["id"] for row in stored if row["status"] in FINISHED}
    todo = [r for r in plan.runs if r.run_id not in finished]
    if (
        budget is not None
        and executor is not None
        and not isinstance(executor, (LocalExecutor, ProcessExecutor))
    ):
        raise ValueError(
            "--budget: only with the local executor (it starts each run when the last one's time is known)"
        )
    if executor is None:
        packing = None
        if workers == "auto" and todo and max_nproc(todo) == 1 and cuda_available():
            packing = pack_this_gpu(todo, stored, budget, len(plan.runs))
            workers = packing.most  # a pool that may grow to this; packing.k runs at once to start with
        executor = make_executor(workers, threads, runs=len(todo), nproc=max_nproc(todo))
        executor.packing = packing
    at_once = executor.packing.k if executor.packing is not None else executor.workers
    if isinstance(executor, (LocalExecutor, ProcessExecutor)):
        need = None
        if executor.gpu:
            measured = estimator_for(stored, gpu=True)
            need = lambda config: memory_need(config, measured)  # noqa: E731
        check_plan(todo, at_once, executor.gpu, memory_limit, need)
    else:
        check_eval(todo)
    if budget is not None:
        estimator = estimator_for(stored, executor.gpu, at_once)
        check_budget(todo, estimator, budget, len(plan.runs), executor)
    return executor


class _Window:
    """Starts the runs of a study on ``executor``, in the spec's order. On this machine's executors
    (in-process, a pool) a run starts when one of ``target`` slots is free (the executor's workers, or
    the packing's runs at once on a GPU), so the runs in flight are the runs training and
    :class:`~.packing.Sharing` counts how many shared the device while each ran (``packed`` in its
    provenance, :meth:`finished`); a cluster's executor gets them all at once. With a budget a run starts
    only if what its estimate needs at ``target`` at once (plus a new worker's start-up) ends inside what
    is left of the budget after the report's reserve: the first such run (the others wait for the next
    invocation). Finished runs refine the estimates; with a packing, each chooses the runs at once again
    (:meth:`~.packing.Packing.again`: the peaks and the gain measured since), up to the pool's size,
    and ``say`` gets its line when it changes."""

    def __init__(
        self,
        executor: Executor,
        todo: list[PlannedRun],
        budget: Budget | None,
        estimator,
        planned: int,
        say=lambda line: None,
    ):
        self.executor, self.queue, self.budget, self.estimator = executor, list(todo), budget, estimator
        self.todo = list(todo)
        self.reserve = report_reserve(planned)
        self.started = self.in_flight = 0
        self.local = executor.on_this_machine
        self.sharing = Sharing(budget.clock if budget is not None else time.monotonic) if self.local else None
        self.packing: Packing | None = getattr(executor, "packing", None)
        self.target = self.packing.k if self.packing is not None else executor.workers  # runs at once
        self.say = say

    def fill(self) -> None:
        """Start what may start now."""
        if self.budget is None and not self.local:
            for run in self.queue:
                self.executor.submit(run)
            self.started += len(self.queue)
            self.queue.clear()
            return
        while self.queue and self.in_flight < self.target:
            if self.budget is None:
                run = self.queue[0]
            else:
                room = self.budget.left() - self.reserve - _first_cost(self.executor, self.started)
                run = next(
                    (r for r in self.queue if self.estimator.needs(r.config, self.target) <= room), None
                )
                if run is None:
                    return
            self.queue.remove(run)
            if self.sharing is not None:
                self.sharing.start(run.run_id)
            self.executor.submit(run)
            self.started += 1
            self.in_flight += 1

    def expected(self) -> list[PlannedRun]:
        """The runs started and those the budget is expected to start (:func:`~.budget.window`, from
        now): what the progress display's ETA counts."""
        if self.budget is None:
            return list(self.todo)
        room = self.budget.left() - self.reserve
        start = POOL_START_S if isinstance(self.executor, ProcessExecutor) else 0.0
        free = max(self.target - self.in_flight, 1)
        later, _ = window(
            self.queue, lambda r: self.estimator.needs(r.config, self.target), room, free, start
        )
        return [r for r in self.todo if r not in self.queue or r in later]

    def finished(self, run: PlannedRun, result: RunResult) -> None:
        """A run came back: how many runs shared the device while it ran goes into its provenance
        (``packed``), and its time into the estimates."""
        self.in_flight -= 1
        if self.sharing is not None:
            result.provenance["packed"] = self.sharing.finish(run.run_id)
        if self.estimator is not None:
            done = result.status == "done" and result.steps_done == run.config.steps
            prov = result.provenance or {}
            self.estimator.add(
                Timing(
                    run.config.to_dict(),
                    str(prov.get("device") or ""),
                    result.wall_s,
                    done,
                    packed=float(prov.get("packed") or 1.0),
                    tokens_per_s=result.tokens_per_s,
                    peak_memory=prov.get("peak_memory"),
                )
            )
        if self.packing is not None and self.estimator is not None and self.queue:
            room = self.budget.left() - self.reserve if self.budget is not None else None
            again = self.packing.again(self.queue, self.estimator, room, self.in_flight)
            if min(again.k, self.executor.workers) != self.target:
                self.target = min(again.k, self.executor.workers)
                self.say(again.line())


def run_study(
    spec: StudySpec,
    out_dir: str | Path,
    *,
    workers: int | str = "auto",
    threads: int | None = None,
    executor: Executor | None = None,
    progress: bool = True,
    report: bool = True,
    prune: bool = False,
    stream: TextIO | None = None,
    trackers: list[Tracker] | None = None,
    memory_limit: str | None = None,
    budget: Budget | None = None,
    mix_devices: bool = False,
) -> StudyOutcome:
    """Run every run of ``spec`` that ``out_dir/study.sqlite`` has no result for (failed runs are tried
    again), then write ``out_dir/report.html``. The report and findings cover exactly this spec's runs;
    other stored runs are counted (``stale``) and deleted with ``prune=True``. ``trackers`` log every
    run of the plan (stored ones they lack included); they only read, and one that fails is dropped
    with a warning while the study goes on. Before anything is written, runs this machine cannot hold
    are refused (:mod:`.limits`: ``memory_limit`` a size per run or ``off``, default by available
    memory and workers; and evaluations beyond the held-out data), and so is a database of another
    version or other settings (:mod:`.resume`). With a ``budget`` (:class:`~.budget.Budget`) a run
    starts only if its estimate fits in what is left of it; the others are counted in ``left`` for the
    next invocation. ``mix_devices``: the report ranks runs of one setting measured on different
    devices in one table (by default one table per device).

    Args:
        spec: the study (:func:`parse_spec`, :func:`load_spec`).
        out_dir: its folder: ``study.sqlite`` and ``report.html``.
        workers: processes running at once, or ``"auto"`` (1: in this process).
        threads: torch threads per worker (default 1).
        executor: where the runs execute (default: by ``workers``).
        progress: print each run's progress.
        report: write the report at the end.
        prune: delete stored runs that are not part of this spec.
        stream: where progress goes (default stderr).
        trackers: experiment trackers every run is logged to as well.
        memory_limit: a size per run, or ``"off"``.
        budget: a time budget: runs whose estimate does not fit are left for the next invocation.
        mix_devices: see above.

    Returns:
        What ran, what failed, what is left, and the report's path.
    """
    out = Path(out_dir)
    plan = spec.resolved()  # the spec's one expansion: the runs, the store's plan, the report's left-out runs
    planned, members = list(plan.runs), plan.memberships
    stream = stream or sys.stderr
    db = out / "study.sqlite"
    executor = prepare(spec, out, workers, threads, executor, memory_limit, budget)
    with folder_lock(out), Store(db) as store:
        _store_unsaved(store, out, stream)
        done = store.finished_ids()
        todo = [r for r in planned if r.run_id not in done]
        rows = [(run_id, exp, label) for run_id, pairs in members.items() for exp, label in pairs]
        store.save_plan(spec.name, spec.to_dict(), plan.base, rows, plan.not_applicable)
        pruned = store.prune() if prune else 0
        stale = len(store.stale_ids())
        retried = sum(1 for r in store.runs() if r["status"] == FAILED)
        estimator = None
        if budget is not None or executor.packing is not None:
            at_once = executor.packing.k if executor.packing is not None else executor.workers
            estimator = estimator_for(store.measurements(), executor.gpu, at_once)
        if executor.packing is not None:  # what --workers auto chose on a GPU: said even with --quiet
            stream.write(executor.packing.line() + "\n")
        if progress:
            notes = [f"{len(planned) - len(todo)} already stored", f"{len(todo)} to run"]
            if retried:
                notes.append(f"{retried} failed before and tried again")
            if stale:
                notes.append(f"{stale} stored runs not part of this spec (--prune deletes them)")
            if pruned:
                notes.append(f"{pruned} stale runs pruned")
            stream.write(f"study {spec.name!r}: {len(planned)} runs ({', '.join(notes)}) in {out}\n")
            if budget is not None:
                stream.write(
                    f"budget {fmt_time(budget.seconds)} ({fmt_time(budget.left())} left): a run starts when "
                    f"its estimate fits ({estimator.describe()})\n"
                )
        tracking = TrackerGroup(trackers or [], stream)
        tracking.open(out, spec.name, store)
        bar = None
        failed = []
        say = lambda line: (stream.write(line + "\n"), stream.flush())  # noqa: E731
        starter = _Window(executor, todo, budget, estimator, len(planned), say)
        try:
            try:
                starter.fill()  # an executor on a cluster connects here, and then knows its size
            except BaseException:
                executor.cancel()
                raise
            bar = StudyProgress(
                len(planned),
                len(planned) - len(todo),
                starter.expected(),
                stream=stream,
                enabled=progress,
                workers=starter.target,
                gpu=executor.gpu,
            )

            def on_step(run: PlannedRun, step: int, loss: float) -> None:
                bar.step(run, step, loss)
                tracking.step(run, step, loss)

            watched = progress or tracking.trackers
            steps = on_step if watched else None
            if starter.started:
                with contextlib.closing(
                    executor.results(steps, bar.progress if progress else None)
                ) as results:
                    for run, result in results:
                        starter.finished(run, result)
                        row = (spec.name, run.run_id, members[run.run_id], run.config.to_dict(), result)
                        _save(store, out, *row, time.time() - result.wall_s)
                        bar.finished(run, result)
                        if tracking.trackers:
                            tracking.log_run(store.run_record(run.run_id))
                        if result.status == FAILED:
                            failed.append(f"{run.experiment}: {run.label} ({result.error})")
                        starter.fill()
        finally:
            if bar is not None:
                bar.close()
            tracking.close()
        path = build_report(out, mix_devices=mix_devices) if report else None
        stored = len(store.finished_ids() & {r.run_id for r in planned})
    return StudyOutcome(
        out, len(planned), len(planned) - len(todo), starter.started, failed, stale, pruned, path,
        left=len(starter.queue), stored=stored,
    )  # fmt: skip
