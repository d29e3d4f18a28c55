"""Study runs that span processes (issue 24, item 3): ``distributed: {strategy, nproc}`` launches a run
through torchrun; 2 processes (gloo, one thread each) store what 1 process stores; only the driver
opens the database; a killed rank fails the run with one line and the next invocation reruns it.

Oracle: the same spec trained in one process. Real processes, a real SIGKILL, loopback only
(torchrun ``--standalone`` rendezvous on a free port)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import addnorm.train.launch as launch_module
from addnorm.cli import app
from addnorm.study import executors
from addnorm.study.executors import LocalExecutor, max_nproc, plan_workers
from addnorm.study.runner import run_study
from addnorm.study.spec import SpecError, load_spec, parse_spec
from addnorm.study.store import Store
from addnorm.train import RunConfig, train
from addnorm.train.launch import launch, launcher_command
from tools.procs import alive, children, parent

# slow: spawned ranks (torchrun)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="needs torch.distributed"),
]

TINY = {
    "d_model": 16,
    "n_heads": 2,
    "d_ff": 32,
    "n_layers": 2,
    "batch_size": 4,
    "seq_len": 16,
    "steps": 40,
    "eval_every": 20,
    "eval_batches": 1,
    "probe_every": 20,
    "corpus_bytes": 20_000,
    "lr": 3e-3,
}
TOL = 1e-5


def spec(distributed: dict | None = None, **extra) -> object:
    base = {**TINY, **extra, **({"distributed": distributed} if distributed else {})}
    return parse_spec({"name": "dist", "base": base, "experiments": {"one": {}}})


def stored(folder: Path) -> tuple[dict, dict, list]:
    """(final values, {(step, name): value}, per-layer rows) of the one run stored in ``folder``."""
    with Store(folder / "study.sqlite") as store:
        (run,) = store.runs()
        record = store.run_record(run["id"])
    final = {key: record[f"final_{key}"] for key in ("train_loss", "val_loss", "val_metric")}
    metrics = {(step, name): value for step, name, value in record["metrics"]}
    layers = sorted(
        (r["step"], r["layer"], r["sublayer"], r["metric"], r["param"] or "", r["value"])
        for r in record["layer_metrics"]
    )
    return final, metrics, layers


def assert_same_run(one: Path, two: Path) -> None:
    final1, metrics1, layers1 = stored(one)
    final2, metrics2, layers2 = stored(two)
    assert set(metrics1) == set(metrics2)
    assert len({s for s, n in metrics1 if n == "train_loss"}) >= 3  # at least 3 optimiser steps
    for key, value in metrics1.items():
        assert metrics2[key] == pytest.approx(value, abs=TOL), key
    for key in ("train_loss", "val_loss", "val_metric"):
        assert final2[key] == pytest.approx(final1[key], abs=TOL), key
    assert [row[:5] for row in layers1] == [row[:5] for row in layers2]
    for a, b in zip(layers1, layers2, strict=True):
        assert b[5] == pytest.approx(a[5], abs=TOL), a[:5]


def rank_pids() -> list[int]:
    """Processes below this one running a rank (``addnorm.train.launch`` under torchrun)."""
    mine, found = os.getpid(), []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes().split(b"\0")
            if b"addnorm.train.launch" not in cmd or b"torch.distributed.run" in cmd:
                continue
            pid = int(entry.name)
            up = parent(pid)
            while up is not None and up > 1:  # descends from this test process
                if up == mine:
                    found.append(pid)
                    break
                up = parent(up)
        except (OSError, ValueError):
            continue
    return sorted(found)


def local_rank(pid: int) -> int:
    env = (Path("/proc") / str(pid) / "environ").read_bytes().split(b"\0")
    return int(next(v for v in env if v.startswith(b"LOCAL_RANK=")).split(b"=")[1])


class Watching(LocalExecutor):
    """The in-process executor, calling ``watch()`` at every step the launcher relays."""

    def __init__(self, watch) -> None:
        super().__init__()
        self.watch = watch

    def results(self, on_step=None, on_progress=None):
        def step(run, step, loss):
            self.watch()
            if on_step is not None:
                on_step(run, step, loss)

        return super().results(step, on_progress)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("one")
    run_study(spec(), folder, workers=1, progress=False, report=False)
    return folder


@pytest.mark.skipif(not Path("/proc/self/fd").exists(), reason="reads /proc")
def test_ddp_on_two_processes_stores_the_one_process_run_and_only_the_driver_opens_the_store(
    one_process, tmp_path, monkeypatch
):
    """Two DDP ranks store what one process stores, only the driver opens the database, and the run
    leaves nothing in the temporary directory (its work folder, and torchrun's own folder inside it)."""
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setenv("TMPDIR", str(temp))  # torchrun's
    monkeypatch.setattr(tempfile, "tempdir", str(temp))  # the launcher's
    seen: dict[int, list[str]] = {}

    def look() -> None:  # what each rank has open while it trains
        for pid in rank_pids():
            fds = (Path("/proc") / str(pid) / "fd").iterdir()
            seen[pid] = [os.readlink(fd) for fd in fds if fd.is_symlink()]

    outcome = run_study(
        spec({"strategy": "ddp", "nproc": 2}),
        tmp_path,
        executor=Watching(look),
        progress=False,
        report=False,
    )
    assert outcome.failed == []
    assert len(seen) == 2  # both ranks were seen training
    assert not any("study.sqlite" in path for paths in seen.values() for path in paths)
    assert_same_run(one_process, tmp_path)
    with Store(tmp_path / "study.sqlite") as store:
        (run,) = store.runs()
        assert store.run_record(run["id"])["provenance"]["distributed"] == "ddp x 2"
    assert list(temp.iterdir()) == []


def test_fsdp2_from_the_cli_stores_the_one_process_run(one_process, tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(
        "name: dist\nbase: {"
        + ", ".join(f"{k}: {v}" for k, v in TINY.items())
        + "}\nexperiments: {one: {}}\n"
    )
    out = tmp_path / "out"
    result = CliRunner().invoke(
        app,
        [
            "study",
            str(path),
            "--out",
            str(out),
            "--nproc",
            "2",
            "--strategy",
            "fsdp2",
            "--workers",
            "1",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert_same_run(one_process, out)


def test_a_killed_rank_fails_the_run_with_one_line_and_the_next_invocation_reruns_it(tmp_path):
    plan = spec({"strategy": "ddp", "nproc": 2}, steps=150, eval_every=0, probe_every=0)
    killed: list[int] = []

    def kill_rank_1() -> None:
        if not killed:
            for pid in rank_pids():
                if local_rank(pid) == 1:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    first = run_study(plan, tmp_path, executor=Watching(kill_rank_1), progress=False, report=False)
    assert killed
    (line,) = first.failed
    assert "\n" not in line
    assert "rank 1 was killed by SIGKILL" in line, line
    second = run_study(plan, tmp_path, workers=1, progress=False, report=False)
    assert (second.skipped, second.ran, second.failed) == (0, 1, [])
    with Store(tmp_path / "study.sqlite") as store:
        (run,) = store.runs()
        assert run["status"] == "done"


@pytest.mark.parametrize(
    ("printed", "said"),
    [
        (
            "terminate called without an active exception",
            " after: terminate called without an active exception",
        ),
        ("[rank1]: Fatal Python error: Segmentation fault", " after: Fatal Python error: Segmentation fault"),
        ("Traceback (most recent call last):", ""),  # not a dying process's line: nothing added
    ],
)
def test_a_rank_killed_by_a_signal_is_named_with_what_it_printed_as_it_died(tmp_path, printed, said):
    """torchrun's log of a rank ended by SIGABRT (its own summary format): the one line names the rank,
    the signal and the last line a dying process printed there, so a rare abort says what it was."""
    log = (
        "step 4\n" + printed + "\n"
        "torch.distributed.elastic.multiprocessing.api: failed\n"
        "Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-28_04:00:00\n"
        "  host      : localhost\n  rank      : 1 (local_rank: 1)\n  exitcode  : -6 (pid: 4242)\n"
    )
    (tmp_path / launch_module.LOG).write_text(log)
    line = launch_module._failure(tmp_path, 1)
    assert line == f"distributed run: rank 1 was killed by SIGABRT{said} (torchrun exit code 1); " + (
        "the next study invocation runs it again"
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_killed_torchrun_takes_its_ranks_with_it(tmp_path):
    """torchrun killed with SIGKILL cannot stop its ranks: they die with it (the kernel's parent-death
    signal) instead of training on as orphans; the run fails with one line and is stored as failed."""
    plan = spec({"strategy": "ddp", "nproc": 2}, steps=5000, eval_every=0, probe_every=0)
    ranks: list[int] = []

    def kill_torchrun() -> None:
        if not ranks:
            pids = rank_pids()
            if len(pids) == 2:
                ranks.extend(pids)
                os.kill(parent(pids[0]), signal.SIGKILL)

    outcome = run_study(plan, tmp_path, executor=Watching(kill_torchrun), progress=False, report=False)
    assert len(ranks) == 2
    (line,) = outcome.failed
    assert "\n" not in line and "distributed run" in line, line
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in ranks if alive(pid)], "orphaned ranks"


LAUNCHER = (
    "import sys\nfrom addnorm.train import RunConfig\nfrom addnorm.train.launch import launch\n"
    "print(launch(RunConfig(**eval(sys.argv[1]))).error, flush=True)\n"
)


def _wait(predicate, what: str, timeout: float = 120.0) -> None:
    """Wait for ``predicate`` (a bound on a wait, not a measured time: a hang fails the test)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout:.0f} s: {what}"
        time.sleep(0.05)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
@pytest.mark.parametrize("victim", ["torchrun", "launcher"])
def test_ranks_whose_parent_died_before_their_first_line_leave(tmp_path, victim):
    """The early window, deterministically: each rank stops at a barrier before anything it runs
    (``ADDNORM_RANK_BARRIER``), its torchrun dies meanwhile (killed itself, or with the launcher that
    started it), and, released, the rank finds its parent gone and leaves, instead of importing torch
    and lingering as an orphan (issue 31: 4 of 4 ranks killed early stayed alive)."""
    barrier = tmp_path / "go"
    settings = {**TINY, "steps": 5000, "distributed": {"strategy": "ddp", "nproc": 2}}
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, repr(settings)],
        # TMPDIR: the killed launcher's work folder is left in this test's folder, not in /tmp
        env={**os.environ, "ADDNORM_RANK_BARRIER": str(barrier), "TMPDIR": str(tmp_path)},
        stdout=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        marks = [Path(f"{barrier}.rank{r}") for r in (0, 1)]
        _wait(lambda: all(m.exists() and m.read_text() for m in marks), "both ranks at the barrier")
        ranks = [int(m.read_text()) for m in marks]
        torchrun = parent(ranks[0])
        assert torchrun == parent(ranks[1]) and b"torch.distributed.run" in Path(
            f"/proc/{torchrun}/cmdline"
        ).read_bytes().split(b"\0")
        os.kill(launcher.pid if victim == "launcher" else torchrun, signal.SIGKILL)
        # torchrun is gone once its ranks have another parent (its main thread turns zombie before its
        # other threads end, and the children move only when the last one has)
        _wait(lambda: all(parent(pid) != torchrun for pid in ranks), "the ranks handed to another parent")
        assert not alive(torchrun) and all(alive(pid) for pid in ranks)  # orphaned, held at the barrier
        barrier.touch()
        _wait(lambda: not any(alive(pid) for pid in ranks), "the orphaned ranks gone", timeout=60)
    finally:
        barrier.touch()
        for pid in [*ranks, launcher.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        launcher.wait()


# A rank entry that fails rank 1 at its third sharded step: after ``ranks.wrap`` both ranks hold a side
# process group; with IN_FLIGHT, rank 1 first starts a collective on it that rank 0 never joins.
FAILING_RANK = """import os, runpy
import torch, torch.distributed as dist
from addnorm.train import ranks
side, calls, wrap, shard = [], [], ranks.Ranks.wrap, ranks.Ranks.shard
def wrapped(self, model, device):
    side.append(dist.new_group(backend="gloo"))
    return wrap(self, model, device)
def failing(self, batch):
    calls.append(1)
    if os.environ["RANK"] == "1" and len(calls) == 3:
        if IN_FLIGHT:
            dist.all_reduce(torch.ones(3), group=side[0], async_op=True)
        raise RuntimeError("injected fault on rank 1")
    return shard(self, batch)
ranks.Ranks.wrap, ranks.Ranks.shard = wrapped, failing
runpy.run_module("addnorm.train.launch", run_name="__main__")
"""


@pytest.mark.parametrize("in_flight", [False, True], ids=["plain", "collective-in-flight"])
def test_an_error_on_one_rank_fails_the_run_naming_that_rank_and_its_error(tmp_path, monkeypatch, in_flight):
    """Rank 1 raises at its third step while rank 0 goes on into the step's gradient all-reduce (and,
    with a collective of rank 1's in flight that rank 0 never joins, which the process group's teardown
    would wait for until gloo's 30-minute timeout): rank 0's collective fails as rank 1 leaves, the run
    fails, and its one line names rank 1 and its own error, not rank 0's lost connection."""
    import threading

    from addnorm.train import launch as launch_module

    script = tmp_path / "failing_rank.py"
    script.write_text(FAILING_RANK.replace("IN_FLIGHT", str(in_flight)))
    command = launch_module.launcher_command
    monkeypatch.setattr(
        launch_module, "launcher_command", lambda work, n: [*command(work, n)[:-3], str(script), str(work)]
    )
    cfg = RunConfig(**{**TINY, "steps": 50, "eval_every": 0, "probe_every": 0}, distributed={"nproc": 2})
    results = []
    worker = threading.Thread(target=lambda: results.append(launch(cfg)), daemon=True)
    worker.start()
    worker.join(timeout=240)  # a bound on a hang (it was 30 minutes), not a measured time
    if worker.is_alive():
        for pid in children(os.getpid()):
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)
        worker.join()
        pytest.fail("the ranks hung after rank 1 failed")
    (result,) = results
    assert result.status == "failed"
    assert "\n" not in result.error
    assert result.error.startswith(
        "distributed run: rank 1 failed: RuntimeError: injected fault on rank 1"
    ), result.error


# --- settings, refusals and resources (no processes) --------------------------------------------------


def test_runs_without_distributed_keep_their_ids():
    assert RunConfig().run_id == "78aef321cc1e"  # the id on main before the key existed
    assert RunConfig(distributed={"strategy": "fsdp2", "nproc": 1}).run_id == RunConfig().run_id
    assert RunConfig(distributed={"nproc": 2}).distributed == {"strategy": "ddp", "nproc": 2}
    assert RunConfig(distributed={"nproc": 2}).run_id != RunConfig().run_id


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (3, "distributed: expected a mapping"),
        ({"nproc": 0}, "distributed.nproc: expected a positive integer"),
        ({"nproc": 2, "strategy": "zero"}, "distributed.strategy: expected one of ddp, fsdp2"),
        ({"nproc": 2, "gpus": 2}, "distributed.gpus: unknown key"),
        ({"nproc": 3}, "distributed.nproc: 3 processes cannot share batch_size=16"),
    ],
)
def test_bad_distributed_settings_are_one_line_naming_the_key(value, words):
    with pytest.raises(SpecError) as err:
        parse_spec({"name": "x", "base": {"distributed": value}, "experiments": {"a": {}}})
    assert words in str(err.value) and "\n" not in str(err.value)


def test_workers_times_processes_above_the_cores_is_refused(monkeypatch):
    monkeypatch.setattr(executors, "usable_cores", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plan_workers(1, None, runs=3, nproc=2) == (1, 1)
    assert plan_workers("auto", None, runs=3, nproc=2) == (1, 1)
    with pytest.raises(ValueError, match=r"^workers: 2 worker\(s\) x 2 processes per run .* use --workers 1"):
        plan_workers(2, None, runs=3, nproc=2)
    assert max_nproc(spec({"nproc": 2}).expand()) == 2 and max_nproc(spec().expand()) == 1


def test_the_cli_options_set_distributed_everywhere_and_strategy_needs_nproc():
    plan = load_spec("quick", ["distributed={strategy: fsdp2, nproc: 2}"])
    assert {str(r.config.distributed) for r in plan.expand()} == {"{'strategy': 'fsdp2', 'nproc': 2}"}
    result = CliRunner().invoke(app, ["study", "quick", "--strategy", "fsdp2", "--dry-run"])
    assert result.exit_code != 0 and "--strategy: only with --nproc" in result.output


def test_the_ray_executor_gives_a_run_on_n_processes_n_gpus():
    ray_executor = pytest.importorskip("addnorm.study.ray_executor")
    (two,) = spec({"nproc": 2}).expand()
    (one,) = spec().expand()
    on_gpus = ray_executor.RayExecutor(None, cpus_per_run=1, gpus_per_run=1)
    assert on_gpus.task_options(two)["num_gpus"] == 2 and on_gpus.task_options(two)["num_cpus"] == 2
    assert on_gpus.task_options(one)["num_gpus"] == 1
    on_cpus = ray_executor.RayExecutor(None, cpus_per_run=1)
    assert on_cpus.task_options(two)["num_gpus"] == 0 and on_cpus.task_options(two)["num_cpus"] == 2

    class Cluster:  # one node with 1 CPU and no GPU: a 2-process run cannot be placed
        @staticmethod
        def nodes():
            return [{"Alive": True, "Resources": {"CPU": 1.0}}]

    on_cpus._ray = Cluster()
    with pytest.raises(ValueError, match="^distributed.nproc: .* 2 CPUs and 0 GPUs on one node; no node"):
        on_cpus._check_fits(on_cpus.task_options(two))


def test_on_gpus_a_run_takes_one_gpu_per_process(monkeypatch):
    """The GPU path without a GPU: N processes need N GPUs; torchrun gets one process per GPU."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert plan_workers("auto", None, runs=4, nproc=2) == (1, 1)
    with pytest.raises(ValueError, match=r"^workers: a run on 2 processes takes 2 GPUs .*--workers 1"):
        plan_workers(2, None, runs=4, nproc=2)
    with pytest.raises(ValueError, match=r"^distributed.nproc: a run on 4 processes takes 4 GPUs .* has 2$"):
        plan_workers("auto", None, runs=4, nproc=4)
    command = launcher_command("/tmp/work", 2)
    assert command[1:4] == ["-m", "torch.distributed.run", "--standalone"]
    assert "--nproc-per-node=2" in command and "--max-restarts=0" in command
    assert "--log-dir=/tmp/work/torchrun" in command  # torchrun's folder inside the run's
    assert command[-3:] == ["-m", "addnorm.train.launch", "/tmp/work"]
    with pytest.raises(ValueError, match="^distributed: launch needs a run with distributed set"):
        launch(RunConfig(**TINY))


@pytest.mark.parametrize(
    ("extra", "strategy"),
    [
        ({"model": "hf-llama", "fused": True}, "fsdp2"),  # a fused HF family, sharded per decoder layer
        ({"task": "copy", "placement": "post", "grad_clip": 0.5}, "fsdp2"),  # encoder-decoder, clipping
        ({"placement": "resi_dual"}, "ddp"),
    ],
    ids=["hf-llama-fused-fsdp2", "copy-post-clip-fsdp2", "resi_dual-ddp"],
)
def test_two_processes_train_like_one_across_models(extra, strategy):
    if extra.get("model", "").startswith("hf-"):
        pytest.importorskip("transformers")
    settings = {**TINY, "steps": 4, "eval_every": 2, "probe_every": 2, **extra}
    torch.set_num_threads(1)
    one = train(RunConfig(**settings))
    two = launch(RunConfig(**settings, distributed={"strategy": strategy, "nproc": 2}))
    assert two.status == "done", two.error
    expected = {(step, name): value for step, name, value in one.metrics}
    got = {(step, name): value for step, name, value in two.metrics}
    assert set(got) == set(expected)
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=TOL), key
    assert len(two.layer_metrics) == len(one.layer_metrics)
    for a, b in zip(one.layer_metrics, two.layer_metrics, strict=True):
        assert (b["step"], b["layer"], b["metric"]) == (a["step"], a["layer"], a["metric"])
        assert b["value"] == pytest.approx(a["value"], abs=TOL), a
