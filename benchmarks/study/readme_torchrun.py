"""Every torchrun block of the documentation, run as printed many times under CPU load (issue 41).

    python -m benchmarks.study.readme_torchrun [--runs 50] [--load 1] [--only README.md:762]
        [--script PROGRAM.py ... [--with-addnorm]] [--starve-gloo] [--src DIR] [--label NAME] [--record]

Each block marked ``<!-- test: torchrun 2 -->`` in ``README.md`` and ``docs/*.md`` is saved as a file
and started with ``torchrun --standalone --nproc-per-node 2 example.py`` (``doc_blocks.run_torchrun``,
what ``tests/test_readme.py`` runs once), its teardown and the interpreter's exit included, ``--runs``
times, the blocks taking turns so that each sees the same load. ``--load K`` adds K busy processes for
the whole run (on top of whatever else the machine runs); ``--script`` adds programs of one's own to
the turns (``tools/gloo_exit_repro.py``, the plain-torch program of ``docs/gloo-exit-abort.md``),
``--with-addnorm`` each that does not import addnorm a second time with ``import addnorm`` as its
first line. A run fails when torchrun exits non-zero; a rank ended by SIGABRT with "terminate called
without an active exception" is counted apart.

``--starve-gloo`` is the stress case of the cause: a watcher thread in each rank puts the process
group's gloo worker threads (``addnorm.gloo_exit.WORKER_THREAD``) in ``SCHED_IDLE`` as they appear, so
that under load they release a finished collective late; the block itself runs unchanged (through
``runpy``). ``--src DIR``: the ``addnorm`` source tree the ranks import (default this tree's ``src``),
to count an earlier commit's library (set ``ADDNORM_COMMIT`` to name it).

Writes ``readme_torchrun[_LABEL]_cpu.md`` and ``.json`` (per program: runs, failures, aborts, the first
failures' output; the machine, the commit and the load averages), again after each round.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.results_path import add_out_argument
from tools.doc_blocks import ENV, ROOT, TORCHRUN, Block, run_torchrun

ABORT = "terminate called without an active exception"
KEPT_FAILURES = 3  # failures per program whose output tail the JSON keeps

# The --starve-gloo rank: a watcher puts the gloo worker threads in SCHED_IDLE, then the block runs.
_STARVED_RANK = """import os, runpy, threading, time

def _starve():
    done, end = set(), time.monotonic() + 120
    while len(done) < 2 and time.monotonic() < end:
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{{tid}}/comm") as f:
                    if tid not in done and f.read().strip() == {name!r}:
                        os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                        done.add(tid)
            except OSError:
                pass
        time.sleep(0.001)

