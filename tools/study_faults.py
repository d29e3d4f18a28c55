"""The faults a study meets, once, for the fault trials (``tools/fault_trials.py``) and their tests
(``tests/test_study_faults.py``): the command line in a fresh process, a spec written to a file, what a
fault leaves (one line on stderr, no process outliving its driver), the storage faults set up on a
study folder, a study interrupted by a signal, a process run as an unprivileged user would be, and the
specs refused in one line.

What does not hold raises :class:`NotHeld` (an ``AssertionError``: a failed test in pytest, a trial
"not held" in the trials). Nothing here imports torch.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import yaml

from tools.procs import interruptible, session

SRC = Path(__file__).resolve().parents[1] / "src"
ENV = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", "TRITON_INTERPRET": "1"}
INTERRUPTED = "interrupted: finished runs are stored"  # the study's last line on SIGINT / SIGTERM
STORAGE_FAULT = "error: storage fault: "


class NotHeld(AssertionError):
    """A property of a fault trial did not hold."""


def check(condition: bool, message: str) -> None:
    if not condition:
        raise NotHeld(message)


def addnorm_cmd(*args: str | Path) -> list[str]:
    """``addnorm ARGS`` as a fresh process of this Python."""
    return [sys.executable, "-m", "addnorm.cli", *map(str, args)]


def study_cmd(spec: Path, out: Path, *extra: str) -> list[str]:
    return addnorm_cmd("study", spec, "--out", out, *extra)


def addnorm(*args: str | Path, timeout: float = 600, **popen) -> subprocess.CompletedProcess:
    """Run ``addnorm ARGS`` to its end (text output captured)."""
    return subprocess.run(
        addnorm_cmd(*args), env=ENV, capture_output=True, text=True, timeout=timeout, **popen
    )


def write_spec(path: Path, spec: dict) -> Path:
    path.write_text(yaml.safe_dump(spec))
    return path


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, every: float = 0.02) -> bool:
    """Whether ``predicate`` held within ``timeout`` seconds (a bound on a wait, not a measurement)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(every)
    return predicate()


def line_within(stream, timeout: float) -> str:
    """The next line of a child's pipe, waiting at most ``timeout`` seconds ("" if none came)."""
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else ""


def one_line(stderr: str, prefix: str) -> str:
    """The one non-empty line of ``stderr``, which must start with ``prefix`` (no traceback)."""
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    check(len(lines) == 1 and lines[0].startswith(prefix), f"expected one {prefix!r} line, got {lines[-5:]}")
    check("Traceback" not in stderr, "a traceback")
    return lines[0]


def no_orphans(driver_pid: int, timeout: float = 30.0) -> None:
    """Within ``timeout`` seconds no process of the killed driver's session (``start_new_session``) is
    left; any left is killed, and the check fails naming them."""
    gone = wait_for(lambda: not session(driver_pid), timeout=timeout, every=0.2)
    left = session(driver_pid)
    for pid in left:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    check(gone and not left, f"processes of the driver's session outlived it by {timeout:.0f} s: {left}")


def interrupt(command: list[str], ready: Callable[[], bool], sig: int, timeout: float = 300) -> tuple:
    """Start ``command`` (a study) in its own session, taking SIGINT as a terminal's foreground job
    does; once ``ready()`` (or it ended), send ``sig``. (returncode, stderr, pid, whether the signal
    was sent: False when the study ended first)."""
    with interruptible():  # this process may run where SIGINT is ignored (a background job)
        driver = subprocess.Popen(
            command,
            env=ENV,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
    try:
        check(wait_for(lambda: ready() or driver.poll() is not None, timeout=timeout), "not ready in time")
        sent = driver.poll() is None
        if sent:
            driver.send_signal(sig)
        _, err = driver.communicate(timeout=120)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
    return driver.returncode, err, driver.pid, sent


def check_interrupted(returncode: int, stderr: str, sig: int) -> None:
    """A study stopped by SIGINT or SIGTERM: exit 130 and its last line says what is kept."""
    name = signal.Signals(sig).name
    check(returncode == 130, f"exit {returncode} on {name}: {stderr[-300:]}")
    check(stderr.strip().splitlines()[-1].startswith(INTERRUPTED), stderr[-300:])


# --- storage ------------------------------------------------------------------------------------------
STORAGE_FAULTS = ("garbage database", "truncated database", "file in place of the folder")


def break_storage(out: Path, fault: str, finished_study: Callable[[], None]) -> None:
    """Set up ``fault`` on the study folder ``out`` (``finished_study()`` runs a whole study into it,
    which a truncated database needs first)."""
    if fault == "file in place of the folder":
        out.write_text("not a folder")
        return
    out.mkdir()
    if fault == "garbage database":
        (out / "study.sqlite").write_bytes(os.urandom(8192))
    elif fault == "truncated database":
        finished_study()
        data = (out / "study.sqlite").read_bytes()
        (out / "study.sqlite").write_bytes(data[: len(data) // 3])
    else:
        raise ValueError(f"fault: expected one of {', '.join(STORAGE_FAULTS)}, got {fault!r}")


def drop_file_capabilities() -> None:
    """In a child before exec: drop the capabilities that let root ignore file permissions
    (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, CAP_FOWNER) from the bounding set, so that after exec
    this root process meets permissions as an unprivileged user does (and can still run an
    interpreter that only root may read, which ``user="nobody"`` cannot)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # 24 = PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


# reads a file, then must be refused a write into the folder
_PROBE = """import sys
open(sys.argv[1]).read()
try:
    open(sys.argv[2], "w")
except PermissionError:
    sys.exit(0)
sys.exit(1)"""


def unprivileged(folder: Path, reads: Path) -> dict | None:
    """subprocess arguments that run a command unprivileged for ``folder``'s permissions: as is for a
    user other than root; as root, without the file capabilities (see above), else as ``nobody``.
    None when neither can read ``reads`` and is refused a write into ``folder``."""
    if os.geteuid() != 0:
        return {}
    probe = [sys.executable, "-c", _PROBE, str(reads), str(folder / "probe")]
    for how in ({"preexec_fn": drop_file_capabilities}, {"user": "nobody", "group": "nogroup"}):
        try:
            child = subprocess.run(probe, env=ENV, capture_output=True, text=True, timeout=60, **how)
        except (OSError, subprocess.SubprocessError, KeyError):
            continue
        if child.returncode == 0:
            return how
    return None


# --- specs refused in one line (exit 2): text, what the line names ------------------------------------
SPEC_ERRORS = {
    "duplicate experiment name": (
        "name: t\nexperiments:\n  a: {set: {lr: 0.01}}\n  a: {}\n",
        "duplicate key 'a' (line 4",
    ),
    "duplicate base key": (
        "name: t\nbase: {steps: 3, steps: 4}\nexperiments: {a: {}}\n",
        "duplicate key 'steps'",
    ),
    "duplicate variant label": (
        "name: t\nexperiments:\n  a:\n    sweep:\n      variant: [{label: x}, {label: x, lr: 1}]\n",
        "label 'x' is used twice",
    ),
}
