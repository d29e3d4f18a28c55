"""Study specs, identity, store, resume after interruption (exception and kill -9), stale runs, retries,
findings, report, CLI."""

import csv
import os
import signal
import sqlite3
import subprocess
import sys
import time

import pytest
import yaml
from tiny_runs import TINY_SIZES
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, compute_findings, executors, load_spec, parse_spec, preset_names, run_study
from addnorm.study.spec import apply_overrides
from addnorm.train import RunConfig

TINY = dict(TINY_SIZES, steps=4, eval_every=2, eval_batches=1)


def tiny_spec(**sweep):
    return {
        "name": "tiny",
        "base": dict(TINY),
        "experiments": {"main": {"sweep": sweep or {"placement": ["post", "pre"]}}},
    }


def run(spec, out, **kw):
    """run_study in this process (tests stay fast: no worker start-up)."""
    return run_study(spec, out, workers=1, progress=False, **kw)


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


def test_quick_preset_runs_three_seeds_for_every_compared_arm():
    runs = load_spec("quick").expand()
    arms: dict = {}
    for r in runs:
        key = repr(sorted((k, repr(v)) for k, v in r.config.to_dict().items() if k != "seed"))
        arms.setdefault(key, set()).add(r.config.seed)
    assert min(len(seeds) for seeds in arms.values()) >= 3
    flow = [r for r in runs if r.experiment == "gradient_flow"]
    assert {r.config.init for r in flow} == {"torch", "xavier", "gpt2"}


def test_literature_preset_covers_every_placement():
    from addnorm import PLACEMENTS

    runs = load_spec("literature").expand()
    for experiment in ("depth", "lr_tolerance"):
        assert {r.config.placement for r in runs if r.experiment == experiment} == set(PLACEMENTS)
    seeds: dict = {}  # the ranked depth comparison: four seeds for every placement and depth
    for r in runs:
        if r.experiment == "depth":
            seeds.setdefault((r.config.placement, r.config.n_layers), set()).add(r.config.seed)
    assert len(seeds) == 2 * len(PLACEMENTS) and {len(s) for s in seeds.values()} == {4}
    # one seed list (a YAML anchor) for the depth and warmup comparisons
    sweeps = load_spec("literature").experiments
    assert sweeps["warmup"]["sweep"]["seed"] == sweeps["depth"]["sweep"]["seed"] == [0, 1, 2, 3]


def test_aliases_are_the_same_run_and_the_findings_see_them(tmp_path):
    a = RunConfig(placement="Post-LN", norm="LN", init="Xavier", activation="ReLU", task="char_lm", lr=1)
    b = RunConfig(placement="post", norm="layernorm", init="xavier", activation="relu", task="lm", lr=1.0)
    assert a.run_id == b.run_id and a.to_dict() == b.to_dict() and a.placement == "post"
    spec = tiny_spec(placement=["Post-LN", "pre_norm"], warmup=[0, 2], seed=[0, 1, 2])
    spec["base"]["eval_every"] = 0
    run(parse_spec(spec), tmp_path, report=False)
    with Store(tmp_path / "study.sqlite") as store:
        assert {r["config"]["placement"] for r in store.runs()} == {"post", "pre"}
        (warm,) = [f for f in compute_findings(store) if f.claim.startswith("Pre-LN trains without warmup")]
    assert warm.verdict != "not tested by this study"


def test_overrides_reach_everywhere_and_typos_are_errors():
    spec = load_spec("quick", ["steps=120", "base.eval_batches=3", "experiments.warmup.set.lr=0.01"])
    runs = spec.expand()
    assert {r.config.steps for r in runs} == {120}  # experiments that set their own steps included
    assert {r.config.eval_batches for r in runs} == {1, 3}  # gradient_flow sets its own
    assert {r.config.lr for r in runs if r.experiment == "warmup"} == {0.01}
    one_seed = load_spec("quick", ["seed=5"]).expand()
    assert {r.config.seed for r in one_seed} == {5}  # a sweep over the key collapses to the value
    with pytest.raises(ValueError, match=r"--set experiments.ablation.set.steps: no experiment 'ablation'"):
        load_spec("quick", ["experiments.ablation.set.steps=20"])
    with pytest.raises(ValueError, match=r"--set stepz: unknown key"):
        load_spec("quick", ["stepz=20"])
    with pytest.raises(ValueError, match=r"--set base.stepz: unknown run key 'stepz'"):
        load_spec("quick", ["base.stepz=20"])
    with pytest.raises(
        ValueError, match=r"--set experiments.warmup.sett.lr: 'sett' is not an experiment key"
    ):
        load_spec("quick", ["experiments.warmup.sett.lr=1"])
    with pytest.raises(
        ValueError, match=r"warmup: 200 warmup steps need more than that many steps, got steps=60"
    ):
        load_spec("warmup", ["steps=60", "eval_every=10"])
    with pytest.raises(ValueError, match=r"eval_every: 100 is more than steps=50"):
        load_spec("ablations", ["steps=50", "warmup=0"])
    data = {
        "name": "x",
        "base": {},
        "experiments": {"a": {"sweep": {"variant": [{"label": "v", "lr": 1.0}]}}},
    }
    assert apply_overrides(data, ["lr=0.5"])["experiments"]["a"]["sweep"]["variant"][0]["lr"] == 0.5


