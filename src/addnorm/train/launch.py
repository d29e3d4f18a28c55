"""Launch a run on N processes through PyTorch's elastic launcher (``torch.distributed.run``, i.e.
torchrun), and the entry point each of its processes runs.

``launch(cfg)`` starts ``python -m torch.distributed.run --standalone --nproc-per-node N
--max-restarts 0 --log-dir WORKDIR/torchrun -m addnorm.train.launch WORKDIR`` (a rendezvous on a free
loopback port; WORKDIR a temporary folder removed when the run ends, torchrun's own in it). Every rank
trains its shard (:mod:`addnorm.train.ranks`): one process per GPU with NCCL on a GPU machine, gloo
with ``threads`` torch threads per process on the CPU. Only rank 0 writes anything back: its steps
(``steps.jsonl``, passed on to ``on_step`` as they come) and its :class:`RunResult` (``result.pkl``);
the caller (the study's driver) alone stores results. A rank that dies (killed, out of memory, an
exception) makes torchrun stop the others; the run comes back ``failed`` with one line saying which
rank and how, and is trained again by the next study invocation.

Lifetimes: torchrun dies with its launcher and every rank with torchrun, at every moment, ``kill -9``
included. torchrun arms Linux's parent-death signal before it runs (:func:`die_with_parent`, checking
that its launcher is still its parent); a rank does the same as its first act, before it imports
torch (:func:`hold_to_torchrun`: this module imports only the standard library at the top, and
``addnorm`` and ``addnorm.train`` import nothing until asked), and leaves at once if its parent is
no longer torchrun (torchrun died before the request took effect). Errors: a rank whose run raises
writes its error, claims ``first-error`` if no rank has, and leaves at once, without the process
group's teardown (which waits for its collectives in flight, for a peer that may never join them);
its peers' collectives then fail on the closed connection, and torchrun stops any rank not in one.
The failure line names the rank that failed first and its own error, not a peer's lost connection.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported inside the functions: a rank checks its parent before torch is imported
    from .config import RunConfig
    from .loop import RunResult

POLL_S = 0.2  # seconds between reads of rank 0's steps while the run trains
RESULT, STEPS, LOG, FIRST_ERROR = "result.pkl", "steps.jsonl", "torchrun.log", "first-error"
# Tests: a rank started with this variable set waits, before anything else, until the file it names
# exists, having written its pid to ``<file>.rank<RANK>`` (so a test can kill its parent meanwhile).
BARRIER_ENV = "ADDNORM_RANK_BARRIER"


def launcher_command(workdir: str | Path, nproc: int) -> list[str]:
    """torchrun's command line for a run whose config is in ``workdir``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on localhost, a free port
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",  # a dead rank fails the run; the study reruns it next time
        # torchrun's own folder (its ranks' error files) inside the run's, removed with it: by default
        # every torchrun leaves a torchelastic_* folder in the system's temporary directory
        f"--log-dir={Path(workdir) / 'torchrun'}",
        "-m",
        "addnorm.train.launch",
        str(workdir),
    ]


