"""A study under faults: a NaN loss, two studies on one folder (two real processes), a killed holder's
stale lock, storage faults (corrupt database, read-only folder, a file in the way, a full disk by an
injected ENOSPC) as one line with their own exit codes, and an atomic report."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from addnorm.study import Store, parse_spec, run_study
from addnorm.study import store as store_module
from addnorm.study.lock import LOCK_NAME, FolderInUse, folder_lock

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)
SRC = str(Path(__file__).resolve().parents[1] / "src")
HOLD = "import time\nfrom addnorm.study.lock import folder_lock\nwith folder_lock({!r}):\n    {}"
ENV = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}


def write_spec(path: Path, name="tiny", **sweep) -> Path:
    spec = {"name": name, "base": dict(TINY), "experiments": {"main": {"sweep": sweep or {"seed": [0]}}}}
    path.write_text(yaml.safe_dump(spec))
    return path


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
        spec = write_spec(tmp_path / "spec.yaml")
        second = subprocess.run(
            [sys.executable, "-m", "addnorm.cli", "study", str(spec), "--out", str(tmp_path), "--quiet"],
            env=ENV, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert second.returncode == 3, second.stderr
        lines = second.stderr.strip().splitlines()
        assert len(lines) == 1 and str(tmp_path) in lines[0] and f"process {holder.pid}" in lines[0], lines
        assert not (tmp_path / "study.sqlite").exists()  # nothing was touched
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    with folder_lock(tmp_path):  # the killed holder's lock is taken over at once
        assert (tmp_path / LOCK_NAME).read_text().strip() == str(os.getpid())


def test_the_lock_is_reentrant_in_one_process_and_exclusive_across_open_files(tmp_path):
    with folder_lock(tmp_path), folder_lock(tmp_path):
        pass
    with folder_lock(tmp_path):
        child = subprocess.run(
            [sys.executable, "-c", HOLD.format(str(tmp_path), "pass")],
            env=ENV, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert child.returncode != 0 and FolderInUse.__name__ in child.stderr


@pytest.mark.parametrize(
    "fault",
    ["garbage database", "truncated database", "read-only folder", "file in the way"],
)
def test_storage_faults_are_one_line_with_exit_code_4(tmp_path, fault):
    spec = write_spec(tmp_path / "spec.yaml")
    out = tmp_path / "out"
    if fault == "file in the way":
        out.write_text("not a folder")
    else:
        out.mkdir()
        if fault == "garbage database":
            (out / "study.sqlite").write_bytes(os.urandom(4096))
        elif fault == "truncated database":
            assert cli("study", spec, "--out", out, "--quiet").exit_code == 0
            data = (out / "study.sqlite").read_bytes()
            (out / "study.sqlite").write_bytes(data[: len(data) // 3])
        else:
            out.chmod(0o500)
            if os.access(out, os.W_OK):
                pytest.skip("running as root: permissions do not stop writes")
    try:
        result = cli("study", spec, "--out", out, "--quiet")
    finally:
        if out.is_dir():
            out.chmod(0o700)
    assert result.exit_code == 4, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "storage fault" in errors[0] and "Traceback" not in result.output


def test_a_full_disk_while_writing_the_report_keeps_the_old_report(tmp_path, monkeypatch):
    """The report goes through a temporary file and a rename: ENOSPC mid-write leaves the previous
    report whole, no temporary file, and the study exits 4 with one line."""
    spec = write_spec(tmp_path / "spec.yaml")
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
        (
            "name: t\nexperiments:\n  a: {set: {lr: 0.01}}\n  a: {}\n",
            "duplicate key 'a' (line 4",
        ),
        ("name: t\nbase: {steps: 3, steps: 4}\nexperiments: {a: {}}\n", "duplicate key 'steps'"),
        (
            "name: t\nexperiments:\n  a:\n    sweep:\n      variant: [{label: x}, {label: x, lr: 1}]\n",
            "label 'x' is used twice",
        ),
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
    spec = write_spec(tmp_path / "spec.yaml")
    ray = ("--executor", "ray", "--cpus-per-run", "0")
    result = cli("study", spec, "--out", tmp_path / "out", *ray, "--dry-run")
    assert result.exit_code == 2 and "--cpus-per-run: expected a whole number >= 1, got 0" in result.output
