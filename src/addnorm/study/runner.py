"""Drive a study: expand the spec, record its plan, skip what the store already has, run the rest,
write each result as it arrives, report."""

from __future__ import annotations

import contextlib
import pickle
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from ..train import FAILED, RunResult
from .budget import (
    EVAL_BATCH_COST,
    POOL_START_S,
    Budget,
    BudgetTooSmall,
    Estimator,
    Timing,
    estimate_seconds,
    fmt_time,
    report_reserve,
    run_work,
    window,
)
from .executors import Executor, LocalExecutor, ProcessExecutor, make_executor, max_nproc
from .limits import check_eval, check_plan
from .lock import folder_lock
from .report import build_report
from .resume import check_resumable, timings
from .spec import PlannedRun, StudySpec
from .store import FINISHED, Store, stored_runs, write_atomic
from .trackers import Tracker, TrackerGroup


def fmt_rate(tokens_per_s: float | None) -> str:
    if not tokens_per_s:
        return ""
    for scale, unit in ((1e6, "M"), (1e3, "k")):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit} tokens/s"
    return f"{tokens_per_s:.0f} tokens/s"


def describe(result: RunResult) -> str:
    """One line for a finished run: its held-out loss (and throughput), where it diverged, or its error."""
    final = result.final.get("val_loss")
    if final is not None:
        rate = fmt_rate(result.tokens_per_s)
        return f"val loss {final:.3f}" + (f", {rate}" if rate else "")
    if result.diverged_step is not None:
        return f"diverged at step {result.diverged_step}"
    return result.error or ""


@dataclass
class _InFlight:
    """What the display knows of a run in flight (its progress events so far)."""

    started: float
    steps: int = 0  # completed training steps
    evaluated: int = 0  # held-out batches done, over the whole run
    eval_total: int = 0  # held-out batches the run makes in all
    phase: str = "build"  # build, train or eval
    loss: float | None = None

    def work(self) -> float:
        return self.steps + EVAL_BATCH_COST * self.evaluated


