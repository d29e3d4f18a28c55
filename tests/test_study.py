"""Study specs, store, resume after interruption (exception and kill -9), failures, findings, report, CLI."""

import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, compute_findings, executors, load_spec, parse_spec, preset_names, run_study
from addnorm.train import RunConfig, RunResult

TINY = dict(
    d_model=16,
    n_heads=2,
    d_ff=32,
    n_layers=2,
    steps=4,
    batch_size=4,
    seq_len=16,
    eval_every=2,
    eval_batches=1,
)


def tiny_spec(**sweep):
    return {
        "name": "tiny",
        "base": dict(TINY),
        "experiments": {"main": {"sweep": sweep or {"placement": ["post", "pre"]}}},
    }


def test_every_preset_validates_and_expands_with_stable_ids():
    names = preset_names()
    assert {"quick", "gradient-flow", "warmup", "lr-sweep", "depth", "ablations", "dropout"} <= set(names)
    for name in names:
        runs = load_spec(name).expand()
        ids = [r.run_id for r in runs]
        assert runs and len(ids) == len(set(ids))
        assert ids == [r.run_id for r in load_spec(name).expand()]
    ablations = load_spec("ablations").expand()
    assert {r.config.n_layers for r in ablations} == {2, 6, 12}
    assert {(r.config.residual, r.config.norm) for r in ablations} >= {
        (False, "layernorm"),
        (True, "none"),
        (True, "batchnorm"),
    }


def test_literature_preset_covers_every_placement():
    from addnorm import PLACEMENTS

    runs = load_spec("literature").expand()
    for experiment in ("depth_warmup", "lr_tolerance"):
        assert {r.config.placement for r in runs if r.experiment == experiment} == set(PLACEMENTS)


def test_overrides_and_spec_errors(tmp_path):
    spec = load_spec("quick", ["steps=7", "base.eval_batches=3", "experiments.warmup.set.lr=0.01"])
    assert all(r.config.eval_batches == 3 for r in spec.expand())
    assert {r.config.lr for r in spec.expand() if r.experiment == "warmup"} == {0.01}
    with pytest.raises(ValueError, match=r"base.stepz: unknown key; allowed keys: task"):
        parse_spec({"name": "x", "base": {"stepz": 3}, "experiments": {"a": {}}})
    with pytest.raises(ValueError, match=r"experiments.a.sweep.placement: expected a non-empty list"):
        parse_spec({"name": "x", "experiments": {"a": {"sweep": {"placement": "post"}}}})
    with pytest.raises(ValueError, match=r"experiments.a: placement: unknown placement 'pst'"):
        parse_spec({"name": "x", "experiments": {"a": {"sweep": {"placement": ["pst"]}}}})
    with pytest.raises(ValueError, match="spec: unknown preset 'quik'; presets: ablations"):
        load_spec("quik")


def _count_calls(monkeypatch):
    calls = []
    real = executors.train

    def counting(cfg, on_step=None):
        calls.append(cfg.run_id)
        return real(cfg, on_step=on_step)

    monkeypatch.setattr(executors, "train", counting)
    return calls


def test_end_to_end_study_writes_database_and_report_and_resumes(tmp_path, monkeypatch):
    calls = _count_calls(monkeypatch)
    spec = parse_spec(tiny_spec(placement=["post", "pre"], warmup=[0, 2]))
    outcome = run_study(spec, tmp_path, progress=False)
    assert outcome.total == outcome.ran == 4 and len(calls) == 4
    with Store(tmp_path / "study.sqlite") as store:
        runs = store.runs()
        assert {r["status"] for r in runs} == {"done"} and len(runs) == 4
        assert store.metric(runs[0]["id"], "train_loss")
        assert store.layer_metric(runs[0]["id"], "weight_grad_norm", step=0)
        finished = {r["id"]: r["finished"] for r in runs}
    html = (tmp_path / "report.html").read_text()
    assert "Findings" in html and "data:image/png;base64," in html
    assert "Pre-LN trains without warmup where Post-LN needs it" in html
    again = run_study(spec, tmp_path, progress=False)
    assert again.ran == 0 and again.skipped == 4 and len(calls) == 4  # nothing recomputed
    with Store(tmp_path / "study.sqlite") as store:
        assert {r["id"]: r["finished"] for r in store.runs()} == finished  # nothing lost or rewritten
        paths = store.export_csv(tmp_path / "csv")
    assert [p.name for p in paths] == ["runs.csv", "metrics.csv", "layer_metrics.csv"]
    assert len((tmp_path / "csv" / "runs.csv").read_text().splitlines()) == 5


