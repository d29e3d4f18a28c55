"""Fused Add & Norm (``addnorm.ops.add_norm``) against eager PyTorch, torch.compile and a copy.

Memory-bound, so judged in bytes moved per second, counting the minimum bytes:

    forward  prenorm: read x, residual; write y, s        post: read x, residual; write y
    backward prenorm: read dy, ds, s; write dx             post: read dy, y (saved); write dx

(dx = dresidual when alpha = 1 without dropout or gate; weight-sized vectors are negligible).

On CUDA: for each norm (layernorm, rmsnorm), prenorm on/off, dtype (bf16, fp16, fp32) and hidden size
(256 ... 16384, rows = 2**27 / hidden), median time and effective bandwidth of ours (Triton), eager
PyTorch (x + r, then F.layer_norm / F.rms_norm), ``torch.compile`` of that eager function, our op under
``torch.compile`` with its Triton kernels (``addnorm_compiled``: the registered triton_op, compile path
"kernel"), Liger-Kernel when installed (``pip install liger-kernel``; its LayerNorm after the add, its
fused add + RMSNorm), flash-attn's Triton layer norm where it imports (``flash_attn``), and a
device-to-device copy of the same tensor in the same run (the bandwidth ceiling). Compiled functions
are built with donated buffers off, since the backward alone is timed on a retained graph.
On the CPU: our torch path against eager PyTorch (fp32, smaller sizes; ``--quick`` smaller still);
``--compile`` adds torch.compile on the CPU too. fwd+bwd bandwidth counts both phases' bytes.

The report ends with the issue's targets, each checked against the rows it covers: on an H100 in bf16,
forward >= 95% of the copy bandwidth, forward+backward >= 90%, never slower than torch.compile,
Post-LN forward+backward >= 1.2x torch.compile; on the CPU, add + RMSNorm forward+backward no slower
than eager.

    python benchmarks/bench_add_norm.py [--quick] [--compile] [--reps N] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_info, machine_line, write_results
from timing import interleaved

from addnorm.ops import add_norm
from addnorm.ops.policy import using_compile_path

GPU_HIDDEN = (256, 1024, 2048, 4096, 8192, 16384)
GPU_ELEMENTS = 2**27
# name -> (x's dtype, the stream's: residual, s, y, weight); "mixed" is what autocast gives a model:
# a bf16 branch added into an fp32 stream
DTYPES = {
    "bfloat16": (torch.bfloat16, torch.bfloat16),
    "mixed": (torch.bfloat16, torch.float32),
    "float16": (torch.float16, torch.float16),
    "float32": (torch.float32, torch.float32),
}
GPU_DTYPES = ("bfloat16", "mixed", "float16", "float32")


def eager_add_norm(x, r, w, b, norm: str, prenorm: bool, eps: float = 1e-5):
    """The unfused composite: s = x + r, then the norm."""
    s = x + r
    if norm == "layernorm":
        y = F.layer_norm(s, (s.shape[-1],), w, b, eps)
    else:
        y = F.rms_norm(s, (s.shape[-1],), w, eps)
    return (y, s) if prenorm else y


def fused_add_norm(x, r, w, b, norm: str, prenorm: bool, eps: float = 1e-5):
    bias = b if norm == "layernorm" else None
    out = torch.promote_types(x.dtype, r.dtype)  # y in the stream's dtype, as the unfused add gives it
    return add_norm(x, r, w, bias, norm=norm, eps=eps, prenorm=prenorm, out_dtype=out)


def compiled_kernel_add_norm() -> Callable:
    """Our op under torch.compile with its Triton kernels (the triton_op, compile path "kernel")."""
    compiled = torch.compile(fused_add_norm, dynamic=False)

    def fn(*args):
        with using_compile_path("kernel"):
            return compiled(*args)

    return fn


def flash_attn_add_norm() -> Callable | None:
    """flash-attn's Triton layer norm (``layer_norm_fn``: the add, LayerNorm or RMSNorm and, for
    prenorm, s in one kernel; returns (y, s) for prenorm), or None when flash-attn does not import."""
    try:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn
    except Exception:  # not installed, or built for another torch / CUDA
        return None

    def fn(x, r, w, b, norm: str, prenorm: bool, eps: float = 1e-5):
        rms = norm == "rmsnorm"
        return layer_norm_fn(x, w, None if rms else b, residual=r, eps=eps, prenorm=prenorm, is_rms_norm=rms)

    return fn


def liger_add_norm() -> Callable | None:
    """Liger-Kernel's LayerNorm after the add, and its fused add + RMSNorm (returns (y, s)), or None
    when liger-kernel is not installed (it runs on GPUs only)."""
    try:
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
    except ImportError:
        return None
    modules: dict = {}

    def fn(x, r, w, b, norm: str, prenorm: bool, eps: float = 1e-5):
        key = (norm, x.shape[-1], x.device)
        if key not in modules:
            cls = LigerLayerNorm if norm == "layernorm" else LigerFusedAddRMSNorm
            modules[key] = cls(x.shape[-1], eps=eps).to(x.device)
        mod = modules[key]
        if norm == "layernorm":
            s = x + r
            y = torch.func.functional_call(mod, {"weight": w, "bias": b}, (s,))
        else:
            y, s = torch.func.functional_call(mod, {"weight": w}, (x, r))
        return (y, s) if prenorm else y

    return fn


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


def interleaved_medians(fns: dict[str, Callable[[], object]], device: str, warmup: int, reps: int) -> dict:
    """Median seconds of each fn, timed in alternation (round-robin) so that drifts in machine load
    hit every implementation alike."""
    timers = {k: (lambda fn=fn: time_once(fn, device)) for k, fn in fns.items()}
    times, _ = interleaved(timers, reps, warmup)
    return {k: statistics.median(v) for k, v in times.items()}


def min_bytes(rows: int, hidden: int, x_elem: int, s_elem: int, prenorm: bool) -> int:
    """Per phase: fwd x, r, y (+ s); bwd dy, (ds,) s or y, dx (x's size; r, s, y in the stream's)."""
    return rows * hidden * (x_elem + (3 if prenorm else 2) * s_elem)


def make_calls(fn, rows, hidden, dtypes, norm, prenorm, device) -> dict:
    """Closures for the forward (no grad), the backward alone (on a retained graph) and both."""
    x_dtype, s_dtype = dtypes
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(rows, hidden, generator=g).to(device=device, dtype=x_dtype).requires_grad_(True)
    r = torch.randn(rows, hidden, generator=g).to(device=device, dtype=s_dtype).requires_grad_(True)
    # trained-looking affine parameters (|b| < |w| everywhere: x_hat is recomputed from y on the GPU)
    w = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device=device, dtype=s_dtype).requires_grad_(True)
    b = (0.02 * torch.randn(hidden, generator=g)).to(device=device, dtype=s_dtype).requires_grad_(True)
    params = (x, r, w, b) if norm == "layernorm" else (x, r, w)

    def fwd():
        with torch.no_grad():
            return fn(x, r, w, b, norm, prenorm)

    out = fn(x, r, w, b, norm, prenorm)
    outs = list(out) if prenorm else [out]
    grads = [torch.randn_like(o) for o in outs]

    def bwd():
        return torch.autograd.grad(outs, params, grads, retain_graph=True)

    def fwd_bwd():
        o = fn(x, r, w, b, norm, prenorm)
        o = list(o) if prenorm else [o]
        return torch.autograd.grad(o, params, grads)

    return {"fwd": fwd, "bwd": bwd, "fwd_bwd": fwd_bwd}


def run(args) -> dict:
    device = "cuda" if torch.cuda.is_available() and not args.cpu else "cpu"
    if device == "cuda":
        hiddens, dtypes = GPU_HIDDEN, GPU_DTYPES
        elements = GPU_ELEMENTS
    else:
        hiddens = (256, 1024, 4096) if args.quick else (512, 1024, 2048, 4096, 8192)
        dtypes = ("float32",)
        elements = 2**20 if args.quick else 2**22
    hiddens = tuple(args.hidden or hiddens)
    dtypes = tuple(args.dtypes or dtypes)
    elements = args.elements or elements
    impls: dict[str, Callable] = {"addnorm": fused_add_norm, "eager": eager_add_norm}
    if device == "cuda" or args.compile:
        # one compiled graph per (norm, prenorm, dtype, shape, grad mode): more than dynamo's default 8
        torch._dynamo.config.recompile_limit = 256
        # the backward alone is timed on a retained graph, which buffers donated to it would break
        # ("This backward function was compiled with non-empty donated buffers")
        torch._functorch.config.donated_buffer = False
        impls["compiled"] = torch.compile(eager_add_norm, dynamic=False)
        impls["addnorm_compiled"] = compiled_kernel_add_norm()
    liger = liger_add_norm() if device == "cuda" else None
    if liger is not None:
        impls["liger"] = liger
    elif device == "cuda":
        print("liger-kernel not installed: no Liger column (pip install liger-kernel)")
    flash = flash_attn_add_norm() if device == "cuda" else None
    if flash is not None:
        impls["flash_attn"] = flash
    elif device == "cuda":
        print("flash-attn does not import: no flash_attn column")
    results = []
    prenorms = {"both": (True, False), "on": (True,), "off": (False,)}[args.prenorm]
    for norm in args.norms:
        for prenorm in prenorms:
            for dtype in dtypes:
                for hidden in hiddens:
                    rows = elements // hidden
                    x_dtype, s_dtype = DTYPES[dtype]
                    row = {"norm": norm, "prenorm": prenorm, "dtype": dtype, "hidden": hidden, "rows": rows}
                    row |= {"ms": {}, "GBps": {}}
                    src = torch.randn(rows, hidden, device=device).to(x_dtype)
                    dst = torch.empty_like(src)
                    fns = {"copy": lambda d=dst, s=src: d.copy_(s)}
                    # Liger's fused add + RMSNorm takes one dtype: no Liger cell for the autocast mix
                    # (nor for flash-attn's, whose s takes x's dtype or fp32)
                    mixed = x_dtype != s_dtype
                    used = {k: f for k, f in impls.items() if not (k in ("liger", "flash_attn") and mixed)}
                    for name, fn in used.items():
                        calls = make_calls(fn, rows, hidden, DTYPES[dtype], norm, prenorm, device)
                        fns |= {f"{name}_{phase}": c for phase, c in calls.items()}
                    med = interleaved_medians(fns, device, args.warmup, args.reps)
                    row["ms"] = {k: v * 1e3 for k, v in med.items()}
                    row["GBps"]["copy"] = 2 * src.numel() * src.element_size() / med["copy"] / 1e9
                    size = torch.empty((), dtype=s_dtype).element_size()
                    nbytes = min_bytes(rows, hidden, src.element_size(), size, prenorm)
                    for name in used:
                        for phase, n in (("fwd", nbytes), ("bwd", nbytes), ("fwd_bwd", 2 * nbytes)):
                            row["GBps"][f"{name}_{phase}"] = n / med[f"{name}_{phase}"] / 1e9
                    for other in used:
                        if other != "addnorm":
                            row[f"speedup_fwd_bwd_vs_{other}"] = (
                                row["ms"][f"{other}_fwd_bwd"] / row["ms"]["addnorm_fwd_bwd"]
                            )
                    results.append(row)
                    print(_line(row, used), flush=True)
    machine = machine_info(device)
    return {"machine": machine, "device": device, "quick": args.quick, "reps": args.reps, "results": results}


def check_targets(report: dict) -> list[dict]:
    """The issue's targets, each with the rows it covers, the worst value and whether it holds: on
    CUDA, bf16 forward >= 95% of the copy bandwidth, and forward+backward no slower than the better of
    torch.compile and Liger-Kernel in bf16 and the autocast mix; on the CPU, RMSNorm fwd+bwd >= eager."""
    rows = report["results"]

    def pct(r, phase):
        return r["GBps"][f"addnorm_{phase}"] / r["GBps"]["copy"]

    if report["device"] == "cuda":
        bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
        lowp = [r for r in rows if r["dtype"] in ("bfloat16", "mixed")]
        specs = [
            ("bf16 forward >= 95% of copy bandwidth", bf16, lambda r: pct(r, "fwd"), 0.95, "{:.0%}"),
            (
                "fwd+bwd >= the better of torch.compile and Liger (bf16 and the autocast mix)",
                lowp,
                lambda r: min(r.get(f"speedup_fwd_bwd_vs_{k}", float("inf")) for k in ("compiled", "liger")),
                1.0,
                "{:.2f}x",
            ),
        ]
    else:
        rms = [r for r in rows if r["norm"] == "rmsnorm"]
        specs = [
            (
                "CPU add + RMSNorm forward+backward no slower than eager",
                rms,
                lambda r: r["speedup_fwd_bwd_vs_eager"],
                1.0,
                "{:.2f}x",
            ),
        ]
    out = []
    for name, covered, value, bound, fmt in specs:
        values = [value(r) for r in covered]
        worst = min(values) if values else float("nan")
        out.append({"target": name, "rows": len(values), "worst": fmt.format(worst), "met": worst >= bound})
    return out


def _line(row: dict, impls) -> str:
    ms, bw = row["ms"], row["GBps"]
    parts = [
        f"{row['norm']:9s} {'pre ' if row['prenorm'] else 'post'} {row['dtype']:8s} h={row['hidden']:5d}"
    ]
    for name in impls:
        parts.append(
            f"{name}: fwd {ms[name + '_fwd']:.3f}ms {bw[name + '_fwd']:.1f}GB/s "
            f"bwd {ms[name + '_bwd']:.3f}ms {bw[name + '_bwd']:.1f}GB/s"
        )
    speeds = ", ".join(f"{k.split('_vs_')[1]} {v:.2f}x" for k, v in row.items() if k.startswith("speedup"))
    parts.append(f"copy {bw['copy']:.1f}GB/s; fwd+bwd speed vs {speeds}")
    return " | ".join(parts)


def to_markdown(report: dict) -> str:
    m = report["machine"]
    impls = sorted({k.rsplit("_", 1)[0] for r in report["results"] for k in r["ms"] if k != "copy"})
    impls = [
        i for i in ("addnorm", "eager", "compiled", "addnorm_compiled", "liger", "flash_attn") if i in impls
    ]
    title = "GPU" if report["device"] == "cuda" else "CPU"
    lines = [
        f"# addnorm.ops.add_norm vs eager PyTorch ({title})",
        "",
        machine_line(m),
        "",
        f"Median of {report['reps']} calls, implementations timed in alternation. GB/s counts the minimum "
        "bytes (fwd prenorm: x, r, y, s; fwd post: x, r, y; bwd prenorm: dy, ds, s, dx; "
        "bwd post: dy, y, dx; fwd+bwd: both; mixed = bf16 x, fp32 r / s / y). speed vs X = X's fwd+bwd "
        "time / ours (>= 1: ours no slower). copy = device-to-device copy of x, read + write; % = our "
        "bandwidth / copy's. addnorm_compiled = our op under torch.compile with its Triton kernels.",
        "",
    ]
    if report.get("note"):
        lines += [report["note"], ""]
    head = ["norm", "prenorm", "dtype", "hidden", "rows"]
    for i in impls:
        head += [f"{i} fwd ms (GB/s)", f"{i} bwd ms (GB/s)", f"{i} fwd+bwd ms"]
    others = [i for i in impls if i != "addnorm"]
    head += ["copy GB/s", "ours fwd % copy", "ours fwd+bwd % copy"] + [f"speed vs {i}" for i in others]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["results"]:
        ms, bw = r["ms"], r["GBps"]
        cells = [r["norm"], str(r["prenorm"]), r["dtype"], str(r["hidden"]), str(r["rows"])]
        for i in impls:
            if i + "_fwd" not in ms:
                cells += ["-"] * 3
                continue
            cells += [
                f"{ms[i + '_fwd']:.3f} ({bw[i + '_fwd']:.1f})",
                f"{ms[i + '_bwd']:.3f} ({bw[i + '_bwd']:.1f})",
                f"{ms[i + '_fwd_bwd']:.3f} ({bw[i + '_fwd_bwd']:.1f})",
            ]
        cells += [f"{bw['copy']:.1f}"]
        cells += [f"{bw['addnorm_' + p] / bw['copy']:.0%}" for p in ("fwd", "fwd_bwd")]
        cells += [
            f"{r['speedup_fwd_bwd_vs_' + i]:.2f}x" if "speedup_fwd_bwd_vs_" + i in r else "-" for i in others
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Targets", "", "| target | rows | worst | met |", "| --- | --- | --- | --- |"]
    for t in check_targets(report):
        lines.append(f"| {t['target']} | {t['rows']} | {t['worst']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (CPU)")
    ap.add_argument("--cpu", action="store_true", help="benchmark the CPU path even when CUDA is present")
    ap.add_argument("--compile", action="store_true", help="also torch.compile on the CPU")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--hidden", type=int, nargs="+", default=None, help="hidden sizes (default by device)")
    ap.add_argument("--dtypes", nargs="+", default=None, choices=list(DTYPES), help="default by device")
    ap.add_argument("--norms", nargs="+", default=["layernorm", "rmsnorm"], choices=["layernorm", "rmsnorm"])
    ap.add_argument(
        "--prenorm", choices=["both", "on", "off"], default="both", help="Pre-LN (y, s), Post-LN (y)"
    )
    ap.add_argument("--elements", type=int, default=None, help="rows x hidden (default by device)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    ap.add_argument("--note", default="", help="a line recorded with the results (e.g. machine load)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.reps is None:
        args.reps = 100 if torch.cuda.is_available() and not args.cpu else (10 if args.quick else 20)
    report = run(args)
    report["note"] = args.note
    stem = "add_norm_cuda" if report["device"] == "cuda" else "add_norm_cpu"
    write_results(args.out, stem, to_markdown(report), report)


if __name__ == "__main__":
    main()
