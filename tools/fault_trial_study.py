"""The study every fault trial of ``tools/fault_trials.py`` runs (a spec of tiny runs), and what a trial reads
back from its folder: the runs stored, the database's signature (which must equal the uninterrupted
study's), the study's summary line, a whole report, and the resume that trains only the runs not stored."""

from __future__ import annotations

import re
import sqlite3
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tools.study_faults import ENV, check, study_cmd

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=30, batch_size=4, seq_len=16, eval_every=10)
RUNS = 6
SPEC = {"name": "faults", "base": TINY, "experiments": {"main": {"sweep": {"seed": list(range(RUNS))}}}}
OTHER = {"name": "other", "base": TINY, "experiments": {"side": {"sweep": {"seed": [10, 11, 12]}}}}


# --- helpers ---------------------------------------------------------------------------------------
def finished(db: Path) -> set[str]:
    """Run ids stored as done or diverged (read-only, while a study may be writing)."""
    if not db.is_file():
        return set()
    for _ in range(50):
        try:
            con = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True, timeout=5)
            try:
                rows = con.execute("SELECT id FROM runs WHERE status IN ('done', 'diverged')").fetchall()
                return {r[0] for r in rows}
            finally:
                con.close()
        except sqlite3.OperationalError:  # the schema not written yet, or a moment's lock
            time.sleep(0.05)
    return set()


def signature(db: Path) -> dict:
    """What an uninterrupted study must equal: per stored run its status, final numbers and every
    per-step and per-layer metric (no wall times, dates or provenance)."""
    con = sqlite3.connect(f"{db.absolute().as_uri()}?mode=ro", uri=True)
    try:
        out = {}
        for row in con.execute(
            "SELECT id, status, steps_done, diverged_step, final_train_loss, final_val_loss, "
            "final_val_metric FROM runs"
        ):
            metrics = con.execute(
                "SELECT step, name, value FROM metrics WHERE run_id = ? ORDER BY step, name", (row[0],)
            ).fetchall()
            layers = con.execute(
                "SELECT step, layer, sublayer, metric, param, value FROM layer_metrics WHERE run_id = ? "
                "ORDER BY step, layer, sublayer, metric, param",
                (row[0],),
            ).fetchall()
            out[row[0]] = (row[1:], metrics, layers)
        return out
    finally:
        con.close()


def summary(stdout: str) -> tuple[int, int, int]:
    """(runs, already stored, run now) from the study's summary line."""
    m = re.search(r"(\d+) runs \((\d+) already stored, (\d+) run now", stdout)
    check(m is not None, f"no summary line in {stdout[-300:]!r}")
    return int(m[1]), int(m[2]), int(m[3])


def report_whole(out: Path) -> None:
    report = out / "report.html"
    if report.exists():
        text = report.read_text(errors="replace")
        check(text.rstrip().endswith("</html>"), "report.html is not whole")


@dataclass
class Context:
    root: Path
    reference: dict = field(default_factory=dict)
    reference_other: dict = field(default_factory=dict)
    spec: Path | None = None
    other: Path | None = None


def resume_equals_reference(ctx: Context, out: Path, stored: set[str], *extra: str) -> str:
    """The same command again: it reports the runs stored at the fault as already stored, trains
    only the rest, exits 0, and its database equals the uninterrupted study's."""
    again = subprocess.run(
        study_cmd(ctx.spec, out, "--quiet", *extra), env=ENV, capture_output=True, text=True, timeout=600
    )
    check(again.returncode == 0, f"resume exit {again.returncode}: {again.stderr[-400:]}")
    total, skipped, ran = summary(again.stdout)
    check(
        (total, skipped, ran) == (RUNS, len(stored), RUNS - len(stored)),
        f"resume: {skipped} already stored and {ran} run now, but {len(stored)} were stored",
    )
    check(
        signature(out / "study.sqlite") == ctx.reference,
        "the resumed database differs from an uninterrupted one",
    )
    report_whole(out)
    return f"{len(stored)} stored at the fault"


def stored_values_match(ctx: Context, out: Path) -> set[str]:
    stored = finished(out / "study.sqlite")
    got = signature(out / "study.sqlite") if stored else {}
    for run_id in stored:
        check(got[run_id] == ctx.reference[run_id], f"stored run {run_id} differs from the uninterrupted one")
    return stored
