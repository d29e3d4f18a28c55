"""``addnorm study llama --smoke`` and ``addnorm study literature --smoke``: the ranked presets run end to
end through the CLI (the same path as the full presets, at a tiny size), and their reports carry the
ranking with intervals and letter groups, the side-by-side of the settings and the placement claims."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, compute_findings

pytestmark = pytest.mark.slow  # smoke studies

CLAIMS = (
    "DeepNorm trains better than Post-LN at depth",
    "Peri-LN (sandwich) keeps the residual stream's activations from growing with depth as Pre-LN's do",
    "Mix-LN gives the last layers larger gradients than Pre-LN",
)


def smoke(preset: str, out) -> str:
    result = CliRunner().invoke(app, ["study", preset, "--smoke", "--out", str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    return (out / "report.html").read_text()


def test_llama_smoke_ranks_both_architectures_side_by_side(tmp_path):
    pytest.importorskip("transformers")
    page = smoke("llama", tmp_path)
    with Store(tmp_path / "study.sqlite") as store:
        runs = store.runs()
        found = {f.claim: f for f in compute_findings(store)}
    assert {r["status"] for r in runs} == {"done"}
    evidence = found[CLAIMS[0]].evidence  # each setting named, the Llama ones with their initialisation
    assert "6 layers: " in evidence and "6 layers (hf-llama): " in evidence
    assert "6 layers (hf-llama, hf_init xavier): " in evidence
    llama = [r for r in runs if r["config"]["model"] == "hf-llama"]
    # 5 placements are not applicable to Llama; it trains under its own init and under Xavier's
    assert len(llama) == 12 * 3 * 2 and len(runs) == 17 * 3 + 12 * 3 * 2
    assert {r["config"]["hf_init"] for r in llama} == {"own", "xavier"}
    assert {r["provenance"]["transformers"] for r in llama} != {None}
    for text in (
        "<h3>model=addnorm</h3>",
        "<h3>model=hf-llama, hf_init=own</h3>",
        "<h3>model=hf-llama, hf_init=xavier</h3>",
        "95% interval",
        "<th>groups</th><th>tied with the best</th>",
        "Side by side",
    ):
        assert text in page
    assert "llama: placement=ngpt: not applicable" in page and "Spearman vs first" in page


def test_literature_smoke_ranks_four_seeds_and_judges_the_placement_claims(tmp_path):
    """Four seeds since the cross-CPU flips (study_literature.md): 17 x 2 depths x 4, 8 more warmup runs
    of Post-LN and Pre-LN, 17 x 3 learning rates; the seeds are one YAML anchor of the preset."""
    page = smoke("literature", tmp_path)
    with Store(tmp_path / "study.sqlite") as store:
        assert len(store.runs()) == 17 * 2 * 4 + 2 * 4 + 17 * 3 == 195
        found = {f.claim: f for f in compute_findings(store)}
    for claim in CLAIMS:
        assert found[claim].verdict != "not tested by this study" and "seeds 0, 1, 2, 3" in found[claim].scale
    assert (
        "<h3>n_layers=2</h3>" in page and "<h3>n_layers=8</h3>" in page and "tolerated learning rates" in page
    )
