"""Training-step throughput of ``addnorm.LanguageModel``: the model's default (fused Add & Norm where
the policy picks it) against ``fused=False`` and against the same LM built on ``nn.TransformerEncoder``.

The issue-10 configuration (GPU): d_model 1024, 12 layers, 16 heads, d_ff 4096, GELU, vocab 32,000,
batch 8 x seq 1024, dropout 0.1, bf16 autocast, fused AdamW. For Pre-LN and Post-LN, in three modes
(eager, ``torch.compile``, ``torch.compile(mode="reduce-overhead")``: CUDA graphs), one step =
forward + cross-entropy + backward + AdamW; tokens/s of the median step and peak memory.

Under ``torch.compile`` the op hands Inductor either its traceable composite (the default) or the
registered Triton kernels (:func:`addnorm.ops.policy.set_compile_path`): ``--compile-paths both`` adds
a column for the non-default one, so a GPU run can decide which wins.

``--small`` is a CPU-sized model (fp32, no autocast, eager and torch.compile); ``--tiny`` a smoke test.

    python benchmarks/bench_lm_step.py [--small] [--placements pre post] [--modes eager compile]
        [--steps 15] [--compile-paths both] [--out benchmarks/results]

Targets (issue 10), checked per row: on a GPU the default >= 1.05x ``fused=False`` in eager and
>= 1.0x under both compile modes, >= 1.0x nn.TransformerEncoder everywhere, peak memory <= unfused;
on the CPU the default no slower than ``fused=False``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_info, machine_line, write_results
from timing import interleaved
from torch import nn

import addnorm as an
from addnorm.ops import policy

GPU = {
    "d_model": 1024,
    "n_layers": 12,
    "n_heads": 16,
    "d_ff": 4096,
    "vocab": 32000,
    "batch": 8,
    "seq": 1024,
    "dropout": 0.1,
}
SMALL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024, "vocab": 4096, "batch": 8, "seq": 128}
SMALL["dropout"] = 0.1
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "vocab": 64, "batch": 2, "seq": 8}
TINY["dropout"] = 0.1
# the host-overhead benchmark's tiny Pre-LN step: d_model 64, 4 layers, dropout 0.1
SMALL_HOST = {"d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 256, "vocab": 256, "batch": 8, "seq": 16}
SMALL_HOST["dropout"] = 0.1
COLUMNS = ("nn.TransformerEncoder", "fused=False", "default")


def set_fused(model: nn.Module, fused: bool) -> None:
    """``AddNorm(fused=...)`` on every connection of ``model`` (the public switch of the unfused path)."""
    found = False
    for m in model.modules():
        if isinstance(m, an.AddNorm):
            m.fused = fused
            found = True
    if not found:
        raise ValueError("set_fused: the model has no AddNorm connection")


def build_lm(cfg: dict, placement: str, *, fused: bool | None, device: str) -> nn.Module:
    """An ``addnorm.LanguageModel`` of ``cfg`` (GELU); ``fused`` None keeps the model's default."""
    tc = an.TransformerConfig(
        d_model=cfg["d_model"],
        n_heads=cfg["n_heads"],
        d_ff=cfg["d_ff"],
        n_layers=cfg["n_layers"],
        dropout=cfg["dropout"],
        activation="gelu",
        placement=placement,
        max_len=cfg["seq"],
    )
    model = an.LanguageModel(tc, cfg["vocab"]).to(device)
    if fused is not None:
        set_fused(model, fused)
    return model


class TorchEncoderLM(nn.Module):
    """The same LM with its stack built from ``nn.TransformerEncoderLayer`` (causal mask, GELU)."""

    def __init__(self, cfg: dict, placement: str, device: str) -> None:
        super().__init__()
        ours = build_lm(cfg, placement, fused=None, device=device)
        self.embed, self.head = ours.embed, ours.head
        pre = placement == "pre"
        layer = nn.TransformerEncoderLayer(
            cfg["d_model"],
            cfg["n_heads"],
            cfg["d_ff"],
            cfg["dropout"],
            activation="gelu",
            norm_first=pre,
            batch_first=True,
            device=device,
        )
        norm = nn.LayerNorm(cfg["d_model"], device=device) if pre else None
        self.stack = nn.TransformerEncoder(layer, cfg["n_layers"], norm=norm, enable_nested_tensor=False)
        mask = nn.Transformer.generate_square_subsequent_mask(cfg["seq"], device=device)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.stack(self.embed(tokens, "tokens"), mask=self.mask, is_causal=True)
        return self.head(x)


