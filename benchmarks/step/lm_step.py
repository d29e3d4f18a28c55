"""Training-step throughput of ``addnorm.LanguageModel``: the model's default (fused Add & Norm where
the policy picks it) against ``fused=False`` (and the same LM built on ``nn.TransformerEncoder``), and
how much of what fusion can remove the fused step removes.

Two models (``--models``), both with the issue-30 sizes on a GPU (d_model 1024, 12 layers, 16 heads,
vocab 32,000, batch 8 x seq 1024, bf16 autocast, fused AdamW):

- ``gelu``: addnorm's LayerNorm + GELU LM, d_ff 4096, biases, dropout 0.1 (issue 10's configuration);
- ``llama``: a Llama-style LM, RMSNorm + SwiGLU (d_ff 2816, 8/3 d rounded up to 256), no biases, no
  dropout.

Columns: ``fused=False`` (the unfused modules), ``default`` (the fusion policy's choice,
``addnorm.ops.fusion_decision``: on a GPU the op only where a recorded step on that GPU ran faster fused),
``fused`` (the op wherever the model can fuse, ``set_fusion("always")``: the measurement the policy's
rows come from) and ``nn.TransformerEncoder`` (the same LM on torch's layers).

Per (model, placement, mode) row: tokens/s of the median step (forward + cross-entropy + backward +
AdamW) and, on a GPU, peak memory, in ``eager`` or ``compile`` (``torch.compile``; ``reduce-overhead``:
CUDA graphs); the columns stepped in alternation and compared by their paired ratios (:func:`run_cells`).
Under ``torch.compile`` the op hands Inductor its traceable composite (the default) or the registered
Triton kernels: ``--compile-paths both`` adds a ``fused`` column for the non-default one.

``--profile``: the removable time (``benchmarks/step/removable_time.py``): the torch profiler over a few steps
of the ``fused=False`` model, the time of the dropout, add and norm ops that the fused op replaces; the fused
step's saving (fused=False step time - default step time) as a share of it ("realised"), and what the
fused step still spends in add & norm. Targets, per row: default no slower than fused=False beyond
the runs' 2% spread; fused >= 1.05x fused=False eager on a GPU and >= 1.0x compiled (issue 38), realised
>= 70%, peak memory <= fused=False's.

``--warm N``: before timing, the compiled cells are compiled in N processes at once (each builds its
model, compiles it and runs one step, filling Inductor's and Triton's on-disk caches); the timed
compile then loads them. A whole-model compile is 20-40 s on an H100 host, most of it in lowering and
kernel compiles that the caches keep (on the CPU a cached compile took 18 s against 190 s cold).

``--small`` is a CPU-sized model (fp32, no autocast); ``--tiny`` a smoke test. The table is written
after every row, so a run stopped early keeps the rows it finished.

    python -m benchmarks.step.lm_step [--models gelu llama] [--placements pre post]
        [--modes eager compile] [--columns default fused=False] [--profile] [--warm 4]
        [--steps 15] [--compile-paths both] [--out DIR | --record]
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

import addnorm as an
from addnorm.ops import policy
from benchmarks.common.machine import machine_info, record_rows
from benchmarks.common.results_path import ROOT, add_out_argument
from benchmarks.common.timing import ORDER, interleaved, paired_speedup, peak_apart, resident_bytes
from benchmarks.common.variant_plans import BackwardVariant, SublayerCast
from benchmarks.step.lm_step_tables import AUTOCAST_H, CANDIDATES, KERNEL_SUMS, RATIOS, to_markdown

GPU = {"d_model": 1024, "n_layers": 12, "n_heads": 16, "d_ff": 4096, "vocab": 32000, "batch": 8, "seq": 1024}
SMALL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "d_ff": 1024, "vocab": 4096, "batch": 8, "seq": 128}
TINY = {"d_model": 32, "n_layers": 2, "n_heads": 2, "d_ff": 64, "vocab": 64, "batch": 2, "seq": 8}
for _cfg in (GPU, SMALL, TINY):
    _cfg["dropout"] = 0.1
# the host-overhead benchmark's tiny Pre-LN step: d_model 64, 4 layers, dropout 0.1
SMALL_HOST = {"d_model": 64, "n_layers": 4, "n_heads": 4, "d_ff": 256, "vocab": 256, "batch": 8, "seq": 16}
SMALL_HOST["dropout"] = 0.1
MODELS = {
    "gelu": {"norm": "layernorm", "activation": "gelu", "bias": True, "dropout": 0.1},
    "llama": {"norm": "rmsnorm", "activation": "swiglu", "bias": False, "dropout": 0.0},
}
# "default": the policy's choice (addnorm.ops.fusion_decision: on a GPU the op only where a recorded step
# on that GPU ran faster fused); "fused": the op wherever the model can fuse (set_fusion("always")),
# the measurement the policy's rows are made from
# "fused (kernel_sums)": "fused" with the backward variant "kernel_sums" (its partial parameter gradients
# added up in the kernel; level with the default at 81f67f7, no longer in the GPU suite), eager only (a
# traced backward sums with torch), its call plans apart from the others' (variant_plans.BackwardVariant)
# "fused (autocast h)": "fused" with each sublayer's normed input written by the op in autocast's dtype
# (addnorm.model.stream.AUTOCAST_SUBLAYER_INPUT: the candidate), eager only
COLUMNS = ("nn.TransformerEncoder", "fused=False", "default", "fused", KERNEL_SUMS, AUTOCAST_H)
# each candidate column's switch, entered around each of its steps
CANDIDATE_SWITCHES = {
    KERNEL_SUMS: lambda: BackwardVariant("kernel_sums"),
    AUTOCAST_H: lambda: SublayerCast(True),
}
PROFILED = ("fused=False", "fused")  # the columns --profile profiles: what realised() compares


def llama_ff(d_model: int) -> int:
    """Llama's FFN width: 8/3 d rounded up to a multiple of 256 (of d below 256): 2816 for 1024."""
    multiple = min(256, d_model)
    return multiple * math.ceil(8 * d_model / 3 / multiple)


