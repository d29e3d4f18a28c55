"""Experiment trackers: a study's runs in TensorBoard or MLflow, one tracker run per study run.

A tracker logs each run's loss live, step by step as the executor passes the steps back (from remote
Ray workers too, through the driver), and, once the run is stored, everything the database holds of
it, read back from the database: the config (TensorBoard hparams, MLflow params), every per-step metric
(train_loss, grad_norm, lr, val_loss, ...), per-layer values at each probed step and the final numbers.
What a tracker shows is therefore the database's values (TensorBoard keeps scalars as float32).

Per-layer values, named ``<metric>/L<layer>.<sublayer>`` (sublayer ``out`` is the layer's output):
``act_rms`` (the residual stream's RMS), ``stream_grad_norm`` (the gradient norm of the stream there)
and ``weight_grad_norm`` (the norm of the sublayer's weight gradients, its matrices together).

Trackers only read: they never change a run. The runner guards them: a tracker that fails mid-study
is dropped with a warning and the study goes on, every run stored. A study resumed with ``--track``
logs its stored runs that the tracker does not have yet. Each tracker is an extra, imported only when
asked for (:data:`TRACKERS`).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from ..extras import require
from ..registry import Registry
from .profiles import combine

if TYPE_CHECKING:
    from .spec import PlannedRun

TRACKERS: Registry = Registry("tracker")
LAYER_METRICS = {
    "act_rms": "act_rms",
    "grad_norm": "stream_grad_norm",
    "weight_grad_norm": "weight_grad_norm",
}
FINAL = ("final_train_loss", "final_val_loss", "final_val_metric", "tokens_per_s", "wall_s")


def layer_values(rows: list[dict]) -> dict[tuple[int, str], float]:
    """(step, name) -> value of the tracked per-layer metrics of one run's stored layer rows, a
    sublayer's rows combined by the profile rule (:func:`.profiles.combine`: the weight-gradient norms of
    its matrices as sqrt(sum of squares))."""
    grouped: dict[tuple[int, str], tuple[str, list[float]]] = {}
    for r in rows:
        metric = LAYER_METRICS.get(r["metric"])
        if metric is None or r["value"] is None:
            continue
        key = (r["step"], f"{metric}/L{r['layer']:02d}.{r['sublayer'] or 'out'}")
        grouped.setdefault(key, (r["metric"], []))[1].append(r["value"])
    return {key: combine(metric, values) for key, (metric, values) in grouped.items()}


def run_values(record: dict) -> list[tuple[str, int, float]]:
    """Every value a tracker logs for a stored run, as (name, step, value): the per-step metrics, the
    per-layer values and the final numbers (at the last step); stored NULLs (a NaN loss) are left out."""
    values = [(name, step, v) for step, name, v in record["metrics"] if v is not None]
    values += [(name, step, v) for (step, name), v in sorted(layer_values(record["layer_metrics"]).items())]
    last = max(record.get("steps_done") or 0, 0)
    values += [
        (f"final/{k.removeprefix('final_')}", last, record[k]) for k in FINAL if record.get(k) is not None
    ]
    return values


def hparam(value):
    """A config value as a tracker parameter: numbers, strings and booleans as they are, the rest JSON."""
    return value if isinstance(value, (bool, int, float, str)) else json.dumps(value)


def run_name(experiment: str, label: str) -> str:
    return f"{experiment}: {label}"


class Tracker:
    """One tracker. ``open`` before the study's runs, then ``step`` (live) and ``log_run`` (a stored
    run, whole) in any order across runs, ``close`` at the end; ``has`` says whether a run is logged."""

    name = ""

    def open(self, out_dir: Path, study: str) -> None:
        raise NotImplementedError

    def has(self, run_id: str) -> bool:
        raise NotImplementedError

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        raise NotImplementedError

    def log_run(self, record: dict) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


@TRACKERS.register("tensorboard")
class TensorBoardTracker(Tracker):
    """One TensorBoard run per study run, in ``<out>/tensorboard/<experiment>/<label> (<run id>)``
    (``tensorboard --logdir <out>/tensorboard``): the config as hparams (with the final held-out loss
    as their metric), every value as a scalar, the status as text."""

    name = "tensorboard"
    MARK = "addnorm-run.json"  # written last: the run is logged whole

    def __init__(self, log_dir: str | Path | None = None) -> None:
        tb = require("torch.utils.tensorboard", "tensorboard", "--track tensorboard")
        self._writer_class = tb.SummaryWriter
        self._log_dir = Path(log_dir) if log_dir else None
        self._writers: dict = {}
        self._live: dict[str, set[int]] = {}

    def open(self, out_dir: Path, study: str) -> None:
        self.root = self._log_dir or Path(out_dir) / "tensorboard"
        self.root.mkdir(parents=True, exist_ok=True)

    def _folder(self, run_id: str, experiment: str, label: str) -> Path:
        safe = lambda s: s.replace(os.sep, "∕").replace("/", "∕")  # noqa: E731
        return self.root / safe(experiment) / f"{safe(label)} ({run_id})"

    def _existing(self, run_id: str) -> list[Path]:
        return [p for p in self.root.glob(f"*/* ({run_id})") if p.is_dir()]

    def has(self, run_id: str) -> bool:
        return any((p / self.MARK).is_file() for p in self._existing(run_id))

    def _writer(self, run_id: str, experiment: str, label: str):
        """The run's writer; a run (re)started in this study starts from an empty folder."""
        if run_id not in self._writers:
            for old in self._existing(run_id):  # an earlier attempt (failed, interrupted) or record
                shutil.rmtree(old)
            self._writers[run_id] = self._writer_class(log_dir=str(self._folder(run_id, experiment, label)))
            self._live[run_id] = set()
        return self._writers[run_id]

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        self._writer(run.run_id, run.experiment, run.label).add_scalar("train_loss", loss, step)
        self._live[run.run_id].add(step)

    def log_run(self, record: dict) -> None:
        from torch.utils.tensorboard.summary import hparams

        run_id = record["id"]
        experiment, label = record["experiments"][0]
        writer = self._writer(run_id, experiment, label)
        live = self._live.get(run_id, set())
        for name, step, value in run_values(record):
            if not (name == "train_loss" and step in live):
                writer.add_scalar(name, value, step)
        final = record.get("final_val_loss")
        metrics = {"final/val_loss": final} if final is not None else {}
        params = {k: hparam(v) for k, v in record["config"].items()}
        params["status"] = record["status"]
        for summary in hparams(params, metrics):
            writer.file_writer.add_summary(summary)
        status = record["status"] + (f": {record['error']}" if record.get("error") else "")
        writer.add_text("status", status, record.get("steps_done") or 0)
        writer.close()
        folder = Path(writer.log_dir)
        mark = {"run_id": run_id, "status": record["status"], "experiments": record["experiments"]}
        (folder / self.MARK).write_text(json.dumps(mark))
        del self._writers[run_id]
        self._live.pop(run_id, None)

    def close(self) -> None:
        for writer in self._writers.values():  # runs still in flight when the study stopped
            writer.close()
        self._writers.clear()


