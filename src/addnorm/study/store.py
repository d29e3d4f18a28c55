"""SQLite store of a study: its current plan, runs (config, status, timings, error, provenance), per-step
and per-layer metrics.

Only the driver writes. A run's row and all its metrics go in one transaction when the run ends, so a
study killed at any moment (even ``kill -9``) loses at most the runs in flight, and a rerun skips every
run already finished (done or diverged; failed runs are tried again). The ``plan`` table holds the runs
of the spec last run into this folder: readers (report, findings, export) see exactly those; other
stored runs stay until :meth:`Store.prune`. Never imports ``ops`` or ``model``.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import sqlite3
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path

FINISHED = ("done", "diverged")  # a result; "failed" (an exception, a dead worker) is retried

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
CREATE TABLE IF NOT EXISTS plan (
    position INTEGER NOT NULL, run_id TEXT NOT NULL, experiment TEXT NOT NULL, label TEXT NOT NULL
);
"""
# Columns added after the first release: (table, column, type); older databases gain them on open.
ADDED_COLUMNS = (
    ("runs", "provenance", "TEXT"),
    ("studies", "base", "TEXT"),
    ("runs", "tokens_per_s", "REAL"),
    ("studies", "not_applicable", "TEXT"),
)

RUN_COLUMNS = (
    "id",
    "status",
    "error",
    "diverged_step",
    "steps_done",
    "started",
    "finished",
    "wall_s",
    "final_train_loss",
    "final_val_loss",
    "final_val_metric",
    "metric",
    "tokens_per_s",
)


