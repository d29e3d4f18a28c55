"""addnorm.gloo_exit: at exit, the gloo worker threads are waited for until none still runs or waits
for the GIL (issue 41, docs/gloo-exit-abort.md).

The threads here stand in for gloo's: Python threads given gloo's worker thread name (Linux
``prctl(PR_SET_NAME)``), one blocked (as an idle worker waits on its queue), one running, one woken
while this thread holds the GIL (a worker releasing a finished collective's tensors). A real process
group made earlier in this process (``test_one_rank_mesh.py``) may leave its idle gloo workers
behind: each test looks at the threads it made (:func:`_new_workers`), and the waits must still
return as they do with those quiet ones there. That the real
gloo workers carry the name is checked in a process group: ``tests/test_tensor_parallel.py``.
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from addnorm.gloo_exit import WORKER_THREAD, gloo_workers, wait_for_gloo_workers

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads Linux /proc")
ROOT = Path(__file__).resolve().parents[1]


def _named_thread(target, *args) -> threading.Thread:
    """A daemon thread running ``target(*args)`` under gloo's worker thread name."""

    def named():
        ctypes.CDLL(None).prctl(15, WORKER_THREAD.encode(), 0, 0, 0)  # PR_SET_NAME
        target(*args)

    thread = threading.Thread(target=named, daemon=True)
    thread.start()
    return thread


def _wait_until(predicate, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "the thread did not get there"
        time.sleep(0.001)


@pytest.fixture(autouse=True)
def _earlier_workers():
    """The gloo-named threads there before the test: a real group's idle workers, or the previous
    test's thread ending after its join (still in /proc for a moment)."""
    before = dict(gloo_workers())
    _BEFORE.clear()
    _BEFORE.update(before)
    yield


_BEFORE: dict = {}


def _new_workers() -> dict:
    """The gloo-named threads the test made (those not there before it)."""
    return {tid: v for tid, v in gloo_workers().items() if tid not in _BEFORE}


def test_no_worker_threads_means_no_wait():
    """No gloo thread: the wait returns at once; only a real group's idle ones left behind: after one
    pause that finds them quiet."""
    assert _new_workers() == {}
    start = time.monotonic()
    assert wait_for_gloo_workers() is True
    assert time.monotonic() - start < (0.5 if _BEFORE else 0.005)


def test_a_blocked_worker_is_quiet():
    stop = threading.Event()
    thread = _named_thread(stop.wait)
    try:
        _wait_until(lambda: [s for s, _ in _new_workers().values()] == ["S"])
        assert wait_for_gloo_workers(deadline=5.0) is True
    finally:
        stop.set()
        thread.join()


def test_a_running_worker_is_waited_for_until_the_deadline():
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            pass

    thread = _named_thread(spin)
    try:
        _wait_until(lambda: len(_new_workers()) == 1)
        start = time.monotonic()
        assert wait_for_gloo_workers(deadline=0.2) is False
        assert 0.2 <= time.monotonic() - start < 2.0
    finally:
        stop.set()
        thread.join()


def test_a_worker_woken_while_this_thread_holds_the_gil_finishes_before_the_wait_returns():
    """The case of the abort: a worker needs the GIL when the exit begins; the wait releases it until
    the worker has run its Python and is blocked again."""
    go, stop, done = threading.Event(), threading.Event(), []

    def worker():
        go.wait()
        done.append(True)  # needs the GIL, which the main thread holds
        stop.wait()

    thread = _named_thread(worker)
    try:
        _wait_until(lambda: [s for s, _ in _new_workers().values()] == ["S"])
        go.set()
        assert wait_for_gloo_workers(deadline=5.0) is True
        assert done == [True]
    finally:
        go.set()  # where the wait above failed, so that the worker can end
        stop.set()
        thread.join()


_EXITING = """import atexit, ctypes, sys, threading
import addnorm

named, go, stop = threading.Event(), threading.Event(), threading.Event()

def worker():
    ctypes.CDLL(None).prctl(15, {name!r}.encode(), 0, 0, 0)
    named.set()
    go.wait()
    open(sys.argv[1], "w").write("released")  # Python, with the GIL, after the program ended
    stop.wait()

threading.Thread(target=worker, daemon=True).start()
named.wait()
atexit.register(go.set)  # registered after addnorm's handler, so it runs before it
"""


def test_import_addnorm_waits_at_exit_for_a_worker_still_releasing(tmp_path):
    """A program that imports addnorm: a worker woken as the program ends gets to run its Python
    before the interpreter finalizes (without the wait, finalization ends it first)."""
    marker = tmp_path / "released"
    script = tmp_path / "program.py"
    script.write_text(_EXITING.format(name=WORKER_THREAD))
    env = {"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"}
    ran = subprocess.run(
        [sys.executable, str(script), str(marker)], env=env, capture_output=True, text=True, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    assert marker.read_text() == "released"


def test_the_program_of_the_docs_is_the_benchmarks():
    """docs/gloo-exit-abort.md shows the plain-torch program that benchmarks/study/readme_torchrun.py runs."""
    from tools.doc_blocks import ALL

    shown = [b.code for b in ALL if b.where.startswith("docs/gloo-exit-abort.md") and b.kind == "python"]
    assert shown == [(ROOT / "tools" / "gloo_exit_repro.py").read_text()]
