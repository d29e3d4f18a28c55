"""Training throughput (tokens/s) of ``addnorm.LanguageModel`` vs the same architecture built from
``torch.nn.TransformerEncoderLayer`` with a causal mask, side by side on the CPU.

Both models share the embedding and head code (an addnorm LanguageModel whose stack is replaced by an
``nn.TransformerEncoder`` for the torch side); one step = forward + cross-entropy + backward + AdamW.
Interleaved in one process after a warmup; speed = our tokens/s / torch tokens/s (>= 1.0: no slower).

    python -m benchmarks.step.training_throughput [--reps 30] [--threads 1,2] [--out benchmarks/results]

``--threads`` repeats the comparison at each torch thread count (default: torch's own, one per core).
On a shared machine one thread per process is the robust number: two OpenMP threads time-shared with
another busy process can stall each other.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import addnorm as an
from benchmarks.common.machine import cpu_model, write_results
from benchmarks.common.results_path import add_out_argument
from benchmarks.common.timing import interleaved, training_step

VOCAB, D_MODEL, HEADS, D_FF, LAYERS, BATCH, SEQ, DROPOUT = 256, 256, 4, 1024, 4, 16, 128, 0.1


class TorchStackLM(nn.Module):
    """The same language model with its stack built from nn.TransformerEncoderLayer (causal mask)."""

    def __init__(self, ours: an.LanguageModel, norm_first: bool) -> None:
        super().__init__()
        self.embed, self.head = ours.embed, ours.head
        layer = nn.TransformerEncoderLayer(
            D_MODEL, HEADS, D_FF, DROPOUT, norm_first=norm_first, batch_first=True
        )
        self.stack = nn.TransformerEncoder(
            layer, LAYERS, norm=nn.LayerNorm(D_MODEL) if norm_first else None, enable_nested_tensor=False
        )
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(SEQ), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.stack(self.embed(tokens, "tokens"), mask=self.mask, is_causal=True)
        return self.head(x)


def bench(placement: str, reps: int, warmup: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    sizes = {"d_model": D_MODEL, "n_heads": HEADS, "d_ff": D_FF, "n_layers": LAYERS, "max_len": SEQ}
    cfg = an.TransformerConfig(**sizes, dropout=DROPOUT, placement=placement)
    ours = an.LanguageModel(cfg, VOCAB)
    theirs = TorchStackLM(an.LanguageModel(cfg, VOCAB), norm_first=placement == "pre")
    n_ours = sum(p.numel() for p in ours.parameters())
    n_theirs = sum(p.numel() for p in theirs.parameters())
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1))

    def step_of(model: nn.Module):
        return training_step(
            model,
            lambda: F.cross_entropy(model(tokens[:, :-1]).reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)),
        )

    times, _ = interleaved({"addnorm": step_of(ours), "torch": step_of(theirs)}, reps, warmup)
    med = {k: statistics.median(v) for k, v in times.items()}
    tok = BATCH * SEQ
    return {
        "placement": placement,
        "threads": threads,
        "params": {"addnorm": n_ours, "torch": n_theirs},
        "tokens_per_s": {k: tok / v for k, v in med.items()},
        "speed": med["torch"] / med["addnorm"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", default=str(torch.get_num_threads()), help="comma-separated counts")
    add_out_argument(parser)
    args = parser.parse_args()
    counts = [int(t) for t in args.threads.split(",")]
    results = [bench(p, args.reps, args.warmup, t) for t in counts for p in ("post", "pre")]
    machine = f"{cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}"
    lines = [
        "# Training throughput: addnorm.LanguageModel vs the same model on nn.TransformerEncoderLayer (CPU)",
        "",
        f"Machine: {machine}; {dt.date.today()}.",
        f"Byte-level LM, vocab {VOCAB}, d_model {D_MODEL}, {HEADS} heads, d_ff {D_FF}, {LAYERS} layers, "
        f"batch {BATCH} x seq {SEQ}, dropout {DROPOUT}; step = forward + cross-entropy + backward + AdamW; "
        f"{args.reps} interleaved steps after {args.warmup} warmup, medians.",
        "",
        "| threads | placement | torch tokens/s | addnorm tokens/s | addnorm/torch | parameters (both) |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        t = r["tokens_per_s"]
        lines.append(
            f"| {r['threads']} | {r['placement']} | {t['torch']:.0f} | {t['addnorm']:.0f} "
            f"| {r['speed']:.3f}x | "
            f"{r['params']['addnorm']:,} / {r['params']['torch']:,} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    write_results(args.out, "throughput_cpu", text, {"machine": machine, "results": results})


if __name__ == "__main__":
    main()
