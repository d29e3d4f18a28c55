"""SQLite store of a study: runs (config, status, timings, error), per-step and per-layer metrics.

Only the driver writes. A run's row and all its metrics go in one transaction when the run ends, so a
study killed at any moment (even ``kill -9``) loses at most the runs in flight, and a rerun skips every
run already stored. Never imports ``ops`` or ``model``.
"""

from __future__ import annotations

import csv
import json
import sqlite3
import time
from pathlib import Path

SCHEMA = """
CREATE TABLE IF NOT EXISTS studies (name TEXT PRIMARY KEY, spec TEXT NOT NULL, updated REAL NOT NULL);
CREATE TABLE IF NOT EXISTS runs (
    id TEXT PRIMARY KEY, study TEXT NOT NULL, experiments TEXT NOT NULL, config TEXT NOT NULL,
    status TEXT NOT NULL, error TEXT, diverged_step INTEGER, steps_done INTEGER,
    started REAL, finished REAL, wall_s REAL,
    final_train_loss REAL, final_val_loss REAL, final_val_metric REAL, metric TEXT
);
CREATE TABLE IF NOT EXISTS metrics (run_id TEXT NOT NULL, step INTEGER NOT NULL, name TEXT NOT NULL, value REAL);
CREATE INDEX IF NOT EXISTS metrics_run ON metrics (run_id, name);
CREATE TABLE IF NOT EXISTS layer_metrics (
    run_id TEXT NOT NULL, step INTEGER NOT NULL, layer INTEGER NOT NULL, layer_name TEXT,
    sublayer TEXT, metric TEXT NOT NULL, param TEXT, value REAL
);
CREATE INDEX IF NOT EXISTS layer_metrics_run ON layer_metrics (run_id, metric);
"""


class Store:
    """A study's database at ``path`` (created with its schema; WAL journal)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(self.path)
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing (driver only) ------------------------------------------------------------------
    def save_study(self, name: str, spec: dict) -> None:
        with self.db:
            self.db.execute(
                "INSERT OR REPLACE INTO studies VALUES (?, ?, ?)", (name, json.dumps(spec), time.time())
            )

    def save_run(
        self, study: str, run_id: str, experiments: list, config: dict, result, started: float
    ) -> None:
        """One transaction: the run row and every metric of it (replacing an earlier row of the id)."""
        final = result.final or {}
        with self.db:
            self.db.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
            self.db.execute("DELETE FROM layer_metrics WHERE run_id = ?", (run_id,))
            self.db.execute(
                "INSERT OR REPLACE INTO runs VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    run_id,
                    study,
                    json.dumps(experiments),
                    json.dumps(config, sort_keys=True),
                    result.status,
                    result.error,
                    result.diverged_step,
                    result.steps_done,
                    started,
                    time.time(),
                    result.wall_s,
                    final.get("train_loss"),
                    final.get("val_loss"),
                    final.get("val_metric"),
                    final.get("metric"),
                ),
            )
            self.db.executemany(
                "INSERT INTO metrics VALUES (?, ?, ?, ?)", [(run_id, s, n, v) for s, n, v in result.metrics]
            )
            self.db.executemany(
                "INSERT INTO layer_metrics VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        run_id,
                        r["step"],
                        r["layer"],
                        r["layer_name"],
                        r["sublayer"],
                        r["metric"],
                        r["param"],
                        r["value"],
                    )
                    for r in result.layer_metrics
                ],
            )

    # --- reading ----------------------------------------------------------------------------------
    def finished_ids(self) -> set[str]:
        return {row["id"] for row in self.db.execute("SELECT id FROM runs")}

    def study_spec(self) -> tuple[str, dict] | None:
        row = self.db.execute("SELECT name, spec FROM studies ORDER BY updated DESC LIMIT 1").fetchone()
        return (row["name"], json.loads(row["spec"])) if row else None

    def runs(self) -> list[dict]:
        out = []
        for row in self.db.execute("SELECT * FROM runs ORDER BY started"):
            d = dict(row)
            d["config"] = json.loads(d["config"])
            d["experiments"] = [tuple(x) for x in json.loads(d["experiments"])]
            out.append(d)
        return out

    def metric(self, run_id: str, name: str) -> list[tuple[int, float]]:
        rows = self.db.execute(
            "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? ORDER BY step", (run_id, name)
        )
        return [(r["step"], r["value"]) for r in rows]

    def layer_metric(self, run_id: str, metric: str, step: int | None = None) -> list[dict]:
        query = "SELECT * FROM layer_metrics WHERE run_id = ? AND metric = ?"
        args: list = [run_id, metric]
        if step is not None:
            query += " AND step = ?"
            args.append(step)
        return [dict(r) for r in self.db.execute(query + " ORDER BY step, layer", args)]

    def export_csv(self, folder: str | Path) -> list[Path]:
        """runs.csv, metrics.csv and layer_metrics.csv in ``folder``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        written = []
        for table in ("runs", "metrics", "layer_metrics"):
            cur = self.db.execute(f"SELECT * FROM {table}")  # noqa: S608 (fixed table names)
            path = folder / f"{table}.csv"
            with path.open("w", newline="") as fh:
                writer = csv.writer(fh)
                writer.writerow([c[0] for c in cur.description])
                writer.writerows(cur)
            written.append(path)
        return written
