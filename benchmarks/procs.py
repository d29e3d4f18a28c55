"""Child processes for the fault trials (``fault_trials.py``) and the tests that interrupt or kill
drivers and workers (``tests/test_study_faults.py``, ``tests/test_ray.py``): children that take Ctrl-C
(:func:`interruptible`), and, as Linux's ``/proc`` lists them, a process's parent, children and
liveness, a session's live members and a driver's pool workers."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path


def _stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of ``/proc/<pid>/stat`` after the command name) of every process."""
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat(int(entry))) is not None:
            yield int(entry), fields


def _stat(pid: int) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the command name, or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def parent(pid: int) -> int | None:
    """The parent of ``pid`` (None once it is gone)."""
    fields = _stat(pid)
    return None if fields is None else int(fields[1])


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper is dead)."""
    fields = _stat(pid)
    return fields is not None and fields[0] != "Z"


def children(pid: int) -> list[int]:
    """The processes whose parent is ``pid``."""
    return [p for p, fields in _stats() if int(fields[1]) == pid]


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``: a process started with
    ``start_new_session=True`` leads one with its pid, and its children stay in it."""
    return [p for p, fields in _stats() if int(fields[3]) == sid and fields[0] != "Z"]


def pool_workers(pid: int) -> list[int]:
    """The children of ``pid`` that run multiprocessing's ``spawn_main`` (a process pool's workers)."""
    workers = []
    for child in children(pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                workers.append(child)
    return workers


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Children started inside the block take SIGINT (Ctrl-C) as a terminal's foreground job does,
    even when this process ignores it: a shell without job control starts a background job (``cmd
    &`` in a script, a CI step) with SIGINT ignored, a child inherits that, and Python then installs
    no KeyboardInterrupt, so a SIGINT sent to it does nothing. A signal this process handles is reset
    to its default in a child, so the block handles SIGINT (this process is sent none)."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if ignored:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
