"""Fused Add & Norm (``addnorm.ops.add_norm``) against eager PyTorch, torch.compile, Liger-Kernel and a
copy: the op table.

Memory-bound, so judged in bytes moved per second, counting the minimum bytes:

    forward  prenorm: read x, residual; write y, s        post: read x, residual; write y
    backward prenorm: read dy, ds, s; write dx             post: read dy, y (saved); write dx

(dx = dresidual when alpha = 1 without dropout or gate; weight-sized vectors are negligible); fwd+bwd
counts both phases' bytes, and each is shown as a share of a device-to-device copy of x timed in the
same run (the bandwidth ceiling).

On CUDA, the grid of issue 30 (``--hidden`` 256 ... 16384, rows = 2**27 / hidden; LayerNorm and RMSNorm,
Pre-LN (y, s) and Post-LN (y), dropout 0 and 0.1; bf16 by default, ``--dtypes`` for the autocast mix,
fp16, fp32): the training forward (inputs that require grad, as in a training step) and forward +
backward, median time per call (CUDA events) of

- ``eager``: s = dropout(x) + r, then F.layer_norm / F.rms_norm;
- ``compiled``: ``torch.compile(eager, dynamic=False)``, one compiled function per dropout rate
  (recompiled per shape, which static shapes need anyway);
- ``liger``: Liger-Kernel's LayerNorm after the add, its fused add + RMSNorm (dropout before, eager),
  where ``liger_kernel`` imports; ``flash_attn``: flash-attn's Triton ``layer_norm_fn`` (add, dropout,
  norm in one kernel) where it imports;
- ``addnorm``: the fused op's Triton kernels (``backend="triton"``: the table times the kernels, not the
  policy's choice, which for some shapes is the torch path), its default backward variant
  (``launch_config.BWD_VARIANT``); ``addnorm_<variant>``: the same with another backward variant (a GPU run
  times each candidate, ``launch_config.BWD_CANDIDATES``, by default: none pending since the H200 at 81f67f7
  kept "row_sums"; ``--impls`` names any; recorded tables also hold "slices", "row_sums" and "kernel_sums"),
  selected around its calls only (the plans made again outside the timed call), so the default and the variant
  it replaced are timed in one run and the targets judged for each, and a later change of default needs no
  edit here; ``--impls ... addnorm_compiled``: the op under torch.compile with its Triton kernels (compile
  path "kernel"). On the CPU ``addnorm`` is the torch path, or with ``TRITON_INTERPRET=1`` the interpreted
  kernels, as ``addnorm_<variant>`` (which needs them) is.

A missing extra is one line under the table ("liger: not installed"), never a lost table.

**Fitting a device window** (``--budget S``, ``--warm N``). Compiling dominates: on the CPU (2 cores)
a cold ``torch.compile`` of this function took 33 s for the first shape (one-time start-up) and 4-6 s
per further shape, forward and backward graphs (a recompile per hidden size: dynamic=False specialises
on the shape, so one compiled function per dropout rate saves nothing but the function objects); a
fresh process with Inductor's on-disk cache filled took 6 s to start and 0.4-0.5 s per shape
(AOTAutograd and FX-graph cache hits). Triton's JIT of addnorm's and Liger's kernels (one variant per
hidden size, norm and options) is cached on disk the same way. So ``--warm N`` first runs every shape's
calls once in N processes at once (``--warm-only``; each compiles with ``cpu_count / N`` Inductor
threads), filling both caches, and the timed process then loads them. ``--budget`` then sizes the
repetitions: each shape gets an equal share of the time left, its reps are what fit after its set-up
(between ``--min-reps`` and ``--reps``), and shapes that no longer fit are listed as not reached. The
table is rewritten after every shape, so a run stopped from outside keeps the rows it finished.

On the CPU: our torch path against eager PyTorch (fp32, smaller sizes; ``--quick`` smaller still);
``--compile`` adds torch.compile on the CPU too.

The report ends with the targets, each checked against the rows it covers: on CUDA in bf16
fwd+bwd >= torch.compile on every shape (issue 30), >= Liger where it ran, forward >= 95% of the copy
bandwidth (issue 10); on the CPU, add + RMSNorm fwd+bwd no slower than eager. The columns and their rendering:
``benchmarks/op/add_norm_tables.py``.

    python -m benchmarks.op.add_norm [--hidden ...] [--dropout 0 0.1] [--budget 150 --warm 8]
        [--reps 30] [--out DIR | --record]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from itertools import product

import torch
import torch.nn.functional as F

from addnorm.ops import add_norm
from addnorm.ops import launch_config as lc
from addnorm.ops.args import interpreting
from addnorm.ops.policy import using_compile_path
from benchmarks.common.machine import machine_info, record_rows
from benchmarks.common.results_path import ROOT, add_out_argument
from benchmarks.common.timing import interleaved
from benchmarks.op.add_norm_tables import GPU_IMPLS, IMPLS, OPS, _line, speed_key, to_markdown
from benchmarks.op.add_norm_tables import (
    check_targets as check_targets,  # re-exported: bench_add_norm.check_targets
)
from benchmarks.op.other_add_norms import flash_attn_add_norm, liger_add_norm

GPU_HIDDEN = (256, 512, 1024, 2048, 4096, 8192, 16384)
GPU_ELEMENTS = 2**27
DROPOUT = 0.1
# name -> (x's dtype, the stream's: residual, s, y, weight); "mixed" is what autocast gives a model:
# a bf16 branch added into an fp32 stream
DTYPES = {
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "mixed": (torch.bfloat16, torch.float32),
    "float16": (torch.float16, torch.float16),
    "float32": (torch.float32, torch.float32),
}


def eager_add_norm(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0, eps: float = 1e-5):
    """The unfused composite: s = dropout(x) + r, then the norm."""
    s = (F.dropout(x, p, True) if p else x) + r
    if norm == "layernorm":
        y = F.layer_norm(s, (s.shape[-1],), w, b, eps)
    else:
        y = F.rms_norm(s, (s.shape[-1],), w, eps)
    return (y, s) if prenorm else y


def fused_add_norm(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0, eps=1e-5, backend="auto"):
    bias = b if norm == "layernorm" else None
    out = torch.promote_types(x.dtype, r.dtype)  # y in the stream's dtype, as the unfused add gives it
    return add_norm(
        x, r, w, bias, norm=norm, eps=eps, prenorm=prenorm, dropout_p=p, training=True, out_dtype=out,
        backend=backend,
    )  # fmt: skip


def op_column(variant: str, backend: str) -> Callable:
    """The fused op on ``backend`` with the backward variant ``variant``. Another variant than the
    default gets ``select(inputs, norm, prenorm, p, on)``: the variant selected (``on``) or the default
    again, each followed by a one-row call that makes the call's plan (selecting one makes every plan
    anew), so that a timed call only runs the plan made for its variant."""

    def fn(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0):
        return fused_add_norm(x, r, w, b, norm, prenorm, p, backend=backend)

    def select(inputs: dict, norm: str, prenorm: bool, p: float, on: bool) -> None:
        lc.use_bwd_variant(variant if on else OPS["addnorm"])
        x, r, w, b = inputs["args"]
        with torch.no_grad():
            fn(x[:1], r[:1], w, b, norm, prenorm, p)

    if variant != OPS["addnorm"]:
        fn.select = select
    return fn


def compiled(impl: Callable, path: str | None = None) -> Callable:
    """torch.compile of ``impl`` (static shapes), one compiled function per dropout rate (a constant in
    its graph), run under compile path ``path`` when given ("kernel": our op's registered Triton op)."""
    by_rate: dict[float, Callable] = {}

    def fn(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0):
        if p not in by_rate:

            def at_rate(x, r, w, b, norm, prenorm, _p=p):
                return impl(x, r, w, b, norm, prenorm, _p)

            by_rate[p] = torch.compile(at_rate, dynamic=False)
        with using_compile_path(path) if path else contextlib.nullcontext():
            return by_rate[p](x, r, w, b, norm, prenorm)

    return fn


def implementations(names, device: str) -> tuple[dict[str, Callable], dict[str, str]]:
    """The implementations to time, and one line for each asked for that cannot run here."""
    import importlib.util

    impls: dict[str, Callable] = {}
    missing: dict[str, str] = {}
    has_triton = importlib.util.find_spec("triton") is not None
    kernels = has_triton and (device == "cuda" or interpreting())  # where the Triton kernels run
    for name in names:
        if name in OPS and (name == "addnorm" or kernels):
            impls[name] = op_column(OPS[name], "triton" if kernels else "auto")
            if device == "cuda" and not has_triton:
                missing["addnorm (Triton)"] = "not installed: triton; the addnorm column is the torch path"
        elif name in OPS:
            missing[name] = "the Triton kernels need CUDA or TRITON_INTERPRET=1" + (
                "" if has_triton else " (not installed: triton)"
            )
        elif name == "eager":
            impls[name] = eager_add_norm
        elif name in ("compiled", "addnorm_compiled"):
            if device == "cuda" and not has_triton:
                missing[name] = "not installed: torch.compile on CUDA needs triton"
                continue
            impls[name] = (
                compiled(eager_add_norm) if name == "compiled" else compiled(fused_add_norm, "kernel")
            )
        elif device != "cuda":
            continue  # Liger and flash-attn are GPU kernels: no CPU column, and nothing to report
        else:
            fn = liger_add_norm() if name == "liger" else flash_attn_add_norm()
            if fn is None:
                missing[name] = f"not installed ({'liger-kernel' if name == 'liger' else 'flash-attn'})"
            else:
                impls[name] = fn
    return impls, missing


def time_once(fn: Callable[[], object], device: str) -> float:
    """Seconds for one call of fn (CUDA events on the GPU)."""
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def min_bytes(rows: int, hidden: int, x_elem: int, s_elem: int, prenorm: bool) -> int:
    """Per phase: fwd x, r, y (+ s); bwd dy, (ds,) s or y, dx (x's size; r, s, y in the stream's)."""
    return rows * hidden * (x_elem + (3 if prenorm else 2) * s_elem)


def make_inputs(rows: int, hidden: int, dtype: str, norm: str, prenorm: bool, device: str) -> dict:
    """x, residual, weight, bias (leaves that require grad) and the output gradients, drawn on the
    device (drawing 2**27 values on the host costs seconds a shape), shared by every implementation."""
    x_dtype, s_dtype = DTYPES[dtype]
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(rows, hidden, generator=g, device=device, dtype=x_dtype).requires_grad_(True)
    r = torch.randn(rows, hidden, generator=g, device=device, dtype=s_dtype).requires_grad_(True)
    # trained-looking affine parameters (|b| < |w| everywhere: x_hat is recomputed from y on the GPU)
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device=device)).to(s_dtype).requires_grad_(True)
    b = (0.02 * torch.randn(hidden, generator=g, device=device)).to(s_dtype).requires_grad_(True)
    out = torch.promote_types(x_dtype, s_dtype)
    grads = [
        torch.randn(rows, hidden, generator=g, device=device, dtype=out) for _ in range(2 if prenorm else 1)
    ]
    params = (x, r, w, b) if norm == "layernorm" else (x, r, w)
    return {"args": (x, r, w, b), "params": params, "grads": grads}


