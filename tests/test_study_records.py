"""Study results as records and views: the spec expanded once per command, one per-layer profile rule for
the report, the findings, the trackers and the export (Hugging Face's ``mlp`` as addnorm's ``ff``), and
the analysis modules kept below the model (no torch, no ops, no run config)."""

from __future__ import annotations

import ast
import csv
import html
import math
import re
import sqlite3
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, build_report, parse_spec, run_study, spec
from addnorm.study.analysis import analyse, layer_panels
from addnorm.study.profiles import combine, ffn_grad_profile, layer_profile
from addnorm.study.rule import VERDICTS
from addnorm.study.trackers import layer_values
from addnorm.train import RunConfig, RunResult

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)
STUDY = Path(__file__).resolve().parents[1] / "src" / "addnorm" / "study"


def row(layer, value, sublayer="ff", metric="weight_grad_norm", step=0, param="w"):
    return {"step": step, "layer": layer, "layer_name": f"layers.{layer}", "sublayer": sublayer,
            "metric": metric, "param": param, "value": value}  # fmt: skip


def test_the_profile_rule_by_hand():
    rows = [
        row(0, 3.0, param="ff.w1.weight"), row(0, 4.0, param="ff.w2.weight"),  # sqrt(9 + 16) = 5
        row(1, 1.0, "mlp", param="mlp.gate_proj.weight"), row(1, 2.0, "mlp", param="mlp.up_proj.weight"),
        row(1, 2.0, "mlp", param="mlp.down_proj.weight"),  # Hugging Face's FFN: sqrt(1 + 4 + 4) = 3
        row(0, 7.0, "self_attn"), row(1, 7.0, "self_attn"),  # attention: not the FFN
        row(0, 9.0, step=5), row(1, 1.0, step=5),  # a later step
        row(0, 0.1, "ff", "update_ratio", step=5), row(0, 0.3, "ff", "update_ratio", step=5),
        row(0, 1.5, "", "act_rms"), row(1, 2.5, "", "act_rms"),
    ]  # fmt: skip
    assert layer_profile(rows, "weight_grad_norm", "ffn") == {0: 5.0, 1: 3.0}
    assert ffn_grad_profile(rows) == [5.0, 3.0]
    assert layer_profile(rows, "weight_grad_norm", "ffn", "last") == {0: 9.0, 1: 1.0}
    assert layer_profile(rows, "update_ratio", "ffn", "last") == {0: pytest.approx(0.2)}  # the mean
    assert layer_profile(rows, "act_rms", "stream") == {0: 1.5, 1: 2.5}
    assert layer_profile(rows, "grad_norm", "stream") == {}
    assert combine("weight_grad_norm", [3.0, 4.0]) == 5.0 and combine("act_rms", [1.0, 3.0]) == 2.0
    with pytest.raises(ValueError, match="part: expected one of ffn, stream"):
        layer_profile(rows, "act_rms", "attention")
    # the trackers' per-sublayer values follow the same rule
    tracked = layer_values(rows)
    assert tracked[(0, "weight_grad_norm/L00.ff")] == 5.0 and tracked[(0, "weight_grad_norm/L01.mlp")] == 3.0


def save(store, placement, grads, sublayer, seed=0, status="done"):
    """A stored run whose FFN weight gradients at step 0 are ``grads`` (one matrix per value and layer)."""
    cfg = RunConfig(placement=placement, n_layers=len(grads), seed=seed).to_dict()
    rows = [
        row(k, g, sublayer, param=f"{sublayer}.{i}") for k, gs in enumerate(grads) for i, g in enumerate(gs)
    ]
    rows += [row(k, 1.0 + k, "", "act_rms") for k in range(len(grads))]
    final = {"train_loss": 2.0, "val_loss": 2.0, "val_metric": 0.0, "metric": "bits_per_byte"}
    result = RunResult(status=status, final=final, layer_metrics=rows)
    run_id = RunConfig(**cfg).run_id
    store.save_run("s", run_id, [("main", f"placement={placement}, seed={seed}")], cfg, result, time.time())
    return run_id


def test_report_and_findings_read_hugging_face_ffn_rows(tmp_path):
    """The report's FFN panels and the gradient findings read ``mlp`` rows as they read ``ff`` rows (the
    report used to filter on ``ff`` only: its FFN panels were empty for Hugging Face runs)."""
    with Store(tmp_path / "s.sqlite") as store:
        for seed, top in enumerate((3.0, 3.3, 2.7)):
            save(store, "post", [[1.0, 0.0], [1.5, 0.0], [2.0, 0.0], [top, 0.0]], "mlp", seed)
        runs = store.runs()
        panels = layer_panels(store, runs, "main", ["weight_grad_norm", "act_rms"], "init")
        findings = {f.claim: f for f in analyse(store).findings}
    assert panels.metrics == ["weight_grad_norm", "act_rms"]
    (ffn,) = [s for s in panels.series if s.metric == "weight_grad_norm"]
    assert ffn.layers == [1, 2, 3, 4] and ffn.values == pytest.approx([1.0, 1.5, 2.0, 3.0]) and ffn.seeds == 3
    post = findings["Post-LN gradient norms grow toward the top layers"]
    assert post.verdict == "supported" and "per seed 3.00, 3.30, 2.70" in post.evidence


