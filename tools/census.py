"""Where a command's CPU time goes, by kind of process (Linux)::

    python -m tools.census --out FOLDER -- make test-all PYTEST_ARGS="-q -p no:cacheprovider"

runs the command and, every ``--every`` seconds until it ends, reads ``/proc`` for it and every process
descended from it: each one's command line and its own CPU time (user + system, its children not
included; a pid reused later is another process). Writes ``FOLDER/processes.json`` (one row per
process), ``FOLDER/census.json`` (CPU seconds per kind of process, :data:`KINDS`, and the costliest
processes: :func:`summary`) and ``FOLDER/census.md`` (that, drawn as tables).
Exits with the command's exit code.

What it cannot see: a process that lives less than one interval (its CPU is that short too), the CPU a
process spends after the last read before it ends (at most one interval of it), and a process whose
parent left it to init before it was first read. The kernel's own threads are not descendants, so the
table holds the command's CPU, which ``/proc/stat``'s busy time (``test_durations.md``) also counts.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.procs import cmdline, stats

TICKS = os.sysconf("SC_CLK_TCK")

# (kind, pieces of a command line that name it), the first kind with a piece in the line wins: what
# starts processes in the test suite, then the compilers and the browser; anything else is "other"
KINDS = (
    ("pytest-xdist worker", ("sys.stdin.readline",)),  # execnet's bootstrap of an xdist worker
    ("pytest", ("-m pytest",)),
    ("rank forked from a forkserver (tests' shared spawns)", ("multiprocessing.forkserver",)),
    ("study process-pool worker (spawned)", ("multiprocessing.spawn",)),
    ("torchrun launcher", ("torch.distributed.run", "bin/torchrun")),
    ("torchrun rank of the study CLI", ("addnorm.train.launch",)),
    ("study CLI (addnorm study, report, export)", ("-m addnorm", "bin/addnorm ")),
    ("Ray (raylet, GCS, workers)", ("/ray/",)),
    ("benchmark, run end to end", ("-m benchmarks.",)),
    ("example or docs block", ("example.py", "/examples/")),
    ("C++ compiler (Inductor's kernels, the native extension)", ("cc1plus",)),
    ("linker", ("/ld ", "collect2")),
    ("browser (docs site test)", ("chrom",)),
    ("other python", ("python",)),
)


def kind(cmdline: str) -> str:
    """The first of :data:`KINDS` with a piece in ``cmdline``, else ``"other"``."""
    return next((name for name, pieces in KINDS if any(p in cmdline for p in pieces)), "other")


@dataclass
class Process:
    pid: int
    ppid: int
    cmdline: str
    first_seen: float  # seconds after the command started
    cpu: float  # its own CPU seconds (user + system) at the last read


def watch(cmd: list[str], every: float = 0.1) -> tuple[int, float, list[Process]]:
    """Run ``cmd``; (its exit code, its wall seconds, every process of its tree read meanwhile)."""
    start = time.monotonic()
    root = subprocess.Popen(cmd)
    seen: dict[tuple[int, str], Process] = {}  # by (pid, start time): a reused pid is another process
    live: set[int] = {root.pid}
    try:
        while True:
            done = root.poll() is not None
            now, alive = time.monotonic() - start, set()
            for pid, fields in stats():
                key = (pid, fields[19])
                proc = seen.get(key)
                if proc is None and (pid == root.pid or int(fields[1]) in live):
                    proc = seen[key] = Process(pid, int(fields[1]), "", round(now, 2), 0.0)
                if proc is not None:
                    proc.cpu = (int(fields[11]) + int(fields[12])) / TICKS
                    # read again each time: a fork shows its parent's line until it execs; a zombie, none
                    proc.cmdline = cmdline(pid) or proc.cmdline
                    alive.add(pid)
            live = alive | {root.pid}
            if done:
                return root.returncode, time.monotonic() - start, list(seen.values())
            time.sleep(every)
    finally:  # interrupted (Ctrl-C) or failed: the command does not outlive the census
        if root.poll() is None:
            root.terminate()
            try:
                root.wait(10)
            except subprocess.TimeoutExpired:
                root.kill()
                root.wait()


def summary(processes: list[Process], wall: float, own: float, top: int = 15) -> dict:
    """The census's record: its wall and CPU seconds, CPU per kind (costliest first) and the ``top``
    costliest processes; ``own``: the CPU seconds the census itself took to read ``/proc`` (not in the
    totals, but on the same cores)."""
    by_kind: dict[str, list[Process]] = collections.defaultdict(list)
    for p in processes:
        by_kind[kind(p.cmdline)].append(p)
    kinds = [
        {"kind": name, "processes": len(procs), "cpu": round(sum(p.cpu for p in procs), 2)}
        for name, procs in by_kind.items()
    ]
    costliest = sorted(processes, key=lambda p: -p.cpu)[:top]
    return {
        "wall": round(wall, 1),
        "cpu": round(sum(p.cpu for p in processes), 2),
        "processes": len(processes),
        "census_cpu": round(own, 1),
        "kinds": sorted(kinds, key=lambda k: -k["cpu"]),
        "costliest": [
            {"cpu": p.cpu, "started": p.first_seen, "command": " ".join(p.cmdline.split())[:200]}
            for p in costliest
        ],
    }


def table(record: dict) -> str:
    """:func:`summary`'s record as Markdown."""
    cpu, wall = record["cpu"], record["wall"]
    lines = [
        f"{record['processes']} processes, {cpu:.0f} s of CPU in {wall:.0f} s of wall time "
        f"({cpu / wall:.2f} cores busy on average); reading /proc took the census "
        f"{record['census_cpu']:.0f} s of CPU.",
        "",
        "| kind of process | processes | CPU s | share |",
        "| --- | ---: | ---: | ---: |",
    ]
    for k in record["kinds"]:
        lines.append(f"| {k['kind']} | {k['processes']} | {k['cpu']:.1f} | {k['cpu'] / cpu:.0%} |")
    lines += [
        "",
        f"The {len(record['costliest'])} costliest processes:",
        "",
        "| CPU s | started at s | command |",
        "| ---: | ---: | --- |",
    ]
    for p in record["costliest"]:
        lines.append(f"| {p['cpu']:.1f} | {p['started']:.0f} | `{p['command'][:140].replace('|', '/')}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.census", description=__doc__.split("::")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for the census")
    parser.add_argument("--every", type=float, default=0.1, help="seconds between reads of /proc")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- the command to run")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("cmd: expected the command to run after --")
    if args.every <= 0:
        parser.error(f"--every: expected seconds > 0, got {args.every}")
    if not Path("/proc/self/stat").exists():
        parser.error("tools.census reads /proc: Linux only")
    code, wall, processes = watch(cmd, args.every)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "processes.json").write_text(json.dumps([asdict(p) for p in processes], indent=0) + "\n")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    record = summary(processes, wall, usage.ru_utime + usage.ru_stime)
    (args.out / "census.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "census.md").write_text(table(record))
    print(f"census: {args.out / 'census.md'}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