@TRACKERS.register("mlflow")
class MLflowTracker(Tracker):
    """One MLflow run per study run in the experiment ``addnorm-<study>`` of the tracking URI (default:
    ``$MLFLOW_TRACKING_URI``, else a SQLite store at ``<out>/mlflow.db``; ``mlflow ui
    --backend-store-uri sqlite:///<out>/mlflow.db`` shows it): the config as params, every value as a
    metric, the run id, memberships and status as tags; a failed run ends FAILED."""

    name = "mlflow"
    HTTP_TIMEOUT = 5  # seconds per request to a tracking server (MLFLOW_HTTP_REQUEST_TIMEOUT overrides)
    LIVE_EVERY = 2.0  # seconds between batches of live steps
    BATCH = 1000  # metrics per log_batch call (MLflow's limit)

    def __init__(self, uri: str | None = None) -> None:
        self.mlflow = require("mlflow", "mlflow", "--track mlflow")
        self._uri = uri
        self._runs: dict[str, str] = {}  # study run id -> MLflow run id, for runs started here
        self._live: dict[str, set[int]] = {}
        self._buffer: dict[str, list] = defaultdict(list)
        self._flushed = 0.0

    def open(self, out_dir: Path, study: str) -> None:
        import logging

        from mlflow.tracking import MlflowClient

        # no notes on creating the tables, nor MLflow's multi-line retry warnings: a failure is one line
        logging.getLogger("mlflow").setLevel(logging.ERROR)
        # bounded (unless set by the user): MLflow's defaults retry an unresponsive server for minutes;
        # one retry of at most HTTP_TIMEOUT seconds each gives up in about 2 x HTTP_TIMEOUT
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(self.HTTP_TIMEOUT))
        uri = self._uri or os.environ.get("MLFLOW_TRACKING_URI")
        self.uri = uri or f"sqlite:///{(Path(out_dir) / 'mlflow.db').resolve()}"
        if not uri:
            Path(out_dir).mkdir(parents=True, exist_ok=True)
        try:
            _check_sqlite(self.uri, self.HTTP_TIMEOUT)
            self.client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
            name = f"addnorm-{study}"
            found = self.client.get_experiment_by_name(name)
            self.experiment = found.experiment_id if found else self.client.create_experiment(name)
        except Exception as err:  # noqa: BLE001 - one line for any backend's error
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"--track mlflow: cannot use the tracking URI {self.uri!r}: {first}") from None

    def _find(self, run_id: str) -> list:
        return self.client.search_runs(
            [self.experiment], filter_string=f"tags.`addnorm.run_id` = '{run_id}'", max_results=100
        )

    def has(self, run_id: str) -> bool:
        return any(r.data.tags.get("addnorm.logged") == "true" for r in self._find(run_id))

    def _run(self, run_id: str, experiment: str, label: str) -> str:
        """The MLflow run of ``run_id`` in this study; earlier ones (a failed attempt, an interrupted
        one, a record) are deleted when a run (re)starts here."""
        if run_id not in self._runs:
            for old in self._find(run_id):
                self.client.delete_run(old.info.run_id)
            tags = {"addnorm.run_id": run_id, "addnorm.experiment": experiment, "addnorm.label": label}
            created = self.client.create_run(self.experiment, run_name=run_name(experiment, label), tags=tags)
            self._runs[run_id] = created.info.run_id
            self._live[run_id] = set()
        return self._runs[run_id]

    def _log(self, mlflow_run: str, metrics: list) -> None:
        for i in range(0, len(metrics), self.BATCH):
            self.client.log_batch(mlflow_run, metrics=metrics[i : i + self.BATCH])

    def _flush_live(self) -> None:
        for run_id, metrics in self._buffer.items():
            if metrics and run_id in self._runs:
                self._log(self._runs[run_id], metrics)
        self._buffer.clear()
        self._flushed = time.monotonic()

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        from mlflow.entities import Metric

        self._run(run.run_id, run.experiment, run.label)
        self._buffer[run.run_id].append(Metric("train_loss", loss, int(time.time() * 1000), step))
        self._live[run.run_id].add(step)
        if time.monotonic() - self._flushed >= self.LIVE_EVERY:
            self._flush_live()

    def log_run(self, record: dict) -> None:
        from mlflow.entities import Metric, Param, RunTag

        self._flush_live()
        run_id = record["id"]
        experiment, label = record["experiments"][0]
        mlflow_run = self._run(run_id, experiment, label)
        live = self._live.get(run_id, set())
        now = int(time.time() * 1000)
        metrics = [
            Metric(name, value, now, step)
            for name, step, value in run_values(record)
            if not (name == "train_loss" and step in live)
        ]
        params = [Param(k, str(hparam(v))) for k, v in record["config"].items()]
        tags = [
            RunTag("addnorm.status", record["status"]),
            RunTag("addnorm.experiments", json.dumps(record["experiments"])),
            RunTag("addnorm.provenance", json.dumps(record.get("provenance") or {})),
        ]
        if record.get("error"):
            tags.append(RunTag("addnorm.error", record["error"][:5000]))
        for i in range(0, len(params), 100):  # MLflow's limit on params per call
            self.client.log_batch(mlflow_run, params=params[i : i + 100])
        self.client.log_batch(mlflow_run, tags=tags)
        self._log(mlflow_run, metrics)
        self.client.set_tag(mlflow_run, "addnorm.logged", "true")
        self.client.set_terminated(mlflow_run, "FAILED" if record["status"] == "failed" else "FINISHED")
        del self._runs[run_id]
        self._live.pop(run_id, None)

    def close(self) -> None:
        self._flush_live()
        for mlflow_run in self._runs.values():  # runs in flight when the study stopped
            self.client.set_terminated(mlflow_run, "KILLED")
        self._runs.clear()