def die_with_parent(parent: int | None = None) -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing): a
    study's pool worker and torchrun when the study dies, a rank when torchrun dies (a killed torchrun
    cannot stop its ranks; they would train on, orphaned). ``parent``: the pid the parent must have;
    if it has another once the signal is armed, that parent died before, and this process exits."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def _parent_is_torchrun() -> bool:
    """Whether this process's parent runs torchrun (``torch.distributed.run``), read from ``/proc``;
    True where there is no ``/proc`` to read. A rank whose torchrun died has been handed to another
    process (init, a subreaper), which is not torchrun."""
    if not os.path.exists("/proc/self/stat"):
        return True
    parent = os.getppid()
    try:
        with open(f"/proc/{parent}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
    except OSError:  # gone already
        return False
    return parent > 1 and (
        b"torch.distributed.run" in argv or any(os.path.basename(a) == b"torchrun" for a in argv[:2])
    )


def _wait_at_barrier(path: str) -> None:
    """Tests only (``ADDNORM_RANK_BARRIER``): say where this rank is, then wait for ``path`` to exist."""
    with open(f"{path}.rank{os.environ.get('RANK', '0')}", "w") as f:
        f.write(str(os.getpid()))
    while not os.path.exists(path):
        time.sleep(0.01)


def hold_to_torchrun() -> None:
    """A rank's first act, before it imports torch: die with torchrun (``PR_SET_PDEATHSIG``), and
    leave at once if torchrun is gone already (this rank's parent is then another process). Armed
    first and checked after, so there is no moment at which torchrun's death goes unnoticed."""
    if os.environ.get(BARRIER_ENV):
        _wait_at_barrier(os.environ[BARRIER_ENV])
    die_with_parent()
    if not _parent_is_torchrun():
        sys.stderr.write("addnorm.train.launch: torchrun is gone; this rank leaves\n")
        os._exit(1)


def _failure(workdir: Path, code: int) -> str:
    """One line: the rank that failed first and how (the signal that killed it, or its own error as
    it wrote it). A rank killed from outside (by another signal than the SIGTERM torchrun stops ranks
    with) is named first; else the rank whose error came first (``first-error``, claimed before it
    left, so a peer's error about the lost connection comes after it); else torchrun's root cause."""
    log = (workdir / LOG).read_text(errors="replace") if (workdir / LOG).exists() else ""
    ended = {  # rank -> exit code, every failure torchrun lists
        m.group(1): int(m.group(2))
        for m in re.finditer(r"rank\s*:\s*(\d+)[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", log)
    }
    root = log[log.find("Root Cause") :] if "Root Cause" in log else log
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    errors = {p.stem.split("rank")[-1]: p for p in sorted(workdir.glob("error-rank*.txt"))}
    first = (workdir / FIRST_ERROR).read_text().strip() if (workdir / FIRST_ERROR).exists() else None
    killed = [r for r, c in sorted(ended.items()) if c < 0 and -c != signal.SIGTERM]
    who = next(iter(killed), None) or first or (rank.group(1) if rank else next(iter(errors), None))
    if who in ended and ended[who] < 0:
        how = f"was killed by {signal.Signals(-ended[who]).name}" + _last_words(log)
    elif who in errors:
        how = f"failed: {errors[who].read_text().strip()}"
    else:
        how = f"exited with {ended[who]}" if who in ended else "died"
    return (
        f"distributed run: {'rank ' + who if who else 'a rank'} {how} (torchrun exit code {code}); "
        "the next study invocation runs it again"
    )


# what a process prints as it aborts (the C++ runtime, CPython, glibc), last seen first
_DYING = re.compile(
    r"^(?:\[[^\]]*\]:?\s*)?(terminate called[^\n]*|Fatal Python error[^\n]*|\*\*\* [^\n]*terminated[^\n]*)$",
    re.M,
)


def _last_words(log: str) -> str:
    """The last line of the log that a dying process printed (``terminate called ...``, ``Fatal Python
    error: ...``, glibc's ``*** ... terminated``), as ``" after: LINE"``; empty where there is none."""
    found = _DYING.findall(log)
    return f" after: {found[-1].strip()[:200]}" if found else ""


def launch(
    cfg: RunConfig, on_step: Callable[[int, float], None] | None = None, threads: int = 1
) -> RunResult:
    """Train ``cfg`` (which has ``distributed`` set) on ``nproc`` processes started by torchrun; its
    result as rank 0 computed it, or a ``failed`` result with one line when a rank died."""
    from .loop import FAILED, RunResult

    if cfg.distributed is None:
        raise ValueError("distributed: launch needs a run with distributed set; train() runs one process")
    start = time.perf_counter()
    me = os.getpid()
    package_root = str(Path(__file__).resolve().parents[2])
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(threads),
        "PYTHONPATH": os.pathsep.join(p for p in (package_root, os.environ.get("PYTHONPATH")) if p),
    }
    with tempfile.TemporaryDirectory(prefix="addnorm-ranks-") as tmp:
        work = Path(tmp)
        (work / "config.json").write_text(json.dumps(cfg.to_dict()))
        with open(work / LOG, "wb") as log:
            proc = subprocess.Popen(
                launcher_command(work, cfg.distributed["nproc"]),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # the whole group (torchrun and its ranks) is stopped together
                preexec_fn=lambda: die_with_parent(me),  # noqa: PLW1509 - prctl only, no locks taken
            )
            try:
                seen = 0
                while True:
                    code = proc.poll()
                    seen = _relay(work / STEPS, seen, on_step)
                    if code is not None:
                        break
                    time.sleep(POLL_S)
            finally:
                if proc.poll() is None:  # interrupted: torchrun stops its ranks on SIGTERM
                    proc.terminate()
                    try:
                        proc.wait(timeout=10)
                    except subprocess.TimeoutExpired:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.pid, signal.SIGKILL)
                        proc.wait()
        if code == 0 and (work / RESULT).exists():
            result = pickle.loads((work / RESULT).read_bytes())  # noqa: S301 - written by rank 0 below
            result.wall_s = time.perf_counter() - start  # the run's cost: starting the ranks included
            return result
        return RunResult(status=FAILED, error=_failure(work, code), wall_s=time.perf_counter() - start)


