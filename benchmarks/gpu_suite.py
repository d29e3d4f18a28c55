"""Everything the GPU measures, in one command: ``make gpu-bench`` or ``python benchmarks/gpu_suite.py``.

One process tree, at most ``--budget`` seconds (600 by default, an H100's ten minutes), steps in
order, each a child process with its own time limit (killed with its process group when it runs
over; the next step still runs):

1. ``pytest -m gpu``: the tests that need CUDA;
2. the op bandwidth table (``bench_add_norm.py``: eager, torch.compile, Liger-Kernel and flash-attn's
   Triton layer norm where they import, addnorm eager and compiled);
3. host time per call with real launches (``bench_host_overhead.py`` on CUDA tensors);
4. the LM training step (``bench_lm_step.py``: default / ``fused=False`` / ``nn.TransformerEncoder``;
   eager, torch.compile with both compile paths, reduce-overhead; tokens/s and peak memory);
5. the Hugging Face Llama step (``bench_hf_step.py --gpu``: plain / fused / Liger).

Each benchmark writes its table with the device name into ``benchmarks/results/``; the suite adds
``gpu_suite_<device>.md`` / ``.json``: every step's command, exit status, seconds and log tail.

It runs on a bare device image (torch and Triton preinstalled, the tree copied, ``PYTHONPATH=src``):
no virtual environment, no network. Optional wheels (Liger-Kernel, flash-attn) may travel beside the
tree in ``--wheels DIR`` (default ``benchmarks/wheels`` when it exists): they are installed with
``pip --no-index --no-deps --target`` into a scratch folder on the children's ``PYTHONPATH``, leaving
the image's packages alone. ``--dry-run`` plans every step and prints it, launching nothing (CI).

Measured on an H100: the default plan's whole-model compiles and the op table for four dtypes did not
fit in ten minutes; ``--full`` plans them (about 20 minutes: two device calls, or one long session).

    python benchmarks/gpu_suite.py [--dry-run] [--full] [--budget 600] [--only ops lm_step] [--wheels DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from shlex import split

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


@dataclass
class Step:
    """One child process of the suite: ``argv`` run in the repository root within ``timeout_s``."""

    name: str
    what: str
    argv: list[str]
    timeout_s: int
    result: dict = field(default_factory=dict)


def plan(py: str = sys.executable, out: Path = BENCH / "results", full: bool = False) -> list[Step]:
    """The suite's steps, in order, with their time limits (seconds; 505 in all, so that the suite
    with its start-up fits ten minutes on an H100, measured there 2026-11-24). ``full`` adds what does
    not fit in ten minutes (whole-model compiles take 20-40 s each on an H100): the op table for every
    dtype and Post-LN, the LM step's second compile path ("kernel"), reduce-overhead and Post-LN, the
    HF step compiled; about 20 minutes."""
    o = ["--out", str(out)]
    if full:
        return [
            Step("gpu_tests", "pytest -m gpu", [py, *split("-m pytest -m gpu -q -p no:cacheprovider")], 90),
            Step(
                "ops",
                "op bandwidth, every dtype, Pre-LN and Post-LN",
                [py, str(BENCH / "bench_add_norm.py"), *split("--reps 10 --warmup 2"), *o],
                600,
            ),  # fmt: skip
            Step(
                "host_overhead",
                "host time per call, real launches",
                [py, str(BENCH / "bench_host_overhead.py"), *split("--label gpu --samples 15"), *o],
                60,
            ),  # fmt: skip
            Step(
                "lm_step",
                "LM step: eager, compile (both paths), reduce-overhead; Pre-LN and Post-LN",
                [
                    py,
                    str(BENCH / "bench_lm_step.py"),
                    *split("--modes eager compile reduce-overhead"),
                    *split("--compile-paths both --steps 8 --warmup 2"),
                    *o,
                ],
                480,
            ),  # fmt: skip
            Step(
                "hf_step",
                "HF Llama step: plain / fused / Liger; eager and compile",
                [py, str(BENCH / "bench_hf_step.py"), *split("--gpu --reps 10 --warmup 3"), *o],
                240,
            ),  # fmt: skip
        ]
    return [
        Step(
            "gpu_tests",
            "pytest -m gpu",
            [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"],
            75,
        ),
        Step(
            "ops",
            "op bandwidth, bf16 Pre-LN, hidden 1K/4K/16K: eager, torch.compile, Liger, flash-attn, addnorm",
            [
                py,
                str(BENCH / "bench_add_norm.py"),
                *split("--dtypes bfloat16 --prenorm on --hidden 1024 4096 16384"),
                *split("--reps 10 --warmup 2"),
                *o,
            ],  # fmt: skip
            170,
        ),
        Step(
            "host_overhead",
            "host time per call, real launches",
            [py, str(BENCH / "bench_host_overhead.py"), "--label", "gpu", "--samples", "15", *o],
            40,
        ),
        Step(
            "lm_step",
            "LM step, Pre-LN: default / fused=False / nn.TransformerEncoder; eager, torch.compile",
            [
                py,
                str(BENCH / "bench_lm_step.py"),
                *split("--placements pre --modes eager compile"),
                *split("--compile-paths default --steps 8 --warmup 2"),
                *o,
            ],  # fmt: skip
            160,
        ),
        Step(
            "hf_step",
            "HF Llama step: plain / fused / Liger; eager",
            [py, str(BENCH / "bench_hf_step.py"), *split("--gpu --modes eager --reps 10 --warmup 3"), *o],
            60,
        ),
    ]


def install_wheels(wheels: Path, py: str) -> tuple[str | None, str]:
    """pip-install every wheel in ``wheels`` (no index, no dependencies) into a scratch folder; its
    path (to go on the children's PYTHONPATH, or None when there are none) and pip's log tail."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return None, "no wheels"
    target = tempfile.mkdtemp(prefix="addnorm-wheels-")
    cmd = [py, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", target, *files]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return (target if out.returncode == 0 else None), (out.stdout + out.stderr)[-2000:]


def run_step(step: Step, env: dict[str, str], deadline: float) -> dict:
    """Run one step in its own process group, within its limit and the suite's deadline; kill the
    group when it runs over. Its exit status, seconds and the tail of its output."""
    limit = max(1.0, min(step.timeout_s, deadline - time.monotonic()))
    t0 = time.monotonic()
    proc = subprocess.Popen(
        step.argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        log, _ = proc.communicate(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        timed_out = True
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "seconds": round(time.monotonic() - t0, 1),
        "log_tail": (log or "")[-3000:],
    }


def to_markdown(report: dict) -> str:
    lines = [
        "# GPU suite",
        "",
        f"Device: {report['device']}; torch {report['torch']}; commit {report['commit']}; {report['date']}; "
        f"{report['seconds']:.0f} s of a {report['budget_s']} s budget. Wheels: {report['wheels']}.",
        "",
        "| step | what | exit | seconds | limit |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in report["steps"]:
        r = s["result"]
        status = "timed out" if r.get("timed_out") else str(r.get("rc", "skipped"))
        lines.append(f"| {s['name']} | {s['what']} | {status} | {r.get('seconds', 0)} | {s['timeout_s']} |")
    lines.append("")
    for s in report["steps"]:
        if s["result"].get("log_tail"):
            lines += [f"## {s['name']}", "", "```", s["result"]["log_tail"].rstrip(), "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="plan and print every step, launch nothing")
    ap.add_argument("--full", action="store_true", help="every mode, dtype and compile path (~20 min)")
    ap.add_argument("--budget", type=int, default=None, help="seconds for the whole suite (600; --full 1500)")
    ap.add_argument("--only", nargs="+", default=None, help="run only these steps (by name)")
    ap.add_argument("--wheels", type=Path, default=BENCH / "wheels", help="optional wheels to install")
    ap.add_argument("--out", type=Path, default=BENCH / "results")
    args = ap.parse_args(argv)
    steps = plan(out=args.out, full=args.full)
    args.budget = args.budget or (1500 if args.full else 600)
    names = [s.name for s in steps]
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"--only: expected step names from {names}, got {unknown}")
        steps = [s for s in steps if s.name in args.only]
    for s in steps:
        print(f"[{s.name}] <= {s.timeout_s} s: {s.what}\n    {' '.join(s.argv)}", flush=True)
    if args.dry_run:
        print(
            f"dry run: {len(steps)} steps planned, {sum(s.timeout_s for s in steps)} s of limits; nothing run"
        )
        return 0
    import datetime as dt

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (use --dry-run to see the plan)")
    start = time.monotonic()
    deadline = start + args.budget - 5
    env = dict(os.environ)
    paths = [str(ROOT / "src")]
    wheels = "none"
    if args.wheels.is_dir():
        target, log = install_wheels(args.wheels, sys.executable)
        wheels = f"installed from {args.wheels}" if target else f"not installed ({log.strip()[-200:]})"
        paths += [target] if target else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    for s in steps:
        if time.monotonic() > deadline - 10:
            s.result = {"rc": None, "skipped": "out of budget"}
            continue
        s.result = run_step(s, env, deadline)
        print(f"[{s.name}] exit {s.result['rc']} in {s.result['seconds']} s", flush=True)
    device = torch.cuda.get_device_name()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    report = {
        "device": device,
        "torch": torch.__version__,
        "commit": commit.stdout.strip() or "unknown",
        "date": dt.date.today().isoformat(),
        "budget_s": args.budget,
        "seconds": time.monotonic() - start,
        "wheels": wheels,
        "steps": [asdict(s) for s in steps],
    }
    slug = "".join(c if c.isalnum() else "_" for c in device.lower()).strip("_")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"gpu_suite_{slug}.md").write_text(to_markdown(report))
    (args.out / f"gpu_suite_{slug}.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.out}/gpu_suite_{slug}.md and .json")
    return 0 if all(s.result.get("rc") == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
