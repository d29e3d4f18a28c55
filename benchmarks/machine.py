"""What the benchmarks record: the machine they ran on (the study's provenance reads it the same way) and
their results, one Markdown table and one JSON file per benchmark under ``benchmarks/results/``."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from addnorm.study.provenance import cpu_model

__all__ = ["cpu_model", "machine_info", "machine_line", "write_results"]


def _commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def machine_info(device: str) -> dict:
    """The device, CPU, cores, torch threads, versions, commit and date of a benchmark run."""
    return {
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": _commit(),
        "date": dt.date.today().isoformat(),
    }


def machine_line(m: dict) -> str:
    """``machine_info`` as the sentence a results table starts with."""
    return (
        f"Machine: {m['device']}; CPU {m['cpu']}, {m['logical_cores']} logical cores, torch threads "
        f"{m['torch_threads']}; torch {m['torch']}, Python {m['python']}; commit {m.get('commit', '?')}; "
        f"{m['date']}."
    )


def write_results(out: Path, name: str, markdown: str, payload: dict) -> Path:
    """Write ``out/name.md`` (the table) and ``out/name.json`` (the numbers behind it); the JSON's path."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.md").write_text(markdown)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {out / name}.md and .json")
    return path
