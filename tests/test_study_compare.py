"""``addnorm compare``: two ranked studies side by side, from their databases: each ranking with its
letters and the seeds of a placement that split, every placement's rank in both, and Spearman's rank
correlation against its closed form."""

from __future__ import annotations

import time

from tiny_runs import TINY_SIZES
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import Store, parse_spec
from addnorm.train import RunResult

TINY = dict(TINY_SIZES, steps=3, eval_every=0)


def fake_study(folder, name: str, losses: dict[str, list[float]], device: str) -> None:
    """A study of ``losses`` (placement -> final held-out loss of seeds 0, 1, 2), ranked, stored as if
    trained on ``device`` (only the outcomes: nothing is trained)."""
    spec = parse_spec(
        {
            "name": name,
            "base": dict(TINY),
            "experiments": {"main": {"rank": True, "sweep": {"placement": list(losses), "seed": [0, 1, 2]}}},
        }
    )
    plan = spec.resolved()
    rows = [(run_id, e, label) for run_id, pairs in plan.memberships.items() for e, label in pairs]
    folder.mkdir(parents=True)
    with Store(folder / "study.sqlite") as store:
        store.save_plan(spec.name, spec.to_dict(), plan.base, rows, plan.not_applicable)
        for run in plan.runs:
            loss = losses[run.config.to_dict()["placement"]][run.config.seed]
            result = RunResult(status="done", steps_done=3, wall_s=1.0)
            result.final = {
                "val_loss": loss,
                "train_loss": loss,
                "val_metric": 0.0,
                "metric": "bits_per_byte",
            }
            result.provenance = {"device": device}
            store.save_run(
                name, run.run_id, plan.memberships[run.run_id], run.config.to_dict(), result, time.time()
            )


def test_two_studies_side_by_side_with_their_letters_splits_and_rank_correlation(tmp_path):
    """gpu: pre < sandwich < mix, and post split (seeds 0 and 1 at 1.30, seed 2 stalled at 4.0: shown
    apart, after the others); cpu: mix < sandwich < pre < post. Ranks (1, 2, 3, 4) against (3, 2, 1, 4):
    rho = 1 - 6 x (4 + 0 + 4 + 0) / (4 x 15) = 0.2."""
    gpu = {
        "pre": [1.00, 1.01, 1.02],
        "sandwich": [1.10, 1.11, 1.12],
        "mix": [1.20, 1.21, 1.22],
        "post": [1.30, 1.31, 4.00],
    }
    cpu = {
        "mix": [2.0, 2.01, 2.02],
        "sandwich": [2.1, 2.11, 2.12],
        "pre": [2.2, 2.21, 2.22],
        "post": [2.3, 2.31, 2.32],
    }
    fake_study(tmp_path / "gpu", "gpu-literature", gpu, "NVIDIA H200")
    fake_study(tmp_path / "cpu", "literature", cpu, "AMD EPYC")
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "gpu"), str(tmp_path / "cpu")])
    assert result.exit_code == 0, result.output
    text = result.output
    assert "# Rankings compared: gpu-literature, literature" in text
    assert "12 of 12 runs stored; trained on NVIDIA H200." in text
    assert "| 1 | pre | 1.010 ± 0.010 (3 seeds) |" in text
    assert "| 4 | post | split (2 of 3 trained): 1.305 vs 4.000 (3 seeds) |" in text
    assert "post split: seed(s) 0, 1 trained (1.305), 2 did not (4.000)." in text
    side = text[text.index("## Side by side") :]
    assert "| post | 4 (split) | 4 (" in side and "| pre | 1 (a) | 3 (" in side
    assert "| gpu-literature: all runs | literature: all runs | +0.20 | 4 |" in text
    out = tmp_path / "compare.md"
    written = CliRunner().invoke(
        app, ["compare", str(tmp_path / "gpu"), str(tmp_path / "cpu"), "--to", str(out)]
    )
    assert written.exit_code == 0 and out.read_text() == text


def test_a_study_with_too_few_placements_stored_has_no_ranking_yet_and_a_folder_without_one_is_refused(
    tmp_path,
):
    fake_study(
        tmp_path / "gpu",
        "gpu-literature",
        {"post": [1.2, 1.25, 1.22], "pre": [1.0, 1.05, 1.08]},
        "NVIDIA H200",
    )
    result = CliRunner().invoke(app, ["compare", str(tmp_path / "gpu")])
    assert result.exit_code == 0, result.output
    assert "No ranking yet: fewer than three placements of a ranked setting are stored." in result.output
    missing = CliRunner().invoke(app, ["compare", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "compare: no study database at" in missing.output
    assert len(missing.output.strip().splitlines()) == 1
