"""The Ray executor on a local two-CPU Ray cluster (one start for the module): the same runs and numbers
as in this process, progress and per-step losses from remote runs, a killed worker, Ctrl-C, errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from addnorm.study import Store, parse_spec, run_study
from addnorm.study.trackers import Tracker
from tools.procs import interruptible

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow: a Ray cluster

ray_executor = pytest.importorskip("addnorm.study.ray_executor")

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)


@pytest.fixture(scope="module")
def cluster():
    """A local cluster as the study starts one (two CPUs, loopback only), shared by this module."""
    address = ray_executor.start_local_cluster(num_cpus=2)
    import ray

    yield address
    ray.shutdown()


def tiny(name="ray", **experiments):
    return parse_spec({"name": name, "base": dict(TINY), "experiments": experiments})


class Recorder(Tracker):
    """A tracker that keeps what it is given."""

    name = "recorder"

    def __init__(self):
        self.steps, self.records = {}, {}

    def open(self, out_dir, study):
        pass

    def has(self, run_id):
        return run_id in self.records

    def step(self, run, step, loss):
        self.steps.setdefault(run.run_id, []).append((step, loss))

    def log_run(self, record):
        self.records[record["id"]] = record


def final_losses(folder):
    with Store(folder / "study.sqlite") as store:
        return {
            r["id"]: (r["status"], r["final_val_loss"], store.metric(r["id"], "train_loss"))
            for r in store.runs()
        }


def test_ray_gives_the_runs_and_numbers_of_in_process(cluster, tmp_path):
    """Same run ids, same losses (same seeds, one thread each); every remote step reached the driver in
    order; the driver stored each run as it came back; each run trained with the task's threads."""
    spec = tiny(main={"sweep": {"placement": ["post", "pre"], "seed": [0, 1]}})
    here = run_study(spec, tmp_path / "here", workers=1, progress=False, report=False)
    recorder = Recorder()
    there = run_study(
        spec,
        tmp_path / "ray",
        executor=ray_executor.RayExecutor(),
        progress=False,
        report=False,
        trackers=[recorder],
    )
    assert here.ran == there.ran == 4 and not there.failed
    assert final_losses(tmp_path / "here") == final_losses(tmp_path / "ray")
    with Store(tmp_path / "ray" / "study.sqlite") as store:
        for run in store.runs():
            assert run["provenance"]["threads"] == 1 and run["provenance"]["compile"] is False
            # the live steps: each once, in order, equal to the stored curve
            assert recorder.steps[run["id"]] == store.metric(run["id"], "train_loss")


def test_remote_steps_reach_the_driver_while_the_run_trains(cluster):
    """Progress from a remote run arrives live (through the progress actor), not only with its result:
    the run waits for the driver to take its first batch, so that batch is passed on while the run is
    still in flight (deterministic, whatever the load or pytest's capture); every step once, in order."""
    (run,) = tiny(live={"set": {"steps": 40}}).expand()
    executor = ray_executor.RayExecutor()
    seen = []

    def on_step(r, step, loss):
        in_flight = any(p.run_id == r.run_id for p in executor._refs.values())
        seen.append((in_flight, step, loss))

    executor.submit(run)
    ((_, result),) = executor.results(on_step)
    assert result.status == "done"
    assert [(s, v) for _, s, v in seen] == [(s, v) for s, n, v in result.metrics if n == "train_loss"]
    assert seen[0][0], "the first step was passed on only with the result"


