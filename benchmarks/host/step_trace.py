"""Where a training step's wall time goes, plain against fused: a torch profiler trace (CPU and CUDA
activity, Python stacks) of a few steps of each run, and a table read from it
(:mod:`trace_analysis`): wall time, GPU busy time and share, the longest GPU idle gaps and what the host
was doing in them, kernel launches, host-device synchronisations, the host time in addnorm's own
Python, and the backward's host time by autograd node kind. Issue 38: on the H200 the fused HF Llama
step lost 17.8 ms to the plain one while its add & norm kernels saved GPU time; this is what lets a
machine without a GPU read where from the trace.

Runs (each variant built from one seed, both built side by side; two warmup steps of each, then
``--steps`` profiled steps of each in alternation in one profiler session, each step in a
``record_function("addnorm.step")`` scope; the H200's trace at 81f67f7, which traced the variants one
after the other, caught its host running the same aten ops 1.6x slower in one variant's minute than in
the other's):

- ``hf``: the Hugging Face Llama of ``benchmarks/step/hf_step.py`` (GPU: 134M, hidden 768 x 12 layers, batch 8
  x seq 1024), untouched (``plain``) and ``addnorm.hf.fuse`` (``fused``);
- ``lm``: addnorm's LM of ``benchmarks/step/lm_step.py`` (GPU: d_model 1024 x 12 layers, LayerNorm + GELU,
  dropout 0.1), ``fused=False`` and the op wherever it can fuse (``set_fusion("always")``: what the default
  does on a GPU where a step was measured faster fused);
- ``lm-llama``: the same LM with RMSNorm + SwiGLU, no biases, no dropout (``benchmarks/step/lm_step.py``'s
  ``llama``), the one that ran 0.926x fused on the H200 at 81f67f7;
- ``hf-gpu-bound``: the HF Llama at hidden 2048, 4 layers, batch 1 x seq 4096, a step the GPU bounds
  (its GPU-busy share says how far).

On a GPU: bf16 autocast, fused AdamW. On the CPU (no GPU: the runs at toy sizes, the fused ones on the
op's CUDA path with Triton's driver faked and no-op kernels, :mod:`fake_launch`), the same table
without its GPU columns: the end-to-end check that the trace and its reading work.

Writes ``step_trace_<device>.md`` / ``.json`` (the table and the records) and
``step_trace_<device>.json.gz``, one Chrome trace of every run side by side (open it in Perfetto or
chrome://tracing; Python frames kept for addnorm, the model and the benchmark), at most ``--max-mib``.

    python -m benchmarks.host.step_trace [--runs hf lm lm-llama hf-gpu-bound] [--steps 2]
        [--out DIR | --record]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import re
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace

from benchmarks.host.fake_launch import faked_launches, require_jit

require_jit()  # the real JIT kernels (on the CPU the fused runs launch them through a faked driver)

import torch  # noqa: E402

from addnorm.ops import policy  # noqa: E402
from benchmarks.common.machine import device_slug, machine_info, machine_line, write_results  # noqa: E402
from benchmarks.common.results_path import add_out_argument  # noqa: E402
from benchmarks.common.timing import round_order, within  # noqa: E402
from benchmarks.host.trace_analysis import STEP_SCOPE, analyze, trim  # noqa: E402

RUNS = ("hf", "lm", "lm-llama", "hf-gpu-bound")
VARIANTS = {run: ("plain", "fused") if run.startswith("hf") else ("fused=False", "fused") for run in RUNS}


def _hf_setup(run: str, gpu: bool):
    from benchmarks.step import hf_step as hf

    if not gpu:
        return replace(hf.CPU, layers=4, hidden=64, heads=4, kv_heads=4, intermediate=128, vocab=256, seq=32)
    if run == "hf-gpu-bound":
        return replace(
            hf.GPU, hidden=2048, layers=4, heads=16, kv_heads=16, intermediate=5632, batch=1, seq=4096
        )
    return hf.GPU


def build_step(run: str, variant: str, device: str) -> tuple[Callable[[], None], int]:
    """One training step of ``run``'s ``variant`` on ``device`` and its tokens per step."""
    gpu = device == "cuda"
    if run.startswith("hf"):
        from benchmarks.step import hf_step as hf

        setup = _hf_setup(run, gpu)
        model = hf.build(variant, setup, torch.device(device))
        tokens = hf.tokens_for(setup, torch.device(device))
        timed = hf.make_step(model, tokens, gpu=gpu, compiled=False, variant=variant)
        return (lambda: timed()), setup.batch * setup.seq
    from benchmarks.step import lm_step as lm

    cfg = lm.model_config(lm.GPU if gpu else lm.TINY, "llama" if run == "lm-llama" else "gelu")
    model = lm.build_lm(cfg, "pre", fused=variant == "fused", device=device)
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1), device=device)
    return lm.make_step(model, tokens, cfg["vocab"], fused_adamw=gpu, autocast=gpu), cfg["batch"] * cfg["seq"]