def _check_sqlite(uri: str, timeout: float) -> None:
    """For a ``sqlite:///PATH`` tracking URI: open PATH and take a write lock (waiting at most
    ``timeout`` seconds for another writer), so that a database that cannot be written (a read-only
    folder or file, a folder in its place) fails here at once; MLflow itself retries opening it ten
    times with growing pauses, about 100 s."""
    if not uri.startswith("sqlite:///"):
        return
    path = uri[len("sqlite:///") :].split("?", 1)[0]
    if path in ("", ":memory:"):
        return
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, timeout=timeout)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.rollback()
    finally:
        db.close()


def make_trackers(names: list[str], mlflow_uri: str | None = None) -> list[Tracker]:
    """The trackers named (each once), built now: a missing extra is a one-line error before any run."""
    trackers = []
    for name in dict.fromkeys(TRACKERS.resolve(n) for n in names):
        trackers.append(MLflowTracker(mlflow_uri) if name == "mlflow" else TRACKERS[name]())
    return trackers


class TrackerGroup:
    """The study's trackers behind one guard: a tracker whose call raises is dropped with one warning
    line and the study goes on (its runs are in the database whatever happens here)."""

    def __init__(self, trackers: list[Tracker], stream: TextIO) -> None:
        self.trackers, self.stream = list(trackers), stream

    def _call(self, tracker: Tracker, call: str, *args):
        """``tracker.call(*args)``; None when it raised (the tracker is dropped then)."""
        try:
            return getattr(tracker, call)(*args)
        except Exception as err:  # noqa: BLE001 - never lose the study to a tracker
            self.trackers.remove(tracker)
            message = " ".join(str(err).split()) or type(err).__name__
            self.stream.write(
                f"warning: --track {tracker.name} stopped ({type(err).__name__}: {message}); "
                "the study goes on and stores every run\n"
            )
            try:
                tracker.close()
            except Exception:  # noqa: BLE001
                pass
            return None

    def _each(self, call: str, *args) -> None:
        for tracker in list(self.trackers):
            self._call(tracker, call, *args)

    def open(self, out_dir: Path, study: str, store) -> None:
        """Open every tracker (one that fails to open, e.g. an unreachable server or a file where its
        folder should be, is dropped with one warning line), then log the stored finished runs of the
        plan that a tracker does not have yet."""
        for tracker in list(self.trackers):
            self._call(tracker, "open", out_dir, study)
        finished = store.finished_ids()
        for run_id in dict.fromkeys(run_id for run_id, _, _ in store.planned()):
            if run_id not in finished:
                continue
            record = None
            for tracker in list(self.trackers):
                if self._call(tracker, "has", run_id) is False:
                    record = record or store.run_record(run_id)
                    self._call(tracker, "log_run", record)

    def step(self, run: PlannedRun, step: int, loss: float) -> None:
        self._each("step", run, step, loss)

    def log_run(self, record: dict) -> None:
        self._each("log_run", record)

    def close(self) -> None:
        self._each("close")
