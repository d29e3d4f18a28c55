"""Multi-process tests: run a worker on several spawned processes that meet on a free loopback port,
and fail the test (killing them) if they do not finish in time."""

from __future__ import annotations

import socket
import time

import pytest
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_spawned(worker, *args, nprocs: int = 2, deadline: float = 150.0) -> None:
    """``worker(rank, port, *args)`` on ``nprocs`` spawned processes; a process that fails or a run
    longer than ``deadline`` seconds fails the test."""
    ctx = mp.start_processes(
        worker, args=(free_port(), *args), nprocs=nprocs, join=False, start_method="spawn"
    )
    start = time.monotonic()
    while not ctx.join(timeout=5):
        if time.monotonic() - start > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"the {nprocs}-process run did not finish in {deadline:.0f} s")