def make_step(
    model: nn.Module, tokens: torch.Tensor, vocab: int, *, fused_adamw: bool, autocast: bool = False
) -> Callable[[], None]:
    """One training step: forward, cross-entropy, backward, AdamW (fused on CUDA when asked)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused_adamw or None)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if autocast else nullcontext()
    inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with ctx:
            logits = model(inp)
            loss = F.cross_entropy(logits.reshape(-1, vocab).float(), tgt)
        loss.backward()
        opt.step()

    return step


def time_steps(step: Callable[[], None], device: str, warmup: int, steps: int) -> list[float]:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(warmup):
        step()
    sync()
    out = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def prepare(cfg, placement, mode, column, device, args) -> Callable[[], None]:
    """One (placement, mode, column) cell's training step, built (and compiled) from seed 0, run under
    the column's compile path."""
    torch.manual_seed(0)
    path = None
    if column.startswith("default") and "compile path" in column:
        path = column.split("compile path ")[-1].rstrip(")")
    if column == "nn.TransformerEncoder":
        model: nn.Module = TorchEncoderLM(cfg, placement, device)
    else:
        model = build_lm(cfg, placement, fused=False if column == "fused=False" else None, device=device)
    fwd = model
    if mode != "eager":
        fwd = torch.compile(model, mode="reduce-overhead" if mode == "reduce-overhead" else None)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=device)
    gpu = device == "cuda"
    step = make_step(fwd, tokens, cfg["vocab"], fused_adamw=gpu, autocast=gpu and not args.fp32)
    if path is None:
        return step

    def on_path() -> None:
        with policy.using_compile_path(path):
            step()

    return on_path


def cell(times: list[float], cfg: dict, peak: float | None) -> dict:
    med = statistics.median(times)
    return {"tokens_per_s": cfg["batch"] * cfg["seq"] / med, "median_s": med, "peak_mib": peak}


def run_cells(cfg, placement, mode, cols, device, args) -> dict:
    """tokens/s (and on a GPU peak memory) of every column of one row. On a GPU one column at a time
    (each model freed before the next, so peak memory is its own); on the CPU the columns' steps
    interleaved, so that load from other processes hits them alike."""
    if device == "cuda":
        out = {}
        for col in cols:
            torch._dynamo.reset()  # the previous column's graphs (and CUDA graph pools) go
            step = prepare(cfg, placement, mode, col, device, args)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            times = time_steps(step, device, args.warmup, args.steps)
            out[col] = cell(times, cfg, torch.cuda.max_memory_allocated() / 2**20)
            del step
            torch.cuda.empty_cache()
        return out
    torch._dynamo.reset()
    steps = {col: prepare(cfg, placement, mode, col, device, args) for col in cols}
    timers = {col: (lambda step=step: time_steps(step, device, 0, 1)[0]) for col, step in steps.items()}
    times, _ = interleaved(timers, args.steps, args.warmup)
    return {col: cell(times[col], cfg, None) for col in cols}


