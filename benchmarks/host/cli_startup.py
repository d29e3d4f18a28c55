"""How long the command line's instant answers take against ``import torch``, in one run.

    python -m benchmarks.host.cli_startup [--repeat N] [--out DIR | --record]

Each command (``addnorm --help``, ``--version``, ``study --list``, ``study --show quick``, ``study
--keys``, ``study --keys --markdown``) and the reference, ``python -c "import torch"``, runs as a fresh
process ``--repeat`` times (default 7), interleaved so that a change in the machine's load touches
them alike; the table gives each median wall time and its ratio to the reference's median (issue 32:
each under 0.5). The same Python and ``PYTHONPATH=src`` as the tests. Writes ``cli_startup_cpu.md``
and ``.json`` with the machine and commit (scratch; ``--record``:
``benchmarks/results/<device>/<date>-<commit>/``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.results_path import add_out_argument

SRC = Path(__file__).resolve().parents[2] / "src"

ENV = {**os.environ, "PYTHONPATH": str(SRC)}
REFERENCE = "import torch"
COMMANDS = (
    ("--help",),
    ("--version",),
    ("study", "--list"),
    ("study", "--show", "quick"),
    ("study", "--keys"),
    ("study", "--keys", "--markdown"),
)
TARGET = 0.5  # issue 32: each under half of import torch


def wall(argv: list[str]) -> float:
    """Seconds a fresh process running ``argv`` takes, start to exit (it must exit 0)."""
    start = time.perf_counter()
    done = subprocess.run(argv, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    took = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-300:]}")
    return took


def measure(repeat: int) -> dict[str, list[float]]:
    """label -> wall times; the reference and the commands interleaved, ``repeat`` rounds."""
    runs: dict[str, list[float]] = {}
    for _ in range(repeat):
        runs.setdefault(REFERENCE, []).append(wall([sys.executable, "-c", REFERENCE]))
        for command in COMMANDS:
            label = "addnorm " + " ".join(command)
            runs.setdefault(label, []).append(wall([sys.executable, "-m", "addnorm.cli", *command]))
    return runs


def table(runs: dict[str, list[float]]) -> tuple[list[dict], str]:
    reference = statistics.median(runs[REFERENCE])
    rows = [
        {
            "command": label,
            "median_s": statistics.median(t),
            "ratio": statistics.median(t) / reference,
            "runs": t,
        }
        for label, t in runs.items()
    ]
    lines = ["| command | median wall time (s) | / import torch |", "| --- | --- | --- |"]
    lines += [f"| `{r['command']}` | {r['median_s']:.3f} | {r['ratio']:.2f} |" for r in rows]
    return rows, "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="fresh processes per command (7)")
    add_out_argument(parser)
    args = parser.parse_args()
    load = os.getloadavg()[0]
    rows, text = table(measure(args.repeat))
    worst = max(r["ratio"] for r in rows if r["command"] != REFERENCE)
    from benchmarks.common.machine import machine_info, machine_line, write_results

    machine = machine_info("cpu")
    markdown = "\n".join(
        [
            "# Command-line start-up against `import torch` (issue 32)",
            "",
            machine_line(machine) + f" Load average {load:.1f} at the start (the machine is shared).",
            "",
            f"`python -m benchmarks.host.cli_startup --repeat {args.repeat} --record`: each command a fresh "
            f"process (`python -m addnorm.cli ...`, `PYTHONPATH=src`), interleaved with "
            f'`python -c "import torch"`; '
            f"medians of {args.repeat}. None of these commands imports torch (`tests/test_cli.py` checks "
            f"it). Largest ratio {worst:.2f} (target: under {TARGET}).",
            "",
            text,
            "",
        ]
    )
    print(markdown)
    write_results(args.out, "cli_startup_cpu", markdown, {"machine": machine, "rows": rows})
    if worst >= TARGET:
        raise SystemExit(f"a command took {worst:.2f} x import torch (target under {TARGET})")


if __name__ == "__main__":
    main()