def _pids(run_id):
    """Processes whose title is the Ray task of ``run_id`` (Ray names a worker after its task)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if f"ray::addnorm:{run_id}".encode() in fh.read():
                        found.append(int(pid))
            except OSError:
                pass
    return found


def test_a_killed_worker_fails_its_run_and_loses_nothing_finished(cluster, tmp_path):
    """kill -9 of the worker training a run: that run comes back failed (max_retries=0), the others are
    stored, and the next invocation runs only the failed one."""
    import threading

    spec = tiny(short={"sweep": {"seed": [0, 1]}}, long={"set": {"steps": 300, "seed": 5}})
    victim = next(r for r in spec.expand() if r.experiment == "long").run_id
    killed, stop = [], threading.Event()

    def kill_when_it_trains():
        while not stop.is_set() and not killed:
            for pid in _pids(victim):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.01)

    killer = threading.Thread(target=kill_when_it_trains, daemon=True)
    killer.start()
    out = tmp_path / "out"
    try:
        first = run_study(spec, out, executor=ray_executor.RayExecutor(), progress=False, report=False)
    finally:
        stop.set()
        killer.join()
    assert killed and len(first.failed) == 1 and "worker died" in first.failed[0], first.failed
    with Store(out / "study.sqlite") as store:
        status = {r["id"]: r["status"] for r in store.runs()}
    assert status[victim] == "failed" and sorted(status.values()) == ["done", "done", "failed"]
    second = run_study(spec, out, executor=ray_executor.RayExecutor(), progress=False, report=False)
    assert second.skipped == 2 and second.ran == 1 and not second.failed


def test_ctrl_c_cancels_the_tasks_and_leaves_the_store_consistent(cluster, tmp_path):
    """``addnorm study --executor ray --address ...`` interrupted while a long run trains: it exits, its
    tasks stop (the cluster's CPUs come free), finished runs are stored and nothing of the long one."""
    import ray

    spec = {"name": "int", "base": dict(TINY), "experiments": {
        "short": {"sweep": {"seed": [0, 1]}},
        "long": {"set": {"steps": 200_000, "seed": 9}},  # minutes: still training at the SIGINT
    }}  # fmt: skip
    path, out = tmp_path / "spec.yaml", tmp_path / "out"
    path.write_text(yaml.safe_dump(spec))
    cmd = [sys.executable, "-m", "addnorm", "study", str(path), "--out", str(out), "--quiet"]
    cmd += ["--executor", "ray", "--address", cluster]
    with interruptible():  # the SIGINT below reaches it even where pytest runs as a background job
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # the two short runs stored: a bound, not a timing (minutes where the 2 cores are shared)
        finished, deadline = 0, time.monotonic() + 600
        while finished < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            if (out / "study.sqlite").is_file():
                with Store(out / "study.sqlite") as store:
                    finished = len(store.finished_ids())
        assert proc.poll() is None, proc.communicate()[0]
        assert finished == 2, f"the two short runs were not stored within 600 s ({finished} were)"
        deadline = time.monotonic() + 60  # the long run is training (the cluster's view lags a moment)
        while ray.available_resources().get("CPU", 0) >= 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert ray.available_resources().get("CPU", 0) < 2
        proc.send_signal(signal.SIGINT)
        output = proc.communicate(timeout=60)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "Traceback" not in output, output
    with Store(out / "study.sqlite") as store:
        assert len(store.finished_ids()) == 2 and len(store.runs()) == 2  # the long run was never stored
    deadline = time.monotonic() + 120
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.5)
    assert ray.available_resources().get("CPU", 0) == 2  # its task was cancelled


def test_one_line_errors(cluster, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from addnorm.cli import app

    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump({"name": "e", "base": dict(TINY), "experiments": {"a": None}}))
    runner = CliRunner()
    study = ["study", str(path), "--out", str(tmp_path / "out"), "--quiet"]
    cases = [
        (
            ["--executor", "ray", "--cpus-per-run", "3"],
            "--cpus-per-run: 3 CPUs per run, but the largest node",
        ),
        (
            ["--executor", "ray", "--gpus-per-run", "1"],
            "--gpus-per-run: 1 GPUs per run, but the largest node",
        ),
        (["--executor", "ray", "--workers", "2"], "--workers: not with --executor ray"),
        (["--address", "auto"], "--address: only with --executor ray"),
        (["--executor", "dask"], "--executor: expected one of local, ray"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, study + args)
        assert result.exit_code == 2 and result.output.count("\n") == 1 and expected in result.output, (
            result.output
        )
    with Store(tmp_path / "out" / "study.sqlite") as store:
        assert not store.runs()  # nothing ran
    # a cluster address nobody answers at: said at once (Ray itself would retry for minutes)
    cmd = [sys.executable, "-m", "addnorm", *study, "--executor", "ray", "--address", "127.0.0.1:1"]
    start = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 60 and done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --address: no Ray cluster answers at 127.0.0.1:1 (Connection refused)"
    ], done.stderr
    monkeypatch.setitem(sys.modules, "ray", None)
    result = runner.invoke(app, study + ["--executor", "ray"])
    assert result.exit_code == 2
    assert result.output.strip() == "error: --executor ray needs the 'ray' extra: pip install 'addnorm[ray]'"


def test_an_address_that_is_not_ray_is_one_line_at_once(cluster):
    """A local HTTP server at --address (it accepts the connection, then would keep Ray waiting for
    minutes) is told apart from the cluster's GCS, which answers the HTTP/2 preface."""
    import http.server
    import threading

    ray_executor._check_reachable(cluster)  # the real cluster passes

    class Quiet(http.server.BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    address = f"127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(ValueError, match=f"--address: {address} answers, but not as a Ray cluster"):
            ray_executor._check_reachable(address)
    finally:
        server.shutdown()
        server.server_close()
