"""What the benchmarks record: the machine they ran on (the study's provenance reads it the same way), the
commit of the code that ran, and their results, one Markdown table and one JSON file per benchmark.

The commit of the code that ran is ``results_path.commit_info``'s (with where it came from); the device's
slug, ``results_path.device_slug``'s.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
from pathlib import Path

import torch

from addnorm.study.provenance import cpu_model
from benchmarks.common.results_path import SCRATCH, commit_info, device_slug

__all__ = [
    "commit_info",
    "cpu_model",
    "device_slug",
    "machine_info",
    "machine_line",
    "package_version",
    "record_rows",
    "write_results",
]


def package_version(name: str) -> str:
    """An installed distribution's version without importing it, or "not installed"."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine_info(device: str) -> dict:
    """The device, CPU, cores, torch threads, versions, commit and date of a benchmark run."""
    commit, source = commit_info()
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "python": platform.python_version(),
        "commit": commit,
        "commit_source": source,
        "date": dt.date.today().isoformat(),
    }


def machine_line(m: dict) -> str:
    """``machine_info`` as the sentence a results table starts with."""
    source = f" ({m['commit_source']})" if m.get("commit_source") else ""
    return (
        f"Machine: {m['device']}; CPU {m['cpu']}, {m['logical_cores']} logical cores, torch threads "
        f"{m['torch_threads']}; torch {m['torch']}, Triton {m.get('triton', '?')}, Python {m['python']}; "
        f"commit {m.get('commit', '?')}{source}; {m['date']}."
    )


def write_results(out: Path, name: str, markdown: str, payload: dict, *, quiet: bool = False) -> Path:
    """Write ``out/name.md`` (the table) and ``out/name.json`` (the numbers behind it); the JSON's path.
    A write to the scratch folder says how to record instead."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    if not quiet:
        scratch = out.resolve() == SCRATCH
        hint = " (scratch: --record writes benchmarks/results/<device>/<date>-<commit>/)" if scratch else ""
        print(f"wrote {out / name}.md and .json{hint}", flush=True)
    return path


def record_rows(args, kind: str, device: str, run, to_markdown) -> dict:
    """Run a benchmark, ``run(args, on_row=write)``, whose results ``<kind>_<device slug>`` in ``args.out``
    are written again after each row (quietly: a run cut short keeps what it measured) and at the end,
    each with ``args.note``; returns the report."""
    stem = f"{kind}_{device_slug(torch.cuda.get_device_name() if device == 'cuda' else 'cpu')}"

    def write(report: dict, quiet: bool = True) -> None:
        report["note"] = args.note
        write_results(args.out, stem, to_markdown(report), report, quiet=quiet)

    report = run(args, on_row=write)
    write(report, quiet=False)
    return report