def test_interrupted_study_resumes_where_it_stopped(tmp_path, monkeypatch):
    real = executors.train
    calls = []

    def interrupt_third(cfg, on_step=None):
        calls.append(cfg.run_id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(cfg, on_step=on_step)

    monkeypatch.setattr(executors, "train", interrupt_third)
    spec = parse_spec(tiny_spec(placement=["post", "pre"], seed=[0, 1]))
    with pytest.raises(KeyboardInterrupt):
        run_study(spec, tmp_path, progress=False)
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 2
    calls.clear()
    monkeypatch.setattr(
        executors, "train", lambda cfg, on_step=None: (calls.append(cfg.run_id), real(cfg))[1]
    )
    outcome = run_study(spec, tmp_path, progress=False)
    assert outcome.skipped == 2 and outcome.ran == 2 and len(calls) == 2
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 4


def test_failed_and_diverged_runs_are_recorded_and_the_study_goes_on(tmp_path, monkeypatch):
    real = executors.train

    def fail_post(cfg, on_step=None):
        if cfg.placement == "post":
            raise RuntimeError("boom in post")
        return real(cfg, on_step=on_step)

    monkeypatch.setattr(executors, "train", fail_post)
    spec = tiny_spec(placement=["post", "pre"])
    spec["experiments"]["wild"] = {
        "set": {"lr": 50.0, "norm": "none", "steps": 30, "diverge_factor": 1.5, "eval_every": 0}
    }
    run_study(parse_spec(spec), tmp_path, progress=False)
    with Store(tmp_path / "study.sqlite") as store:
        by_status = {r["status"]: r for r in store.runs()}
    assert by_status["failed"]["error"] == "RuntimeError: boom in post"
    assert by_status["done"]["config"]["placement"] == "pre"
    assert by_status["diverged"]["diverged_step"] is not None
    assert "diverged" in (tmp_path / "report.html").read_text()


def _fake(store, placement, warmup, val_loss, status="done"):
    cfg = RunConfig(placement=placement, warmup=warmup, lr=0.003).to_dict()
    result = RunResult(
        status=status,
        final={"train_loss": val_loss, "val_loss": val_loss, "val_metric": 0.0, "metric": "bits_per_byte"}
        if status == "done"
        else {},
    )
    run_id = RunConfig(**cfg).run_id
    store.save_run("fake", run_id, [("warmup", f"{placement} {warmup}")], cfg, result, time.time())
    return run_id


def test_findings_are_computed_from_the_database(tmp_path):
    with Store(tmp_path / "study.sqlite") as store:
        post0 = _fake(store, "post", 0, 3.0)
        _fake(store, "post", 100, 2.0)
        _fake(store, "pre", 0, 1.9)
        _fake(store, "pre", 100, 1.9)
        verdicts = {f.claim: f for f in compute_findings(store)}
        warm = verdicts["Pre-LN trains without warmup where Post-LN needs it"]
        assert warm.verdict == "supported" and "3.000" in warm.evidence
        assert (
            verdicts["Pre-LN without a final norm is worse than with it"].verdict
            == "not tested by this study"
        )
        store.db.execute("UPDATE runs SET final_val_loss = 1.8 WHERE id = ?", (post0,))
        store.db.commit()
        warm = {f.claim: f for f in compute_findings(store)}[
            "Pre-LN trains without warmup where Post-LN needs it"
        ]
        assert warm.verdict == "not supported" and "1.800" in warm.evidence


def test_cli_study_report_export_and_errors(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(tiny_spec(placement=["pre"])))
    runner = CliRunner()
    out = tmp_path / "out"
    result = runner.invoke(app, ["study", str(spec_path), "--out", str(out), "--quiet", "--set", "steps=3"])
    assert result.exit_code == 0, result.output
    assert "report:" in result.output and (out / "report.html").exists()
    (out / "report.html").unlink()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0 and (out / "report.html").exists()
    assert runner.invoke(app, ["export", str(out)]).exit_code == 0 and (out / "csv" / "metrics.csv").exists()
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nbase: {steps: [1, 2\n")
    result = runner.invoke(app, ["study", str(bad)])
    assert result.exit_code == 2 and "not valid YAML (line" in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output
    bad.write_text(yaml.safe_dump({"name": "x", "base": {"placemnt": "pre"}, "experiments": {"a": None}}))
    result = runner.invoke(app, ["study", str(bad)])
    assert result.exit_code == 2 and "base.placemnt: unknown key" in result.output
    result = runner.invoke(app, ["report", str(tmp_path / "nowhere")])
    assert result.exit_code == 2 and "no study database" in result.output


def test_killed_study_loses_only_the_run_in_flight(tmp_path):
    spec = tiny_spec(seed=[0, 1, 2, 3, 4, 5])
    spec["base"]["steps"] = 40
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "addnorm.cli", "study", str(path), "--out", str(out), "--quiet"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    db = out / "study.sqlite"
    deadline = time.time() + 120
    stored = 0
    while time.time() < deadline and proc.poll() is None:
        if db.exists():
            try:
                with sqlite3.connect(db) as con:
                    stored = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
            except sqlite3.OperationalError:
                stored = 0
            if stored >= 2:
                break
        time.sleep(0.05)
    assert proc.poll() is None, "the study finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with Store(db) as store:
        before = {r["id"]: r["finished"] for r in store.runs()}
    assert 2 <= len(before) < 6
    result = CliRunner().invoke(app, ["study", str(path), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    assert f"({len(before)} already stored, {6 - len(before)} run now)" in result.output
    with Store(db) as store:
        after = {r["id"]: r["finished"] for r in store.runs()}
    assert len(after) == 6 and all(after[k] == v for k, v in before.items())


def test_report_ranks_placements_when_a_study_compares_several(tmp_path):
    spec = {"name": "rank", "base": dict(TINY), "experiments": {
        "main": {"sweep": {"placement": ["post", "pre", "rezero"]}, "rank": True},
        "lrs": {"sweep": {"placement": ["post", "pre", "rezero"], "lr": [0.001, 0.01]}, "rank": True},
    }}  # fmt: skip
    run_study(parse_spec(spec), tmp_path, progress=False)
    html = (tmp_path / "report.html").read_text()
    assert "<h2>Ranking</h2>" in html and "tolerated learning rates" in html
    ranking = html[html.index("<h2>Ranking</h2>") : html.index("</table>", html.index("<h2>Ranking</h2>"))]
    assert all(f"<td>{p}</td>" in ranking for p in ("post", "pre", "rezero"))
    with Store(tmp_path / "study.sqlite") as store:
        main = [r for r in store.runs() if any(e == "main" for e, _ in r["experiments"])]
    best = min(main, key=lambda r: r["final_val_loss"])["config"]["placement"]
    assert ranking.index(f"<td>1</td><td>{best}</td>") > 0


def test_report_ranks_only_experiments_marked_for_ranking(tmp_path):
    spec = {"name": "norank", "base": dict(TINY), "experiments": {
        "main": {"sweep": {"placement": ["post", "pre", "rezero"]}}}}  # fmt: skip
    run_study(parse_spec(spec), tmp_path, progress=False)
    assert "<h2>Ranking</h2>" not in (tmp_path / "report.html").read_text()
