"""Where a benchmark writes its results: a scratch folder unless ``--record`` is given.

Recorded results (``benchmarks/results/``) are the project's evidence; a run to try something must not
overwrite them. They are filed by device and window (``benchmarks/results/README.md``):
``benchmarks/results/<device>/<date>-<commit>/`` (:func:`record_dir`), the device the running machine's
(:func:`machine_slug`: its GPU's model, ``h100``, ``h200``, else ``cpu``), the date today, the commit
``commit_info()``'s first 7 digits. Every benchmark that writes results takes its output folder from here:

- ``add_out_argument(parser)``: ``--out DIR`` (default ``benchmarks/results/scratch/``, git-ignored) and
  ``--record`` (write :func:`record_dir` when no ``--out`` is given);
- ``add_record_argument(parser)`` and ``out_dir(args)`` for scripts with no ``--out``.

Each result names the commit of the code that ran (``commit_info``): ``addnorm.commit.commit_of`` for
this tree, the one source of truth the study's provenance reads too: the environment variable
``ADDNORM_COMMIT`` (``benchmarks/device/gpu_suite.py`` sets it for its steps, with ``ADDNORM_COMMIT_SOURCE``),
the file ``benchmarks/.commit`` (written before a device call, whose copy of the tree may have no ``.git``:
``git rev-parse HEAD > benchmarks/.commit``), then ``git rev-parse HEAD`` (``+dirty`` when tracked files
differ from it). No torch import here: the GPU suite's dry run reads it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import re
from pathlib import Path

__all__ = [
    "RESULTS",
    "SCRATCH",
    "add_out_argument",
    "add_record_argument",
    "commit_info",
    "device_slug",
    "machine_slug",
    "out_dir",
    "record_dir",
    "window_name",
]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
SCRATCH = RESULTS / "scratch"
COMMIT_FILE = ROOT / "benchmarks" / ".commit"


class _Record(argparse.Action):
    """``--record``: recorded results; moves ``--out`` from the scratch default to :func:`record_dir`
    unless ``--out`` was given (before or after)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)
        if getattr(namespace, "out", None) is SCRATCH:
            namespace.out = record_dir()


def add_record_argument(parser: argparse.ArgumentParser) -> None:
    """``--record``: write the results to :func:`record_dir` (default: the scratch folder)."""
    parser.add_argument(
        "--record",
        action=_Record,
        help=f"write recorded results to {RESULTS}/<device>/<date>-<commit>/ (default: {SCRATCH})",
    )


def add_out_argument(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` (default the scratch folder) and ``--record`` (the recorded folder)."""
    parser.add_argument(
        "--out", type=Path, default=SCRATCH, help="results folder (default: scratch; --record: recorded)"
    )
    add_record_argument(parser)


def out_dir(args: argparse.Namespace) -> Path:
    """The folder a script without ``--out`` writes to: recorded (:func:`record_dir`) with ``--record``,
    else scratch."""
    return record_dir() if getattr(args, "record", False) else SCRATCH


def device_slug(name: str) -> str:
    """A device name as a file-name suffix and results folder: the GPU model ("NVIDIA H100 80GB HBM3" ->
    "h100", "NVIDIA H200" -> "h200"), "cpu" for the CPU, else the name in lower case with "_" for the rest."""
    if name.lower() == "cpu":
        return "cpu"
    found = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", name)
    if found:
        return found.group(1).lower()
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_") or "device"


def machine_slug() -> str:
    """The running machine's results folder name: its GPU's :func:`device_slug` where torch sees one,
    else "cpu" (imports torch: call it only to record)."""
    import torch

    return device_slug(torch.cuda.get_device_name()) if torch.cuda.is_available() else "cpu"


def window_name(commit: str, date: str | None = None) -> str:
    """A recording window's folder name, ``<date>-<commit>``: the date (default today) and the commit's
    first 7 digits, ``-dirty`` after it for uncommitted changes ("564f000abcde+dirty" on 2026-12-01 ->
    "2026-12-01-564f000-dirty"); a commit that is not hex ("unknown") as it is."""
    sha, _, rest = commit.partition("+")
    sha = sha[:7] if re.fullmatch(r"[0-9a-f]{7,40}", sha) else sha
    return f"{date or dt.date.today().isoformat()}-{sha}" + (f"-{rest}" if rest else "")


def record_dir(device: str | None = None, commit: str | None = None, date: str | None = None) -> Path:
    """Where recorded results go: ``benchmarks/results/<device>/<date>-<commit>/``, by default this
    machine's device (:func:`machine_slug`), today and the code's commit (:func:`commit_info`)."""
    return RESULTS / (device or machine_slug()) / window_name(commit or commit_info()[0], date)


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
