"""One study at a time per folder: an exclusive ``flock`` on ``<out>/.addnorm.lock``, holding the pid
of the process that has it. The kernel drops the lock when that process exits, however it exits
(``kill -9`` included), so a stale lock file never blocks: the next study simply takes it over.
Re-entrant within a process (the CLI holds it around the study and its findings; ``run_study`` too)."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

LOCK_NAME = ".addnorm.lock"
_held: dict[Path, list] = {}  # folder -> [open lock file, depth], for re-entry in this process


class FolderInUse(RuntimeError):
    """Another process holds the study folder's lock (the CLI's exit code 3)."""

    exit_code = 3


def _holder(fh) -> str:
    fh.seek(0)
    pid = fh.read().strip()
    return f"process {pid}" if pid.isdigit() else "another process"


@contextlib.contextmanager
def folder_lock(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder``'s study lock (creating the folder) for the block; :class:`FolderInUse` naming
    the folder and the holder's pid at once if another process holds it."""
    folder = Path(folder).absolute()
    if folder in _held:
        _held[folder][1] += 1
        try:
            yield folder
        finally:
            _held[folder][1] -= 1
        return
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise FolderInUse(
                f"{folder} is in use by {_holder(fh)} (another study); wait for it to finish or use "
                "another --out"
            ) from None
        fh.seek(0)
        fh.truncate()
        fh.write(f"{os.getpid()}\n")
        fh.flush()
        _held[folder] = [fh, 1]
        try:
            yield folder
        finally:
            del _held[folder]
    finally:
        fh.close()  # releases the flock
