"""At interpreter exit, wait until torch's gloo worker threads are idle (armed by ``import addnorm``).

Why (torch 2.13, CPython 3.11; ``docs/gloo-exit-abort.md``): a ``ProcessGroupGloo`` worker thread
(named ``pt_gloo_runloop``) drops its reference to a collective's work right after completing it. The
work holds the collective's tensors; for one that Python also holds, the last C++ reference going
away decrements its Python object, which takes the GIL on that thread. Once a ``DeviceMesh`` (every
DTensor, FSDP2 and tensor-parallel program) has been made, ``destroy_process_group()`` no longer frees
the process group, so its threads live on into the interpreter's finalization; a worker still waiting
for the GIL when finalization starts is ended by CPython with ``pthread_exit``, whose unwinding
through the work's destructor (``noexcept``) calls ``std::terminate``: "terminate called without an
active exception", SIGABRT, after the program's work is done.

:func:`wait_for_gloo_workers` runs before finalization (an ``atexit`` handler, registered first so it
runs after the program's own) and, with the GIL released, waits until every such thread is asleep
(blocked on its work queue) and has not run for one pause longer than CPython's GIL wait (5 ms): a
thread still releasing a work is running, runnable, or waiting for the GIL, whose timed wait wakes
it within that pause. A process without gloo worker threads (or without ``/proc``) returns at once.
"""

from __future__ import annotations

import atexit
import os
import time

WORKER_THREAD = "pt_gloo_runloop"  # the name c10d's ProcessGroupGloo gives its worker threads
PAUSE = 0.01  # seconds: twice CPython's GIL switch interval (a waiting thread wakes within it)
DEADLINE = 5.0  # seconds at most spent waiting at exit (a thread that never settles)

__all__ = ["wait_for_gloo_workers", "gloo_workers"]


def gloo_workers() -> dict[str, tuple[str, int]]:
    """This process's gloo worker threads: thread id -> (state letter, context switches so far), as
    ``/proc/self/task/<tid>/status`` gives them; empty without ``/proc``."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    found = {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                fields = dict(line.split(":", 1) for line in f.read().splitlines() if ":" in line)
        except OSError:  # the thread ended meanwhile
            continue
        if fields.get("Name", "").strip() != WORKER_THREAD:
            continue
        switches = sum(
            int(fields.get(k, "0")) for k in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")
        )
        found[tid] = (fields.get("State", "?").split()[0], switches)
    return found


def wait_for_gloo_workers(deadline: float = DEADLINE) -> bool:
    """Wait, the GIL released, until every gloo worker thread of this process sleeps and did not run
    during one pause; True once they do (at once when there are none), False after ``deadline``
    seconds."""
    before = gloo_workers()
    if not before:
        return True
    end = time.monotonic() + deadline
    while True:
        time.sleep(PAUSE)  # the GIL is free: a worker waiting for it takes it and runs
        after = gloo_workers()
        if after == before and all(state == "S" for state, _ in after.values()):
            return True
        if time.monotonic() > end:
            return False
        before = after


atexit.register(wait_for_gloo_workers)
