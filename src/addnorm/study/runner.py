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

from ..train import FAILED, RunConfig, RunResult
from ..train.loop import eval_batches_total
from .executors import Executor, LocalExecutor, ProcessExecutor, make_executor, max_nproc
from .limits import check_eval, check_plan
from .lock import folder_lock
from .report import build_report
from .spec import PlannedRun, StudySpec
from .store import Store, stored_finished, write_atomic
from .trackers import Tracker, TrackerGroup

# Seconds per run = steps x (per-layer host overhead x layers + training FLOPs / FLOP rate) plus
# evaluation; both constants fitted on a 2-core AMD EPYC with one torch thread per run (small models
# are dominated by per-op host time, which the first term carries). An estimate for --dry-run and the
# ETA's first guess, not a promise: the ETA corrects itself from measured run times.
HOST_S_PER_LAYER_STEP = 3.4e-3
FLOPS_PER_S = 5.7e10
# On a GPU the host queues kernels while the device computes, so a step takes the longer of the two.
# Neither constant is measured here (no GPU on the machines this was written on): the FLOP rate is an
# H100 SXM's dense bf16 peak (989 TFLOP/s) at 25% utilisation, about the best small models (d_model
# 512) reach; the host time assumes ~80 kernel launches per layer and step at ~5 us each.
GPU_FLOPS_PER_S = 2.5e14
GPU_HOST_S_PER_LAYER_STEP = 4e-4
GPU_START_S = 3.0  # per run: build the model, move it to the device, probe and evaluate
EVAL_BATCH_COST = 1 / 3  # a held-out batch (forward only) in training steps (forward and backward)


def run_flops(config: RunConfig) -> float:
    """Training FLOPs per step: 6 x tokens x (matmul weights per token) plus attention scores."""
    m = config.model
    tokens = config.batch_size * config.seq_len
    ffn = 3 if m.activation == "swiglu" else 2
    per_layer = 4 * m.d_model**2 + ffn * m.d_model * m.d_ff + 2 * config.seq_len * m.d_model
    layers = m.n_layers
    if config.task != "lm":  # encoder-decoder: encoder and decoder stacks, cross-attention
        layers = m.encoder_layers + m.decoder_layers * 1.5
    return 6.0 * tokens * (layers * per_layer + m.d_model * 256)


def estimate_seconds(config: RunConfig, gpu: bool = False) -> float:
    """Rough wall time of one run on one core (see :data:`FLOPS_PER_S`) or on one GPU (``gpu``, see
    :data:`GPU_FLOPS_PER_S`; a guess until measured on one)."""
    layers = (
        config.model.n_layers
        if config.task == "lm"
        else config.model.encoder_layers + config.model.decoder_layers
    )
    if gpu:
        per_step = max(GPU_HOST_S_PER_LAYER_STEP * layers, run_flops(config) / GPU_FLOPS_PER_S)
    else:
        per_step = HOST_S_PER_LAYER_STEP * layers + run_flops(config) / FLOPS_PER_S
    return per_step * run_work(config) + (GPU_START_S if gpu else 0.0)


def run_work(config: RunConfig) -> float:
    """A run's work in training steps: its steps, and its held-out batches (a forward pass each, at
    :data:`EVAL_BATCH_COST` of a step). The time estimate and the progress display both count it."""
    return config.steps + EVAL_BATCH_COST * eval_batches_total(config)


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


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


def prepare(
    spec: StudySpec,
    out_dir: str | Path,
    workers: int | str = "auto",
    threads: int | None = None,
    executor: Executor | None = None,
    memory_limit: str | None = None,
) -> Executor:
    """The study's executor (``executor``, or one for ``workers`` x ``threads``), once the runs still to
    train (as far as a read-only look at ``out_dir``'s database tells) are checked against what this
    machine can run (:mod:`.limits`; a cluster's nodes are not known here: evaluation only). Raises
    :class:`~addnorm.study.spec.SpecError` without touching the folder. :func:`run_study` calls it."""
    stored = stored_finished(Path(out_dir) / "study.sqlite")
    todo = [r for r in spec.resolved().runs if r.run_id not in stored]
    executor = executor or make_executor(workers, threads, runs=len(todo), nproc=max_nproc(todo))
    if isinstance(executor, (LocalExecutor, ProcessExecutor)):
        check_plan(todo, executor.workers, executor.gpu, memory_limit)
    else:
        check_eval(todo)
    return executor


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
) -> StudyOutcome:
    """Run every run of ``spec`` that ``out_dir/study.sqlite`` has no result for (failed runs are tried
    again), then write ``out_dir/report.html``. The report and findings cover exactly this spec's runs;
    other stored runs are counted (``stale``) and deleted with ``prune=True``. ``trackers`` log every
    run of the plan (stored ones they lack included); they only read, and one that fails is dropped
    with a warning while the study goes on. Before anything is written, runs this machine cannot hold
    are refused (:mod:`.limits`: ``memory_limit`` a size per run or ``off``, default by available
    memory and workers; and evaluations beyond the held-out data)."""
    out = Path(out_dir)
    plan = spec.resolved()  # the spec's one expansion: the runs, the store's plan, the report's left-out runs
    planned, members = list(plan.runs), plan.memberships
    stream = stream or sys.stderr
    db = out / "study.sqlite"
    executor = prepare(spec, out, workers, threads, executor, memory_limit)
    with folder_lock(out), Store(db) as store:
        _store_unsaved(store, out, stream)
        done = store.finished_ids()
        todo = [r for r in planned if r.run_id not in done]
        rows = [(run_id, exp, label) for run_id, pairs in members.items() for exp, label in pairs]
        store.save_plan(spec.name, spec.to_dict(), plan.base, rows, plan.not_applicable)
        pruned = store.prune() if prune else 0
        stale = len(store.stale_ids())
        retried = sum(1 for r in store.runs() if r["status"] == FAILED)
        if progress:
            notes = [f"{len(planned) - len(todo)} already stored", f"{len(todo)} to run"]
            if retried:
                notes.append(f"{retried} failed before and tried again")
            if stale:
                notes.append(f"{stale} stored runs not part of this spec (--prune deletes them)")
            if pruned:
                notes.append(f"{pruned} stale runs pruned")
            stream.write(f"study {spec.name!r}: {len(planned)} runs ({', '.join(notes)}) in {out}\n")
        tracking = TrackerGroup(trackers or [], stream)
        tracking.open(out, spec.name, store)
        bar = None
        failed = []
        try:
            try:
                for run in todo:  # an executor on a cluster connects here, and then knows its size
                    executor.submit(run)
            except BaseException:
                executor.cancel()
                raise
            bar = StudyProgress(
                len(planned),
                len(planned) - len(todo),
                todo,
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
            with contextlib.closing(executor.results(steps, bar.progress if progress else None)) as results:
                for run, result in results:
                    row = (spec.name, run.run_id, members[run.run_id], run.config.to_dict(), result)
                    _save(store, out, *row, time.time() - result.wall_s)
                    bar.finished(run, result)
                    if tracking.trackers:
                        tracking.log_run(store.run_record(run.run_id))
                    if result.status == FAILED:
                        failed.append(f"{run.experiment}: {run.label} ({result.error})")
        finally:
            if bar is not None:
                bar.close()
            tracking.close()
        path = build_report(out) if report else None
    return StudyOutcome(out, len(planned), len(planned) - len(todo), len(todo), failed, stale, pruned, path)
