"""The storage faults of ``tools/fault_trials.py``: a truncated, a garbage and a locked database, a file in
place of the folder, a read-only folder (run unprivileged), and a full disk (a small tmpfs; without the
privilege to mount one, a file size limit) while runs are stored and while the report is written."""

from __future__ import annotations

import contextlib
import os
import resource
import signal
import sqlite3
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from tools.fault_trial_study import RUNS, Context, signature, stored_values_match, summary
from tools.study_faults import ENV, addnorm, break_storage, check, one_line, study_cmd, unprivileged


def storage(ctx: Context, out: Path, fault: str) -> str:
    def finished_study() -> None:
        done = subprocess.run(study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, timeout=600)
        check(done.returncode == 0, "setup failed")

    if fault == "locked database":
        out.mkdir()
        finished_study()
        holder = sqlite3.connect(out / "study.sqlite", timeout=0)
        holder.execute("BEGIN EXCLUSIVE")
        try:
            start = time.monotonic()
            result = subprocess.run(
                study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, text=True, timeout=600
            )
            took = time.monotonic() - start
        finally:
            holder.rollback()
            holder.close()
        line = one_line(result.stderr, "error: storage fault: ")
        check(result.returncode == 4, f"exit {result.returncode}")
        check(signature(out / "study.sqlite") == ctx.reference, "the stored study changed")
        return f"{line[len('error: ') :][:90]} ({took:.1f} s)"
    break_storage(out, fault, finished_study)
    result = subprocess.run(
        study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, text=True, timeout=600
    )
    check(result.returncode == 4, f"exit {result.returncode}: {result.stderr[-300:]}")
    line = one_line(result.stderr, "error: storage fault: ")
    return line[len("error: ") :][:100]


def read_only(ctx: Context, out: Path) -> str:
    first = subprocess.run(study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, timeout=600)
    check(first.returncode == 0, "setup failed")
    out.chmod(0o555)
    how = unprivileged(out, ctx.spec) or {}
    try:
        again = addnorm("study", ctx.spec, "--out", out, "--quiet", **how)
        dry = addnorm("study", ctx.spec, "--out", out, "--dry-run", **how)
        export = addnorm("export", out, "--to", out.parent / "csv", **how)
    finally:
        out.chmod(0o755)
    check(again.returncode == 4, f"study exit {again.returncode}")
    one_line(again.stderr, "error: storage fault: ")
    check(dry.returncode == 0 and f"{RUNS} already stored" in dry.stdout, f"dry-run exit {dry.returncode}")
    check(export.returncode == 0, f"export exit {export.returncode}: {export.stderr[-200:]}")
    check(signature(out / "study.sqlite") == ctx.reference, "database changed")
    return "study exit 4 in one line; --dry-run and export work"


@contextlib.contextmanager
def small_disk(folder: Path, size: int):
    """``folder`` on a tmpfs of ``size`` bytes (unmounted after); yields a function that resizes it,
    or None for the file-size limit used instead where this process may not mount."""
    folder.mkdir(parents=True)
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
        ).returncode
        == 0
    )
    try:
        if mounted:
            yield lambda new: subprocess.run(
                ["mount", "-o", f"remount,size={new}", str(folder)], check=True, capture_output=True
            )
        else:
            yield None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def file_size_limit(size: int) -> Callable[[], None]:
    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))

    return limit


def full_disk(ctx: Context, out: Path, when: str) -> str:
    """A disk that fills while runs are stored (then space freed and the study resumed), or while the
    report is written (the previous report must stay whole)."""
    disk = out.parent / "disk"
    reference_db = ctx.root / "reference" / "study.sqlite"
    db_size = reference_db.stat().st_size
    with small_disk(disk, 4 * 2**20) as resize:
        out = disk / "out"
        if when == "while runs are stored":
            # room for the database about twice its final size: its write-ahead log outgrows that
            # after a few runs (on a file size limit: the log may not grow past the final size)
            limit = db_size
            if resize is not None:
                resize(2 * limit)
                run = subprocess.run(
                    study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, text=True, timeout=600
                )
            else:
                run = subprocess.run(
                    study_cmd(ctx.spec, out, "--quiet"),
                    env=ENV,
                    capture_output=True,
                    text=True,
                    timeout=600,
                    preexec_fn=file_size_limit(limit),
                )
            check(run.returncode == 4, f"exit {run.returncode}: {run.stderr[-300:]}")
            line = one_line(run.stderr, "error: storage fault: ")
            stored = stored_values_match(ctx, out)
            kept = len(list((out / "unsaved").glob("*.pkl"))) if (out / "unsaved").is_dir() else 0
            if resize is not None:
                resize(64 * 2**20)  # space freed
            again = subprocess.run(
                study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, text=True, timeout=600
            )
            check(again.returncode == 0, f"resume exit {again.returncode}: {again.stderr[-300:]}")
            total, skipped, ran = summary(again.stdout)
            check(
                skipped == len(stored) + kept and ran == RUNS - skipped,
                f"resume: {skipped} already stored, {ran} run now; {len(stored)} stored + {kept} kept aside",
            )
            check(signature(out / "study.sqlite") == ctx.reference, "database differs after the resume")
            how = "tmpfs" if resize is not None else "file size limit"
            return f"{how}: {line[len('error: ') :][:70]}; {len(stored)} stored, {kept} kept aside, resumed"
        # while the report is written: a whole study, then the disk filled up to less than a report
        first = subprocess.run(study_cmd(ctx.spec, out, "--quiet"), env=ENV, capture_output=True, timeout=600)
        check(first.returncode == 0, "setup failed")
        good = (out / "report.html").read_bytes()
        if resize is not None:
            filler = disk / "filler"
            with open(filler, "wb") as fh, contextlib.suppress(OSError):
                while True:
                    fh.write(b"\0" * 65536)
                    fh.flush()
            os.truncate(filler, max(os.path.getsize(filler) - len(good) // 2, 0))
            result = addnorm("report", out)
        else:
            result = addnorm("report", out, preexec_fn=file_size_limit(len(good) // 2))
        check(result.returncode == 4, f"report exit {result.returncode}")
        one_line(result.stderr, "error: storage fault: ")
        check((out / "report.html").read_bytes() == good, "the previous report was damaged")
        check(not [p for p in out.iterdir() if p.name.endswith(".tmp")], "a temporary file left")
        return "exit 4 in one line, the previous report whole"