def make_calls(fn, inputs: dict, norm: str, prenorm: bool, p: float) -> dict:
    """Closures for the training forward (its graph dropped) and forward + backward."""
    args, params, grads = inputs["args"], inputs["params"], inputs["grads"]

    def fwd():
        return fn(*args, norm, prenorm, p)

    def fwd_bwd():
        o = fn(*args, norm, prenorm, p)
        return torch.autograd.grad(list(o) if prenorm else [o], params, grads)

    return {"fwd": fwd, "fwd_bwd": fwd_bwd}


def selected(fn, inputs: dict, norm: str, prenorm: bool, p: float, call: Callable) -> Callable:
    """``call`` as it is, or for an op column of another backward variant (``op_column``) that variant
    selected before the call and the default after it, outside ``call`` (and so outside its timing)."""
    select = getattr(fn, "select", None)
    if select is None:
        return call

    def run():
        select(inputs, norm, prenorm, p, True)
        try:
            return call()
        finally:
            select(inputs, norm, prenorm, p, False)

    return run


def shapes(args, device: str) -> list[dict]:
    """The grid, in order: norm, placement, dropout, dtype, hidden."""
    prenorms = {"both": (True, False), "on": (True,), "off": (False,)}[args.prenorm]
    return [
        {"norm": n, "prenorm": pre, "dropout": p, "dtype": dt, "hidden": h, "rows": args.elements // h}
        for n, pre, p, dt, h in product(args.norms, prenorms, args.dropout, args.dtypes, args.hidden)
    ]


def measure_shape(shape: dict, impls: dict, device: str, args, allowance: float | None) -> dict:
    """One row: every implementation's fwd and fwd+bwd, with the copy, timed in alternation; the
    reps fill what is left of ``allowance`` seconds after the set-up and warm-up (>= ``--min-reps``)."""
    t0 = time.monotonic()
    norm, prenorm, p, hidden, rows = (shape[k] for k in ("norm", "prenorm", "dropout", "hidden", "rows"))
    x_dtype, s_dtype = DTYPES[shape["dtype"]]
    inputs = make_inputs(rows, hidden, shape["dtype"], norm, prenorm, device)
    src = inputs["args"][0].detach()
    dst = torch.empty_like(src)
    # Liger's fused add + RMSNorm and flash-attn's s take one dtype: no cell for the autocast mix
    mixed = x_dtype != s_dtype
    used = {k: f for k, f in impls.items() if not (k in ("liger", "flash_attn") and mixed)}
    timers = {"copy": lambda: time_once(lambda: dst.copy_(src), device)}
    for name, fn in used.items():
        for ph, c in make_calls(fn, inputs, norm, prenorm, p).items():
            timers[f"{name}_{ph}"] = selected(fn, inputs, norm, prenorm, p, lambda c=c: time_once(c, device))
    interleaved(timers, 0, args.warmup)  # compiles (or loads) and JITs here
    t_round = time.monotonic()
    interleaved(timers, 1)
    round_s = time.monotonic() - t_round
    reps = args.reps
    if allowance is not None:
        fit = int((allowance - (time.monotonic() - t0)) / max(round_s, 1e-6))
        reps = max(args.min_reps, min(args.reps, fit))
    times, _ = interleaved(timers, reps)
    med = {k: statistics.median(v) for k, v in times.items()}
    row = {**shape, "reps": reps, "ms": {k: v * 1e3 for k, v in med.items()}, "GBps": {}}
    row["GBps"]["copy"] = 2 * src.numel() * src.element_size() / med["copy"] / 1e9
    size = torch.empty((), dtype=s_dtype).element_size()
    nbytes = min_bytes(rows, hidden, src.element_size(), size, prenorm)
    for name in used:
        for ph, n in (("fwd", nbytes), ("fwd_bwd", 2 * nbytes)):
            row["GBps"][f"{name}_{ph}"] = n / med[f"{name}_{ph}"] / 1e9
    for ours in (k for k in OPS if k in used):
        for other in (k for k in used if k != ours and (ours == "addnorm" or k not in OPS)):
            row[speed_key(ours, other)] = row["ms"][f"{other}_fwd_bwd"] / row["ms"][f"{ours}_fwd_bwd"]
    row["seconds"] = time.monotonic() - t0
    return row


def warm(args, grid: list[dict], device: str) -> dict:
    """Run every shape's calls once in ``args.warm`` processes at once (``--warm-only``), filling
    Inductor's and Triton's on-disk caches for the timed run; seconds and each process's status."""
    n = max(1, min(args.warm, len(grid)))
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    t0 = time.monotonic()
    procs = []
    for i in range(n):
        argv = [sys.executable, "-m", __spec__.name, "--warm-only", f"{i}/{n}", *args.argv_shapes]
        log = tempfile.TemporaryFile("w+")
        child = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=log, text=True)
        procs.append((child, log))
    status = {}
    for i, (proc, log) in enumerate(procs):
        left = max(1.0, args.warm_timeout - (time.monotonic() - t0))
        try:
            proc.wait(timeout=left)
            log.seek(0)
            err = log.read().strip()[-300:]
            status[i] = "ok" if proc.returncode == 0 else f"exit {proc.returncode}: {err}"
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            status[i] = f"stopped after {args.warm_timeout:.0f} s"
        log.close()
    seconds = time.monotonic() - t0
    print(f"warm: {len(grid)} shapes in {n} processes, {seconds:.0f} s", flush=True)
    return {"processes": n, "seconds": seconds, "status": status}