def model_config(cfg: dict, model: str) -> dict:
    """``cfg``'s sizes with ``model``'s choices (norm, activation, bias, dropout, d_ff)."""
    if model not in MODELS:
        raise ValueError(f"model: expected one of {', '.join(MODELS)}, got {model!r}")
    out = {**cfg, **MODELS[model]}
    out["d_ff"] = cfg["d_ff"] if model == "gelu" else llama_ff(cfg["d_model"])
    return out


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
    """An ``addnorm.LanguageModel`` of ``cfg`` (GELU, LayerNorm, biases unless ``cfg`` says otherwise:
    see ``model_config``); ``fused`` None keeps the model's default."""
    tc = an.TransformerConfig(
        d_model=cfg["d_model"],
        n_heads=cfg["n_heads"],
        d_ff=cfg["d_ff"],
        n_layers=cfg["n_layers"],
        dropout=cfg["dropout"],
        activation=cfg.get("activation", "gelu"),
        norm=cfg.get("norm", "layernorm"),
        bias=cfg.get("bias", True),
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

    step.optimizer = opt  # what the step holds besides its model (timing.resident_bytes)
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


def _compile_path(column: str) -> str | None:
    return column.split("compile path ")[-1].rstrip(")") if "compile path" in column else None


def prepare(cfg, placement, mode, column, device, args) -> tuple[Callable[[], None], nn.Module]:
    """One (placement, mode, column) cell's training step, built (and compiled) from seed 0, run under
    the column's fusion (``fused``: everywhere the model can) and compile path; and the (uncompiled)
    model it trains."""
    torch.manual_seed(0)
    path = _compile_path(column)
    if column == "nn.TransformerEncoder":
        model: nn.Module = TorchEncoderLM(cfg, placement, device)
    else:
        model = build_lm(cfg, placement, fused=False if column == "fused=False" else None, device=device)
    fwd = model
    if mode != "eager":
        backend = args.compile_backend  # "aot_eager": Dynamo and AOTAutograd, no Inductor codegen
        fwd = torch.compile(
            model, backend=backend, mode="reduce-overhead" if mode == "reduce-overhead" else None
        )
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=device)
    gpu = device == "cuda"
    step = make_step(fwd, tokens, cfg["vocab"], fused_adamw=gpu, autocast=gpu and not args.fp32)
    fusion = "always" if column.startswith("fused") and column != "fused=False" else "measured"
    if path is None and fusion == "measured":
        return step, model
    variant = CANDIDATE_SWITCHES.get(column, nullcontext)()

    def on_path() -> None:
        with policy.using_compile_path(path or policy.compile_path()), policy.fusion(fusion), variant:
            step()

    on_path.optimizer = step.optimizer
    return on_path, model


