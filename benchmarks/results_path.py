"""Where a benchmark writes its results: a scratch folder unless ``--record`` is given.

Recorded results (``benchmarks/results/``) are the project's evidence; a run to try something must not
overwrite them. Every benchmark that writes results takes its output folder from here:

- ``add_out_argument(parser)``: ``--out DIR`` (default ``benchmarks/results/scratch/``, git-ignored) and
  ``--record`` (write ``benchmarks/results/`` when no ``--out`` is given);
- ``add_record_argument(parser)`` and ``out_dir(args)`` for scripts with no ``--out``.

Each result names the commit of the code that ran (``commit_info``): ``addnorm.commit.commit_of`` for
this tree, the one source of truth the study's provenance reads too: the environment variable
``ADDNORM_COMMIT`` (``gpu_suite.py`` sets it for its steps, with ``ADDNORM_COMMIT_SOURCE``), the file
``benchmarks/.commit`` (written before a device call, whose copy of the tree may have no ``.git``: ``git
rev-parse HEAD > benchmarks/.commit``), then ``git rev-parse HEAD`` (``+dirty`` when tracked files differ
from it). No torch import here: the GPU suite's dry run reads it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["RESULTS", "SCRATCH", "add_out_argument", "add_record_argument", "commit_info", "out_dir"]

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = RESULTS / "scratch"
COMMIT_FILE = ROOT / "benchmarks" / ".commit"


class _Record(argparse.Action):
    """``--record``: recorded results; moves ``--out`` from the scratch default to ``RESULTS`` unless
    ``--out`` was given (before or after)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        if getattr(namespace, "out", None) is SCRATCH:
            namespace.out = RESULTS


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    """``--record``: write the results to ``benchmarks/results/`` (default: the scratch folder)."""
    parser.add_argument(
        "--record", action=_Record, help=f"write recorded results to {RESULTS} (default: {SCRATCH})"
    )


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` (default the scratch folder) and ``--record`` (the recorded folder)."""
    parser.add_argument(
        "--out", type=Path, default=SCRATCH, help="results folder (default: scratch; --record: recorded)"
    )
    add_record_argument(parser)


def out_dir(args: argparse.Namespace) -> Path:
    """The folder a script without ``--out`` writes to: recorded with ``--record``, else scratch."""
    return RESULTS if getattr(args, "record", False) else SCRATCH


def commit_info() -> tuple[str, str]:
    """(commit, where it came from) of the code this process runs (see the module docstring): the
    commit's first 12 digits (``+dirty`` with uncommitted tracked changes), or ("unknown", why)."""
    from addnorm.commit import commit_of

    found = commit_of(ROOT, COMMIT_FILE)
    if found.sha is None:
        return "unknown", found.source
    if found.source == "git rev-parse HEAD":
        return found.sha[:12] + ("+dirty" if found.dirty else ""), found.source
    return found.sha, found.source