class StudyProgress:
    """What is running, how far, and an ETA. On a terminal: a ``rich`` display (width-aware, redrawn in
    place) with one bar for the study and one per run in flight (from the moment its model is being
    built; evaluation batches move it too), and a printed line per finished run. Elsewhere (logs, CI):
    a line per finished run, and every ``PLAIN_EVERY`` seconds while runs are in flight a line saying
    what each does (building its model, its step, or its evaluation batch) from a timer thread, so a
    run whose one step or evaluation takes minutes is visible too.

    The ETA counts a run's work as its steps and its held-out batches (:func:`run_work`), from the cost
    model until a run has finished (or ``MEASURED_AFTER`` seconds have passed), then from the measured
    rate. It only observes: the executor's callbacks (``step``, ``progress``) feed it, in the driver."""

    PLAIN_EVERY = 5.0  # seconds between the plain display's lines on the runs in flight
    MEASURED_AFTER = 30.0  # seconds of a study before the ETA trusts its in-flight runs' pace

    def __init__(
        self,
        total: int,
        done: int,
        todo: list[PlannedRun],
        stream: TextIO | None = None,
        enabled: bool = True,
        workers: int = 1,
        gpu: bool = False,
    ) -> None:
        self.stream = stream or sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.total, self.done, self.workers = total, done, max(1, workers)
        self.cost = {run.run_id: estimate_seconds(run.config, gpu) for run in todo}
        self.remaining = sum(self.cost.values())
        self.spent = 0.0
        self.flight: dict[str, tuple[PlannedRun, _InFlight]] = {}
        self.start = time.perf_counter()
        self._lock = threading.RLock()
        self._last = time.perf_counter()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        self._bars: dict[str, TaskID] = {}
        self._live: Progress | None = None
        if self.tty:
            self.console = Console(file=self.stream)
            self._live = Progress(
                TextColumn(
                    "{task.description}", table_column=Column(ratio=3, no_wrap=True, overflow="ellipsis")
                ),
                BarColumn(table_column=Column(ratio=1)),
                TextColumn("{task.fields[note]}", table_column=Column(no_wrap=True)),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=self.console,
                expand=True,
            )
            self._study = self._live.add_task(self._title(), total=self.remaining or 1.0, note="")
            self._live.start()
        elif enabled:
            self._ticker = threading.Thread(target=self._tick, name="addnorm-progress", daemon=True)
            self._ticker.start()

    def _title(self) -> str:
        return f"[{self.done}/{self.total}] runs"

    def _partial(self) -> float:
        """Estimated seconds of work done in the runs in flight."""
        return sum(
            self.cost.get(run.run_id, 0.0) * min(state.work() / run_work(run.config), 1.0)
            for run, state in self.flight.values()
        )

    def eta(self) -> str:
        """Time left: the cost model's estimate shared over the workers until a run has finished (or
        :data:`MEASURED_AFTER` seconds have passed with work done), then the measured rate of work so
        far (steps and held-out batches, finished runs and those in flight) applied to the work left."""
        with self._lock:
            elapsed = time.perf_counter() - self.start
            partial = self._partial()
            left = max(self.remaining - partial, 0.0)
            measured = self.spent > 0 or (partial > 0 and elapsed >= self.MEASURED_AFTER)
            if not measured:  # the model's guess
                return "~" + fmt_time(left / self.workers)
            return fmt_time(elapsed / (self.spent + partial) * left)

    def _state(self, run: PlannedRun) -> _InFlight:
        if run.run_id not in self.flight:
            self.flight[run.run_id] = (run, _InFlight(time.perf_counter()))
        return self.flight[run.run_id][1]

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        with self._lock:
            state = self._state(run)
            state.steps, state.loss, state.phase = step + 1, loss, "train"
            self._show(run, state)

    def progress(self, run: PlannedRun, phase: str, done: int, total: int) -> None:
        """A run's progress between steps: building its model, or held-out batch ``done`` of ``total``."""
        with self._lock:
            state = self._state(run)
            state.phase = phase
            if phase == "eval":
                state.evaluated, state.eval_total = done, total
            self._show(run, state)

    def _note(self, run: PlannedRun, state: _InFlight) -> str:
        if state.phase == "build":
            return "building the model"
        if state.phase == "eval":
            return f"evaluating {state.evaluated:,}/{state.eval_total:,}"
        return f"step {state.steps}/{run.config.steps} loss {state.loss:.3f}"

    def _show(self, run: PlannedRun, state: _InFlight) -> None:
        if self._live is None:
            return
        if run.run_id not in self._bars:
            label = f"  {run.experiment}: {run.label}"
            self._bars[run.run_id] = self._live.add_task(label, total=run_work(run.config), note="")
        self._live.update(self._bars[run.run_id], completed=state.work(), note=self._note(run, state))
        self._live.update(self._study, completed=self.spent + self._partial())

    def _tick(self) -> None:
        """The plain display's timer: a line on what the runs in flight do, every PLAIN_EVERY seconds
        without other output."""
        while not self._stop.wait(min(self.PLAIN_EVERY, 1.0)):
            with self._lock:
                if not self.flight or time.perf_counter() - self._last < self.PLAIN_EVERY:
                    continue
                now = time.perf_counter()
                doing = "; ".join(
                    f"{run.experiment}: {run.label} | {self._note(run, state)}, "
                    + fmt_time(now - state.started)
                    for run, state in self.flight.values()
                )
                self._line(f"[{self.done}/{self.total}] {doing} | ETA {self.eta()}")

    def finished(self, run: PlannedRun, result: RunResult) -> None:
        with self._lock:
            self.done += 1
            self.flight.pop(run.run_id, None)
            cost = self.cost.get(run.run_id, 0.0)
            self.spent += cost
            self.remaining -= cost
            if not self.enabled:
                return
            head = f"[{self.done}/{self.total}] {run.experiment}: {run.label}"
            tail = f" -> {result.status} {describe(result)} ({fmt_time(result.wall_s)})"
            if self._live is not None:
                if run.run_id in self._bars:
                    self._live.remove_task(self._bars.pop(run.run_id))
                self._live.update(self._study, completed=self.spent, description=self._title())
                room = self.console.width - len(tail)  # the label gives way, the outcome stays readable
                if len(head) > room:
                    head = head[: max(room - 1, 8)] + "…"
                line = Text(head + tail)
                line.truncate(self.console.width, overflow="ellipsis")
                self.console.print(line, highlight=False, no_wrap=True)
            else:
                self._line(f"{head}{tail} | ETA {self.eta()}")

    def _line(self, text: str) -> None:
        self._last = time.perf_counter()
        self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
            self._ticker = None
        if self._live is not None:
            self._live.stop()
            self._live = None


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