def warm_only(args, grid: list[dict], impls: dict, device: str, part: str) -> None:
    """``--warm-only i/n``: run the i-th of n slices of the grid's calls once each."""
    i, n = (int(v) for v in part.split("/"))
    for shape in grid[i::n]:
        inputs = make_inputs(
            shape["rows"], shape["hidden"], shape["dtype"], shape["norm"], shape["prenorm"], device
        )
        mixed = DTYPES[shape["dtype"]][0] != DTYPES[shape["dtype"]][1]
        for name, fn in impls.items():
            if mixed and name in ("liger", "flash_attn"):
                continue
            how = (inputs, shape["norm"], shape["prenorm"], shape["dropout"])
            selected(fn, *how, make_calls(fn, *how)["fwd_bwd"])()
        del inputs
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()


def run(args, on_row: Callable[[dict], None] | None = None) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    t_start = time.monotonic()
    impls, missing = implementations(args.impls, device)
    if impls.get("compiled") or impls.get("addnorm_compiled"):
        # one compiled graph per (norm, prenorm, dtype, shape): more than dynamo's default 8
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
    grid = shapes(args, device)
    report = {
        "machine": machine_info(device),
        "device": device,
        "impls": list(impls),
        # the backward variant each op column timed (launch_config.BWD_VARIANTS)
        "bwd_variants": {k: v for k, v in OPS.items() if k in impls},
        "missing": missing,
        "budget_s": args.budget,
        "max_reps": args.reps,
        "results": [],
        "not_reached": [],
    }
    for name, why in missing.items():
        print(f"{name}: {why}", flush=True)
    if args.warm:
        report["warm"] = warm(args, grid, device)
    for i, shape in enumerate(grid):
        allowance = None
        if args.budget is not None:
            left = args.budget - (time.monotonic() - t_start)
            allowance = left / (len(grid) - i)
            done = report["results"]
            needed = statistics.median(r["seconds"] for r in done) if done else 0.0
            if left <= 0 or (done and left < 0.5 * needed):
                report["not_reached"] = grid[i:]
                print(f"budget: {len(grid) - i} shapes not reached", flush=True)
                break
        row = measure_shape(shape, impls, device, args, allowance)
        report["results"].append(row)
        print(_line(row, [k for k in impls if f"{k}_fwd" in row["ms"]]), flush=True)
        if device == "cuda":
            torch.cuda.empty_cache()
        if on_row is not None:
            on_row(report)
    report["seconds"] = time.monotonic() - t_start
    return report


