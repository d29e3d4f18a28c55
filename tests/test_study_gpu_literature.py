"""The ``gpu-literature`` preset: every literature placement ``with_placement`` can apply to Llama, at the
issue's size, three seeds, ranked; DeepNorm vs Post-LN at 24 layers and the warmup comparison; each run
estimated under a minute on a GPU (the description states the cost model's numbers); ``--dry-run`` lists
every run with an estimate, and ``--smoke`` runs every run on the CPU."""

from __future__ import annotations

import json
import math
import re
import shutil
import sqlite3
import statistics
from collections import Counter
from contextlib import closing
from pathlib import Path

import pytest
from typer.testing import CliRunner

from addnorm import PLACEMENTS
from addnorm.cli import app
from addnorm.study import Store, load_spec
from addnorm.study.cost_model import GPU_HOST_S_PER_LAYER_STEP, estimate_seconds, report_reserve, run_work
from addnorm.train import RunConfig
from addnorm.train.hf_model import not_applicable

pytestmark = pytest.mark.slow  # smoke studies

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


# --- the database of the H200 windows: 13 of 48 runs stored --------------------------------------------
# Post-LN and Pre-LN seeds 0-1 one at a time (commit fb82146), then 8 runs packed 2-3 at once on one GPU
# (commit 81f67f7, --workers auto): Pre-LN seed 2, sandwich and normed_residual seeds 0-2, Post-LN without
# warmup seed 0. The tests read the runs with sqlite3 (the study's own code not involved) and check what
# the study prints against them.
H200_DB = Path(__file__).resolve().parents[1] / "benchmarks/results/h200/study-gpu-literature/study.sqlite"
H200 = "NVIDIA H200"


@pytest.fixture
def h200_folder(tmp_path) -> Path:
    """A study folder holding a copy of the H200's database (the committed file is never opened)."""
    folder = tmp_path / "gpu-literature"
    folder.mkdir()
    shutil.copyfile(H200_DB, folder / "study.sqlite")
    return folder


def h200_runs(folder: Path) -> list[dict]:
    """The stored runs, read with sqlite3: id, config, status, wall_s, tokens_per_s, provenance."""
    with closing(sqlite3.connect(f"file:{folder / 'study.sqlite'}?mode=ro", uri=True)) as db:
        rows = db.execute("SELECT id, config, status, wall_s, tokens_per_s, provenance FROM runs").fetchall()
    keys = ("id", "config", "status", "wall_s", "tokens_per_s", "provenance")
    runs = [dict(zip(keys, row, strict=True)) for row in rows]
    for run in runs:
        run["config"] = json.loads(run["config"])
        run["provenance"] = json.loads(run["provenance"] or "{}")
    return runs


def measured_on_the_h200(folder: Path) -> tuple[list[dict], float, dict[int, float]]:
    """From the database alone: the runs that trained alone (no ``packed`` stored, or 1), the time of a
    12-layer run alone (the median training step, from tokens/s, times a run's work, plus the median of
    what the runs took besides their steps) and, per packing k (``packed`` rounded), the throughput gain
    k / median(wall time / the time alone)."""
    runs = [r for r in h200_runs(folder) if r["status"] == "done" and r["provenance"]["device"] == H200]
    assert {r["config"]["n_layers"] for r in runs} == {12}
    work = run_work(RunConfig(**runs[0]["config"]))  # a run's steps and held-out batches, in steps
    level = {r["id"]: max(1, round(r["provenance"].get("packed") or 1.0)) for r in runs}
    alone = [r for r in runs if level[r["id"]] == 1]
    step = {r["id"]: 256 * 32 / r["tokens_per_s"] for r in alone}  # seq_len x batch tokens a step
    seconds = statistics.median(step.values()) * work
    seconds += max(0.0, statistics.median(r["wall_s"] - step[r["id"]] * work for r in alone))
    gains = {}
    for k in sorted(set(level.values()) - {1}):
        slowdown = statistics.median(r["wall_s"] / seconds for r in runs if level[r["id"]] == k)
        gains[k] = k / slowdown
    return alone, seconds, gains


def seconds_of(cell: str) -> int:
    found = re.fullmatch(r"(?:(\d+)m)?(\d+)s", cell.strip())
    return int(found[1] or 0) * 60 + int(found[2])


def test_the_h200_database_resumes_here_planning_exactly_its_35_missing_runs(h200_folder):
    """Its 13 runs, written on an H200 (5 by commit fb82146, whose provenance names no commit: the
    device's tree had no .git; 8 by 81f67f7, named with --commit), are recognised by their settings: a
    dry run on this CPU marks exactly the database's runs stored, plans the 35 others, and touches
    nothing. This machine's memory is not the subject (--memory-limit off)."""
    runs = h200_runs(h200_folder)
    assert {r["status"] for r in runs} == {"done"} and len(runs) == 13
    assert Counter(r["provenance"].get("git_commit") for r in runs) == {None: 5, "81f67f7": 8}
    stored = {
        (r["config"]["placement"], r["config"]["warmup"], r["config"]["n_layers"], r["config"]["seed"])
        for r in runs
    }
    assert stored == {
        *((p, 100, 12, s) for p in ("post", "pre", "sandwich", "normed_residual") for s in (0, 1, 2)),
        ("post", 0, 12, 0),  # Post-LN without warmup, seed 0
    }
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
    text = " ".join(result.output.split())
    assert f"48 runs, {len(runs)} already stored in" in text
    assert f"{48 - len(runs)} to run on 1 worker(s)" in text
    rows = [line.split("│") for line in result.output.splitlines() if re.search(r"│ [0-9a-f]{12} │", line)]
    marked = {cells[3].strip() for cells in rows if cells[4].strip() == "yes"}
    assert len(rows) == 48 and marked == {r["id"] for r in runs}
    assert (h200_folder / "study.sqlite").read_bytes() == before and not list(h200_folder.glob("*-wal"))


