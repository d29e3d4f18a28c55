"""``addnorm inspect --hf TYPE``: the per-layer table and plot of a tiny random-weight Hugging Face model,
untouched and re-placed, with Probe's numbers; a bad model type is one error line."""

from __future__ import annotations

import json
import sys

import pytest
from hf_models import TYPES
from typer.testing import CliRunner

from addnorm import cli

runner = CliRunner()
ARGS = ["--layers", "3", "--d-model", "16", "--heads", "2", "--seq", "8", "--batch", "2", "--repeats", "2"]


def _rows(output: str) -> list[list[float]]:
    return [[float(v) for v in ln.split()[1:]] for ln in output.splitlines() if ln.strip()[:1].isdigit()]


@pytest.mark.parametrize("model_type", ["gpt2", "bert"])
def test_inspect_hf_prints_and_plots_each_layer(model_type, tmp_path):
    result = runner.invoke(
        cli.app, ["inspect", "--hf", model_type, "--placements", "post,pre", *ARGS, "--out", str(tmp_path)]
    )
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / f"inspect-hf-{model_type}.json").read_text())
    assert (tmp_path / f"inspect-hf-{model_type}.png").stat().st_size > 0
    results = data["results"]
    assert list(results) == ["model", "post", "pre"]
    # the table prints the JSON's numbers: three metrics x three layers, a column per placement
    rows = _rows(result.output)
    assert len(rows) == 9
    for i, metric in enumerate(["weight_grad", "stream_grad", "act_rms"]):
        for layer in range(3):
            expected = [results[name][metric][layer] for name in results]
            assert rows[3 * i + layer] == pytest.approx(expected, rel=1e-3)
    # the model's own placement re-placed is the untouched model: the same statistics
    own = {"gpt2": "pre", "bert": "post"}[model_type]
    for metric in results["model"]:
        assert results[own][metric] == pytest.approx(results["model"][metric], rel=1e-4)
    assert results["post"]["act_rms"] == pytest.approx([1.0] * 3, rel=1e-3)  # every layer ends normalised


def test_inspect_hf_bad_type_is_one_error_line(tmp_path):
    result = runner.invoke(cli.app, ["inspect", "--hf", "opt", *ARGS, "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "unknown model type 'opt'" in lines[0] and ", ".join(TYPES) in lines[0]


def test_inspect_hf_without_the_extra_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers fails
    result = runner.invoke(cli.app, ["inspect", "--hf", "llama", *ARGS, "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "pip install 'addnorm[hf]'" in lines[0], result.output


def test_inspect_hf_applies_norm_and_rejects_init(tmp_path):
    """--norm re-places with that norm: RMSNorm under Post-LN ends every layer at RMS 1 exactly as
    LayerNorm does, but the statistics differ from the LayerNorm run (the norm was applied);
    --init has no meaning for a Hugging Face model: one error line."""
    base = ["inspect", "--hf", "gpt2", "--placements", "post", *ARGS]
    runs = {}
    for norm in ("layernorm", "rmsnorm"):
        result = runner.invoke(cli.app, [*base, "--norm", norm, "--out", str(tmp_path / norm)])
        assert result.exit_code == 0, result.output
        assert f"re-placed with {norm}" in result.output
        runs[norm] = json.loads((tmp_path / norm / "inspect-hf-gpt2.json").read_text())
        assert runs[norm]["config"]["norm"] == norm
    ln, rms = (runs[n]["results"]["post"] for n in ("layernorm", "rmsnorm"))
    assert rms["act_rms"] == pytest.approx([1.0] * 3, rel=1e-3)
    assert rms["weight_grad"] != pytest.approx(ln["weight_grad"], rel=1e-3)
    assert runs["rmsnorm"]["results"]["model"] == runs["layernorm"]["results"]["model"]  # untouched
    result = runner.invoke(cli.app, [*base, "--init", "gpt2", "--out", str(tmp_path)])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --init: 'gpt2'"), result.output