def cell(times: list[float], cfg: dict, peak: float | None) -> dict:
    """A column's record: tokens/s of its median step, and every timed step in round order (ms)."""
    med = statistics.median(times)
    return {
        "tokens_per_s": cfg["batch"] * cfg["seq"] / med, "median_s": med, "peak_mib": peak,
        "steps_ms": [round(t * 1e3, 4) for t in times],
    }  # fmt: skip


def _profile(step, model, cfg, mode, device, args) -> dict:
    from benchmarks.step import removable_time

    eager = mode == "eager"
    return removable_time.profile_steps(
        step,
        device=device,
        steps=args.profile_steps,
        model=model if eager else None,
        d_model=cfg["d_model"],
        stream_shape=(cfg["batch"], cfg["seq"], cfg["d_model"]),
    )


def run_cells(cfg, placement, mode, cols, device, args) -> tuple[dict, dict]:
    """tokens/s (and on a GPU peak memory) of every column of one row, the columns' speed ratios
    (``paired``), and with ``--profile`` the profile of the fused=False and fused columns.

    Every column's step is built side by side and timed step by step in alternation
    (``timing.interleaved``: no step right after itself), so that drift in the host's speed
    (other processes on the CPU; a GPU's host, whose step times moved by 25% between runs minutes apart
    on an H200 at 7722722) hits them alike; a ratio is the median over rounds of the two steps' times in
    the same round (``timing.paired_speedup``). On a GPU each column's peak memory comes from one more
    step, less what the other columns hold (``timing.peak_apart``). With CUDA graphs
    (``reduce-overhead``) one column at a time, each freed before the next: their graph pools stay
    allocated between steps, which that subtraction cannot tell apart."""
    if mode == "reduce-overhead" and device == "cuda":
        return _one_at_a_time(cfg, placement, mode, cols, device, args), {}
    profiled = PROFILED if args.profile else ()
    torch._dynamo.reset()  # the previous row's graphs go
    prepared = {col: prepare(cfg, placement, mode, col, device, args) for col in cols}
    timers = {col: (lambda step=s: time_steps(step, device, 0, 1)[0]) for col, (s, _) in prepared.items()}
    times, _ = interleaved(timers, args.steps, args.warmup)
    out: dict = {}
    for col, (step, model) in prepared.items():
        peak = None
        if device == "cuda":
            peak = peak_apart(step, resident_bytes(model, step.optimizer)) / 2**20
        out[col] = cell(times[col], cfg, peak)
        if col in profiled:
            out[col]["profile"] = _profile(step, model, cfg, mode, device, args)
    del prepared, timers
    if device == "cuda":
        torch.cuda.empty_cache()
    pairs = [p for p in RATIOS if p[0] in times and p[1] in times]
    return out, {f"{a}/{b}": paired_speedup(times, b, a) for a, b in pairs}


def _one_at_a_time(cfg, placement, mode, cols, device, args) -> dict:
    """:func:`run_cells` with each column built, timed and freed before the next (CUDA graphs)."""
    out: dict = {}
    for col in cols:
        torch._dynamo.reset()  # the previous column's graphs (and CUDA graph pools) go
        step, model = prepare(cfg, placement, mode, col, device, args)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        times = time_steps(step, device, args.warmup, args.steps)
        out[col] = cell(times, cfg, torch.cuda.max_memory_allocated() / 2**20)
        if col in PROFILED and args.profile:
            out[col]["profile"] = _profile(step, model, cfg, mode, device, args)
        del step, model
        torch.cuda.empty_cache()
    return out


