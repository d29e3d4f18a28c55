"""The order in which ``make test`` and ``make test-all`` hand test files to their two xdist workers:
longest first, by each file's seconds in the last recorded ``make test-all`` (``tests/file_seconds.json``,
written by ``python -m tools.test_durations --order``), files not recorded yet before all of them.

With ``--dist loadfile`` a worker takes the next file when it finishes one, so the run ends when the
worker holding the last long file ends. xdist's own order (most tests first) put the 2-test, 2-minute
preset smoke studies last: a 20-minute run on 2 cores (2026-12-02, after c05ce30) spent its last
2 minutes with one core idle more and more. Longest first (the Makefile passes
``--no-loadscope-reorder``, so xdist keeps this order) leaves only short files for the end. Only the
order changes: every test runs, each file's tests in their own order, in one worker."""

from __future__ import annotations

import json
from pathlib import Path

SECONDS = Path(__file__).with_name("file_seconds.json")


def recorded() -> dict[str, float]:
    """Seconds per test file name (``test_ray.py``) of the last recorded full run; {} without one."""
    try:
        return {str(k): float(v) for k, v in json.loads(SECONDS.read_text()).items()}
    except (OSError, ValueError, AttributeError):
        return {}


def longest_first(items: list) -> None:
    """Reorder pytest's collected ``items`` in place: whole files, longest recorded first (files with no
    record first of all, as if longest), each file's tests kept in their order. pytest collects a file's
    tests together and the sort is stable, so files of equal seconds keep their collection order."""
    seconds = recorded()
    unknown = max(seconds.values(), default=0.0) + 1.0
    items.sort(key=lambda it: -seconds.get(it.path.name, unknown))
