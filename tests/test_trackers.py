"""Experiment trackers: what TensorBoard's event reader and MLflow's client read back equals the study
database; a tracked study's results equal an untracked one's; a missing extra is a one-line error."""

from __future__ import annotations

import sys

import pytest
import yaml
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, parse_spec, run_study
from addnorm.study.trackers import TRACKERS, layer_values, make_trackers

TINY = dict(
    d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=4, batch_size=4, seq_len=16, eval_every=2, probe_every=2
)
SPEC = {"name": "tr", "base": TINY, "experiments": {"main": {"sweep": {"placement": ["post", "pre"]}}}}


def stored(folder):
    """run id -> (status, final val loss, train loss curve, per-layer values) from the database."""
    with Store(folder / "study.sqlite") as store:
        out = {}
        for r in store.runs():
            record = store.run_record(r["id"])
            out[r["id"]] = (
                r["status"],
                r["final_val_loss"],
                store.metric(r["id"], "train_loss"),
                store.metric(r["id"], "val_loss"),
                layer_values(record["layer_metrics"]),
                record["config"],
            )
    return out


def scalars(events, tag: str) -> list[tuple[int, float]]:
    return [(e.step, e.value) for e in events.Scalars(tag)]


def history(client, run, key: str) -> list[tuple[int, float]]:
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


@pytest.fixture(scope="module")
def studies(tmp_path_factory):
    """The same spec untracked and tracked by both trackers (through the CLI), in one process each."""
    tmp = tmp_path_factory.mktemp("trackers")
    spec = parse_spec(SPEC)
    run_study(spec, tmp / "plain", workers=1, progress=False, report=False)
    path = tmp / "spec.yaml"
    path.write_text(yaml.safe_dump(SPEC))
    args = ["study", str(path), "--out", str(tmp / "tracked"), "--workers", "1", "--quiet"]
    result = CliRunner().invoke(app, [*args, "--track", "tensorboard", "--track", "mlflow"])
    assert result.exit_code == 0, result.output
    return tmp


def test_tracking_changes_no_result(studies):
    plain, tracked = stored(studies / "plain"), stored(studies / "tracked")
    assert plain == tracked and len(plain) == 2
    assert all(v[0] == "done" and v[4] for v in plain.values())  # per-layer values were probed


def test_tensorboard_event_files_hold_the_database_values(studies):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    folders = sorted((studies / "tracked" / "tensorboard" / "main").iterdir())
    assert len(folders) == 2
    for run_id, (_, final, train, val, layers, config) in stored(studies / "tracked").items():
        (folder,) = [f for f in folders if f.name.endswith(f"({run_id})")]
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
        events.Reload()
        for tag, curve in (("train_loss", train), ("val_loss", val)):
            assert [s for s, _ in scalars(events, tag)] == [s for s, _ in curve]
            assert [v for _, v in scalars(events, tag)] == pytest.approx([v for _, v in curve], rel=1e-6)
        layer_tags = {name for _, name in layers}
        assert layer_tags <= set(events.Tags()["scalars"]) and any(
            t.startswith("act_rms/") for t in layer_tags
        )
        for (step, name), value in layers.items():
            assert dict(scalars(events, name))[step] == pytest.approx(value, rel=1e-6)
        assert scalars(events, "final/val_loss")[-1][1] == pytest.approx(final, rel=1e-6)
        hparams = events.PluginTagToContent("hparams")  # the config, as TensorBoard's HParams plugin has it
        assert hparams and any(b"placement" in blob for blob in hparams.values())
        assert config["placement"].encode() in b"".join(hparams.values())


