"""Drive a study: expand the spec, skip what the store already has, run the rest, write, report."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .executors import Executor, make_executor
from .spec import PlannedRun, StudySpec
from .store import Store


def _cost(run: PlannedRun) -> float:
    c = run.config
    return c.steps * c.n_layers * c.batch_size * c.seq_len * (2 if c.task != "lm" else 1)


def _fmt_time(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Progress:
    """Runs done / total, the current run, its loss, and an ETA from the work done so far. Redraws one
    line on a terminal; otherwise prints a line per finished run and one every ``PLAIN_EVERY`` s."""

    PLAIN_EVERY = 10.0

    def __init__(self, total: int, remaining_cost: float, stream=None, enabled: bool = True) -> None:
        self.stream = stream or sys.stderr
        self.tty = enabled and self.stream.isatty()
        self.enabled = enabled
        self.total, self.done = total, 0
        self.remaining, self.spent = remaining_cost, 0.0
        self.start = time.perf_counter()
        self._last = 0.0

    def eta(self, partial: float = 0.0) -> str:
        elapsed = time.perf_counter() - self.start
        work = self.spent + partial
        if work <= 0 or elapsed < 5.0:  # too early for a rate worth showing
            return "?"
        return _fmt_time(elapsed / work * max(self.remaining - partial, 0.0))

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        """The current run's step and loss: redrawn 4 times a second on a terminal, a plain line every
        ``PLAIN_EVERY`` seconds otherwise (logs, CI)."""
        now = time.perf_counter()
        if not self.enabled or now - self._last < (0.25 if self.tty else self.PLAIN_EVERY):
            return
        self._last = now
        partial = _cost(run) * (step + 1) / run.config.steps
        line = (
            f"[{self.done}/{self.total}] {run.experiment}: {run.label} | step {step + 1}/{run.config.steps} "
            f"loss {loss:.3f} | ETA {self.eta(partial)}"
        )
        self.stream.write("\r\033[K" + line[:160] if self.tty else line + "\n")
        self.stream.flush()

    def finished(self, run: PlannedRun, status: str, detail: str) -> None:
        self.done += 1
        self.spent += _cost(run)
        self.remaining -= _cost(run)
        if not self.enabled:
            return
        prefix = "\r\033[K" if self.tty else ""
        self.stream.write(
            f"{prefix}[{self.done}/{self.total}] {run.experiment}: {run.label} -> {status} "
            f"{detail} | ETA {self.eta()}\n"
        )
        self.stream.flush()


@dataclass
class StudyOutcome:
    out_dir: Path
    total: int
    skipped: int
    ran: int
    report: Path | None


def run_study(
    spec: StudySpec,
    out_dir: str | Path,
    *,
    workers: int = 1,
    executor: Executor | None = None,
    progress: bool = True,
    report: bool = True,
) -> StudyOutcome:
    """Run every run of ``spec`` not yet in ``out_dir/study.sqlite``, then write ``out_dir/report.html``."""
    out = Path(out_dir)
    planned = spec.expand()
    members = spec.memberships()
    with Store(out / "study.sqlite") as store:
        store.save_study(spec.name, spec.to_dict())
        done = store.finished_ids()
        todo = [r for r in planned if r.run_id not in done]
        bar = Progress(len(planned), sum(map(_cost, todo)), enabled=progress)
        bar.done = len(planned) - len(todo)
        if progress:
            print(
                f"study {spec.name!r}: {len(planned)} runs, {bar.done} already in {out / 'study.sqlite'}, "
                f"{len(todo)} to run",
                file=sys.stderr,
            )
        executor = executor or make_executor(workers)
        for run, result in executor.map(todo, on_step=bar.step if progress else None):
            started = time.time() - result.wall_s
            store.save_run(spec.name, run.run_id, members[run.run_id], run.config.to_dict(), result, started)
            final = result.final.get("val_loss")
            detail = (
                f"val loss {final:.3f}"
                if final is not None
                else f"at step {result.diverged_step}"
                if result.diverged_step is not None
                else (result.error or "")
            )
            bar.finished(run, result.status, f"{detail} ({_fmt_time(result.wall_s)})")
    path = None
    if report:
        from .report import build_report

        path = build_report(out)
    return StudyOutcome(out, len(planned), len(planned) - len(todo), len(todo), path)
