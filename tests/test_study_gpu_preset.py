"""The ``gpu`` preset: its runs are the issue's comparisons at GPU scale, and ``--smoke`` runs every one of
them on a CPU through the same code path at a tiny size."""

from __future__ import annotations

from collections import Counter

import pytest
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, load_spec

pytestmark = pytest.mark.slow  # smoke studies

KEPT = ("placement", "n_layers", "seed", "init", "precision", "lr", "task", "norm", "schedule", "model")


def test_the_preset_is_the_comparisons_at_scale():
    runs = load_spec("gpu").expand()
    for run in runs:
        c = run.config.to_dict()
        assert (c["d_model"], c["n_heads"], c["seq_len"], c["precision"]) == (512, 8, 256, "bf16")
        assert c["n_layers"] == (24 if run.experiment.startswith("deepnorm") else 12)
        assert c["model"] == ("hf-llama" if run.experiment.endswith("llama") else "addnorm")
    groups = Counter(
        (
            r.experiment,
            r.config.to_dict()["placement"],
            r.config.to_dict()["warmup"],
            r.config.to_dict()["init"],
        )
        for r in runs
    )
    assert set(groups.values()) == {3}  # three seeds for every configuration compared
    assert {(p, w) for e, p, w, _ in groups if e == "warmup"} == {
        ("post", 0),
        ("post", 200),
        ("pre", 0),
        ("pre", 200),
    }
    assert {p for e, p, _, _ in groups if e == "deepnorm"} == {"post", "deepnorm"}
    assert {p for e, p, _, _ in groups if e == "deepnorm_llama"} == {"post", "deepnorm"}
    ranked = {"post", "pre", "sandwich", "deepnorm", "mix"}
    assert {p for e, p, _, _ in groups if e == "placements_llama"} == ranked
    assert {p for e, p, _, _ in groups if e == "placements_addnorm"} == ranked
    assert {(p, i) for e, p, _, i in groups if e == "gradient_flow"} == {
        (p, i) for p in ("post", "pre") for i in ("torch", "xavier", "gpt2")
    }


def test_smoke_shrinks_widths_and_keeps_what_is_compared():
    full, smoke = load_spec("gpu").expand(), load_spec("gpu", smoke=True).expand()
    assert len(full) == len(smoke)
    for big, small in zip(full, smoke, strict=True):
        b, s = big.config.to_dict(), small.config.to_dict()
        assert big.experiment == small.experiment  # labels name the sweep values: warmup=1 for 200
        assert {k: b[k] for k in KEPT} == {k: s[k] for k in KEPT}
        assert bool(b["warmup"]) == bool(s["warmup"]) and s["compile"] is False
        assert (s["d_model"], s["n_heads"], s["d_ff"], s["seq_len"], s["batch_size"]) == (16, 2, 32, 16, 2)
        assert s["steps"] <= 4 and small.run_id != big.run_id


def test_smoke_runs_every_config_of_the_preset_on_cpu(tmp_path):
    """``addnorm study gpu --smoke``: all 72 runs train (bf16 autocast on the CPU, 12 and 24 layers), each
    trained over more than one step with its tokens/s; the findings are computed and the report is written."""
    result = CliRunner().invoke(app, ["study", "gpu", "--smoke", "--out", str(tmp_path), "--workers", "1"])
    assert result.exit_code == 0, result.output
    with Store(tmp_path / "study.sqlite") as store:
        runs = store.runs()
        assert len(runs) == 72 and {r["status"] for r in runs} == {"done"}
        assert {r["provenance"].get("transformers") for r in runs if r["config"]["model"] == "hf-llama"} != {
            None
        }
        # tokens/s is timed after the first step: the 1-step gradient profile runs have none
        assert all((r["tokens_per_s"] or 0) > 0 for r in runs if r["steps_done"] > 1)
        assert all(r["tokens_per_s"] is None for r in runs if r["steps_done"] == 1)
        assert {r["provenance"]["precision"] for r in runs} == {"bfloat16 autocast"}
        assert any(store.layer_metric(r["id"], "act_rms") for r in runs if r["id"])
    assert (tmp_path / "report.html").is_file()
