"""One training step of ``addnorm.EncoderLayer`` vs ``torch.nn.TransformerEncoderLayer``, side by side.

Step = forward + backward + AdamW step, d_model 256, 4 heads, d_ff 1024, batch 16 x seq 128, dropout 0.1,
batch_first, CPU. Placement post (torch ``norm_first=False``) and pre (``norm_first=True``). The two
implementations run interleaved in one process (alternating which goes first), after a warmup; we report
the median step time of each and speed = torch_time / our_time (>= 1.0: ours is no slower).

    python -m benchmarks.step.encoder_layer [--reps 60] [--warmup 10] [--threads N] [--out DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import statistics

import torch
from torch import nn

import addnorm as an
from benchmarks.common.machine import cpu_model, write_results
from benchmarks.common.results_path import add_out_argument
from benchmarks.common.timing import interleaved, training_step

D_MODEL, HEADS, D_FF, BATCH, SEQ, DROPOUT = 256, 4, 1024, 16, 128, 0.1


def bench(placement: str, reps: int, warmup: int) -> dict:
    torch.manual_seed(0)
    cfg = an.TransformerConfig(
        d_model=D_MODEL, n_heads=HEADS, d_ff=D_FF, n_layers=1, dropout=DROPOUT, placement=placement,
        batch_first=True,
    )  # fmt: skip
    ours = an.EncoderLayer(cfg)
    theirs = nn.TransformerEncoderLayer(
        D_MODEL, HEADS, D_FF, DROPOUT, batch_first=True, norm_first=(placement == "pre")
    )
    n_ours = sum(p.numel() for p in ours.parameters())
    n_theirs = sum(p.numel() for p in theirs.parameters())
    x = torch.randn(BATCH, SEQ, D_MODEL)
    steps = {
        "addnorm": training_step(ours, lambda: ours(x).square().mean()),
        "torch": training_step(theirs, lambda: theirs(x).square().mean()),
    }
    times, _ = interleaved(steps, reps, warmup)
    med = {name: statistics.median(t) for name, t in times.items()}
    q = {name: statistics.quantiles(t, n=4) for name, t in times.items()}
    return {
        "placement": placement,
        "params": {"addnorm": n_ours, "torch": n_theirs},
        "median_ms": {k: v * 1e3 for k, v in med.items()},
        "iqr_ms": {k: [v[0] * 1e3, v[2] * 1e3] for k, v in q.items()},
        "speed_ours_over_torch": med["torch"] / med["addnorm"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add_out_argument(parser)
    parser.add_argument("--tag", default="cpu", help="results file suffix: encoder_layer_<tag>.md/json")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = {
        "cpu": cpu_model(),
        "logical_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
    }
    results = [bench(p, args.reps, args.warmup) for p in ("post", "pre")]
    lines = [
        "# addnorm.EncoderLayer vs torch.nn.TransformerEncoderLayer: one training step on CPU",
        "",
        f"Machine: {machine['cpu']}, {machine['logical_cores']} logical cores "
        f"(torch threads {machine['torch_threads']}); torch {machine['torch']}, Python {machine['python']}; "
        f"{machine['date']}.",
        "",
        f"Step = forward + backward + AdamW step; d_model {D_MODEL}, {HEADS} heads, d_ff {D_FF}, "
        f"batch {BATCH} x seq {SEQ}, dropout {DROPOUT}, batch_first, float32. Interleaved in one process, "
        f"{args.warmup} warmup + {args.reps} timed steps each; median (interquartile range).",
        "",
        "| placement | torch (ms) | addnorm (ms) | speed ours/torch |",
        "| --- | --- | --- | --- |",
    ]
    for r in results:
        m, iqr = r["median_ms"], r["iqr_ms"]
        lines.append(
            f"| {r['placement']} | {m['torch']:.2f} ({iqr['torch'][0]:.2f}-{iqr['torch'][1]:.2f}) "
            f"| {m['addnorm']:.2f} ({iqr['addnorm'][0]:.2f}-{iqr['addnorm'][1]:.2f}) "
            f"| {r['speed_ours_over_torch']:.3f}x |"
        )
    lines.append("")
    lines.append("speed = torch median / addnorm median; >= 1.0 means addnorm is no slower.")
    params = "; ".join(
        f"{r['placement']}: torch {r['params']['torch']:,}, addnorm {r['params']['addnorm']:,}"
        for r in results
    )
    lines.append(f"Parameters per layer ({params}).")
    text = "\n".join(lines) + "\n"
    print(text)
    payload = {"machine": machine, "reps": args.reps, "warmup": args.warmup, "results": results}
    write_results(args.out, f"encoder_layer_{args.tag}", text, payload)


if __name__ == "__main__":
    main()