def columns(args) -> list[str]:
    cols = list(COLUMNS)
    if args.compile_paths == "both":
        other = "kernel" if policy.compile_path() == "composite" else "composite"
        cols.append(f"default (compile path {other})")
    return cols


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    cfg = TINY if args.tiny else SMALL if (args.small or device == "cpu") else GPU
    modes = args.modes or (
        ["eager", "compile", "reduce-overhead"] if device == "cuda" else ["eager", "compile"]
    )
    rows = []
    for placement in args.placements:
        for mode in modes:
            cols = [c for c in columns(args) if mode != "eager" or not c.startswith("default (compile path")]
            row = {
                "placement": placement,
                "mode": mode,
                "cells": run_cells(cfg, placement, mode, cols, device, args),
            }
            for col, c in row["cells"].items():
                mem = f"{c['peak_mib']:.0f} MiB" if c["peak_mib"] is not None else "-"
                print(
                    f"{placement:4s} {mode:15s} {col:36s} {c['tokens_per_s']:12,.0f} tok/s  {mem}", flush=True
                )
            rows.append(row)
    machine = machine_info(device)
    dtype = "fp32" if device == "cpu" or args.fp32 else "bf16 autocast"
    return {
        "machine": machine,
        "device": device,
        "config": cfg,
        "dtype": dtype,
        "compile_path_default": policy.compile_path(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rows": rows,
    }


def check_targets(report: dict) -> list[dict]:
    """Per row: default / fused=False (>= 1.05 in GPU eager, else >= 1.0), default / TransformerEncoder
    >= 1.0 (GPU), peak memory default <= fused=False (GPU)."""
    out = []
    gpu = report["device"] == "cuda"
    for r in report["rows"]:
        c = r["cells"]
        d = c["default"]["tokens_per_s"]
        need = 1.05 if gpu and r["mode"] == "eager" else 1.0
        checks = [(f"default / fused=False >= {need}", d / c["fused=False"]["tokens_per_s"], need)]
        if gpu:
            checks.append(
                (
                    "default / nn.TransformerEncoder >= 1.0",
                    d / c["nn.TransformerEncoder"]["tokens_per_s"],
                    1.0,
                )
            )
            mem = c["fused=False"]["peak_mib"] / c["default"]["peak_mib"]
            checks.append(("peak memory unfused / default >= 1.0", mem, 1.0))
        for name, value, bound in checks:
            out.append(
                {
                    "placement": r["placement"],
                    "mode": r["mode"],
                    "target": name,
                    "value": value,
                    "met": value >= bound,
                }
            )
    return out


def to_markdown(report: dict) -> str:
    m, cfg = report["machine"], report["config"]
    title = "GPU" if report["device"] == "cuda" else "CPU"
    cols = list(dict.fromkeys(k for r in report["rows"] for k in r["cells"]))
    lines = [
        f"# Training step: addnorm.LanguageModel default vs fused=False vs nn.TransformerEncoder ({title})",
        "",
        machine_line(m),
        "",
        f"LM: d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, "
        f"d_ff {cfg['d_ff']}, "
        f"GELU, vocab {cfg['vocab']}, batch {cfg['batch']} x seq {cfg['seq']}, dropout {cfg['dropout']}, "
        f"{report['dtype']}; AdamW{' (fused)' if report['device'] == 'cuda' else ''}. Step = forward + "
        f"cross-entropy + backward + optimizer; tokens/s of the median of {report['steps']} steps after "
        f"{report['warmup']} warmup steps. Default compile path of the op: {report['compile_path_default']}.",
        "",
    ]
    if report.get("note"):
        lines += [report["note"], ""]
    head = ["placement", "mode"] + [f"{c} tokens/s" for c in cols] + ["default / fused=False"]
    head += ["default / nn.TransformerEncoder"]
    if report["device"] == "cuda":
        head += [f"{c} peak MiB" for c in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["rows"]:
        c = r["cells"]
        cells = [r["placement"], r["mode"]]
        cells += [f"{c[k]['tokens_per_s']:,.0f}" if k in c else "-" for k in cols]
        d = c["default"]["tokens_per_s"]
        cells += [
            f"{d / c['fused=False']['tokens_per_s']:.3f}x",
            f"{d / c['nn.TransformerEncoder']['tokens_per_s']:.3f}x",
        ]
        if report["device"] == "cuda":
            cells += [f"{c[k]['peak_mib']:,.0f}" if k in c else "-" for k in cols]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Targets",
        "",
        "| placement | mode | target | value | met |",
        "| --- | --- | --- | --- | --- |",
    ]
    for t in check_targets(report):
        met = "yes" if t["met"] else "NO"
        lines.append(f"| {t['placement']} | {t['mode']} | {t['target']} | {t['value']:.3f} | {met} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CPU-sized model (the default on the CPU)")
    ap.add_argument("--tiny", action="store_true", help="smoke-test shapes")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is present")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on the GPU")
    ap.add_argument("--placements", nargs="+", default=["pre", "post"], choices=["pre", "post"])
    ap.add_argument("--modes", nargs="+", default=None, choices=["eager", "compile", "reduce-overhead"])
    ap.add_argument("--compile-paths", choices=["default", "both"], default="both")
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--note", default="", help="a line recorded with the results (e.g. machine load)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = run(args)
    report["note"] = args.note
    stem = "lm_step_cuda" if report["device"] == "cuda" else "lm_step_cpu"
    write_results(args.out, stem, to_markdown(report), report)


if __name__ == "__main__":
    main()
