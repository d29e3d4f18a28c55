"""Child processes for the benchmarks, the tools and the tests: ranks started on a free loopback port
that leave without the interpreter's teardown (:func:`run_spawned`; the multi-process benchmarks, such as
``benchmarks/op/sharded.py``, and tests; the tests' per-job reporting on top of it: ``tests/procs.py``);
children that take Ctrl-C (:func:`interruptible`); and, as Linux's ``/proc`` lists them, a process's
parent, children and liveness, a session's live members and a driver's pool workers (the fault trials,
``tests/test_study_faults.py``, ``tests/test_ray.py``, ``tools/census.py``)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path


def stats() -> Iterator[tuple[int, list[str]]]:
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
    return [p for p, fields in stats() if int(fields[1]) == pid]


def session(sid: int) -> list[int]:
    """The live (not zombie) processes of session ``sid``: a process started with
    ``start_new_session=True`` leads one with its pid, and its children stay in it."""
    return [p for p, fields in stats() if int(fields[3]) == sid and fields[0] != "Z"]


def cmdline(pid: int) -> str:
    """The command line of ``pid``, its arguments joined by spaces ("" once it is gone, or for a zombie
    or a kernel thread)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def pool_workers(pid: int) -> list[int]:
    """The children of ``pid`` that run multiprocessing's ``spawn_main`` (a process pool's workers)."""
    return [child for child in children(pid) if "spawn_main" in cmdline(child)]


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


def free_port() -> int:
    """A loopback port nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# What the forkserver imports once, so that a rank forked from it starts without importing them (torch,
# and torch._dynamo, which building any optimizer imports: ~4 s of CPU a rank here); addnorm itself and
# everything else a rank imports on its own, as a spawned one would.
PRELOAD = ("torch", "torch._dynamo", "torch.distributed")


def _run_then_exit(rank: int, environ: dict[str, str], worker, *args) -> None:
    """``worker(rank, *args)`` in the starting process's environment as it was at the start (the
    forkserver's is the one it had when the server started), then leave without the interpreter's
    teardown: now and then a gloo worker thread still releasing the last collective's tensors aborted a
    process whose work was done ("terminate called without an active exception", SIGABRT; seen in 1 of
    5 full runs of test_distributed and in a CI run of the communication benchmark's test; the
    mechanism: ``docs/gloo-exit-abort.md``). Leaving at once needs no wait for those threads, as
    ``addnorm.train.launch``'s ranks also do. A worker that raises still fails the run."""
    os.environ.clear()
    os.environ.update(environ)
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_spawned(worker, *args, nprocs: int = 2, deadline: float = 150.0) -> None:
    """``worker(rank, port, *args)`` on ``nprocs`` new processes that meet on a free loopback ``port``.
    They are forked from multiprocessing's forkserver, which imported :data:`PRELOAD` once for every
    run of this process (a spawned rank imported them anew: ~2 s of the 4 s a 2-process run took to start
    here); each runs in this process's environment of the moment and imports the rest itself. A process
    that fails raises (torch's ``ProcessRaisedException`` / ``ProcessExitedException``); a run longer
    than ``deadline`` seconds kills them all and raises ``TimeoutError``."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(PRELOAD))  # read when the server starts (the first run)
    ctx = mp.start_processes(
        _run_then_exit,
        args=(dict(os.environ), worker, free_port(), *args),
        nprocs=nprocs,
        join=False,
        start_method="forkserver",
    )
    start = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the {nprocs}-process run did not finish in {deadline:.0f} s")