def test_spec_errors_name_the_key():
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
    outcome = run(spec, tmp_path)
    assert outcome.total == outcome.ran == 4 and len(calls) == 4 and not outcome.failed
    with Store(tmp_path / "study.sqlite") as store:
        runs = store.runs()
        assert {r["status"] for r in runs} == {"done"} and len(runs) == 4
        assert store.metric(runs[0]["id"], "train_loss")
        assert store.layer_metric(runs[0]["id"], "weight_grad_norm", step=0)
        finished = {r["id"]: r["finished"] for r in runs}
    html = (tmp_path / "report.html").read_text()
    assert "Findings" in html and "data:image/png;base64," in html
    assert "Pre-LN trains without warmup where Post-LN needs it" in html
    again = run(spec, tmp_path)
    assert again.ran == 0 and again.skipped == 4 and len(calls) == 4  # nothing recomputed
    with Store(tmp_path / "study.sqlite") as store:
        assert {r["id"]: r["finished"] for r in store.runs()} == finished  # nothing lost or rewritten


def test_provenance_is_stored_with_each_run_and_reported(tmp_path):
    run(parse_spec(tiny_spec(placement=["pre"])), tmp_path)
    with Store(tmp_path / "study.sqlite") as store:
        (stored,) = store.runs()
    prov = stored["provenance"]
    assert {"addnorm", "git_commit", "torch", "python", "device", "threads", "date"} <= set(prov)
    import torch

    import addnorm

    assert prov["addnorm"] == addnorm.__version__ and prov["torch"] == torch.__version__
    assert isinstance(prov["threads"], int) and prov["threads"] >= 1 and prov["date"].startswith("20")
    page = (tmp_path / "report.html").read_text()
    assert "Provenance" in page and prov["torch"] in page and prov["device"] in page
    assert "Base configuration" in page and "<th>d_model</th><td class=given>16</td>" in page


