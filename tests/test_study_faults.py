"""A study under faults: a NaN loss, two studies on one folder (two real processes), a killed holder's
stale lock, storage faults (corrupt database, read-only folder, a file in the way, a full disk by an
injected ENOSPC) as one line with their own exit codes, and an atomic report."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from addnorm.study import Store, parse_spec, run_study
from addnorm.study import store as store_module
from addnorm.study.lock import LOCK_NAME, FolderInUse, folder_lock
from tools.procs import pool_workers
from tools.study_faults import (  # shared with tools/fault_trials.py
    ENV,
    SPEC_ERRORS,
    STORAGE_FAULTS,
    addnorm,
    break_storage,
    check_interrupted,
    interrupt,
    line_within,
    no_orphans,
    study_cmd,
    unprivileged,
    write_spec,
)

pytestmark = pytest.mark.slow  # fault injection (killed processes)

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)
HOLD = "import time\nfrom addnorm.study.lock import folder_lock\nwith folder_lock({!r}):\n    {}"


def tiny_spec(path: Path, name="tiny", **sweep) -> Path:
    return write_spec(
        path, {"name": name, "base": dict(TINY), "experiments": {"main": {"sweep": sweep or {"seed": [0]}}}}
    )


def cli(*args):
    from tests.test_study_cli import make_app

    return CliRunner().invoke(make_app(), [str(a) for a in args])


def test_a_nan_loss_is_a_diverged_run_and_the_findings_and_report_are_still_written(tmp_path):
    """lr = inf makes the first loss NaN (stored as NULL by SQLite): the run is stored as diverged, the
    report is written, and ``report`` rebuilds it."""
    spec = parse_spec(
        {"name": "nan", "base": dict(TINY), "experiments": {"main": {"sweep": {"lr": [1e-3, float("inf")]}}}}
    )
    outcome = run_study(spec, tmp_path, workers=1, progress=False)
    assert outcome.report is not None and outcome.report.stat().st_size > 0
    with Store(tmp_path / "study.sqlite") as store:
        statuses = sorted(r["status"] for r in store.runs())
        assert statuses == ["diverged", "done"]
        diverged = next(r for r in store.runs() if r["status"] == "diverged")
        assert all(isinstance(v, float) for _, v in store.metric(diverged["id"], "train_loss"))
    result = cli("report", tmp_path)
    assert result.exit_code == 0, result.output


def test_a_second_process_on_a_folder_in_use_refuses_in_one_line(tmp_path):
    """A real second process: exit code 3, one line naming the folder and the holder's pid; once the
    holder is killed (-9) its stale lock does not block."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(str(tmp_path), "print('held', flush=True); time.sleep(600)")],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "held"
        spec = tiny_spec(tmp_path / "spec.yaml")
        second = addnorm("study", spec, "--out", tmp_path, "--quiet", timeout=120)
        assert second.returncode == 3, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and str(tmp_path) in lines[0] and f"process {holder.pid}" in lines[0], lines
        assert not (tmp_path / "study.sqlite").exists()  # nothing was touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folder_lock(tmp_path):  # the killed holder's lock is taken over at once
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_wait_waits_for_a_folder_in_use_with_one_line_then_runs(tmp_path):
    """Two real processes against a holder: ``--wait 1`` exits 3 after its second; ``--wait 120`` says
    once whom it waits for (the holder's pid), and runs the study once the holder is gone (kill -9)."""
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD.format(str(tmp_path), "print('held', flush=True); time.sleep(600)")],
        env=ENV, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    study = study_cmd(tiny_spec(tmp_path / "spec.yaml"), tmp_path, "--quiet", "--wait")
    waiters = []
    try:
        assert line_within(holder.stdout, 60).strip() == "held"
        for seconds in ("120", "1"):  # unbuffered bytes: a line read leaves the rest in the pipe
            waiters.append(subprocess.Popen([*study, seconds], env=ENV, stdout=subprocess.PIPE,
                                            stderr=subprocess.PIPE, bufsize=0))  # fmt: skip
        patient, brief = waiters
        _, err = (x.decode() for x in brief.communicate(timeout=120))
        assert brief.returncode == 3, err
        (line,) = err.strip().splitlines()[-1:]
        assert f"process {holder.pid}" in line and "after waiting 1 s" in line, err
        first = line_within(patient.stderr, 60).decode()
        assert first.startswith(f"waiting for {tmp_path}: in use by process {holder.pid}"), first
        assert patient.poll() is None  # still waiting
    finally:
        holder.kill()
        holder.wait()
    out, err = (x.decode() for x in patient.communicate(timeout=120))
    assert patient.returncode == 0, err
    assert "waiting for" not in err and "1 runs (0 already stored, 1 run now)" in out  # told once
    with Store(tmp_path / "study.sqlite") as store:
        assert [r["status"] for r in store.runs()] == ["done"]