def trace_run(
    steps_of: dict[str, Callable[[], None]], device: str, steps: int, warmup: int
) -> tuple[dict, list]:
    """The Chrome trace (as loaded JSON) of ``steps`` profiled steps of each variant in ``steps_of``
    after ``warmup`` unprofiled ones, the variants in alternation (``timing.round_order``, as the timed
    step benchmarks step them: a host whose speed drifts, as the H200's did by 1.6x between runs a
    minute apart, slows them alike), one profiler session for all; and the variant of each
    profiled step, in time order. Each step runs in a ``STEP_SCOPE`` scope, the variant's name in a
    scope inside it (to find it in a viewer)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    names = list(steps_of)
    for _ in range(warmup):
        for name in names:
            steps_of[name]()
    sync()
    order = [name for i in range(steps) for name in round_order(names, i)]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities, with_stack=True) as prof:
        for name in order:
            with record_function(STEP_SCOPE), record_function(f"variant: {name}"):
                steps_of[name]()
                sync()  # the step's GPU work inside its scope
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            return json.load(f), order


def summarise(records: list[dict]) -> dict:
    """The mean over the profiled steps (the gaps: the longest of any step; the backward's nodes: the
    mean calls and ms per step of each kind)."""
    out = {}
    keys = ("wall_ms", "gpu_busy_ms", "gpu_busy_share", "launches", "syncs", "sync_ms", "copies", "copy_ms")
    for key in (*keys, "python_ms", "addnorm_ms"):
        values = [r[key] for r in records if r[key] is not None]
        out[key] = sum(values) / len(values) if values else None
    out["sync_names"] = sorted({n for r in records for n in r["sync_names"]})
    out["gaps"] = sorted((g for r in records for g in r["gaps"]), key=lambda g: -g["ms"])[:3]
    nodes: dict[str, list[float]] = {}
    for r in records:
        for kind, (calls, ms) in r["nodes"].items():
            acc = nodes.setdefault(kind, [0, 0.0])
            acc[0] += calls / len(records)
            acc[1] += ms / len(records)
    out["nodes"] = dict(sorted(nodes.items(), key=lambda kv: -kv[1][1]))
    return out


def run_all(runs: list[str], device: str, steps: int, warmup: int) -> tuple[list[dict], list[dict]]:
    """Each run's two variants built side by side and traced in alternation (:func:`trace_run`); (rows,
    the combined trace's events)."""
    rows, events = [], []
    for run in runs:
        t0 = time.monotonic()
        # on the CPU the fused variant takes the op's CUDA path through a faked driver, for the whole
        # run (the plain variant never calls the op)
        with faked_launches() if device == "cpu" else contextlib.nullcontext():
            steps_of, tokens = {}, {}
            for variant in VARIANTS[run]:
                fusion = "always" if variant == "fused" else "measured"
                with policy.fusion(fusion):
                    step, tokens[variant] = build_step(run, variant, device)
                steps_of[variant] = within(step, functools.partial(policy.fusion, fusion))
            trace, order = trace_run(steps_of, device, steps, warmup)
            del steps_of, step
        if device == "cuda":
            torch.cuda.empty_cache()
        records = analyze(trace)
        if len(records) != len(order):
            raise RuntimeError(f"{run}: {len(records)} step scopes in the trace for {len(order)} steps")
        seconds = time.monotonic() - t0
        for variant in VARIANTS[run]:
            mine = [r for r, v in zip(records, order, strict=True) if v == variant]
            row = {"run": run, "variant": variant, "tokens": tokens[variant], "steps": mine,
                   **summarise(mine), "seconds": seconds}  # fmt: skip
            row["tokens_per_s"] = tokens[variant] / row["wall_ms"] * 1e3 if row["wall_ms"] else None
            rows.append(row)
            print(f"[{run} {variant}] {row['wall_ms']:.1f} ms/step", flush=True)
        events += trim(trace, run)
    return rows, events


