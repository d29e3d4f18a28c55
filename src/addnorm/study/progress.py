"""The progress of a study as it runs: what is in flight, how far each run is, and an ETA; a line per
finished run. Observes only: the executor's callbacks feed it, in the driver (:func:`~.runner.run_study`)."""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Column
from rich.text import Text

from ..train import RunResult
from .cost_model import EVAL_BATCH_COST, estimate_seconds, fmt_time, run_work
from .spec import PlannedRun


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