def _relay(path: Path, seen: int, on_step: Callable[[int, float], None] | None) -> int:
    """Pass the complete lines of ``path`` past byte ``seen`` to ``on_step``; the new offset."""
    if on_step is None or not path.exists():
        return seen
    with open(path, "rb") as f:
        f.seek(seen)
        data = f.read()
    end = data.rfind(b"\n") + 1
    for line in data[:end].splitlines():
        on_step(*json.loads(line))
    return seen + end


def main(argv: list[str] | None = None) -> None:
    """A rank (after :func:`hold_to_torchrun`): join the process group torchrun describes
    (``env://``), train, and on rank 0 write the steps and the result into the work folder. A run that
    raises on this rank: its error written, ``first-error`` claimed if no rank has, and this process
    gone at once with exit code 1 (see the module docstring)."""
    work = Path((argv or sys.argv[1:])[0])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    try:
        import torch

        from .config import RunConfig
        from .loop import train

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        (work / f"rank{rank}.pid").write_text(str(os.getpid()))
        cfg = RunConfig(**json.loads((work / "config.json").read_text()))
        with open(work / STEPS, "a") if rank == 0 else contextlib.nullcontext() as steps:

            def on_step(step: int, loss: float) -> None:
                if steps is not None:
                    steps.write(json.dumps([step, loss]) + "\n")
                    steps.flush()

            result = train(cfg, on_step=on_step, device=device)
        if rank == 0:
            (work / (RESULT + ".part")).write_bytes(pickle.dumps(result))
            os.replace(work / (RESULT + ".part"), work / RESULT)
    except BaseException as err:  # noqa: BLE001 - every way out of a failed rank is the one below
        _leave_failed(work, rank, err)
    torch.distributed.barrier()  # leave together: a rank tearing down under a peer's collective aborts
    torch.distributed.destroy_process_group()


def _leave_failed(work: Path, rank: int, err: BaseException) -> None:
    """Write ``err`` as this rank's one line, claim ``first-error`` if no rank has, print the
    traceback, and exit 1 now: no teardown of the process group, which would wait for collectives in
    flight (a peer that never joins them would hold this rank, and itself, until gloo's timeout)."""
    text = str(err).strip()
    line = f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
    with contextlib.suppress(OSError):
        (work / f"error-rank{rank}.txt").write_text(line)
        fd = os.open(work / FIRST_ERROR, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.write(fd, str(rank).encode())
        os.close(fd)
    traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


if __name__ == "__main__":
    hold_to_torchrun()
    main()
    # Skip the interpreter's teardown: now and then (1 run in 8 with FSDP2 on gloo) the rank aborted
    # there after its run was complete and its result written ("terminate called without an active
    # exception"): a gloo worker thread still releasing the last collective's tensors takes the GIL as
    # the interpreter finalizes (torch 2.13, CPython 3.11; docs/gloo-exit-abort.md). addnorm's wait at
    # exit (addnorm.gloo_exit) covers a program that exits normally; a rank leaves at once instead.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