def write_atomic(path: str | Path, data: str | bytes) -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` through a temporary file in the same folder and a
    rename, so that ``path`` is either absent or its old content, or the whole new one (never a
    truncated file on a full disk)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data.encode("utf-8") if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


class Store:
    """A study's database at ``path`` (created with its schema; WAL journal). ``readonly``: open an
    existing database for reading only (``--dry-run``, ``export``), which works in a read-only folder
    too. An SQLite error opening it names the file."""

    def __init__(self, path: str | Path, readonly: bool = False) -> None:
        self.path = Path(path)
        try:
            if readonly:
                self.db = _open_readonly(self.path)
            else:
                self.path.parent.mkdir(parents=True, exist_ok=True)
                self.db = sqlite3.connect(self.path)
                self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                _create_schema(self.db)
        except sqlite3.Error as err:
            raise type(err)(f"{self.path}: {err}") from None
        self.db.row_factory = sqlite3.Row

    def close(self) -> None:
        self.db.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- writing (driver only) ------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """One transaction; an SQLite error (full disk, read-only or locked database) names the file."""
        try:
            with self.db:
                yield
        except sqlite3.Error as err:
            raise type(err)(f"{self.path}: {err}") from None

    def save_plan(
        self,
        name: str,
        spec: dict,
        base: dict,
        members: list[tuple[str, str, str]],
        not_applicable: list[tuple[str, str, str]] = (),
    ) -> None:
        """The current spec (as given and its resolved base config), its runs as (run id, experiment,
        label) rows and the runs it leaves out as (experiment, label, why), replacing the previous plan in
        one transaction."""
        with self._writing():
            self.db.execute(
                "INSERT OR REPLACE INTO studies (name, spec, updated, base, not_applicable) VALUES (?, ?, ?, ?, ?)",
                (name, json.dumps(spec), time.time(), json.dumps(base), json.dumps(list(not_applicable))),
            )
            self.db.execute("DELETE FROM plan")
            self.db.executemany(
                "INSERT INTO plan VALUES (?, ?, ?, ?)", [(i, *m) for i, m in enumerate(members)]
            )

    def save_run(
        self, study: str, run_id: str, experiments: list, config: dict, result, started: float
    ) -> None:
        """One transaction: the run row and every metric of it (replacing an earlier row of the id)."""
        final = result.final or {}
        with self._writing():
            self.db.execute("DELETE FROM metrics WHERE run_id = ?", (run_id,))
            self.db.execute("DELETE FROM layer_metrics WHERE run_id = ?", (run_id,))
            self.db.execute(
                "INSERT OR REPLACE INTO runs (id, study, experiments, config, status, error, diverged_step, "
                "steps_done, started, finished, wall_s, final_train_loss, final_val_loss, final_val_metric, "
                "metric, provenance, tokens_per_s) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
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
                    json.dumps(getattr(result, "provenance", None) or {}, sort_keys=True),
                    getattr(result, "tokens_per_s", None),
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

    def prune(self) -> int:
        """Delete every stored run that is not part of the current plan (and its metrics); how many."""
        stale = self.stale_ids()
        with self._writing():
            for table, column in (("metrics", "run_id"), ("layer_metrics", "run_id"), ("runs", "id")):
                self.db.executemany(f"DELETE FROM {table} WHERE {column} = ?", [(i,) for i in stale])
        return len(stale)

    # --- reading ----------------------------------------------------------------------------------
    def planned(self) -> list[tuple[str, str, str]]:
        """The current plan: (run id, experiment, label) in the spec's order."""
        rows = self.db.execute("SELECT run_id, experiment, label FROM plan ORDER BY position")
        return [(r["run_id"], r["experiment"], r["label"]) for r in rows]

    def finished_ids(self) -> set[str]:
        """Runs with a result (done or diverged); failed runs are not among them."""
        marks = ",".join("?" * len(FINISHED))
        return {
            row["id"] for row in self.db.execute(f"SELECT id FROM runs WHERE status IN ({marks})", FINISHED)
        }

    def measurements(self) -> list[dict]:
        """Every stored run, of the plan or not, as what it measured: ``id``, ``config`` and
        ``provenance`` (decoded), ``status``, ``steps_done``, ``wall_s`` and ``tokens_per_s``; for the
        time and memory estimates of runs still to train and the checks before a study resumes."""
        out = []
        query = "SELECT id, config, provenance, status, steps_done, wall_s, tokens_per_s FROM runs"
        for row in self.db.execute(query):
            d = dict(row)
            d["config"] = json.loads(d["config"])
            d["provenance"] = json.loads(d["provenance"]) if d.get("provenance") else {}
            out.append(d)
        return out

    def stale_ids(self) -> list[str]:
        """Stored runs that are not part of the current plan (an earlier version of the spec)."""
        rows = self.db.execute(
            "SELECT id FROM runs WHERE id NOT IN (SELECT run_id FROM plan) ORDER BY started"
        )
        return [r["id"] for r in rows]

    def study_spec(self) -> tuple[str, dict] | None:
        row = self.db.execute("SELECT name, spec FROM studies ORDER BY updated DESC LIMIT 1").fetchone()
        return (row["name"], json.loads(row["spec"])) if row else None

    def base_config(self) -> dict:
        """The resolved base config of the current spec ({} for a database written before it was kept)."""
        row = self.db.execute("SELECT base FROM studies ORDER BY updated DESC LIMIT 1").fetchone()
        return json.loads(row["base"]) if row and row["base"] else {}

    def not_applicable(self) -> list[tuple[str, str, str]] | None:
        """The current spec's runs left out of the plan as not applicable, (experiment, label, why); None
        for a database written before they were kept."""
        row = self.db.execute("SELECT not_applicable FROM studies ORDER BY updated DESC LIMIT 1").fetchone()
        if row is None:
            return []
        return (
            None if row["not_applicable"] is None else [tuple(x) for x in json.loads(row["not_applicable"])]
        )

    def runs(self) -> list[dict]:
        """The current plan's stored runs in the spec's order, each with ``config`` and ``provenance`` decoded and
        ``experiments`` as its (experiment, label) memberships in the plan. A database without a plan
        (written before plans were kept) gives every run with the memberships stored with it."""
        plan = self.planned()
        members: dict[str, list[tuple[str, str]]] = {}
        for run_id, experiment, label in plan:
            members.setdefault(run_id, []).append((experiment, label))
        out = []
        order = {run_id: i for i, (run_id, _, _) in reversed(list(enumerate(plan)))}
        for row in self.db.execute("SELECT * FROM runs ORDER BY started"):
            d = dict(row)
            if plan and d["id"] not in members:
                continue
            d["config"] = json.loads(d["config"])
            d["provenance"] = json.loads(d["provenance"]) if d.get("provenance") else {}
            stored = [tuple(x) for x in json.loads(d["experiments"])]
            d["experiments"] = members.get(d["id"], stored)
            out.append(d)
        return sorted(out, key=lambda d: order.get(d["id"], len(order))) if plan else out

    def run_record(self, run_id: str) -> dict | None:
        """One stored run whole, as the trackers log it: the runs row (``config`` and ``provenance``
        decoded, ``experiments`` its memberships in the plan), ``metrics`` as (step, name, value) and
        ``layer_metrics`` as rows; None for a run not stored."""
        row = self.db.execute("SELECT * FROM runs WHERE id = ?", (run_id,)).fetchone()
        if row is None:
            return None
        d = dict(row)
        d["config"] = json.loads(d["config"])
        d["provenance"] = json.loads(d["provenance"]) if d.get("provenance") else {}
        plan = self.db.execute(
            "SELECT experiment, label FROM plan WHERE run_id = ? ORDER BY position", (run_id,)
        )
        d["experiments"] = [tuple(r) for r in plan] or [tuple(x) for x in json.loads(d["experiments"])]
        rows = self.db.execute(
            "SELECT step, name, value FROM metrics WHERE run_id = ? ORDER BY rowid", (run_id,)
        )
        d["metrics"] = [(r["step"], r["name"], r["value"]) for r in rows]
        rows = self.db.execute("SELECT * FROM layer_metrics WHERE run_id = ? ORDER BY rowid", (run_id,))
        d["layer_metrics"] = [dict(r) for r in rows]
        return d

    def metric(self, run_id: str, name: str) -> list[tuple[int, float]]:
        rows = self.db.execute(
            "SELECT step, value FROM metrics WHERE run_id = ? AND name = ? ORDER BY step", (run_id, name)
        )
        # SQLite stores a NaN as NULL: give it back as NaN (a diverged run's last loss)
        return [(r["step"], math.nan if r["value"] is None else r["value"]) for r in rows]

    def layer_metric(self, run_id: str, metric: str, step: int | None = None) -> list[dict]:
        query = "SELECT * FROM layer_metrics WHERE run_id = ? AND metric = ?"
        args: list = [run_id, metric]
        if step is not None:
            query += " AND step = ?"
            args.append(step)
        return [dict(r) for r in self.db.execute(query + " ORDER BY step, layer", args)]

    def layer_rows(self, run_id: str) -> list[dict]:
        """Every per-layer row of a run (all metrics), by step and layer."""
        query = "SELECT * FROM layer_metrics WHERE run_id = ? ORDER BY step, layer"
        return [dict(r) for r in self.db.execute(query, (run_id,))]

    def export_csv(self, folder: str | Path) -> list[Path]:
        """Tidy CSV of the current plan's runs in ``folder``: ``runs.csv`` (one row per run, one column
        per result field, config key and provenance field), ``experiments.csv`` (run id, experiment,
        label: a run can serve several experiments), ``metrics.csv`` (run id, step, name, value) and
        ``layer_metrics.csv`` (run id, step, layer, layer name, sublayer, metric, param, value)."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        runs = self.runs()
        config_keys = list(dict.fromkeys(k for r in runs for k in r["config"]))
        prov_keys = list(dict.fromkeys(k for r in runs for k in r["provenance"]))
        cell = lambda v: json.dumps(v) if isinstance(v, (list, dict)) else v  # noqa: E731
        header = [*RUN_COLUMNS, *config_keys, *(f"provenance_{k}" for k in prov_keys)]
        table = []
        for r in runs:
            row = [_utc(r[c]) if c in ("started", "finished") else r[c] for c in RUN_COLUMNS]
            row += [cell(r["config"].get(k)) for k in config_keys]
            row += [cell(r["provenance"].get(k)) for k in prov_keys]
            table.append(row)
        written = [self._write(folder / "runs.csv", header, table)]
        members = [(r["id"], e, lab) for r in runs for e, lab in r["experiments"]]
        written.append(self._write(folder / "experiments.csv", ["run_id", "experiment", "label"], members))
        ids = [r["id"] for r in runs]
        for name in ("metrics", "layer_metrics"):
            cur = self.db.execute(f"SELECT * FROM {name} WHERE run_id IN ({','.join('?' * len(ids))})", ids)
            written.append(self._write(folder / f"{name}.csv", [c[0] for c in cur.description], cur))
        return written

    @staticmethod
    def _write(path: Path, header: list[str], rows) -> Path:
        with path.open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(header)
            writer.writerows(rows)
        return path


def stored_runs(db: str | Path) -> list[dict]:
    """Every run stored in the database ``db`` (read-only; none when there is no database), as
    :meth:`Store.measurements` gives them."""
    if not Path(db).is_file():
        return []
    with Store(db, readonly=True) as store:
        return store.measurements()


def stored_finished(db: str | Path) -> set[str]:
    """The finished runs stored in the database ``db`` (read-only; none when there is no database)."""
    if not Path(db).is_file():
        return set()
    with Store(db, readonly=True) as store:
        return store.finished_ids()


def _create_schema(db: sqlite3.Connection) -> None:
    """The tables (where missing) and the columns added since the first release."""
    db.executescript(SCHEMA)
    for table, column, kind in ADDED_COLUMNS:
        if column not in _columns(db, table):
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in db.execute(f"PRAGMA table_info({table})")}


def _schema_complete(db: sqlite3.Connection) -> bool:
    tables = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    wanted = {"studies", "runs", "metrics", "layer_metrics", "plan"}
    return wanted <= tables and all(column in _columns(db, t) for t, column, _ in ADDED_COLUMNS)


def _open_readonly(path: Path) -> sqlite3.Connection:
    """``path`` opened for reading only. Where the file and its folder can be written, it is opened
    read-write with ``PRAGMA query_only`` (no statement can change it): a WAL database's reader creates
    ``-wal`` and ``-shm`` files, and only a read-write connection, the last to close, removes them (a
    ``mode=ro`` one leaves them in the study folder). Elsewhere it is opened ``mode=ro``, and where even
    that cannot create its ``-shm`` (a read-only folder: nothing can write there either), as immutable.
    A database without the study's tables (a study killed between creating the file and writing its
    schema) reads as an empty study; one written by an older version, without the tables or columns
    added since, is read from a copy in memory that has them."""
    if not path.is_file():
        raise sqlite3.OperationalError("no such database file")
    uri = path.absolute().as_uri()
    writable = os.access(path, os.W_OK) and os.access(path.parent, os.W_OK)
    for mode in ("mode=rw", "mode=ro", "immutable=1")[0 if writable else 1 :]:
        db = None
        try:
            db = sqlite3.connect(f"{uri}?{mode}", uri=True)
            if mode == "mode=rw":
                db.execute("PRAGMA query_only = ON")
            complete = _schema_complete(db)
            break
        except sqlite3.OperationalError:
            if db is not None:
                db.close()
            if mode == "immutable=1":
                raise
    if complete:
        return db
    copy = sqlite3.connect(":memory:")
    db.backup(copy)
    db.close()
    _create_schema(copy)
    return copy


def _utc(timestamp: float | None) -> str | None:
    """A Unix time as an ISO 8601 UTC timestamp (CSV readers parse it; a float they do not)."""
    if timestamp is None:
        return None
    return datetime.fromtimestamp(timestamp, timezone.utc).isoformat(timespec="seconds")