def main(argv: list[str] | None = None) -> dict | None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU)")
    ap.add_argument("--cpu", action="store_true", help="benchmark the CPU path even when CUDA is present")
    ap.add_argument("--compile", action="store_true", help="also torch.compile on the CPU")
    ap.add_argument("--impls", nargs="+", default=None, choices=IMPLS, help="default by device")
    ap.add_argument("--reps", type=int, default=None, help="most calls per cell (GPU 50, CPU 20)")
    ap.add_argument("--min-reps", type=int, default=5, help="fewest calls per cell under --budget")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=None, help="seconds for the whole table")
    ap.add_argument("--warm", type=int, default=0, help="compile every shape first in N processes (GPU)")
    ap.add_argument("--warm-timeout", type=float, default=90.0, help="seconds the warm-up may take")
    ap.add_argument("--warm-only", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden sizes (default by device)")
    ap.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES), help="default by device")
    ap.add_argument("--norms", nargs="+", default=["layernorm", "rmsnorm"], choices=["layernorm", "rmsnorm"])
    ap.add_argument(
        "--prenorm", choices=["both", "on", "off"], default="both", help="Pre-LN (y, s), Post-LN (y)"
    )
    ap.add_argument("--dropout", type=float, nargs="+", default=[0.0, DROPOUT], help="dropout rates on x")
    ap.add_argument("--elements", type=int, default=None, help="rows x hidden (default by device)")
    add_out_argument(ap)
    ap.add_argument("--note", default="", help="a line recorded with the results (e.g. machine load)")
    args = ap.parse_args(argv)
    # what a warm-up process needs to rebuild the same grid
    raw = list(sys.argv[1:] if argv is None else argv)
    args.argv_shapes = [a for a in raw if a != "--warm-only"]
    if args.warm_only is None and "--warm" in args.argv_shapes:
        k = args.argv_shapes.index("--warm")
        del args.argv_shapes[k : k + 2]
    if args.threads:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cuda":
        args.hidden = args.hidden or list(GPU_HIDDEN)
        args.dtypes = args.dtypes or ["bfloat16"]
        args.elements = args.elements or GPU_ELEMENTS
        args.impls = args.impls or list(GPU_IMPLS)
        args.reps = args.reps or 50
    else:
        args.hidden = args.hidden or ([256, 1024, 4096] if args.quick else [512, 1024, 2048, 4096, 8192])
        args.dtypes = args.dtypes or ["float32"]
        args.elements = args.elements or (2**20 if args.quick else 2**22)
        args.impls = args.impls or (
            ["addnorm", "eager", "compiled"] if args.compile else ["addnorm", "eager"]
        )
        args.reps = args.reps or (10 if args.quick else 20)
    if args.warm_only is not None:
        impls, _ = implementations(args.impls, device)
        torch._dynamo.config.recompile_limit = 1024
        torch._dynamo.config.accumulated_recompile_limit = 4096
        warm_only(args, shapes(args, device), impls, device, args.warm_only)
        return None
    return record_rows(args, "add_norm", device, run, to_markdown)


if __name__ == "__main__":
    main()
