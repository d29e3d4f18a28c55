"""Launch a run on N processes through PyTorch's elastic launcher (``torch.distributed.run``, i.e.
torchrun), and the entry point each of its processes runs.

``launch(cfg)`` starts ``python -m torch.distributed.run --standalone --nproc-per-node N
--max-restarts 0 -m addnorm.train.launch WORKDIR`` (a rendezvous on a free loopback port). Every rank
trains its shard (:mod:`addnorm.train.ranks`): one process per GPU with NCCL on a GPU machine, gloo
with ``threads`` torch threads per process on the CPU. Only rank 0 writes anything back: its steps
(``steps.jsonl``, passed on to ``on_step`` as they come) and its :class:`RunResult` (``result.pkl``);
the caller (the study's driver) alone stores results. A rank that dies (killed, out of memory, an
exception) makes torchrun stop the others; the run comes back ``failed`` with one line saying which
rank and how, and is trained again by the next study invocation.
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

import torch

from .config import RunConfig
from .loop import FAILED, RunResult, train

POLL_S = 0.2  # seconds between reads of rank 0's steps while the run trains
RESULT, STEPS, LOG = "result.pkl", "steps.jsonl", "torchrun.log"


def launcher_command(workdir: str | Path, nproc: int) -> list[str]:
    """torchrun's command line for a run whose config is in ``workdir``."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # c10d rendezvous on localhost, a free port
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",  # a dead rank fails the run; the study reruns it next time
        "-m",
        "addnorm.train.launch",
        str(workdir),
    ]


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing): a
    study's pool worker and torchrun when the study dies, a rank when torchrun dies (a killed torchrun
    cannot stop its ranks; they would train on, orphaned)."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _failure(workdir: Path, code: int) -> str:
    """One line: the rank torchrun names as the root cause, and how it ended (the signal that killed
    it, or its own error as it wrote it; a peer's error about the lost connection comes second)."""
    log = (workdir / LOG).read_text(errors="replace") if (workdir / LOG).exists() else ""
    root = log[log.find("Root Cause") :] if "Root Cause" in log else log
    rank = re.search(r"rank\s*:\s*(\d+)", root)
    exit_code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    errors = {p.stem.split("rank")[-1]: p for p in sorted(workdir.glob("error-rank*.txt"))}
    who = rank.group(1) if rank else next(iter(errors), None)
    if exit_code and int(exit_code.group(1)) < 0:
        how = f"was killed by {signal.Signals(-int(exit_code.group(1))).name}"
    elif who in errors:
        how = f"failed: {errors[who].read_text().strip()}"
    else:
        how = f"exited with {exit_code.group(1)}" if exit_code else "died"
    return (
        f"distributed run: {'rank ' + who if who else 'a rank'} {how} (torchrun exit code {code}); "
        "the next study invocation runs it again"
    )


def launch(
    cfg: RunConfig, on_step: Callable[[int, float], None] | None = None, threads: int = 1
) -> RunResult:
    """Train ``cfg`` (which has ``distributed`` set) on ``nproc`` processes started by torchrun; its
    result as rank 0 computed it, or a ``failed`` result with one line when a rank died."""
    if cfg.distributed is None:
        raise ValueError("distributed: launch needs a run with distributed set; train() runs one process")
    start = time.perf_counter()
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
                preexec_fn=die_with_parent,  # noqa: PLW1509 - prctl only, no locks taken
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
    """A rank: join the process group torchrun describes (``env://``), train, and on rank 0 write the
    steps and the result into the work folder."""
    torchrun = os.getppid()
    die_with_parent()
    if os.getppid() != torchrun:  # torchrun died before the request took effect
        raise SystemExit("addnorm.train.launch: torchrun is gone")
    work = Path((argv or sys.argv[1:])[0])
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    (work / f"rank{rank}.pid").write_text(str(os.getpid()))
    try:
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
    except Exception as err:
        line = f"{type(err).__name__}: {str(err).strip().splitlines()[0]}" if str(err).strip() else None
        (work / f"error-rank{rank}.txt").write_text(line or traceback.format_exc(limit=3).splitlines()[-1])
        raise
    else:
        torch.distributed.barrier()  # leave together: a rank tearing down under a peer's collective aborts
    finally:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown: now and then (1 run in 8 with FSDP2 on gloo) a C++ thread still
    # joinable at exit aborts the rank ("terminate called without an active exception") after the
    # run is complete and its result written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
