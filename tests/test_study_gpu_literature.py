"""The ``gpu-literature`` preset: every literature placement ``with_placement`` can apply to Llama, at the
issue's size, three seeds, ranked; DeepNorm vs Post-LN at 24 layers and the warmup comparison; each run
estimated under a minute on a GPU (the description states the cost model's numbers); ``--dry-run`` lists
every run with an estimate, and ``--smoke`` runs every run on the CPU."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from typer.testing import CliRunner

from addnorm import PLACEMENTS
from addnorm.cli import app
from addnorm.study import Store, load_spec
from addnorm.study.budget import estimate_seconds
from addnorm.train.hf_model import not_applicable

PRESET = "gpu-literature"


def test_the_preset_is_the_literature_ranking_at_gpu_scale():
    spec = load_spec(PRESET)
    runs = spec.expand()
    applicable = {p for p in PLACEMENTS if not_applicable("hf-llama", p) is None}
    assert len(applicable) == 12  # sub_ln, resi_dual, hybridnorm, hybridnorm_star, ngpt: not applicable
    for run in runs:
        c = run.config.to_dict()
        assert (c["model"], c["d_model"], c["n_heads"], c["kv_heads"]) == ("hf-llama", 512, 8, 2)
        assert c["precision"] == "bf16" and c["steps"] >= 1000 and c["task"] == "lm" and c["corpus"] is None
        assert c["n_layers"] == (24 if run.experiment == "deepnorm" else 12)
    arms = Counter(
        (e, r.config.to_dict()["placement"], r.config.warmup, r.config.n_layers)
        for r in runs
        for e, _ in spec.memberships()[r.run_id]
    )
    assert set(arms.values()) == {3}  # three seeds for every arm of every experiment
    assert {p for e, p, _, _ in arms if e == "placements"} == applicable
    assert {(p, w) for e, p, w, _ in arms if e == "warmup"} == {
        (p, w) for p in ("post", "pre") for w in (0, 100)
    }
    assert {(p, n) for e, p, _, n in arms if e == "deepnorm"} == {("post", 24), ("deepnorm", 24)}
    assert spec.experiments["placements"]["rank"] is True
    assert {e for e, _, _ in spec.not_applicable()} == {"placements"} and len(runs) == 48


def test_every_run_is_estimated_under_a_minute_on_a_gpu_as_the_description_says():
    spec = load_spec(PRESET)
    seconds = {r.config.n_layers: estimate_seconds(r.config, gpu=True) for r in spec.expand()}
    assert max(seconds.values()) < 60
    total = sum(estimate_seconds(r.config, gpu=True) for r in spec.expand())
    text = " ".join(spec.description.split())
    assert f"about {seconds[12]:.0f} s a run at 12 layers and {seconds[24]:.0f} s at 24" in text
    assert f"{total / 60:.0f} minutes for the 48 runs" in text and "not yet timed" in text


def test_dry_run_lists_every_run_with_an_estimate(tmp_path):
    # the preset's 24-layer runs need ~19 GiB on a CPU: this machine's free memory is not the subject
    args = ["study", PRESET, "--dry-run", "--out", str(tmp_path), "--workers", "1", "--memory-limit", "off"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    rows = [line for line in result.output.splitlines() if re.search(r"│ [0-9a-f]{12} │", line)]
    assert len(rows) == 48 and all(re.search(r"│ (\d+m\d\ds|\d+s) +│", row) for row in rows)
    assert "48 runs, 0 already stored" in " ".join(result.output.split())
    assert not (tmp_path / "study.sqlite").exists()


def test_smoke_runs_every_run_of_the_preset_on_the_cpu(tmp_path):
    pytest.importorskip("transformers")
    result = CliRunner().invoke(app, ["study", PRESET, "--smoke", "--out", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 0, result.output
    with Store(tmp_path / "study.sqlite") as store:
        runs = store.runs()
    assert len(runs) == 48 and {r["status"] for r in runs} == {"done"}
    assert {r["config"]["n_layers"] for r in runs} == {12, 24}
    assert {r["provenance"]["precision"] for r in runs} == {"bfloat16 autocast"}
    page = (tmp_path / "report.html").read_text()
    assert "<h2 id='ranking'>Ranking</h2>" in page and "95% interval" in page
    assert "placements: placement=ngpt: not applicable" in page