def test_the_lock_is_reentrant_in_one_process_and_exclusive_across_open_files(tmp_path):
    with folder_lock(tmp_path), folder_lock(tmp_path):
        pass
    with folder_lock(tmp_path):
        child = subprocess.run(
            [sys.executable, "-c", HOLD.format(str(tmp_path), "pass")],
            env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert child.returncode != 0 and FolderInUse.__name__ in child.stderr


@pytest.mark.parametrize("fault", STORAGE_FAULTS)
def test_storage_faults_are_one_line_with_exit_code_4(tmp_path, fault):
    spec = tiny_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    break_storage(out, fault, lambda: cli("study", spec, "--out", out, "--quiet"))
    result = cli("study", spec, "--out", out, "--quiet")
    assert result.exit_code == 4, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "storage fault" in errors[0] and "Traceback" not in result.output


def test_a_read_only_folder_is_read_but_never_written(tmp_path):
    """A finished study's folder (owned by root or the test's user) made read-only (0555), the
    commands run as an unprivileged process: resuming the study is one storage-fault line (exit 4)
    naming the database; --dry-run and export to another folder only read, and work."""
    spec = tiny_spec(tmp_path / "spec.yaml")
    out, elsewhere = tmp_path / "out", tmp_path / "csv"
    assert cli("study", spec, "--out", out, "--quiet").exit_code == 0
    before = sorted(p.name for p in out.iterdir())
    out.chmod(0o555)
    try:
        how = unprivileged(out, reads=spec)
        if how is not None:
            resumed = addnorm("study", spec, "--out", out, "--quiet", timeout=120, **how)
            dry = addnorm("study", spec, "--out", out, "--dry-run", timeout=120, **how)
            exported = addnorm("export", out, "--to", elsewhere, timeout=120, **how)
    finally:
        out.chmod(0o755)
    if how is None:
        pytest.skip("no unprivileged way to run a process here (no capability drop, no usable 'nobody')")
    assert resumed.returncode == 4, resumed.stderr
    (line,) = resumed.stderr.strip().splitlines()
    assert line.startswith("error: storage fault: ") and "study.sqlite" in line, line
    assert dry.returncode == 0 and "1 already stored" in dry.stdout, dry.stderr
    assert exported.returncode == 0, exported.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == sorted(
        ["runs.csv", "experiments.csv", "metrics.csv", "layer_metrics.csv"]
    )
    assert sorted(p.name for p in out.iterdir()) == before  # nothing written, no -wal/-shm left


def test_a_full_disk_while_writing_the_report_keeps_the_old_report(tmp_path, monkeypatch):
    """The report goes through a temporary file and a rename: ENOSPC mid-write leaves the previous
    report whole, no temporary file, and the study exits 4 with one line."""
    spec = tiny_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    assert cli("study", spec, "--out", out, "--quiet").exit_code == 0
    good = (out / "report.html").read_bytes()
    real_replace = os.replace

    def full(src, dst):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    monkeypatch.setattr(store_module.os, "replace", full)
    result = cli("report", out)
    monkeypatch.setattr(store_module.os, "replace", real_replace)
    assert result.exit_code == 4 and "No space left on device" in result.output, result.output
    assert (out / "report.html").read_bytes() == good
    assert [p.name for p in out.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize(
    ("text", "named"),
    [
        *SPEC_ERRORS.values(),
        ("name: ../..\nexperiments: {a: {}}\n", "name: '../..'"),
        ("name: /abs/path\nexperiments: {a: {}}\n", "name: '/abs/path'"),
    ],
)
def test_ambiguous_specs_are_one_line_errors_naming_the_duplicate(tmp_path, text, named):
    (tmp_path / "spec.yaml").write_text(text)
    result = cli("study", tmp_path / "spec.yaml", "--out", tmp_path / "out", "--dry-run")
    assert result.exit_code == 2, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("error:")]
    assert named in line, line


def test_cpus_per_run_zero_is_refused(tmp_path):
    spec = tiny_spec(tmp_path / "spec.yaml")
    ray = ("--executor", "ray", "--cpus-per-run", "0")
    result = cli("study", spec, "--out", tmp_path / "out", *ray, "--dry-run")
    assert result.exit_code == 2 and "--cpus-per-run: expected a whole number >= 1, got 0" in result.output


def test_a_dead_pool_worker_fails_no_other_run(tmp_path, monkeypatch):
    """SIGKILL of one of two pool workers mid-study: the pool is replaced, the runs it took down are
    tried again, every run ends done (the one-off kill hit no run twice); an uninterrupted in-process
    study gives the same losses. The workers' progress reaches the display: each run's first event (its
    model being built) and its last held-out batch always arrive (the ones between at most twice a
    second)."""
    import io

    from addnorm.study.progress import StudyProgress
    from addnorm.train.loop import eval_batches_total

    events: dict[str, list] = {}
    shown = StudyProgress.progress
    monkeypatch.setattr(
        StudyProgress,
        "progress",
        lambda self, run, *e: (events.setdefault(run.run_id, []).append(e), shown(self, run, *e))[1],
    )
    spec = parse_spec(
        {
            "name": "kill",
            "base": {**TINY, "steps": 60},
            "experiments": {"main": {"sweep": {"seed": [0, 1, 2, 3]}}},
        }
    )
    import threading

    killed = []

    def killer():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            workers = pool_workers(os.getpid())
            if len(workers) == 2 and (tmp_path / "out" / "study.sqlite").exists():
                time.sleep(1.0)  # inside a run
                os.kill(workers[0], signal.SIGKILL)
                killed.append(workers[0])
                return
            time.sleep(0.05)

    thread = threading.Thread(target=killer)
    thread.start()
    outcome = run_study(
        spec, tmp_path / "out", workers=2, threads=1, report=False, stream=io.StringIO()
    )  # progress on
    thread.join()
    assert killed and outcome.failed == []
    for run in spec.expand():
        total = eval_batches_total(run.config)
        assert events[run.run_id][0] == ("build", 0, 1) and events[run.run_id][-1] == ("eval", total, total)
    here = run_study(spec, tmp_path / "here", workers=1, progress=False, report=False)
    assert here.failed == []
    with Store(tmp_path / "out" / "study.sqlite") as a, Store(tmp_path / "here" / "study.sqlite") as b:
        assert {r["id"]: r["final_val_loss"] for r in a.runs()} == {
            r["id"]: r["final_val_loss"] for r in b.runs()
        }


@pytest.mark.parametrize("after", [2.0, 4.0])
def test_workers_die_with_a_killed_driver_even_while_starting(tmp_path, after):
    """kill -9 of the driver while its two workers start (or run): within 30 s no process of its
    session is left (no orphan holding the output pipe)."""
    spec = tiny_spec(tmp_path / "spec.yaml", seed=[0, 1, 2, 3])
    driver = subprocess.Popen(
        study_cmd(spec, tmp_path / "o", "--workers", "2"),
        env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    time.sleep(after)
    driver.kill()
    driver.wait()
    no_orphans(driver.pid)


def test_a_tracker_that_fails_to_open_is_dropped_with_one_warning(tmp_path):
    """``<out>/tensorboard`` is a file: one warning line, the study runs and exits 0 without it."""
    pytest.importorskip("torch.utils.tensorboard")
    spec = tiny_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    out.mkdir()
    (out / "tensorboard").write_text("in the way")
    result = cli("study", spec, "--out", out, "--track", "tensorboard", "--quiet")
    assert result.exit_code == 0, result.output
    warnings = [x for x in result.output.splitlines() if x.startswith("warning: --track tensorboard")]
    assert len(warnings) == 1 and "Traceback" not in result.output
    with Store(out / "study.sqlite") as store:
        assert [r["status"] for r in store.runs()] == ["done"]


def test_a_finished_run_whose_save_fails_is_kept_and_stored_on_resume(tmp_path, monkeypatch):
    """The database write of a finished run fails (an injected 'disk is full'): the study stops with
    that error, the run is kept in a side file, and the next study stores it without training it again;
    its numbers equal an uninterrupted study's."""
    import sqlite3

    spec = parse_spec(
        {"name": "full", "base": dict(TINY), "experiments": {"main": {"sweep": {"seed": [0, 1]}}}}
    )
    real = Store.save_run

    def full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")

    monkeypatch.setattr(Store, "save_run", full)
    with pytest.raises(sqlite3.OperationalError, match="disk is full"):
        run_study(spec, tmp_path / "out", workers=1, progress=False, report=False)
    assert len(list((tmp_path / "out" / "unsaved").glob("*.pkl"))) == 1
    monkeypatch.setattr(Store, "save_run", real)
    resumed = run_study(spec, tmp_path / "out", workers=1, progress=False, report=False)
    assert (resumed.skipped, resumed.ran) == (1, 1)
    assert list((tmp_path / "out" / "unsaved").glob("*.pkl")) == []
    whole = run_study(spec, tmp_path / "whole", workers=1, progress=False, report=False)
    assert whole.ran == 2
    with Store(tmp_path / "out" / "study.sqlite") as a, Store(tmp_path / "whole" / "study.sqlite") as b:
        losses = [{r["id"]: (r["status"], r["final_val_loss"]) for r in store.runs()} for store in (a, b)]
        assert losses[0] == losses[1]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupted_study_exits_130_with_a_message(tmp_path, sig):
    spec = write_spec(
        tmp_path / "spec.yaml", {"name": "i", "base": {**TINY, "steps": 100000}, "experiments": {"main": {}}}
    )
    seen: list[float] = []

    def training() -> bool:  # 2 s after the database appeared
        if not seen and (tmp_path / "o" / "study.sqlite").exists():
            seen.append(time.monotonic())
        return bool(seen) and time.monotonic() - seen[0] > 2.0

    code, err, _, sent = interrupt(
        study_cmd(spec, tmp_path / "o", "--workers", "1"), training, sig, timeout=60
    )
    assert sent, err
    check_interrupted(code, err, sig)


def test_observing_a_long_run_changes_nothing_and_counts_every_evaluation_batch():
    """A run with every observer (steps and progress) stores the unobserved run's numbers; progress
    says when the model is built and counts each held-out batch over the whole run, to its total."""
    from addnorm.train import RunConfig, train
    from addnorm.train.loop import eval_batches_total

    cfg = RunConfig(**{**TINY, "steps": 4, "eval_every": 2, "eval_batches": 3})
    events, steps = [], []
    watched = train(cfg, on_step=lambda s, v: steps.append(s), on_progress=lambda *e: events.append(e))
    plain = train(cfg)
    assert watched.metrics == plain.metrics and watched.final == plain.final
    total = eval_batches_total(cfg)
    assert total == (2 + 1) * 3  # after steps 2 and 4, then the final evaluation
    assert events == [("build", 0, 1), ("build", 1, 1)] + [("eval", i, total) for i in range(1, total + 1)]
    assert steps == [0, 1, 2, 3]


def test_a_side_file_is_whole_or_absent_and_a_cut_one_is_retrained(tmp_path, monkeypatch):
    """On a full disk the side file of an unsaved run is written whole or not at all (temporary file
    and rename: here the disk fills at its fsync); a side file cut short (as an older version could
    leave) is dropped with one warning on the next study, and its run is trained again."""
    import io
    import sqlite3

    spec = parse_spec({"name": "full", "base": dict(TINY), "experiments": {"main": {"set": {}}}})

    def full(self, *args):
        raise sqlite3.OperationalError("database or disk is full")

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(Store, "save_run", full)
    monkeypatch.setattr(store_module.os, "fsync", no_space)
    with pytest.raises(sqlite3.OperationalError):
        run_study(spec, tmp_path, workers=1, progress=False, report=False)
    assert list((tmp_path / "unsaved").iterdir()) == []  # neither a side file nor a temporary one
    monkeypatch.undo()
    (run,) = spec.expand()
    (tmp_path / "unsaved" / f"{run.run_id}.pkl").write_bytes(b"")  # cut short
    stream = io.StringIO()
    outcome = run_study(spec, tmp_path, workers=1, progress=False, report=False, stream=stream)
    assert (outcome.ran, outcome.failed) == (1, [])
    (line,) = stream.getvalue().splitlines()
    assert line.startswith("warning: ") and "cannot be read (EOFError); its run is trained again" in line
    assert list((tmp_path / "unsaved").iterdir()) == []


@pytest.mark.parametrize("state", ["an empty file", "half its tables"])
def test_a_database_killed_before_its_schema_is_an_empty_study(tmp_path, state):
    """A study killed (-9) between creating its database and writing the tables (the fault trials hit
    it): --dry-run reads it as empty, and the next study runs every run (it was exit 4)."""
    import sqlite3

    spec = tiny_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    out.mkdir()
    db = sqlite3.connect(out / "study.sqlite")
    if state == "half its tables":
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("CREATE TABLE studies (name TEXT PRIMARY KEY, spec TEXT NOT NULL, updated REAL NOT NULL)")
    db.close()
    dry = cli("study", spec, "--out", out, "--dry-run")
    assert dry.exit_code == 0 and "0 already stored" in dry.output, dry.output
    result = cli("study", spec, "--out", out, "--quiet")
    assert result.exit_code == 0 and "1 runs (0 already stored, 1 run now)" in result.output, result.output


def test_the_fault_trials_script_lists_every_fault_and_runs_a_trial(bench_module, tmp_path):
    """A smoke of ``tools/fault_trials.py``: its table names each fault of issue 23, and one of
    its trials (a repeated variant label, through the real command line) holds."""
    trials = bench_module("tools.fault_trials")
    table = trials.trials(repeat=1)
    for fault in ("kill -9", "SIGINT", "SIGTERM", "two studies", "NaN", "pool worker", "truncated",
                  "garbage", "locked", "read-only", "file in place", "full disk", "tracker", "Ray",
                  "duplicate"):  # fmt: skip
        assert any(fault in name for name in table), fault
    ctx = trials.Context(tmp_path)
    note = trials.spec_error(ctx, tmp_path / "out", "duplicate variant label")
    assert "label 'x' is used twice" in note