def realised(cells: dict) -> dict | None:
    """The fused step's saving (the ``fused`` column: the op wherever the model can fuse) as a share of
    the unfused step's removable time (None unprofiled)."""
    prof = cells.get("fused=False", {}).get("profile")
    if prof is None or "fused" not in cells:
        return None
    saving_ms = (cells["fused=False"]["median_s"] - cells["fused"]["median_s"]) * 1e3
    removable = prof["removable_ms"]
    fused_prof = cells["fused"].get("profile") or {}
    remaining = sum(fused_prof.get("ms", {}).get(k, 0.0) for k in ("norm", "dropout", "add", "fused"))
    return {
        "removable_ms": removable,
        "by_class_ms": {k: prof["ms"][k] for k in ("norm", "dropout", "add")},
        "saving_ms": saving_ms,
        "share": saving_ms / removable if removable > 0 else None,
        "fused_remaining_ms": remaining if fused_prof else None,
    }


def columns(args, model: str) -> list[str]:
    cols = [c for c in COLUMNS if c in args.columns]
    if model != "gelu":  # nn.TransformerEncoderLayer has LayerNorm and GELU/ReLU only
        cols = [c for c in cols if c != "nn.TransformerEncoder"]
    if args.compile_paths == "both" and "fused" in cols:
        other = "kernel" if policy.compile_path() == "composite" else "composite"
        cols.append(f"fused (compile path {other})")
    return cols


def base_config(args, device: str) -> dict:
    return TINY if args.tiny else SMALL if (args.small or device == "cpu") else GPU


def cells_of(args, device: str) -> list[tuple[str, str, str, list[str]]]:
    """The (model, placement, mode, columns) rows of this run, in order: every eager row first, so a
    step cut off by its budget while compiling still has each model's eager row."""
    modes = args.modes or (
        ["eager", "compile", "reduce-overhead"] if device == "cuda" else ["eager", "compile"]
    )
    rows = []
    for mode in modes:
        for model in args.models:
            for placement in args.placements:
                cols = [c for c in columns(args, model) if mode != "eager" or not _compile_path(c)]
                cols = [c for c in cols if c not in CANDIDATES or mode == "eager"]
                compiled_only = getattr(args, "compiled_columns", None)
                if mode != "eager" and compiled_only is not None:  # a compiled column's cost: a compile
                    cols = [
                        c
                        for c in cols
                        if c in compiled_only or (_compile_path(c) and "fused" in compiled_only)
                    ]
                rows.append((model, placement, mode, cols))
    return rows


def warm_compiles(args, device: str) -> dict:
    """Compile every compiled cell of the run in ``args.warm`` processes at once (``--warm-column``), so
    that the timed compiles load Inductor's and Triton's on-disk caches; the seconds it took and each
    cell's exit status (a cell that fails or runs past ``--warm-timeout`` only costs its cache)."""
    jobs = []
    for model, placement, mode, cols in cells_of(args, device):
        if mode != "eager":
            jobs += [(model, placement, mode, col) for col in cols]
    if not jobs:
        return {"seconds": 0.0, "cells": {}}
    workers = max(1, min(args.warm, len(jobs)))
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))
    base = [sys.executable, "-m", __spec__.name, "--steps", "1", "--warmup", "1"]
    base += ["--tiny"] if args.tiny else ["--small"] if args.small else []
    base += ["--cpu"] if args.cpu else []
    base += ["--fp32"] if args.fp32 else []
    base += ["--compile-backend", args.compile_backend]
    t0 = time.monotonic()
    status: dict = {}
    pending = list(jobs)
    running: list = []
    while pending or running:
        while pending and len(running) < workers:
            model, placement, mode, col = job = pending.pop(0)
            argv = [
                *base,
                "--models",
                model,
                "--placements",
                placement,
                "--modes",
                mode,
                "--warm-column",
                col,
            ]
            log = tempfile.TemporaryFile("w+")
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
            running.append((job, proc, log))
        time.sleep(0.2)
        for entry in list(running):
            job, proc, log = entry
            over = time.monotonic() - t0 > args.warm_timeout
            if proc.poll() is None and not over:
                continue
            if proc.poll() is None:
                proc.kill()
            rc = proc.wait()
            log.seek(0)
            err = log.read().strip()[-300:]
            log.close()
            status["/".join(job)] = "ok" if rc == 0 else f"exit {rc}: {err}"
            running.remove(entry)
        if time.monotonic() - t0 > args.warm_timeout:
            for job in pending:
                status["/".join(job)] = "not started (warm timeout)"
            pending = []
    seconds = time.monotonic() - t0
    print(f"warm compiles: {len(jobs)} cells in {workers} processes, {seconds:.0f} s", flush=True)
    return {"seconds": seconds, "cells": status}


