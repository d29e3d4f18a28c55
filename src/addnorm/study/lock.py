"""One study at a time per folder: an exclusive ``flock`` on ``<out>/.addnorm.lock``, holding the pid
of the process that has it. The kernel drops the lock when that process exits, however it exits
(``kill -9`` included), so a stale lock file never blocks: the next study simply takes it over.
Re-entrant within a process (the CLI holds it around the study and its findings; ``run_study`` too).
A second study either refuses at once (exit 3) or, with ``--wait SECONDS``, says once whom it waits
for and takes the lock when the holder lets go (exit 3 if the time runs out first)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

LOCK_NAME = ".addnorm.lock"
POLL = 0.2  # seconds between attempts while waiting for a folder in use
_held: dict[Path, list] = {}  # folder -> [open lock file, depth], for re-entry in this process


class FolderInUse(RuntimeError):
    """Another process holds the study folder's lock (the CLI's exit code 3)."""

    exit_code = 3


def _holder(fh) -> str:
    fh.seek(0)
    pid = fh.read().strip()
    return f"process {pid}" if pid.isdigit() else "another process"


@contextlib.contextmanager
def folder_lock(
    folder: str | Path, wait: float = 0.0, notify: Callable[[str], None] | None = None
) -> Iterator[Path]:
    """Hold ``folder``'s study lock (creating the folder) for the block. If another process holds it:
    :class:`FolderInUse` naming the folder and the holder's pid at once, or with ``wait`` > 0 (seconds,
    ``math.inf`` for no limit) first ``notify`` one line naming the holder, then wait for the lock,
    checking every :data:`POLL` seconds, and raise :class:`FolderInUse` if it is still held then."""
    folder = Path(folder).absolute()
    if folder in _held:
        _held[folder][1] += 1
        try:
            yield folder
        finally:
            _held[folder][1] -= 1
        return
    if not wait >= 0:
        raise ValueError(f"wait: expected a number of seconds >= 0, got {wait!r}")
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "not a folder (a file is in its place)", str(folder))
    folder.mkdir(parents=True, exist_ok=True)
    fh = open(folder / LOCK_NAME, "a+", encoding="utf-8")  # noqa: SIM115 - held for the block
    try:
        _acquire(fh, folder, wait, notify)
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


def _acquire(fh, folder: Path, wait: float, notify: Callable[[str], None] | None) -> None:
    """Take the flock on ``fh`` (see :func:`folder_lock` for ``wait`` and ``notify``)."""
    deadline = time.monotonic() + wait
    told = False
    while True:
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            holder = _holder(fh)
        if time.monotonic() >= deadline:
            waited = f" after waiting {_seconds(wait)}" if wait else ""
            raise FolderInUse(
                f"{folder} is in use by {holder} (another study){waited}; wait for it to finish "
                "(--wait SECONDS) or use another --out"
            ) from None
        if not told and notify is not None:
            limit = "until it is free" if math.isinf(wait) else f"for up to {_seconds(wait)}"
            notify(f"waiting for {folder}: in use by {holder} (another study), {limit}")
            told = True
        time.sleep(min(POLL, max(deadline - time.monotonic(), 0.0)))


def _seconds(value: float) -> str:
    return f"{value:g} s"