def test_a_hugging_face_study_draws_its_ffn_panels(tmp_path):
    pytest.importorskip("transformers")
    study = {
        "name": "hf",
        "base": {**TINY, "model": "hf-llama", "kv_heads": 1},
        "experiments": {"main": None},
    }
    run_study(parse_spec(study), tmp_path, workers=1, progress=False)
    page = (tmp_path / "report.html").read_text()
    assert 'alt="main: per-layer FFN weight-gradient norm, residual-stream gradient norm' in page
    with Store(tmp_path / "study.sqlite") as store:
        (run,) = store.runs()
        panels = layer_panels(store, [run], "main", ["weight_grad_norm"], "init")
    # the oracle: the stored mlp rows at step 0, combined by hand in SQL
    with sqlite3.connect(tmp_path / "study.sqlite") as con:
        expected = con.execute(
            "SELECT layer, SUM(value * value) FROM layer_metrics WHERE run_id = ? AND step = 0 AND "
            "metric = 'weight_grad_norm' AND sublayer = 'mlp' GROUP BY layer ORDER BY layer",
            (run["id"],),
        ).fetchall()
    assert len(expected) == 2
    (series,) = panels.series
    assert series.values == pytest.approx([math.sqrt(s) for _, s in expected], rel=1e-12)


def test_the_spec_is_expanded_once_per_command(tmp_path, monkeypatch):
    calls = Counter()
    real = spec._expand_experiment

    def counting(name, exp, base):
        calls[name] += 1
        return real(name, exp, base)

    monkeypatch.setattr(spec, "_expand_experiment", counting)
    path, out = tmp_path / "spec.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump({"name": "once", "base": TINY, "experiments": {
        "a": {"sweep": {"placement": ["post", "pre"]}}, "b": {"sweep": {"placement": ["pre"], "seed": [1]}},
    }}))  # fmt: skip
    runner = CliRunner()
    for args in (["--dry-run"], ["--quiet", "--csv"]):
        calls.clear()
        result = runner.invoke(app, ["study", str(path), "--out", str(out), "--workers", "1", *args])
        assert result.exit_code == 0, result.output
        assert calls == {"a": 1, "b": 1}, args
    calls.clear()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0
    assert runner.invoke(app, ["export", str(out)]).exit_code == 0
    assert not calls  # readers read the stored plan


