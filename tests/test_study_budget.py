"""Studies in time windows (``addnorm study --budget``): the estimates from a stored history, which runs
start, the one-line refusals (a budget too small, a database of another version or other settings), a
run killed mid-way that is trained again, and a database carried to another machine."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sqlite3
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_runs import TINY_SIZES

from addnorm import __version__
from addnorm.study import Store
from addnorm.study.cost_model import (
    MEASURED_MARGIN,
    SCALED_MARGIN,
    Budget,
    Estimator,
    Timing,
    estimate_seconds,
    report_reserve,
    run_work,
    step_sides,
    window,
)
from addnorm.study.executors import Executor
from addnorm.study.runner import _Window
from addnorm.train import RunConfig, RunResult
from addnorm.train.device import device_name

TINY = dict(TINY_SIZES, steps=3, eval_every=0)
SRC = str(Path(__file__).resolve().parents[1] / "src")
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
H100 = "NVIDIA H100 80GB HBM3"


def cli(*args):
    from typer.testing import CliRunner

    from tests.test_study_cli import make_app

    return CliRunner().invoke(make_app(), [str(a) for a in args], env={"COLUMNS": "250"})


def write_spec(path: Path, sweep: dict, name: str = "win", rank: bool = False) -> Path:
    experiment = {"sweep": sweep, **({"rank": True} if rank else {})}
    path.write_text(yaml.safe_dump({"name": name, "base": dict(TINY), "experiments": {"main": experiment}}))
    return path


def store_fake(db: Path, config: dict, seconds: float, device: str, version: str = __version__) -> None:
    """A stored run that trained every step in ``seconds`` on ``device`` (a measurement, nothing else)."""
    result = RunResult(status="done", steps_done=config["steps"], wall_s=seconds)
    result.final = {"val_loss": 2.0, "train_loss": 2.0, "val_metric": 0.5, "metric": "accuracy"}
    result.provenance = {"device": device, "addnorm": version}
    with Store(db) as store:
        store.save_run("win", RunConfig(**config).run_id, [["main", "fake"]], config, result, time.time())


def cfg(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


# --- the estimates ---------------------------------------------------------------------------------
def test_estimates_come_from_this_devices_stored_runs_else_the_cost_model():
    """Same cost (only seed, lr, warmup, init differ): the median stored time, and the longest x
    MEASURED_MARGIN as what a window must hold; another size: the cost model fitted to this device's runs
    (their time per step over the model's, here from wall time less the model's 3 s start, for runs
    without tokens/s) x SCALED_MARGIN; runs of another device, diverged or failed runs and runs that
    stopped early are no measurement."""
    small, big = cfg(d_model=16), cfg(d_model=32, n_layers=4)
    history = [
        Timing({**small.to_dict(), "seed": 7}, H100, 40.0, True),
        Timing({**small.to_dict(), "seed": 8, "lr": 0.01}, H100, 50.0, True),
        Timing({**small.to_dict(), "seed": 9}, H100, 900.0, False),  # diverged: stopped early
        Timing({**small.to_dict(), "seed": 5}, "NVIDIA A100-SXM4-80GB", 999.0, True),  # another device
    ]
    est = Estimator(H100, gpu=True, history=history)
    assert est.measured == 2
    assert est.seconds(cfg(d_model=16, seed=3)) == pytest.approx(45.0)
    assert est.needs(cfg(d_model=16, seed=3)) == pytest.approx(50.0 * MEASURED_MARGIN)
    # closed form: tiny models are host-bound on a GPU (2 ms per layer and step against microseconds of
    # FLOPs), so a step is 2e-3 x layers x the measured scale, the start 3 s
    scale = statistics.median([(t - 3.0) / run_work(small) / (2e-3 * 2) for t in (40.0, 50.0)])
    expected = 2e-3 * 4 * scale * run_work(big) + 3.0
    assert est.seconds(big) == pytest.approx(expected)
    assert est.needs(big) == pytest.approx(expected * SCALED_MARGIN)
    assert "measured" in est.source(small) and "fitted to 2 run(s) stored for NVIDIA H100" in est.source(big)
    nothing = Estimator(H100, gpu=True, history=history[2:])
    assert nothing.seconds(big) == pytest.approx(estimate_seconds(big, gpu=True))
    assert (
        nothing.needs(big) == pytest.approx(estimate_seconds(big, gpu=True))
        and "no run stored" in nothing.source()
    )
    nothing.add(Timing(big.to_dict(), H100, 12.0, True))  # a run finished in this window: used at once
    assert nothing.needs(cfg(d_model=32, n_layers=4, seed=1)) == pytest.approx(12.0 * MEASURED_MARGIN)


def test_the_cost_model_fitted_to_a_device_tracks_its_measured_time():
    """A device whose host is 3x slower per layer than the cost model and which starts each run in 4 s
    (its runs store tokens/s, as training does): after three runs of one size, the estimate of another
    size (twice the layers, other widths) is the time that device takes, where the cost model alone is
    far off; the fitted rates say what they rest on."""
    truth_scale, truth_start = 3.0, 4.0

    def truth(config: RunConfig) -> tuple[float, float]:  # the device: (wall seconds, tokens/s)
        host, _ = step_sides(config, gpu=True)
        step = host * truth_scale
        return step * run_work(config) + truth_start, config.batch_size * config.seq_len / step

    measured = cfg(d_model=32, n_layers=3, steps=200)
    history = []
    for seed in range(3):
        config = {**measured.to_dict(), "seed": seed}
        wall, rate = truth(measured)
        history.append(Timing(config, "NVIDIA X", wall, True, tokens_per_s=rate))
    est = Estimator("NVIDIA X", gpu=True, history=history)
    other = cfg(d_model=48, d_ff=96, n_layers=6, steps=300)
    assert est.seconds(other) == pytest.approx(truth(other)[0], rel=1e-9)
    assert abs(estimate_seconds(other, gpu=True) - truth(other)[0]) > 0.4 * truth(other)[0]
    rates = est.rates()
    assert rates.host == pytest.approx(truth_scale) and rates.start == pytest.approx(truth_start)
    assert "host 6.00 ms per layer and step (x 3.00, 3 runs)" in est.describe()
    assert "no run device-bound" in est.describe() and "packing not measured" in est.describe()


def test_the_window_plan_starts_each_run_at_the_first_free_worker_if_it_ends_in_time():
    """Closed form: 2 workers, runs of 30, 50, 40, 100, 10 s in a window of 90 s (start-up 5 s per
    worker): 30 (0-35) and 50 (0-55) start, 40 (35-75) starts, 100 fits nowhere, 10 (55-65) starts."""
    runs = ["a", "b", "c", "d", "e"]
    cost = dict(zip(runs, [30, 50, 40, 100, 10], strict=True))
    chosen, end = window(runs, cost.__getitem__, 90.0, workers=2, start_s=5.0)
    assert chosen == ["a", "b", "c", "e"] and end == 75.0
    assert window(runs, cost.__getitem__, 20.0, workers=1)[0] == ["e"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class SimulatedExecutor(Executor):
    """Runs that take a known time on a fake clock, ``workers`` at once (a discrete-event simulation)."""

    def __init__(self, clock: FakeClock, workers: int, took: dict[str, float]) -> None:
        self.clock, self.workers, self.took = clock, workers, took
        self.flight: list[tuple[float, object]] = []
        self.log: list[tuple[str, float, int]] = []  # (run, start, in flight after the start)

    def submit(self, run) -> None:
        self.flight.append((self.clock.now + self.took[run.label], run))
        self.log.append((run.label, self.clock.now, len(self.flight)))

    def results(self, on_step=None, on_progress=None):
        while self.flight:
            self.flight.sort(key=lambda f: f[0])
            end, run = self.flight.pop(0)
            self.clock.now = end
            yield run, RunResult(status="done", steps_done=run.config.steps, wall_s=self.took[run.label])

    def cancel(self) -> None:
        self.flight.clear()


def test_a_budget_starts_a_run_only_when_its_estimate_ends_in_time_on_every_worker():
    """Two workers, a budget of 100 s of which report_reserve(5) is kept: each run starts at a free
    worker only if its estimate ends inside the budget; the later runs are judged on the clock as it is
    when a worker frees (runs here take as long as estimated)."""
    from addnorm.study.spec import PlannedRun

    clock = FakeClock()
    took = {"a": 30.0, "b": 50.0, "c": 40.0, "d": 85.0, "e": 10.0}
    runs = [PlannedRun("main", k, cfg(seed=i)) for i, k in enumerate(took)]

    class Known:
        def needs(self, config, packed=None):
            return took[next(r.label for r in runs if r.config == config)]

        def add(self, timing):
            pass

    budget = Budget(100.0 + report_reserve(5), started=0.0, clock=clock)
    executor = SimulatedExecutor(clock, 2, took)
    starter = _Window(executor, runs, budget, Known(), planned=5)
    starter.fill()
    for run, result in executor.results():
        starter.finished(run, result)
        starter.fill()
    assert [(label, start) for label, start, _ in executor.log] == [("a", 0), ("b", 0), ("c", 30), ("e", 50)]
    assert max(n for _, _, n in executor.log) == 2  # never more in flight than workers
    assert all(start + took[label] <= 100.0 for label, start, _ in executor.log)
    assert [r.label for r in starter.queue] == ["d"] and starter.started == 4


# --- the command --------------------------------------------------------------------------------------
def _two_widths_measured(tmp_path: Path) -> tuple[Path, Path]:
    """A spec of 4 runs (d_model 16 and 32, two seeds each) and its out folder, whose store holds a run of
    each width of another seed measured on this device: d_model 32 at 1000 s, d_model 16 at 1 s."""
    spec = write_spec(tmp_path / "spec.yaml", {"d_model": [16, 32], "seed": [0, 1]})
    out = tmp_path / "out"
    store_fake(out / "study.sqlite", cfg(d_model=32, seed=9).to_dict(), 1000.0, device_name())
    store_fake(out / "study.sqlite", cfg(d_model=16, seed=9).to_dict(), 1.0, device_name())
    return spec, out


def test_a_budget_stores_what_fits_and_says_how_many_runs_are_left(tmp_path):
    """Runs of d_model 32 measured at 1000 s on this device (a stored run of another seed) do not fit a
    budget of 300 s; the d_model 16 runs, measured at 1 s, do: exit 0, 'N of M runs stored, resume to
    continue'. A budget that holds them all finishes the study (no such line)."""
    spec, out = _two_widths_measured(tmp_path)
    result = cli("study", spec, "--out", out, "--budget", "300", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert "2 of 4 runs stored, resume to continue (2 did not fit in the budget of 5m00s" in result.output
    with Store(out / "study.sqlite") as store:
        stored = {r["config"]["d_model"] for r in store.runs() if r["status"] == "done"}
        assert stored == {16}
    result = cli("study", spec, "--out", out, "--budget", "3000", "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert "resume to continue" not in result.output and "(2 already stored, 2 run now" in result.output


def test_a_budget_too_small_for_any_run_is_one_line_and_touches_nothing(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", {"seed": [0, 1]})
    out = tmp_path / "out"
    db = out / "study.sqlite"
    store_fake(db, cfg(seed=9).to_dict(), 1000.0, device_name())
    before = db.read_bytes()
    result = cli("study", spec, "--out", out, "--budget", "120", "--workers", "1")
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --budget: 2m00s leaves")
    assert "the cheapest of the 2 runs left needs about 18m20s (measured" in lines[0]
    assert db.read_bytes() == before
    for bad in ("0", "-5", "nan"):
        result = cli("study", spec, "--out", out, "--budget", bad)
        assert result.exit_code == 2 and "--budget: expected a number of seconds > 0" in result.output


def test_dry_run_with_a_budget_lists_every_run_with_its_estimate_and_what_starts(tmp_path):
    spec, out = _two_widths_measured(tmp_path)
    result = cli("study", spec, "--out", out, "--budget", "300", "--workers", "1", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "--budget 5m00s: 2 of the 4 runs left would start" in " ".join(result.output.split())
    rows = [line for line in result.output.splitlines() if "d_model=" in line and "│" in line]
    # the estimate shown is the measured time (1000 s); what a window must hold, 1100 s, does not fit 300 s
    assert len([r for r in rows if "starts" in r]) == 2 and all("16m40s" in r for r in rows if "32" in r)


def test_refused_with_ray_the_budget_needs_the_local_executor(tmp_path):
    pytest.importorskip("ray")
    spec = write_spec(tmp_path / "spec.yaml", {"seed": [0]})
    result = cli("study", spec, "--out", tmp_path / "o", "--executor", "ray", "--budget", "60")
    assert result.exit_code == 2 and "--budget: only with the local executor" in result.output


# --- databases that cannot be resumed, and one carried to another machine ------------------------------
def test_a_database_of_another_version_or_other_settings_is_refused_in_one_line(tmp_path):
    spec = write_spec(tmp_path / "spec.yaml", {"seed": [0, 1]})
    out = tmp_path / "out"
    result = cli("study", spec, "--out", out, "--quiet", "--workers", "1")
    assert result.exit_code == 0, result.output
    db = out / "study.sqlite"
    with sqlite3.connect(db) as con:
        run_id, prov = con.execute("SELECT id, provenance FROM runs ORDER BY id LIMIT 1").fetchone()
        con.execute(
            "UPDATE runs SET provenance = ? WHERE id = ?",
            (json.dumps({**json.loads(prov), "addnorm": "0.0.9"}), run_id),
        )
    before = db.read_bytes()
    for args in (("--quiet",), ("--dry-run",)):
        result = cli("study", spec, "--out", out, "--workers", "1", *args)
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert (
            len(lines) == 1
            and f"its runs were stored by addnorm 0.0.9, this is addnorm {__version__}" in lines[0]
        )
    assert db.read_bytes() == before
    with sqlite3.connect(db) as con:
        con.execute("UPDATE runs SET provenance = ?", (prov,))
        config = json.loads(con.execute("SELECT config FROM runs WHERE id = ?", (run_id,)).fetchone()[0])
        con.execute("UPDATE runs SET config = ? WHERE id = ?", (json.dumps({**config, "lr": 0.5}), run_id))
    result = cli("study", spec, "--out", out, "--workers", "1", "--quiet")
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and f"run {run_id} (main: seed=" in line
    assert "is stored with other settings than this spec gives it (lr: 0.5 stored, 0.001 here)" in line


def test_a_database_carried_to_another_machine_resumes_and_ranks_each_device_apart(tmp_path):
    """A study stored on 'a GPU machine' (its runs' device rewritten) is copied to this one and resumed
    with one more seed: only the new runs train; the report names every run's device and ranks the
    setting per device with one line saying why, or in one table with --mix-devices."""
    sweep = {"placement": ["post", "pre", "sandwich"], "seed": [0, 1]}
    there = tmp_path / "there"
    assert (
        cli(
            "study",
            write_spec(tmp_path / "a.yaml", sweep, rank=True),
            "--out",
            there,
            "--quiet",
            "--workers",
            "1",
        ).exit_code
        == 0
    )
    assert not list(there.glob("*-wal"))  # the database is whole in one file once the study is over
    with sqlite3.connect(there / "study.sqlite") as con:
        for run_id, prov in con.execute("SELECT id, provenance FROM runs").fetchall():
            con.execute(
                "UPDATE runs SET provenance = ? WHERE id = ?",
                (json.dumps({**json.loads(prov), "device": H100}), run_id),
            )
    here = tmp_path / "here"
    shutil.copytree(there, here)
    spec = write_spec(tmp_path / "b.yaml", {**sweep, "seed": [0, 1, 2]}, rank=True)
    result = cli("study", spec, "--out", here, "--quiet", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert "9 runs (6 already stored, 3 run now)" in result.output
    page = (here / "report.html").read_text()
    cpu = device_name()
    assert f"<h3>all runs, on {H100}</h3>" in page and f"<h3>all runs, on {cpu}</h3>" in page
    assert f"all runs: its runs were measured on 2 devices ({H100}: 6 runs, {cpu}: 3 runs)" in page
    assert page.count(f"<td>{H100}</td>") == 6 and page.count(f"<td>{cpu}</td>") == 3  # the runs table
    assert cli("report", here, "--mix-devices").exit_code == 0
    page = (here / "report.html").read_text()
    assert "<h3>all runs</h3>" in page and "measured on 2 devices" not in page
    assert f"Measured on {H100} and {cpu}" in page or f"Measured on {cpu} and {H100}" in page


# --- a run killed by the end of the window ---------------------------------------------------------
BLOCKING = """
import pathlib, sys, time
from addnorm.study import executors
real = executors.train

def blocking(cfg, **kw):
    if cfg.seed == 1:  # the run the window's end kills: it blocks at its second step
        observe = kw.get("on_step")
        def on_step(step, loss):
            if observe is not None:
                observe(step, loss)
            if step == 1:
                pathlib.Path({flag!r}).write_text("blocked")
                while True:
                    time.sleep(1)
        kw["on_step"] = on_step
    return real(cfg, **kw)

executors.train = blocking
from addnorm.cli import app
app({args!r})
"""


def test_a_run_killed_by_the_end_of_the_window_is_not_stored_and_trains_again(tmp_path):
    """kill -9 while seed 1 is in its second step (it blocks there: no timing): seed 0 is stored, seed 1 is
    not (not half, not failed); the next invocation trains seeds 1 and 2 and every number equals an
    uninterrupted study's."""
    spec = write_spec(tmp_path / "spec.yaml", {"seed": [0, 1, 2]})
    out, flag = tmp_path / "out", tmp_path / "blocked"
    args = ["study", str(spec), "--out", str(out), "--workers", "1", "--quiet", "--budget", "3600"]
    script = BLOCKING.format(flag=str(flag), args=args)
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 300
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert flag.exists(), proc.stderr.read().decode() if proc.poll() is not None else "never blocked"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    with Store(out / "study.sqlite") as store:
        assert [(r["config"]["seed"], r["status"]) for r in store.runs()] == [(0, "done")]
        assert store.metric(store.runs()[0]["id"], "train_loss")
    result = cli("study", spec, "--out", out, "--workers", "1", "--quiet")
    assert result.exit_code == 0, result.output
    assert "3 runs (1 already stored, 2 run now)" in result.output
    whole = tmp_path / "whole"
    assert cli("study", spec, "--out", whole, "--workers", "1", "--quiet").exit_code == 0
    with Store(out / "study.sqlite") as a, Store(whole / "study.sqlite") as b:
        losses = [{r["id"]: (r["status"], r["final_val_loss"]) for r in s.runs()} for s in (a, b)]
        assert losses[0] == losses[1] and len(losses[0]) == 3
        for run in b.runs():
            assert a.metric(run["id"], "train_loss") == b.metric(run["id"], "train_loss")
