"""Multi-process tests: run a worker on several spawned processes that meet on a free loopback port,
and fail the test (killing them) if they do not finish in time."""

from __future__ import annotations

import os
import socket
import sys
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_then_exit(rank: int, worker, *args) -> None:
    """``worker(rank, *args)``, then leave without the interpreter's teardown: now and then a gloo C++
    thread still joinable at exit aborts a process whose work is done ("terminate called without an
    active exception", SIGABRT: seen in 1 of 5 full runs of test_distributed), as in
    ``addnorm.train.launch``. A worker that raises still fails the run."""
    worker(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_spawned(worker, *args, nprocs: int = 2, deadline: float = 150.0) -> None:
    """``worker(rank, port, *args)`` on ``nprocs`` spawned processes; a process that fails or a run
    longer than ``deadline`` seconds fails the test."""
    ctx = mp.start_processes(
        _run_then_exit, args=(worker, free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )
    start = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs}-process run did not finish in {deadline:.0f} s")