def estimator_for(stored: list[dict], gpu: bool) -> Estimator:
    """The run-time estimates of this machine (its device: the GPU's name where runs train on one, else
    the CPU model) from the runs ``stored`` (``Store.measurements``) measured on it."""
    from ..train.device import device_name

    return Estimator(device_name(), gpu, timings(stored))


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
    cheapest = min(todo, key=lambda r: estimator.seconds(r.config))
    need = estimator.seconds(cheapest.config) + _first_cost(executor, 0)
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
    executor = executor or make_executor(workers, threads, runs=len(todo), nproc=max_nproc(todo))
    if isinstance(executor, (LocalExecutor, ProcessExecutor)):
        check_plan(todo, executor.workers, executor.gpu, memory_limit)
    else:
        check_eval(todo)
    if budget is not None:
        check_budget(todo, estimator_for(stored, executor.gpu), budget, len(plan.runs), executor)
    return executor


class _Window:
    """Starts the runs of a study on ``executor``: all at once without a budget; with one, each when a
    worker is free and its estimate (plus a new worker's start-up) ends inside what is left of the budget
    after the report's reserve, the first such run in the spec's order (the others wait for the next
    invocation). Finished runs refine the estimates (:meth:`finished`)."""

    def __init__(
        self, executor: Executor, todo: list[PlannedRun], budget: Budget | None, estimator, planned: int
    ):
        self.executor, self.queue, self.budget, self.estimator = executor, list(todo), budget, estimator
        self.todo = list(todo)
        self.reserve = report_reserve(planned)
        self.started = self.in_flight = 0

    def fill(self) -> None:
        """Start what may start now."""
        if self.budget is None:
            for run in self.queue:
                self.executor.submit(run)
            self.started += len(self.queue)
            self.queue.clear()
            return
        while self.in_flight < self.executor.workers:
            room = self.budget.left() - self.reserve - _first_cost(self.executor, self.started)
            run = next((r for r in self.queue if self.estimator.seconds(r.config) <= room), None)
            if run is None:
                return
            self.queue.remove(run)
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
        free = max(self.executor.workers - self.in_flight, 1)
        later, _ = window(self.queue, lambda r: self.estimator.seconds(r.config), room, free, start)
        return [r for r in self.todo if r not in self.queue or r in later]

    def finished(self, run: PlannedRun, result: RunResult, provenance: dict) -> None:
        self.in_flight -= 1
        if self.estimator is not None:
            done = result.status == "done" and result.steps_done == run.config.steps
            device = str((provenance or {}).get("device") or "")
            self.estimator.add(Timing(run.config.to_dict(), device, result.wall_s, done))


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
    devices in one table (by default one table per device)."""
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
        estimator = estimator_for(store.measurements(), executor.gpu) if budget is not None else None
        if progress:
            notes = [f"{len(planned) - len(todo)} already stored", f"{len(todo)} to run"]
            if retried:
                notes.append(f"{retried} failed before and tried again")
            if stale:
                notes.append(f"{stale} stored runs not part of this spec (--prune deletes them)")
            if pruned:
                notes.append(f"{pruned} stale runs pruned")
            stream.write(f"study {spec.name!r}: {len(planned)} runs ({', '.join(notes)}) in {out}\n")
            if estimator is not None:
                stream.write(
                    f"budget {fmt_time(budget.seconds)} ({fmt_time(budget.left())} left): a run starts when "
                    f"its estimate fits ({estimator.source()})\n"
                )
        tracking = TrackerGroup(trackers or [], stream)
        tracking.open(out, spec.name, store)
        bar = None
        failed = []
        starter = _Window(executor, todo, budget, estimator, len(planned))
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
                workers=executor.workers,
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
                        row = (spec.name, run.run_id, members[run.run_id], run.config.to_dict(), result)
                        _save(store, out, *row, time.time() - result.wall_s)
                        bar.finished(run, result)
                        if tracking.trackers:
                            tracking.log_run(store.run_record(run.run_id))
                        if result.status == FAILED:
                            failed.append(f"{run.experiment}: {run.label} ({result.error})")
                        starter.finished(run, result, result.provenance)
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