def warm_only(args, device: str) -> None:
    """``--warm-column COL``: build and compile that column of the one requested (model, placement,
    mode) cell and run a step (fills the caches)."""
    (model,), (placement,), (mode,) = args.models, args.placements, args.modes
    cfg = model_config(base_config(args, device), model)
    step, _ = prepare(cfg, placement, mode, args.warm_column, device, args)
    step()


def run(args, on_row: Callable[[dict], None] | None = None) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    report = {
        "machine": machine_info(device),
        "device": device,
        "configs": {m: model_config(base_config(args, device), m) for m in args.models},
        "dtype": "fp32" if device == "cpu" or args.fp32 else "bf16 autocast",
        "compile_path_default": policy.compile_path(),
        "compile_backend": args.compile_backend,
        "steps": args.steps,
        "warmup": args.warmup,
        "profile_steps": args.profile_steps if args.profile else None,
        "order": ORDER,
        "rows": [],
    }
    if args.warm:
        report["warm"] = warm_compiles(args, device)
    for model, placement, mode, cols in cells_of(args, device):
        cfg = report["configs"][model]
        row = {"model": model, "placement": placement, "mode": mode}
        row["cells"], row["paired"] = run_cells(cfg, placement, mode, cols, device, args)
        row["realised"] = realised(row["cells"])
        for col, c in row["cells"].items():
            mem = f"{c['peak_mib']:.0f} MiB" if c["peak_mib"] is not None else "-"
            print(
                f"{model:5s} {placement:4s} {mode:15s} {col:36s} {c['tokens_per_s']:12,.0f} tok/s  {mem}",
                flush=True,
            )
        if row["realised"]:
            r = row["realised"]
            share = f"{r['share']:.0%}" if r["share"] is not None else "n/a"
            print(f"      removable {r['removable_ms']:.2f} ms/step, saving {r['saving_ms']:.2f} ms: {share}")
        report["rows"].append(row)
        if on_row is not None:
            on_row(report)
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--small", action="store_true", help="a CPU-sized model (the default on the CPU)")
    ap.add_argument("--tiny", action="store_true", help="smoke-test shapes")
    ap.add_argument("--cpu", action="store_true", help="run on the CPU even when CUDA is present")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast on the GPU")
    ap.add_argument("--models", nargs="+", default=["gelu"], choices=list(MODELS))
    ap.add_argument("--placements", nargs="+", default=["pre", "post"], choices=["pre", "post"])
    ap.add_argument("--modes", nargs="+", default=None, choices=["eager", "compile", "reduce-overhead"])
    ap.add_argument("--columns", nargs="+", default=list(COLUMNS), choices=list(COLUMNS))
    ap.add_argument(
        "--compiled-columns",
        nargs="+",
        default=None,
        choices=list(COLUMNS),
        help="the columns of the compiled rows (default: --columns); each costs a whole-model compile",
    )
    ap.add_argument("--compile-paths", choices=["default", "both"], default="both")
    ap.add_argument(
        "--compile-backend",
        choices=["inductor", "aot_eager"],
        default="inductor",
        help="torch.compile's backend for the compiled rows; aot_eager (Dynamo and AOTAutograd without "
        "Inductor's code generation) checks a compiled row's graphs, its times are not Inductor's",
    )
    ap.add_argument(
        "--profile", action="store_true", help="removable time and the share the fused step gains"
    )
    ap.add_argument("--profile-steps", type=int, default=2)
    ap.add_argument("--warm", type=int, default=0, help="precompile the compiled cells in N processes")
    ap.add_argument("--warm-timeout", type=float, default=150.0, help="seconds for the precompile")
    ap.add_argument("--warm-column", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--steps", type=int, default=15)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    add_out_argument(ap)
    ap.add_argument("--note", default="", help="a line recorded with the results (e.g. machine load)")
    args = ap.parse_args(argv)
    if args.compile_backend != "inductor" and "reduce-overhead" in (args.modes or ()):
        ap.error("--compile-backend: reduce-overhead (CUDA graphs) is Inductor's mode; expected inductor")
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if args.warm_column is not None:
        warm_only(args, device)
        return
    record_rows(args, "lm_step", device, run, to_markdown)


if __name__ == "__main__":
    main()
