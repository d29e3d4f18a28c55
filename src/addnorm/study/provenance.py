"""Where and with what a run ran: package, commit, torch and Python versions, device, threads, date.

Computed in the process that trains (an executor's worker), so it describes that process; the
driver stores it with the run and the report prints it. The training loop adds what it chose itself
(the device it trained on, its precision, whether it compiled).
"""

from __future__ import annotations

import functools
import platform
import subprocess
from datetime import datetime, timezone
from pathlib import Path

import torch

from .. import __version__
from ..train.device import cpu_model, device_name

__all__ = ["cpu_model", "device_name", "git_state", "provenance"]

_PACKAGE = Path(__file__).resolve().parents[1]  # .../src/addnorm


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(_PACKAGE), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.lru_cache(maxsize=1)
def git_state() -> tuple[str | None, bool | None]:
    """(commit, has uncommitted changes) of the checkout this package runs from; (None, None) for an
    installed copy (a checkout is recognised by holding this very package at ``src/addnorm``)."""
    top = _git("rev-parse", "--show-toplevel")
    if not top or (Path(top) / "src" / "addnorm").resolve() != _PACKAGE:
        return None, None
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    return commit, (bool(status) if status is not None else None)


def provenance() -> dict:
    """This process's provenance, as stored with each run."""
    commit, dirty = git_state()
    return {
        "addnorm": __version__,
        "git_commit": commit,
        "git_dirty": dirty,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_name(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(terse=True),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