def test_export_writes_the_profiles_the_report_reads(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        run_id = save(store, "pre", [[3.0, 4.0], [1.0, 0.0]], "ff")
        store.save_plan("s", {"experiments": {"main": None}}, {}, [(run_id, "main", "placement=pre, seed=0")])
    result = CliRunner().invoke(app, ["export", str(tmp_path / "x"), "--to", str(tmp_path / "csv")])
    assert result.exit_code == 2 and "no study database" in result.output
    (tmp_path / "s.sqlite").rename(tmp_path / "study.sqlite")
    result = CliRunner().invoke(app, ["export", str(tmp_path), "--to", str(tmp_path / "plain")])
    assert result.exit_code == 0 and not (tmp_path / "plain" / "layer_profiles.csv").exists()
    result = CliRunner().invoke(app, ["export", str(tmp_path), "--to", str(tmp_path / "csv"), "--profiles"])
    assert result.exit_code == 0, result.output
    with (tmp_path / "csv" / "layer_profiles.csv").open() as fh:
        rows = list(csv.DictReader(fh))
    ffn = {
        r["layer"]: float(r["value"])
        for r in rows
        if r["metric"] == "weight_grad_norm" and r["part"] == "ffn"
    }
    assert ffn == {"0": 5.0, "1": 1.0}  # sqrt(3^2 + 4^2), sqrt(1^2)
    assert {r["part"] for r in rows if r["metric"] == "act_rms"} == {"stream"}


# Modules that read, judge and show a study: none of them may import torch, the ops, the model, the
# training code or the spec (which builds run configs) at module level.
ANALYSIS_MODULES = (
    "store", "profiles", "rule", "claims", "findings", "ranking", "records", "analysis", "figures", "report",
    "export", "compare",
)  # fmt: skip
FORBIDDEN = ("torch", "triton", "addnorm.ops", "addnorm.model", "addnorm.train", "addnorm.study.spec")


def module_imports(path: Path) -> set[str]:
    """Absolute names of the modules ``path`` imports at module level (relative imports resolved)."""
    names = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            package = "addnorm.study".split(".")
            base = package[: len(package) - node.level + 1] if node.level else []
            names.add(".".join([*base, *(node.module.split(".") if node.module else [])]))
    return names


def test_analysis_and_views_stay_below_the_model():
    for name in ANALYSIS_MODULES:
        path = STUDY / f"{name}.py"
        bad = {m for m in module_imports(path) if any(m == f or m.startswith(f + ".") for f in FORBIDDEN)}
        assert not bad, f"{name}.py imports {bad}"
        assert len(path.read_text().splitlines()) <= 600, f"{name}.py is over 600 lines"
    assert module_imports(STUDY / "report.py") >= {"addnorm.study.analysis", "addnorm.study.figures"}


def test_readers_leave_no_wal_or_shm_files_and_write_nothing(tmp_path):
    """``export`` and ``--dry-run`` read a WAL database; they used to leave its ``-wal`` and ``-shm``
    files in the study folder (a ``mode=ro`` connection cannot remove them). A study still writing keeps
    its files, and the reader's connection refuses writes."""
    path, out = tmp_path / "spec.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump({"name": "r", "base": TINY, "experiments": {"a": None}}))
    runner = CliRunner()
    assert (
        runner.invoke(app, ["study", str(path), "--out", str(out), "--quiet", "--workers", "1"]).exit_code
        == 0
    )
    (out / ".addnorm.lock").unlink()
    before = sorted(p.name for p in out.iterdir())
    assert "study.sqlite-wal" not in before and "study.sqlite-shm" not in before
    for args in (
        ["export", str(out), "--to", str(tmp_path / "csv")],
        ["study", str(path), "--out", str(out), "--dry-run"],
    ):
        assert runner.invoke(app, args).exit_code == 0
        assert sorted(p.name for p in out.iterdir()) == before, args
    with Store(out / "study.sqlite", readonly=True) as reader:
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.db.execute("DELETE FROM runs")
    with Store(out / "study.sqlite") as writer:  # a study holding the database open
        assert runner.invoke(app, ["export", str(out), "--to", str(tmp_path / "csv2")]).exit_code == 0
        assert (out / "study.sqlite-wal").exists()  # the writer's files stay while it holds them
        writer.db.execute("UPDATE runs SET wall_s = 1.5")
        writer.db.commit()
    with Store(out / "study.sqlite", readonly=True) as reader:
        assert [r["wall_s"] for r in reader.runs()] == [1.5]


def test_the_page_shows_every_finding_of_the_records_and_explains_every_verdict(tmp_path):
    """The page's findings table has one row per finding record (docs/report-quick.png once showed 11
    of a report's 14: the screenshots are rebuilt from reports by `make report-screenshots`), and every
    verdict is explained beside it."""
    with Store(tmp_path / "study.sqlite") as store:
        for seed, top in enumerate((3.0, 3.3, 2.7)):
            save(store, "post", [[1.0], [1.5], [2.0], [top]], "ff", seed)
        store.save_plan(
            "s", {"experiments": {"main": None}}, {}, [(r["id"], "main", "x") for r in store.runs()]
        )
        records = analyse(store)
    page = build_report(tmp_path).read_text()
    table = page[
        page.index("<table class='findings'>") : page.index(
            "</table>", page.index("<table class='findings'>")
        )
    ]
    rows = re.findall(r"<tr><td>(.*?)<br><small>.*?</small></td>.*?<td class='[a-z]+'>([^<]*)</td>", table)
    assert len(rows) == len(records.findings) == 10  # one per claim here: one measured, nine not tested
    assert [(html.escape(f.claim), f.verdict) for f in records.findings] == rows
    assert {v for _, v in rows} == {"supported", "not tested by this study"}
    for verdict, meaning in VERDICTS.items():
        assert f">{verdict}</span>: {html.escape(meaning)}</li>" in page


def test_the_provenance_table_names_every_stored_field(tmp_path):
    """Runs of a Hugging Face model store the transformers version (and every run its precision and
    whether it compiled): the report's provenance table shows them, saying which runs a field is from."""
    prov = {
        "addnorm": "0.1.0",
        "torch": "2.13.0",
        "device": "AMD EPYC",
        "precision": "fp32",
        "compile": False,
    }
    with Store(tmp_path / "study.sqlite") as store:
        members = []
        for model, extra in (("addnorm", {}), ("hf-llama", {"transformers": "5.23.0", "tp_plan": "auto"})):
            cfg = RunConfig(model=model).to_dict()
            result = RunResult(status="done", final={"val_loss": 2.0}, provenance={**prov, **extra})
            run_id = RunConfig(**cfg).run_id
            store.save_run("s", run_id, [("main", model)], cfg, result, time.time())
            members.append((run_id, "main", model))
        store.save_plan("s", {"experiments": {"main": None}}, {}, members)
    page = build_report(tmp_path).read_text()
    table = page[
        page.index("<h3>Provenance</h3>") : page.index("</table>", page.index("<h3>Provenance</h3>"))
    ]
    cells = dict(re.findall(r"<tr><th>([^<]*)</th><td>([^<]*)</td></tr>", table))
    assert cells["transformers"] == "5.23.0 (1 of 2 runs)"
    assert cells["torch"] == "2.13.0" and cells["precision"] == "fp32" and cells["compiled"] == "false"
    assert cells["tp_plan"] == "auto (1 of 2 runs)"  # a field the report does not know, under its own name
    assert list(cells)[:5] == ["addnorm", "torch", "transformers", "device", "precision"]
