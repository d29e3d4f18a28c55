"""The model's own Python per training step: a tiny language model on one CPU thread, where host time
(module calls, argument checks, the stream's bookkeeping) dominates the arithmetic.

LanguageModel, d_model 64, 4 heads, d_ff 128, 4 layers, vocab 256, batch 4 x seq 32, dropout 0.1,
float32, one torch thread; step = forward + cross-entropy + backward + AdamW, the step of
``benchmarks/step/training_throughput.py``. Placements pre and post,
fused on and off. Median of interleaved steps after a warmup.

    python -m benchmarks.host.model_host [--reps 300] [--warmup 30] [--out DIR]
    python -m benchmarks.host.model_host --baseline /path/to/older/checkout

``--baseline`` also times an older checkout of the repository (its ``src`` is put first on the path
of a child process) in alternating rounds with this one, so that a before/after comparison shares the
machine's state; the table then has one column per tree and their ratio.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import platform
import pstats
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.common.machine import cpu_model, write_results
from benchmarks.common.results_path import ROOT, add_out_argument
from benchmarks.common.timing import interleaved

D_MODEL, HEADS, D_FF, LAYERS, BATCH, SEQ, DROPOUT = 64, 4, 128, 4, 4, 32, 0.1
CONFIGS = [(p, f) for p in ("pre", "post") for f in (True, False)]


def python_calls(step) -> int:
    """Python function calls (cProfile's count, torch's Python included) in one call of ``step``: a
    count of the host work that does not depend on what else the machine is doing."""
    profile = cProfile.Profile()
    profile.runcall(step)
    return pstats.Stats(profile).total_calls


def measure(reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """For each (placement, fused) of :data:`CONFIGS`: ``ms``, the median wall time of a step (steps
    interleaved), ``cpu_ms``, the median CPU time this process spent in it (not counting time it was
    descheduled while other work ran), and ``calls``, the Python calls of one step. Imports addnorm
    here, in the child process whose path picks the tree."""
    import torch

    import addnorm as an
    from benchmarks.step.training_throughput import VOCAB, make_step

    torch.set_num_threads(1)
    steps = {}
    for placement, fused in CONFIGS:
        torch.manual_seed(0)
        cfg = an.TransformerConfig(
            d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, n_layers=LAYERS, dropout=DROPOUT,
            placement=placement, max_len=SEQ,
        )  # fmt: skip
        model = an.LanguageModel(cfg, vocab=VOCAB)
        for m in model.modules():
            if isinstance(m, an.AddNorm):
                m.fused = fused
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))
        steps[f"{placement}/{'fused' if fused else 'unfused'}"] = make_step(model, tokens)
    wall, cpu = interleaved(steps, reps, warmup)
    return {
        "ms": {name: statistics.median(t) * 1e3 for name, t in wall.items()},
        "cpu_ms": {name: statistics.median(t) * 1e3 for name, t in cpu.items()},
        "calls": {name: python_calls(step) for name, step in steps.items()},
    }


def _child(src: Path, reps: int, warmup: int) -> dict[str, dict[str, float]]:
    """:func:`measure` in a fresh process that imports addnorm from ``src``."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", __spec__.name, "--measure-only", "--reps", str(reps), "--warmup"]
    argv.append(str(warmup))
    out = subprocess.run(argv, cwd=ROOT, env=env, check=True, capture_output=True, text=True)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(result["addnorm"]).resolve().is_relative_to(src):
        raise RuntimeError(f"--baseline: the child imported addnorm from {result['addnorm']}, not {src}")
    return result["measured"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds with --baseline")
    parser.add_argument("--baseline", type=Path, default=None, help="an older checkout to compare with")
    parser.add_argument("--label", default="this tree")
    parser.add_argument("--baseline-label", default="baseline")
    add_out_argument(parser)
    parser.add_argument("--measure-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.measure_only:  # a child of --baseline: one JSON line
        import addnorm

        print(json.dumps({"addnorm": addnorm.__file__, "measured": measure(args.reps, args.warmup)}))
        return
    here = Path(__file__).resolve().parents[1] / "src"
    trees = {args.label: here}
    if args.baseline is not None:
        trees = {args.baseline_label: args.baseline.resolve() / "src", **trees}
    runs: dict[str, list[dict]] = {label: [] for label in trees}
    for _ in range(args.rounds if args.baseline is not None else 1):
        for label, src in trees.items():
            runs[label].append(_child(src, args.reps, args.warmup))
    # per tree, the best round's median (the round least disturbed by other work on the machine)
    best = {
        label: {m: {k: min(r[m][k] for r in rs) for k in rs[0][m]} for m in ("ms", "cpu_ms")}
        for label, rs in runs.items()
    }
    calls = {label: rs[0]["calls"] for label, rs in runs.items()}
    import torch

    labels = list(trees)
    pair = len(labels) == 2
    head = []
    for metric in ("wall ms", "CPU ms"):
        head += [f"{label} {metric}" for label in labels] + ([f"{metric} ratio"] if pair else [])
    head += [f"{label} Python calls" for label in labels]
    lines = [
        "# The model's own Python per training step (tiny LM, one CPU thread)",
        "",
        f"Machine: {cpu_model()}, {os.cpu_count()} logical cores, torch threads 1; "
        f"torch {torch.__version__}, Python {platform.python_version()}; {dt.date.today().isoformat()}.",
        "",
        f"LanguageModel d_model {D_MODEL}, {HEADS} heads, d_ff {D_FF}, {LAYERS} layers, vocab 256, "
        f"batch {BATCH} x seq {SEQ}, dropout {DROPOUT}, float32; step = forward + cross-entropy + backward "
        f"+ AdamW (bench_training_throughput's step). {args.warmup} warmup + {args.reps} interleaved "
        "timed steps per configuration, median"
        + (f", best of {args.rounds} alternating rounds per tree" if pair else "")
        + ": wall time, and the CPU time of the process (which time spent descheduled while other work "
        "runs does not inflate). Python calls: cProfile's count of function calls in one step (torch's "
        "Python included), which other work on the machine does not change."
        + (f" Ratios: {labels[1]} / {labels[0]}." if pair else ""),
        "",
        "| placement / add_norm | " + " | ".join(head) + " |",
        "| --- " * (len(head) + 1) + "|",
    ]
    for key in best[labels[0]]["ms"]:
        cells = []
        for metric in ("ms", "cpu_ms"):
            cells += [f"{best[label][metric][key]:.2f}" for label in labels]
            cells += [f"{best[labels[1]][metric][key] / best[labels[0]][metric][key]:.3f}"] if pair else []
        cells += [str(calls[label][key]) for label in labels]
        lines.append(f"| {key} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    payload = {"cpu": cpu_model(), "trees": {k: str(v) for k, v in trees.items()}, "runs": runs, "best": best}
    write_results(args.out, "model_host_cpu", text, payload)


if __name__ == "__main__":
    main()
