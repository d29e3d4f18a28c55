"""The fault table of issue 23, re-run: `addnorm study` under the faults a hostile but realistic user
meets, each a trial on a tiny spec through the real command line, with what must hold checked after it.

    python -m tools.fault_trials [--repeat N] [--only NAME[,NAME]] [--list] [--no-record]

Every trial that interrupts or breaks a study checks afterwards that no finished run was lost or
duplicated (the runs stored at the fault are still stored, with the same numbers; the resumed study
reports them as already stored and trains only the rest) and that the resumed database equals the
uninterrupted study's (every run's status, final numbers and per-step metrics, exactly). Faults:

- ``kill -9`` of the driver at each phase (its workers starting, planned, after 1 and 3 runs stored,
  everything stored while the report is written), with 1 and 2 workers: no process of its session
  outlives it by 30 s, and a report left behind is whole;
- ``kill -9`` of the driver, or of a run's torchrun, within a second of the run's two ranks starting
  (issue 31: both ranks trained on under PID 1 in 4 of 4 such kills): no rank outlives it by 30 s;
- SIGINT and SIGTERM mid-study: exit 130 with the one-line message;
- two studies on one folder (the same spec, two specs, and ``--wait``): one refuses with exit 3 in one
  line naming the holder's pid (or waits for it), nothing is trained twice;
- a NaN loss (``lr: inf``); a pool worker killed mid-study;
- storage: a truncated, a garbage and a locked database, a read-only folder (run unprivileged), a file
  in place of the folder, a full disk (a small tmpfs; without the privilege to mount one, a file size
  limit) while runs are stored and while the report is written: one ``error: storage fault`` line,
  exit 4, results kept (a report stays whole; a finished run that could not be stored is kept aside
  and stored on the resume, once space is free);
- trackers: ``<out>/tensorboard`` a file, an MLflow server refusing connections, one never answering,
  an MLflow database that cannot be written: one warning line (seconds until it are recorded), the
  study runs;
- a Ray ``--address`` where an HTTP server (not Ray) listens; duplicate spec keys and labels; a model
  too big for the memory and evaluation beyond the held-out data: one line, exit 2.

Writes ``fault_trials.md`` and ``.json`` (tried / held per fault, the machine; recorded:
``benchmarks/results/cpu/2026-11-26-2472a64/``).
The study the trials run and what they read back from it: ``tools/fault_trial_study.py``; the storage trials:
``tools/fault_trial_storage.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import http.server
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks.common.results_path import add_record_argument, out_dir
from tools.fault_trial_storage import full_disk, read_only, storage
from tools.fault_trial_study import (
    OTHER,
    RUNS,
    SPEC,
    TINY,
    Context,
    finished,
    report_whole,
    resume_equals_reference,
    signature,
    stored_values_match,
    summary,
)
from tools.procs import alive, children, free_port, parent, pool_workers
from tools.study_faults import (
    ENV,
    SPEC_ERRORS,
    NotHeld,
    addnorm,
    check,
    check_interrupted,
    interrupt,
    no_orphans,
    one_line,
    study_cmd,
    wait_for,
    write_spec,
)

TWO_RANKS = {**TINY, "steps": 2000, "eval_every": 0, "distributed": {"strategy": "ddp", "nproc": 2}}
WAIT = 30.0  # seconds any single wait of a trial may take before it counts as not held


# --- the trials -------------------------------------------------------------------------------------
PHASES = {
    "while its workers start": lambda out: (time.sleep(1.0), True)[1],
    "planned, nothing stored": lambda out: (out / "study.sqlite").is_file(),
    "after 1 run stored": lambda out: len(finished(out / "study.sqlite")) >= 1,
    "after 3 runs stored": lambda out: len(finished(out / "study.sqlite")) >= 3,
    "while the report is written": lambda out: len(finished(out / "study.sqlite")) >= RUNS,
}


def signal_trial(ctx: Context, out: Path, phase: str, workers: int, sig: int) -> str:
    code, err, pid, sent = interrupt(
        study_cmd(ctx.spec, out, "--workers", str(workers)), lambda: PHASES[phase](out), sig
    )
    if not sent:
        return "finished before the signal (not a fault)"
    if sig == signal.SIGKILL:
        report_whole(out)
    else:
        check_interrupted(code, err, sig)
    no_orphans(pid)
    stored = stored_values_match(ctx, out)
    return resume_equals_reference(ctx, out, stored, "--workers", str(workers))


def ranks_below(pid: int) -> list[int]:
    """The ranks (``addnorm.train.launch`` processes, torchrun excluded) descending from ``pid``."""
    found, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            todo.append(child)
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
                if b"addnorm.train.launch" in argv and b"torch.distributed.run" not in argv:
                    found.append(child)
    return found


def early_kill(ctx: Context, out: Path, victim: str) -> str:
    """A study of one run on two ranks; ``victim`` (the driver, or the run's torchrun) killed -9 at a
    random moment within a second of the first rank starting (most such moments fall before the rank
    has imported torch). Every rank must be gone within 30 s, and the driver's session with it."""
    spec = write_spec(
        out.parent / "ranks.yaml", {"name": "ranks", "base": TWO_RANKS, "experiments": {"a": {}}}
    )
    driver = subprocess.Popen(
        study_cmd(spec, out, "--workers", "1", "--quiet"),
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    ranks: list[int] = []
    try:
        check(wait_for(lambda: bool(ranks_below(driver.pid)), timeout=300, every=0.005), "no rank started")
        delay = random.uniform(0.0, 1.0)
        time.sleep(delay)
        ranks = ranks_below(driver.pid)
        check(bool(ranks), "the ranks ended before the kill")
        os.kill(driver.pid if victim == "driver" else parent(ranks[0]), signal.SIGKILL)
        gone = wait_for(lambda: not any(alive(r) for r in ranks), timeout=30, every=0.1)
        left = [r for r in ranks if alive(r)]
        check(
            gone and not left, f"ranks alive 30 s after the kill ({delay:.2f} s after they started): {left}"
        )
    finally:
        for pid in [*ranks, driver.pid]:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        driver.wait()
    if victim == "driver":
        no_orphans(driver.pid)
    return f"killed {delay:.2f} s after the first rank started: {len(ranks)} ranks gone"


def two_studies(ctx: Context, out: Path, case: str) -> str:
    """Two real processes started together on one folder (with ``--wait``: the second once the first
    holds it)."""
    second_spec = ctx.other if case == "two specs" else ctx.spec
    extra = ["--wait", "600"] if case == "--wait" else []
    a = subprocess.Popen(
        study_cmd(ctx.spec, out, "--quiet"),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if case == "--wait":  # the one that waits starts once the other holds the folder
        lock = out / ".addnorm.lock"
        wait_for(lambda: lock.is_file() and lock.read_text().strip() == str(a.pid), timeout=300)
    b = subprocess.Popen(
        study_cmd(second_spec, out, "--quiet", *extra),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    (a_out, a_err), (b_out, b_err) = a.communicate(timeout=600), b.communicate(timeout=600)
    codes = sorted([a.returncode, b.returncode])
    if case == "--wait":
        check(codes == [0, 0], f"exit codes {a.returncode}, {b.returncode}")
        waiting = [ln for e in (a_err, b_err) for ln in e.splitlines() if ln.startswith("waiting for")]
        check(len(waiting) == 1, f"not one waiting line: {a_err!r} {b_err!r}")
        runs = sorted(summary(o)[2] for o in (a_out, b_out))
        check(runs == [0, RUNS], f"runs trained: {runs} (each once expected)")
        check(signature(out / "study.sqlite") == ctx.reference, "database differs")
        return "the second waited, then found every run stored"
    check(codes == [0, 3], f"exit codes {a.returncode}, {b.returncode}")
    winner, winner_out, loser_err = (a, a_out, b_err) if b.returncode == 3 else (b, b_out, a_err)
    line = one_line(loser_err, "error: ")
    check(str(out.absolute()) in line and f"process {winner.pid}" in line, f"no folder and holder in: {line}")
    if case == "two specs":
        name = "faults" if winner is a else "other"
        title = f"<title>addnorm study: {name}</title>"
        check(title in (out / "report.html").read_text(), "the report is not of the winner's spec")
        return f"{'first' if winner is a else 'second'} won; the report is of its own spec"
    check(summary(winner_out)[2] == RUNS, "runs trained twice or missing")
    check(signature(out / "study.sqlite") == ctx.reference, "database differs")
    return "one ran, one refused"


def nan_run(ctx: Context, out: Path) -> str:
    spec = write_spec(
        out.parent / "nan.yaml",
        {"name": "nan", "base": TINY, "experiments": {"main": {"sweep": {"lr": [1e-3, float("inf")]}}}},
    )
    first = subprocess.run(
        study_cmd(spec, out, "--quiet"), env=ENV, capture_output=True, text=True, timeout=600
    )
    check(first.returncode == 0, f"exit {first.returncode}: {first.stderr[-300:]}")
    check((out / "report.html").stat().st_size > 0, "no report")
    again = addnorm("report", out)
    check(again.returncode == 0, f"report exit {again.returncode}")
    con = sqlite3.connect(out / "study.sqlite")
    statuses = sorted(r[0] for r in con.execute("SELECT status FROM runs"))
    con.close()
    check(statuses == ["diverged", "done"], f"statuses {statuses}")
    return "diverged run stored, findings and report written"


def dead_worker(ctx: Context, out: Path) -> str:
    driver = subprocess.Popen(
        study_cmd(ctx.spec, out, "--workers", "2", "--quiet"),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    check(
        wait_for(lambda: len(pool_workers(driver.pid)) == 2 and (out / "study.sqlite").is_file(), 300),
        "no pool",
    )
    time.sleep(0.5)
    victim = pool_workers(driver.pid)[0]
    os.kill(victim, signal.SIGKILL)
    stdout, stderr = driver.communicate(timeout=600)
    check(driver.returncode == 0, f"exit {driver.returncode}: {stderr[-300:]}")
    check(summary(stdout)[2] == RUNS, "not every run ran")
    check(signature(out / "study.sqlite") == ctx.reference, "database differs")
    return "pool replaced, every run done"


def tracker(ctx: Context, out: Path, fault: str) -> str:
    extra: list[str] = []
    server = None
    if fault == "tensorboard folder is a file":
        out.mkdir()
        (out / "tensorboard").write_text("in the way")
        extra = ["--track", "tensorboard"]
    elif fault == "MLflow server refusing connections":
        extra = ["--track", "mlflow", "--mlflow-uri", f"http://127.0.0.1:{free_port()}"]
    elif fault == "MLflow server never answering":
        server = socket.socket()
        server.bind(("127.0.0.1", 0))
        server.listen(16)
        extra = ["--track", "mlflow", "--mlflow-uri", f"http://127.0.0.1:{server.getsockname()[1]}"]
    else:  # an MLflow database that cannot be written: a folder where the file should be
        (out.parent / "mlflow.db").mkdir()
        extra = ["--track", "mlflow", "--mlflow-uri", f"sqlite:///{out.parent / 'mlflow.db'}"]
    start = time.monotonic()
    proc = subprocess.Popen(
        study_cmd(ctx.spec, out, "--quiet", *extra),
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    warned_after, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("warning: --track") and warned_after is None:
            warned_after = time.monotonic() - start
    proc.wait(timeout=600)
    if server is not None:
        server.close()
    check(proc.returncode == 0, f"exit {proc.returncode}: {''.join(lines)[-300:]}")
    check(len(lines) == 1 and warned_after is not None, f"expected one warning line, got {lines[:5]}")
    check(signature(out / "study.sqlite") == ctx.reference, "database differs")
    return f"warning after {warned_after:.1f} s of the command (torch import included)"


class Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # no access log on this script's output
        pass


def bad_ray_address(ctx: Context, out: Path) -> str:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        start = time.monotonic()
        result = addnorm(
            "study",
            ctx.spec,
            "--out",
            out,
            "--executor",
            "ray",
            "--address",
            f"127.0.0.1:{httpd.server_address[1]}",
            "--quiet",
            timeout=120,
        )
        took = time.monotonic() - start
    finally:
        httpd.shutdown()
    check(result.returncode == 2, f"exit {result.returncode}: {result.stderr[-300:]}")
    line = one_line(result.stderr, "error: --address")
    return f"{line[len('error: ') :][:80]} ({took:.1f} s)"


REFUSED = {  # the spec errors (shared with the tests) and what this machine cannot run
    **SPEC_ERRORS,
    "model too big for the memory": (
        "name: t\nbase: {d_model: 20000, n_heads: 4, steps: 2, eval_every: 0}\nexperiments: {a: {}}\n",
        "error: memory: experiments.a",
    ),
    "evaluation beyond the held-out data": (
        "name: t\nbase: {eval_batches: 100000000, steps: 2, eval_every: 0}\nexperiments: {a: {}}\n",
        "error: eval_batches: experiments.a",
    ),
}


def spec_error(ctx: Context, out: Path, case: str) -> str:
    text, named = REFUSED[case]
    path = out.parent / "bad.yaml"
    path.write_text(text)
    result = addnorm("study", path, "--out", out, "--quiet")
    check(result.returncode == 2, f"exit {result.returncode}")
    line = one_line(result.stderr, "error: ")
    check(named in line, f"the line does not name it: {line}")
    check(not out.exists(), "the output folder was touched")
    return line[:90]


def trials(repeat: int) -> dict[str, list[tuple[str, Callable[[Context, Path], str]]]]:
    """fault -> [(trial label, run(ctx, out))]."""
    table: dict[str, list] = {}
    for phase in PHASES:
        for workers in (1, 2):
            table.setdefault(f"kill -9 of the driver {phase}", []).extend(
                (
                    f"{workers} worker(s) #{i + 1}",
                    lambda c, o, p=phase, w=workers: signal_trial(c, o, p, w, signal.SIGKILL),
                )
                for i in range(repeat)
            )
    for victim in ("driver", "torchrun"):
        table[f"kill -9 of the {victim} as a run's ranks start"] = [
            (f"#{i + 1}", lambda c, o, v=victim: early_kill(c, o, v)) for i in range(repeat)
        ]
    for sig in (signal.SIGINT, signal.SIGTERM):
        for phase in ("after 1 run stored", "after 3 runs stored"):
            for workers in (1, 2):
                table.setdefault(f"{sig.name} mid-study", []).append(
                    (
                        f"{phase}, {workers} worker(s)",
                        lambda c, o, p=phase, w=workers, s=sig: signal_trial(c, o, p, w, s),
                    )
                )
    for case in ("same spec", "two specs", "--wait"):
        table.setdefault("two studies on one folder", []).extend(
            (f"{case} #{i + 1}", lambda c, o, k=case: two_studies(c, o, k)) for i in range(repeat)
        )
    table["a NaN loss (lr: inf)"] = [("", nan_run)]
    table["a pool worker killed mid-study"] = [(f"#{i + 1}", dead_worker) for i in range(repeat)]
    for fault in ("truncated database", "garbage database", "locked database", "file in place of the folder"):
        table[f"storage: {fault}"] = [("", lambda c, o, f=fault: storage(c, o, f))]
    table["storage: read-only folder (unprivileged)"] = [("", read_only)]
    for when in ("while runs are stored", "while the report is written"):
        table[f"storage: full disk {when}"] = [("", lambda c, o, w=when: full_disk(c, o, w))]
    for fault in (
        "tensorboard folder is a file",
        "MLflow server refusing connections",
        "MLflow server never answering",
        "MLflow database that cannot be written",
    ):
        table[f"tracker: {fault}"] = [("", lambda c, o, f=fault: tracker(c, o, f))]
    table["Ray --address at an HTTP server"] = [("", bad_ray_address)]
    for case in REFUSED:
        table[f"spec: {case}"] = [("", lambda c, o, k=case: spec_error(c, o, k))]
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="trials per kill phase and worker count (2)")
    parser.add_argument("--only", default="", help="comma-separated substrings of the faults to run")
    parser.add_argument("--list", action="store_true", help="list the faults and exit")
    parser.add_argument("--no-record", action="store_true", help="write no results at all")
    add_record_argument(parser)
    args = parser.parse_args()
    table = trials(args.repeat)
    if args.list:
        for fault, runs in table.items():
            print(f"{fault}: {len(runs)} trial(s)")
        return
    wanted = [w.strip() for w in args.only.split(",") if w.strip()]
    table = {f: r for f, r in table.items() if not wanted or any(w in f for w in wanted)}
    rows, details = [], []
    started, loads = time.monotonic(), [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="addnorm-faults-") as tmp:
        root = Path(tmp)
        os.chmod(root, 0o755)
        ctx = Context(
            root, spec=write_spec(root / "spec.yaml", SPEC), other=write_spec(root / "other.yaml", OTHER)
        )
        ref = subprocess.run(
            study_cmd(ctx.spec, root / "reference", "--quiet", "--workers", "1"),
            env=ENV,
            capture_output=True,
            text=True,
            timeout=900,
        )
        if ref.returncode != 0:
            raise SystemExit(f"the uninterrupted study failed: {ref.stderr[-500:]}")
        ctx.reference = signature(root / "reference" / "study.sqlite")
        for n, (fault, runs) in enumerate(table.items()):
            held, notes = 0, []
            for i, (label, run) in enumerate(runs):
                trial = root / f"t{n}-{i}"
                trial.mkdir()
                t0 = time.monotonic()
                try:
                    note = run(ctx, trial / "out")
                    held += 1
                    ok = True
                except (NotHeld, subprocess.TimeoutExpired) as err:
                    note, ok = f"NOT HELD: {err}", False
                details.append(
                    {
                        "fault": fault,
                        "trial": label,
                        "held": ok,
                        "note": note,
                        "seconds": round(time.monotonic() - t0, 1),
                    }
                )
                print(f"{fault} [{label}]: {'held' if ok else 'NOT HELD'} - {note}", flush=True)
                notes.append(note if not ok or len(runs) == 1 else "")
                shutil.rmtree(trial, ignore_errors=True)
            shown = [x for x in notes if x]
            rows.append((fault, len(runs), held, "; ".join(dict.fromkeys(shown))[:300]))
    loads.append(os.getloadavg()[0])
    import torch

    from benchmarks.common.machine import machine_info, machine_line, write_results

    torch.set_num_threads(1)  # as every study here runs its workers (the machine line reads this process)
    machine = machine_info("cpu")
    tried, kept = sum(r[1] for r in rows), sum(r[2] for r in rows)
    lines = [
        "# Fault trials (issue 23)",
        "",
        machine_line(machine)
        + f" Shared with other engineers' work: load average {loads[0]:.1f} at the start, {loads[1]:.1f} at "
        "the end.",
        "",
        f"`python -m tools.fault_trials --repeat {args.repeat}`"
        + (f" `--only {args.only}`" if args.only else "")
        + f": {tried} trials, {kept} held, in {(time.monotonic() - started) / 60:.1f} min. A spec of "
        f"{RUNS} tiny runs ({TINY['steps']} steps each) through the real command line; after every "
        "interruption the runs stored at the fault keep their numbers, the resume trains only the rest "
        "and its database equals the uninterrupted study's exactly (statuses, final numbers, every "
        "per-step and per-layer metric).",
        "",
        "| fault | tried | held | notes |",
        "| --- | --- | --- | --- |",
    ]
    lines += [f"| {f} | {t} | {h} | {n.replace('|', '/')} |" for f, t, h, n in rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_record:
        write_results(out_dir(args), "fault_trials", text, {"machine": machine, "trials": details})


if __name__ == "__main__":
    main()