threading.Thread(target=_starve, daemon=True).start()
runpy.run_path("block.py", run_name="__main__")
"""


def _programs(args) -> list[Block]:
    chosen = [b for b in TORCHRUN if not args.only or any(o in b.where for o in args.only)]
    if args.only and not chosen:
        raise SystemExit(
            f"--only {args.only}: no torchrun block matches; blocks: {[b.where for b in TORCHRUN]}"
        )
    for script in args.script:
        path = Path(script).resolve()
        code = path.read_text()
        chosen.append(Block(path.name, "python", code, "torchrun 2"))
        if args.with_addnorm and "import addnorm" not in code:  # its wait at exit armed
            armed = "import addnorm  # noqa: F401\n" + code
            chosen.append(Block(f"{path.name} + import addnorm", "python", armed, "torchrun 2"))
    return chosen


def _starved(block: Block, folder: Path) -> Block:
    """``block`` run unchanged as ``block.py`` by a rank whose gloo worker threads are SCHED_IDLE."""
    from addnorm.gloo_exit import WORKER_THREAD

    (folder / "block.py").write_text(block.code)
    return Block(block.where, "python", _STARVED_RANK.format(name=WORKER_THREAD), block.mark)


def _outcome(ran: subprocess.CompletedProcess) -> str:
    if ran.returncode == 0:
        return "ok"
    return "abort" if ABORT in ran.stderr else "failed"


def run(args, on_row) -> dict:
    src = str(Path(args.src).resolve())
    env = {**ENV, "PYTHONPATH": src}
    programs = _programs(args)
    counts = {
        p.where: {"runs": 0, "failed": 0, "aborts": 0, "seconds": 0.0, "failures": []} for p in programs
    }
    report = {
        "machine": args.machine,
        "runs": args.runs,
        "load_processes": args.load,
        "starve_gloo": args.starve_gloo,
        "src": src,
        "loadavg_start": round(os.getloadavg()[0], 2),
        "programs": counts,
    }
    busy = [
        subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL)
        for _ in range(args.load)
    ]
    started = time.monotonic()
    try:
        for i in range(args.runs):
            for program in programs:
                with tempfile.TemporaryDirectory(prefix="addnorm-torchrun-") as tmp:
                    folder = Path(tmp)
                    block = _starved(program, folder) if args.starve_gloo else program
                    t0 = time.monotonic()
                    try:
                        ran = run_torchrun(block, folder, env=env, timeout=args.timeout)
                    except subprocess.TimeoutExpired as err:
                        out = err.stderr.decode() if isinstance(err.stderr, bytes) else err.stderr or ""
                        ran = subprocess.CompletedProcess(err.cmd, 124, "", out + "\n(timed out)")
                row = counts[program.where]
                row["runs"] += 1
                row["seconds"] += time.monotonic() - t0
                outcome = _outcome(ran)
                if outcome != "ok":
                    row["failed"] += 1
                    row["aborts"] += outcome == "abort"
                    if len(row["failures"]) < KEPT_FAILURES:
                        row["failures"].append(
                            {"run": i + 1, "exit": ran.returncode, "stderr": ran.stderr[-1500:]}
                        )
                print(f"round {i + 1}/{args.runs} {program.where}: {outcome}", flush=True)
            report["rounds_done"] = i + 1
            report["loadavg_end"] = round(os.getloadavg()[0], 2)
            report["minutes"] = round((time.monotonic() - started) / 60, 1)
            on_row(report)
    finally:
        for p in busy:
            p.kill()
            p.wait()
    return report


def _rounds(report: dict) -> str:
    """The rounds done: "50 rounds", or "35 of 50 rounds (stopped before the end)" for a cut count."""
    done = report.get("rounds_done", max((r["runs"] for r in report["programs"].values()), default=0))
    if done == report["runs"]:
        return f"{done} rounds"
    return f"{done} of {report['runs']} rounds (stopped before the end)"


def to_markdown(report: dict) -> str:
    from benchmarks.common.machine import machine_line

    starve = (
        " Stress case (`--starve-gloo`): each rank's gloo worker threads run `SCHED_IDLE`, so they release a "
        "finished collective late."
        if report["starve_gloo"]
        else ""
    )
    lines = [
        "# The documentation's torchrun blocks, run as printed (issue 41)",
        "",
        machine_line(report["machine"])
        + f" Shared with other engineers' work, plus {report['load_processes']} busy process(es) of this "
        f"benchmark: load average {report['loadavg_start']:.1f} at the start, "
        f"{report.get('loadavg_end', 0):.1f} at the end.",
        "",
        f"Each program saved as a file and started with `torchrun --standalone --nproc-per-node 2`, its "
        f"teardown and exit included, the programs taking turns: {_rounds(report)} in "
        f"{report.get('minutes', 0):.1f} min; addnorm imported from `{report['src']}`.{starve}"
        + (f" {report['note']}" if report.get("note") else ""),
        "",
        f"| program | runs | failed | of which aborted at exit ({ABORT}) | s per run |",
        "| --- | --- | --- | --- | --- |",
    ]
    for where, row in report["programs"].items():
        per_run = row["seconds"] / row["runs"] if row["runs"] else 0.0
        lines.append(f"| `{where}` | {row['runs']} | {row['failed']} | {row['aborts']} | {per_run:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=50, help="rounds: each program runs once per round")
    ap.add_argument("--load", type=int, default=1, help="busy processes started for the run (default 1)")
    ap.add_argument("--only", nargs="+", default=[], help="blocks whose file:line contains one of these")
    ap.add_argument("--script", nargs="+", default=[], help="programs of one's own to run in the turns")
    ap.add_argument("--with-addnorm", action="store_true", help="--script also with addnorm")
    ap.add_argument("--starve-gloo", action="store_true", help="gloo worker threads SCHED_IDLE (stress)")
    ap.add_argument("--src", default=str(ROOT / "src"), help="the addnorm source the ranks import")
    ap.add_argument("--label", default="", help="results file readme_torchrun_LABEL_cpu (default none)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per run before it counts as failed")
    ap.add_argument("--note", default="", help="a sentence for the table")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    if args.runs < 1 or args.load < 0:
        ap.error(f"--runs: expected at least 1, got {args.runs}; --load: expected 0 or more, got {args.load}")

    import torch

    from benchmarks.common.machine import machine_info, record_rows

    torch.set_num_threads(1)  # as the ranks run (OMP_NUM_THREADS=1); the machine line reads this process
    args.machine = machine_info("cpu")
    kind = "readme_torchrun" + (f"_{args.label}" if args.label else "")
    return record_rows(args, kind, "cpu", run, to_markdown)


if __name__ == "__main__":
    main()