def test_tidy_export_has_one_column_per_config_key(tmp_path):
    run(parse_spec(tiny_spec(placement=["post", "pre"])), tmp_path, report=False)
    with Store(tmp_path / "study.sqlite") as store:
        paths = store.export_csv(tmp_path / "csv")
    assert [p.name for p in paths] == ["runs.csv", "experiments.csv", "metrics.csv", "layer_metrics.csv"]
    with (tmp_path / "csv" / "runs.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == 2 and {r["placement"] for r in rows} == {"post", "pre"}
    assert set(RunConfig.keys()) <= set(rows[0]) and rows[0]["d_model"] == "16"
    assert rows[0]["provenance_torch"] and rows[0]["started"].endswith("+00:00")
    with (tmp_path / "csv" / "experiments.csv").open() as fh:
        assert [r["experiment"] for r in csv.DictReader(fh)] == ["main", "main"]


def test_stale_runs_stay_out_of_the_report_until_pruned(tmp_path):
    spec = tiny_spec(placement=["post", "pre"], seed=[0, 1])
    run(parse_spec(spec), tmp_path)
    spec["base"]["steps"] = 6  # the spec is edited: four new runs
    outcome = run(parse_spec(spec), tmp_path)
    assert outcome.ran == 4 and outcome.stale == 4
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 4 and {r["config"]["steps"] for r in store.runs()} == {6}
        assert len(store.stale_ids()) == 4
    page = (tmp_path / "report.html").read_text()
    assert "4 runs (4 done)" in page and "4 stored runs are not part of this spec" in page
    pruned = run(parse_spec(spec), tmp_path, prune=True)
    assert pruned.pruned == 4 and pruned.stale == 0 and pruned.ran == 0
    with sqlite3.connect(tmp_path / "study.sqlite") as con:
        assert con.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 4
        assert con.execute("SELECT COUNT(DISTINCT run_id) FROM metrics").fetchone()[0] == 4


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
        run(spec, tmp_path, report=False)
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 2
    calls.clear()
    monkeypatch.setattr(
        executors, "train", lambda cfg, on_step=None: (calls.append(cfg.run_id), real(cfg))[1]
    )
    outcome = run(spec, tmp_path, report=False)
    assert outcome.skipped == 2 and outcome.ran == 2 and len(calls) == 2
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 4


def test_failed_runs_are_retried_and_diverged_runs_kept(tmp_path, monkeypatch):
    real = executors.train
    calls = []

    def fail_post(cfg, on_step=None):
        calls.append(cfg.placement)
        if cfg.placement == "post":
            raise RuntimeError("boom in post")
        return real(cfg, on_step=on_step)

    monkeypatch.setattr(executors, "train", fail_post)
    spec = tiny_spec(placement=["post", "pre"])
    spec["experiments"]["wild"] = {
        "set": {"lr": 50.0, "norm": "none", "steps": 30, "diverge_factor": 1.5, "eval_every": 0}
    }
    outcome = run(parse_spec(spec), tmp_path)
    assert outcome.failed == ["main: placement=post (RuntimeError: boom in post)"]
    with Store(tmp_path / "study.sqlite") as store:
        by_status = {r["status"]: r for r in store.runs()}
    assert by_status["failed"]["error"] == "RuntimeError: boom in post"
    assert by_status["done"]["config"]["placement"] == "pre"
    assert by_status["diverged"]["diverged_step"] is not None
    assert "diverged" in (tmp_path / "report.html").read_text()
    calls.clear()
    monkeypatch.setattr(executors, "train", real)
    again = run(parse_spec(spec), tmp_path)
    assert again.ran == 1 and not again.failed  # only the failed run, now fixed; the diverged one is kept
    with Store(tmp_path / "study.sqlite") as store:
        assert sorted(r["status"] for r in store.runs()) == ["diverged", "done", "done"]


def test_cli_exits_nonzero_when_a_run_failed_after_writing_the_rest(tmp_path, monkeypatch):
    real = executors.train

    def fail_post(cfg, on_step=None):
        if cfg.placement == "post":
            raise RuntimeError("boom")
        return real(cfg, on_step=on_step)

    monkeypatch.setattr(executors, "train", fail_post)
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(tiny_spec(placement=["post", "pre"])))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["study", str(path), "--out", str(out), "--quiet", "--workers", "1"])
    assert result.exit_code == 1
    assert "1 run(s) failed" in result.output and "main: placement=post (RuntimeError: boom)" in result.output
    assert (out / "report.html").is_file()
    with Store(out / "study.sqlite") as store:
        assert sorted(r["status"] for r in store.runs()) == ["done", "failed"]
    monkeypatch.setattr(executors, "train", lambda cfg, on_step=None: (_ for _ in ()).throw(OSError("disk")))
    every = CliRunner().invoke(
        app, ["study", str(path), "--out", str(tmp_path / "o2"), "--quiet", "--workers", "1"]
    )
    assert every.exit_code == 1 and "2 run(s) failed" in every.output


def test_cli_study_report_export_and_errors(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(yaml.safe_dump(tiny_spec(placement=["pre"])))
    runner = CliRunner()
    out = tmp_path / "out"
    args = ["study", str(spec_path), "--out", str(out), "--quiet", "--set", "steps=3", "--workers", "1"]
    result = runner.invoke(app, args)
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
    cmd = [
        sys.executable,
        "-m",
        "addnorm",
        "study",
        str(path),
        "--out",
        str(out),
        "--quiet",
        "--workers",
        "1",
    ]
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
    result = CliRunner().invoke(app, ["study", str(path), "--out", str(out), "--quiet", "--workers", "1"])
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
    run(parse_spec(spec), tmp_path)
    html = (tmp_path / "report.html").read_text()
    assert "Ranking</h2>" in html and "tolerated learning rates" in html
    start = html.index("Ranking</h2>")
    ranking = html[start : html.index("</table>", start)]
    assert all(f"<td>{p}</td>" in ranking for p in ("post", "pre", "rezero"))
    with Store(tmp_path / "study.sqlite") as store:
        main = [r for r in store.runs() if any(e == "main" for e, _ in r["experiments"])]
    best = min(main, key=lambda r: r["final_val_loss"])["config"]["placement"]
    assert ranking.index(f"<td>1</td><td>{best}</td>") > 0


def test_report_ranks_only_experiments_marked_for_ranking(tmp_path):
    spec = {"name": "norank", "base": dict(TINY), "experiments": {
        "main": {"sweep": {"placement": ["post", "pre", "rezero"]}}}}  # fmt: skip
    run(parse_spec(spec), tmp_path)
    assert "Ranking</h2>" not in (tmp_path / "report.html").read_text()