def _fmt(v, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def to_markdown(rows: list[dict], machine: dict, steps: int, trace_file: str, trace_note: str) -> str:
    gpu = rows[0]["gpu_busy_ms"] is not None
    lines = [
        "# Where a training step's time goes: plain vs fused (torch profiler trace)",
        "",
        machine_line(machine),
        "",
        f"Each run: its two variants built side by side, 2 warmup steps of each, then {steps} profiled "
        f"steps of each (CPU{' and CUDA' if gpu else ''} activity, Python stacks) in alternation "
        "(`timing.round_order`), in one profiler session (so that a drift in the host's speed slows "
        'both alike); each step in a `record_function("addnorm.step")` scope; means per step. GPU busy: the '
        "union of kernels, copies and memsets in the step; gaps: the longest stretches with nothing on the "
        "GPU, and the innermost frames open on each host thread at their middle; launches: "
        "`cudaLaunchKernel*` and `cuLaunchKernel*` calls; syncs: calls that make the host wait for the GPU "
        "(`*Synchronize`, blocking `cudaMemcpy`); addnorm ms: host time in addnorm's own Python frames "
        f"(self time). The trace: `{trace_file}`{trace_note}. Read with `benchmarks/host/trace_analysis.py`.",
        "",
        "| run | variant | wall ms/step | tokens/s | GPU busy ms | GPU busy | launches | syncs (ms) | "
        "cudaMemcpyAsync (ms) | Python ms | addnorm Python ms |",
        "| --- " * 11 + "|",
    ]
    for r in rows:
        cells = [r["run"], r["variant"], _fmt(r["wall_ms"], ".2f"), _fmt(r["tokens_per_s"], ",.0f")]
        cells += [_fmt(r["gpu_busy_ms"], ".2f"), _fmt(r["gpu_busy_share"], ".1%"), _fmt(r["launches"], ".0f")]
        cells += [f"{_fmt(r['syncs'], '.0f')} ({_fmt(r['sync_ms'], '.2f')})"]
        cells += [f"{_fmt(r['copies'], '.0f')} ({_fmt(r['copy_ms'], '.2f')})"]
        cells += [_fmt(r["python_ms"], ".2f"), _fmt(r["addnorm_ms"], ".2f")]
        lines.append("| " + " | ".join(cells) + " |")
    lines += _node_table(rows)
    if gpu:
        lines += ["", "## The longest GPU idle gaps, and what the host was doing", ""]
        for r in rows:
            lines.append(f"- **{r['run']} {r['variant']}** (syncs: {', '.join(r['sync_names']) or 'none'})")
            for g in r["gaps"]:
                lines.append(
                    f"  - {g['ms']:.2f} ms at {g['at_ms']:.1f} ms into the step; {g['launches']} launches, "
                    f"{g['syncs']} syncs inside; host: {'; '.join(g['host']) or 'nothing open'}"
                )
    return "\n".join(lines) + "\n"


def _node_table(rows: list[dict], top: int = 8) -> list[str]:
    """Per run: the backward's host time by autograd node kind, the variants side by side (the ``top``
    kinds by either variant's time, the rest summed)."""
    lines = [
        "",
        "## The backward's host time by autograd node",
        "",
        "Per step: the outermost `autograd::engine::evaluate_function` events of each kind (calls, and host "
        "ms on the thread that runs the backward): what a fused op's Python node costs against the C++ "
        "nodes it replaces, on the same host in the same minutes.",
    ]
    for run in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == run]
        kinds = sorted(
            {k for r in mine for k in list(r["nodes"])[:top]},
            key=lambda k: -max(r["nodes"].get(k, (0, 0.0))[1] for r in mine),
        )
        head = ["node"] + [f"{r['variant']} {x}" for r in mine for x in ("calls", "ms")]
        lines += ["", f"**{run}**", "", "| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
        for kind in [*kinds, "all other nodes", "all nodes"]:
            cells = [kind]
            for r in mine:
                nodes = r["nodes"]
                picked = (
                    [nodes.get(kind, (0, 0.0))]
                    if kind in kinds
                    else [v for k, v in nodes.items() if kind == "all nodes" or k not in kinds]
                )
                cells += [f"{sum(c for c, _ in picked):.0f}", f"{sum(m for _, m in picked):.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
    return lines


def write_trace(events: list[dict], path: str, max_mib: float) -> str:
    """Write the combined trace gzipped to ``path``; where it exceeds ``max_mib``, again with addnorm's
    Python frames only, then with no Python frames. Returns a note on what it holds."""
    keep_all = events
    only_ours = [
        e for e in events if e.get("cat") != "python_function" or re.search(r"addnorm[/\\]", e["name"])
    ]
    no_py = [e for e in events if e.get("cat") != "python_function"]
    for kept, note in ((keep_all, ""), (only_ours, " (Python frames: addnorm's only, to fit)"),
                       (no_py, " (no Python frames, to fit)")):  # fmt: skip
        data = gzip.compress(json.dumps({"traceEvents": kept}).encode(), compresslevel=6)
        if len(data) <= max_mib * 2**20 or kept is no_py:
            with open(path, "wb") as f:
                f.write(data)
            return note + f", {len(data) / 2**20:.1f} MiB"
    return ""


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=RUNS)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cpu", action="store_true", help="the CPU even where CUDA is present")
    ap.add_argument("--max-mib", type=float, default=15.0, help="the largest trace file written")
    add_out_argument(ap)
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cpu":
        torch.set_num_threads(1)
    rows, events = run_all(args.runs, device, args.steps, args.warmup)
    machine = machine_info(device)
    slug = device_slug(machine["device"])
    args.out.mkdir(parents=True, exist_ok=True)
    trace_file = f"step_trace_{slug}.json.gz"
    note = write_trace(events, str(args.out / trace_file), args.max_mib)
    text = to_markdown(rows, machine, args.steps, trace_file, note)
    print(text)
    write_results(args.out, f"step_trace_{slug}", text, {"machine": machine, "rows": rows})
    return rows


if __name__ == "__main__":
    main()