def test_planned_here_for_the_h200_its_measured_rates_give_every_run_left_its_time(h200_folder):
    """``--for-device 'NVIDIA H200'`` on this CPU, one run at a time: no refusal for this machine's
    memory; the H200's host rate is fitted to the 5 runs that trained alone (tokens/s give the time per
    step: ms per layer and step, and its ratio to the cost model's 2 ms) and the measured packing gains
    come from the 8 packed runs, each as the database gives it; every run left is estimated within the
    times measured alone (41-55 s), not the 27 s of the cost model's H100 constants, the 24-layer runs
    about twice that; with a budget of 420 s it says how many such windows the rest needs."""
    alone, _, gains = measured_on_the_h200(h200_folder)
    runs = h200_runs(h200_folder)
    args = ["study", PRESET, "--dry-run", "--out", str(h200_folder), "--for-device", H200, "--workers", "1"]
    result = CliRunner().invoke(app, [*args, "--budget", "420"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    assert f"{48 - len(runs)} to run on NVIDIA H200, 1 run(s) at once" in text
    per_layer = statistics.median(256 * 32 / r["tokens_per_s"] for r in alone) / 12  # 12 layers
    ratio = per_layer / GPU_HOST_S_PER_LAYER_STEP
    assert f"{H200}, {len(runs)} run(s):" in text and len(alone) == 5 and set(gains) == {2, 3}
    assert f"host {per_layer * 1e3:.2f} ms per layer and step (x {ratio:.2f}, {len(alone)} runs)" in text
    said = ", ".join(f"x {g:.1f} at {k}" for k, g in gains.items())
    assert f"packing gains {said})" in text and f"(measured: {said})" in text
    assert "packing not measured" not in text
    found = re.search(r"the 35 runs left need (\d+) such window\(s\): 1 run\(s\) at once", text)
    assert found and int(found[1]) > 1
    assert "one window holds them all if running them side by side gains x" in text
    rows = [line.split("│") for line in result.output.splitlines() if re.search(r"│ [0-9a-f]{12} │", line)]
    left = [(cells[1], cells[2], seconds_of(cells[5])) for cells in rows if "yes" not in cells[4]]
    assert len(left) == 35
    low = math.floor(min(r["wall_s"] for r in alone))  # 41 s
    high = math.ceil(max(r["wall_s"] for r in alone))  # 55 s
    for experiment, _, seconds in left:
        bounds = (low, high) if experiment.strip() != "deepnorm" else (2 * low, 2 * high)
        assert bounds[0] <= seconds <= bounds[1], (experiment, seconds)
    model = {r.config.n_layers: estimate_seconds(r.config, gpu=True) for r in load_spec(PRESET).expand()}
    assert model[12] < 30 < low  # what the cost model alone said


def test_planned_for_the_h200_packed_as_measured_the_rest_needs_fewer_windows(h200_folder):
    """``--workers auto`` (the device call's) for the H200 from here: the packing is chosen from the gains
    the database measured (one ``packing:`` line saying them), runs packed k at once are estimated at
    the measured slowdown, and the 35 runs left need fewer 7-minute windows than one at a time, though
    more than a gain of that size alone would give; one window would hold them all only at a gain
    above the measured one."""
    _, seconds, gains = measured_on_the_h200(h200_folder)
    args = ["study", PRESET, "--dry-run", "--out", str(h200_folder), "--for-device", H200, "--budget", "420"]
    result = CliRunner().invoke(app, [*args, "--workers", "auto"], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    said = ", ".join(f"x {g:.1f} at {k}" for k, g in gains.items())
    lines = [line for line in result.output.splitlines() if line.startswith("packing: ")]
    assert len(lines) == 1, result.output
    packing = re.fullmatch(
        r"packing: (\d+) run\(s\) at once on NVIDIA H200 \(runs left 35; .*; (.*)\)", lines[0]
    )
    assert packing and packing[2] == f"measured gain {said}", lines[0]
    k = int(packing[1])
    assert k in gains and f"35 to run on NVIDIA H200, {k} run(s) at once" in text
    windows = re.search(r"the 35 runs left need (\d+) such window\(s\): ", text)
    alone = re.search(r"one at a time they take (\d+m\d\ds) of the GPU \((\d+) such window", text)
    at_least = re.search(
        r"one window holds them all if running them side by side gains x ([\d.]+) or more", text
    )
    assert windows and alone and at_least, text
    assert int(windows[1]) < int(alone[2])  # packing as measured saves windows
    room = 420 - report_reserve(48)
    assert int(windows[1]) >= math.ceil(seconds_of(alone[1]) / (max(gains.values()) * room))
    assert float(at_least[1]) > max(gains.values())
    assert abs(seconds_of(alone[1]) - (29 * seconds + 6 * 2 * seconds)) < 0.05 * seconds_of(alone[1])


def test_a_dry_run_refused_for_this_machines_memory_points_to_the_stored_runs_gpu(h200_folder):
    args = ["study", PRESET, "--dry-run", "--out", str(h200_folder), "--workers", "1"]
    result = CliRunner().invoke(app, args, env={"COLUMNS": "300", "ADDNORM_MEMORY_LIMIT": "1G"})
    assert result.exit_code == 2
    line = result.output.strip()
    assert "\n" not in line and line.startswith("error: memory: experiments.")
    assert line.endswith("or plan for the device of the stored runs: --for-device 'NVIDIA H200'")
