"""The ``gpu-literature`` preset: every literature placement ``with_placement`` can apply to Llama, at the
issue's size, three seeds, ranked; DeepNorm vs Post-LN at 24 layers and the warmup comparison; each run
estimated under a minute on a GPU (the description states the cost model's numbers); ``--dry-run`` lists
every run with an estimate, and ``--smoke`` runs every run on the CPU."""

from __future__ import annotations

import re
import shutil
from collections import Counter
from pathlib import Path

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
    assert f"{total / 60:.0f} minutes for the 48 runs" in text and "An H200 measured 41-55 s a run" in text


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


# --- the database of the first GPU windows (an NVIDIA H200, commit fb82146): 5 of 48 runs stored ----------
H200_DB = (
    Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "study_gpu_literature" / "study.sqlite"
)
H200 = "NVIDIA H200"


@pytest.fixture
def h200_folder(tmp_path) -> Path:
    """A study folder holding a copy of the H200's database (the committed file is never opened)."""
    folder = tmp_path / "gpu-literature"
    folder.mkdir()
    shutil.copyfile(H200_DB, folder / "study.sqlite")
    return folder


def seconds_of(cell: str) -> int:
    found = re.fullmatch(r"(?:(\d+)m)?(\d+)s", cell.strip())
    return int(found[1] or 0) * 60 + int(found[2])


def test_the_h200_database_resumes_here_planning_exactly_its_43_missing_runs(h200_folder):
    """Its 5 runs, written on an H200 by commit fb82146 (provenance without a git commit: the device's
    tree had no .git), are recognised by their settings: a dry run on this CPU plans the 43 others, and
    touches nothing. This machine's memory is not the subject (--memory-limit off)."""
    before = (h200_folder / "study.sqlite").read_bytes()
    args = [
        "study",
        PRESET,
        "--dry-run",
        "--out",
        str(h200_folder),
        "--workers",
        "1",
        "--memory-limit",
        "off",
    ]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    assert "48 runs, 5 already stored in" in " ".join(result.output.split())
    assert "43 to run on 1 worker(s)" in " ".join(result.output.split())
    rows = [line for line in result.output.splitlines() if re.search(r"│ [0-9a-f]{12} │", line)]
    stored = [row for row in rows if re.search(r"│ yes +│", row)]
    assert len(rows) == 48 and len(stored) == 5
    assert all(("placement=post" in r or "placement=pre," in r) for r in stored)
    assert (h200_folder / "study.sqlite").read_bytes() == before and not list(h200_folder.glob("*-wal"))


def test_planned_here_for_the_h200_its_measured_rates_give_every_run_left_its_time(h200_folder):
    """``--for-device 'NVIDIA H200'`` on this CPU: no refusal for this machine's memory, and each run left
    is estimated from the H200's five runs (41-55 s each; tokens/s give the time per step): the 12-layer
    runs within the measured range, not the 27 s of the cost model's H100 constants, the 24-layer runs
    about twice that; with a budget of 420 s it says how many such windows the rest needs."""
    args = ["study", PRESET, "--dry-run", "--out", str(h200_folder), "--for-device", H200, "--workers", "1"]
    result = CliRunner().invoke(app, [*args, "--budget", "420"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert "43 to run on NVIDIA H200, 1 run(s) at once" in text
    assert "host 3.65 ms per layer and step (x 1.83, 5 runs)" in text and "packing not measured" in text
    assert re.search(r"the 43 runs left need \d+ such window\(s\)", text)
    assert "one window holds them all if running them side by side gains x" in text
    rows = [line.split("│") for line in result.output.splitlines() if re.search(r"│ [0-9a-f]{12} │", line)]
    left = [(cells[1], cells[2], seconds_of(cells[5])) for cells in rows if "yes" not in cells[4]]
    assert len(left) == 43
    for experiment, _, seconds in left:
        low, high = (41, 55) if experiment.strip() != "deepnorm" else (2 * 41, 2 * 55)
        assert low <= seconds <= high, (experiment, seconds)
    model = {r.config.n_layers: estimate_seconds(r.config, gpu=True) for r in load_spec(PRESET).expand()}
    assert model[12] < 30  # what the cost model alone said


def test_a_dry_run_refused_for_this_machines_memory_points_to_the_stored_runs_gpu(h200_folder):
    args = ["study", PRESET, "--dry-run", "--out", str(h200_folder), "--workers", "1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300", "ADDNORM_MEMORY_LIMIT": "1G"})
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: memory: experiments.")
    assert line.endswith("or plan for the device of the stored runs: --for-device 'NVIDIA H200'")
