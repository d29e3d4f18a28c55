"""The tests' spawned-rank jobs: each rank of a spawned run (``tools.procs.run_spawned``) runs its named
jobs and reports a failing one as a line (:func:`run_jobs`), so that a test reports it per job rather
than as a failed or hung spawn (``tests/test_distributed.py``, ``test_ops_sharded*.py``,
``test_titan_parallel.py``). The process helpers themselves (spawned ranks, a free port, ``/proc``) are
``tools/procs.py``, which the benchmarks and the fault trials share. :data:`SPAWNED_RANKS`: the marks of a
test module whose tests spawn ranks."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

__all__ = ["SPAWNED_RANKS", "run_jobs"]

# a module of spawned-rank tests: slow (the slow tier's cause: spawned ranks), and skipped without
# torch.distributed
SPAWNED_RANKS = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed"),
]


def run_jobs(jobs: dict[str, Callable[[], object]], rank: int, out: str, *, barrier: bool = True) -> None:
    """Run ``jobs`` in order on this rank of an initialised process group, each result by name, a job that
    raises as the line ``"Type: first line of its message"`` (the test reports it per job, rather than as
    a failed or hung spawn), with a barrier after each unless ``barrier`` is False (jobs in which a rank
    leaves); rank 0 saves ``{name: result}`` to ``out`` with ``torch.save``."""
    import torch.distributed as dist
    import triton_interpreter

    triton_interpreter.install()  # as in the pytest processes (conftest.py)
    results = {}
    for name, job in jobs.items():
        try:
            results[name] = job()
        except Exception as e:  # the test reads the type and message
            results[name] = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        if barrier:
            dist.barrier()
    if rank == 0:
        torch.save(results, out)