def test_mlflow_store_holds_the_database_values(studies):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{studies / 'tracked' / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("addnorm-tr")
    runs = {r.data.tags["addnorm.run_id"]: r for r in client.search_runs([experiment.experiment_id])}
    database = stored(studies / "tracked")
    assert set(runs) == set(database)
    for run_id, (status, final, train, val, layers, config) in database.items():
        run = runs[run_id]
        assert run.info.status == "FINISHED" and run.data.tags["addnorm.status"] == status
        assert run.data.params["placement"] == config["placement"] and run.data.params["lr"] == str(
            config["lr"]
        )
        assert (
            history(client, run, "train_loss") == train and history(client, run, "val_loss") == val
        )  # float64 both sides: equal
        for (step, name), value in layers.items():
            assert dict(history(client, run, name))[step] == value
        assert run.data.metrics["final/val_loss"] == final


def test_a_resumed_study_logs_stored_runs_the_tracker_lacks(studies, tmp_path):
    """Runs stored before ``--track`` was given are logged (from the database) when the study resumes."""
    import shutil

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    shutil.copy(studies / "plain" / "study.sqlite", tmp_path / "study.sqlite")
    outcome = run_study(
        parse_spec(SPEC), tmp_path, progress=False, report=False, trackers=make_trackers(["tensorboard"])
    )
    assert outcome.ran == 0 and outcome.skipped == 2
    for run_id, (_, _, train, *_rest) in stored(tmp_path).items():
        (folder,) = (tmp_path / "tensorboard" / "main").glob(f"* ({run_id})")
        events = EventAccumulator(str(folder), size_guidance={"scalars": 0})
        events.Reload()
        assert [e.value for e in events.Scalars("train_loss")] == pytest.approx(
            [v for _, v in train], rel=1e-6
        )


def test_a_failing_tracker_is_dropped_and_the_study_goes_on(tmp_path):
    import io

    class Broken(TRACKERS["tensorboard"]):
        def log_run(self, record):
            raise OSError("disk full")

    stream = io.StringIO()
    outcome = run_study(
        parse_spec(SPEC), tmp_path, progress=False, report=False, trackers=[Broken()], stream=stream
    )
    assert outcome.ran == 2 and not outcome.failed and len(stored(tmp_path)) == 2
    assert stream.getvalue().count("warning: --track tensorboard stopped (OSError: disk full)") == 1


@pytest.mark.parametrize(
    ("track", "module", "extra"),
    [("mlflow", "mlflow", "mlflow"), ("tensorboard", "torch.utils.tensorboard", "tensorboard")],
)
def test_a_missing_extra_is_one_line_naming_it(tmp_path, monkeypatch, track, module, extra):
    monkeypatch.setitem(sys.modules, module, None)
    result = CliRunner().invoke(app, ["study", "quick", "--out", str(tmp_path), "--track", track])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"error: --track {track} needs the {extra!r} extra: pip install 'addnorm[{extra}]'"
    )
    assert not (tmp_path / "study.sqlite").exists()


def test_track_errors():
    runner = CliRunner()
    result = runner.invoke(app, ["study", "quick", "--track", "wandb", "--dry-run"])
    assert result.exit_code == 2 and result.output.count("\n") == 1 and "wandb" in result.output
    result = runner.invoke(app, ["study", "quick", "--mlflow-uri", "sqlite:///x.db", "--dry-run"])
    assert result.output.strip() == "error: --mlflow-uri: only with --track mlflow"


@pytest.mark.parametrize("fault", ["a folder in its place", "a file in place of its folder"])
def test_an_mlflow_database_that_cannot_be_written_is_dropped_at_once(tmp_path, monkeypatch, fault):
    """One warning line and the study runs; MLflow's own retries (ten engines, pausing about 100 s in
    all) are never entered: the database is checked first."""
    import io

    import mlflow.store.db.utils as db_utils

    if fault == "a folder in its place":
        (tmp_path / "mlflow.db").mkdir()
        uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    else:
        (tmp_path / "file").write_text("in the way")
        uri = f"sqlite:///{tmp_path / 'file' / 'mlflow.db'}"
    engines = []  # MLflow's retry loop creates an engine per attempt
    real = db_utils.create_sqlalchemy_engine
    monkeypatch.setattr(db_utils, "create_sqlalchemy_engine", lambda uri: engines.append(uri) or real(uri))
    stream = io.StringIO()
    trackers = make_trackers(["mlflow"], uri)
    outcome = run_study(
        parse_spec(SPEC),
        tmp_path / "out",
        workers=1,
        progress=False,
        report=False,
        trackers=trackers,
        stream=stream,
    )
    assert outcome.ran == 2 and not outcome.failed and engines == []
    (line,) = stream.getvalue().splitlines()
    assert line.startswith(f"warning: --track mlflow stopped (ValueError: --track mlflow: cannot use the "
                           f"tracking URI {uri!r}")  # fmt: skip


def test_an_unresponsive_mlflow_server_is_dropped_with_one_warning(tmp_path, monkeypatch):
    """A server that accepts connections and never answers (a listening socket nobody reads): the
    request times out (here after 1 s; 5 s by default, one retry) and the study runs without it."""
    import io
    import socket

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        uri = f"http://127.0.0.1:{server.getsockname()[1]}"
        stream = io.StringIO()
        outcome = run_study(
            parse_spec(SPEC), tmp_path, workers=1, progress=False, report=False,
            trackers=make_trackers(["mlflow"], uri), stream=stream,
        )  # fmt: skip
    assert outcome.ran == 2 and not outcome.failed
    (line,) = stream.getvalue().splitlines()
    assert line.startswith(f"warning: --track mlflow stopped (ValueError: --track mlflow: cannot use the "
                           f"tracking URI {uri!r}")  # fmt: skip
