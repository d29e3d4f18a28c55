"""Per-call host time of the fused op's eager call on the CPU, the GPU path's launches going through
Triton's real launcher (and the native call's through ``cuLaunchKernel``) onto a fake driver
(:mod:`addnorm.ops.native.fake_driver`: a ``libcuda.so.1`` that returns at once), so that what is timed
is the host's work as on CUDA, the launchers' own packing included (a Python launch that does nothing
under-counts it: issue 52, 2.14 us a launch against 0.37).

Per case (LayerNorm, RMSNorm, with and without dropout; 8x64 fp32, Post-LN, one thread), forward
(inputs requiring grad) and forward + backward (``torch.autograd.grad``, no accumulation), timed in
interleaved rounds (:func:`benchmarks.common.timing.interleaved`), each timer a batch of calls:

- ``eager``: ``x + r`` (``F.dropout(x) + r``) then ``F.layer_norm`` / ``F.rms_norm``;
- ``today``: ``addnorm.ops.add_norm``, today's path (the Python ``autograd.Function``);
- ``native``: the same call on the native path (:mod:`addnorm.ops.native`, the C++ node);
- ``floor``: a Python ``autograd.Function`` that only allocates its outputs (the least any Python op
  costs).

    python -m benchmarks.host.host_call [--rounds 200] [--calls 50] [--record]

Needs the real kernels (``TRITON_INTERPRET`` unset or 0), gcc and the native extension's build.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["TRITON_INTERPRET"] = "0"  # before triton is imported: the real kernels

from addnorm.ops.native import build, fake_driver  # noqa: E402

STREAM = 0x5EED
PATHS = ("eager", "today", "native", "floor")
CASES = {
    "layernorm": ("layernorm", 0.0),
    "layernorm + dropout": ("layernorm", 0.1),
    "rmsnorm": ("rmsnorm", 0.0),
    "rmsnorm + dropout": ("rmsnorm", 0.1),
}


def _floor_function():
    import torch

    class Floor(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, r, w, b):
            ctx.has_b = b is not None
            return torch.empty_like(x)

        @staticmethod
        def backward(ctx, dy):
            n = dy.shape[-1:]
            return (
                torch.empty_like(dy),
                torch.empty_like(dy),
                dy.new_empty(n),
                dy.new_empty(n) if ctx.has_b else None,
            )

    return Floor.apply


def callers(norm: str, p: float, rows: int, n: int, device: str = "cpu"):
    """The four paths' calls for one case: name -> (forward, forward + backward), and the versions of
    the op's plans (today's, native's) each call selects."""
    import torch
    import torch.nn.functional as F

    from addnorm import ops
    from addnorm.ops import policy

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(rows, n, generator=g).to(device).requires_grad_() for _ in range(2))
    w = torch.randn(n, generator=g).to(device).requires_grad_()
    b = torch.randn(n, generator=g).to(device).requires_grad_() if norm == "layernorm" else None
    dy = torch.randn(rows, n, generator=g).to(device)
    leaves = (x, r, w) if b is None else (x, r, w, b)
    floor = _floor_function()

    def eager():
        s = (F.dropout(x, p) if p else x) + r
        if norm == "layernorm":
            return F.layer_norm(s, (n,), w, b, 1e-5)
        return F.rms_norm(s, (n,), w, 1e-5)

    def fused():
        return ops.add_norm(x, r, w, b, norm=norm, dropout_p=p)

    versions = {}
    for path in ("today", "native"):
        ops.set_call_path("python" if path == "today" else "native")
        versions[path] = policy.VERSION
        for _ in range(3):  # the plan, the kernels compiled and registered
            torch.autograd.grad(fused(), leaves, dy)

    def with_version(version, fn):
        def call():
            policy.VERSION = version  # which cached plans the call finds (both paths' stay cached)
            return fn()

        return call

    fwd = {
        "eager": eager, "today": with_version(versions["today"], fused),
        "native": with_version(versions["native"], fused), "floor": lambda: floor(x, r, w, b),
    }  # fmt: skip
    out = {}
    for name, f in fwd.items():

        def both(f=f):
            return torch.autograd.grad(f(), leaves, dy)

        out[name] = (f, both)
    return out


def batch(fn, calls: int):
    """A timer: ``calls`` calls of ``fn``, the seconds per call."""

    def timer() -> float:
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls

    return timer


def run(rounds: int, calls: int, rows: int = 8, n: int = 64, device: str = "cpu") -> dict:
    """Time every case; returns the report (medians in us, ratios to eager)."""
    import torch

    from benchmarks.common.timing import ORDER, interleaved

    torch.set_num_threads(1)
    results = {}
    for case, (norm, p) in CASES.items():
        calls_of = callers(norm, p, rows, n, device)
        timers = {}
        for name in PATHS:
            f, fb = calls_of[name]
            timers[f"{name} fwd"] = batch(f, calls)
            timers[f"{name} fwd+bwd"] = batch(fb, calls)
        wall, _ = interleaved(timers, rounds, warmup=2)
        med = {k: statistics.median(v) * 1e6 for k, v in wall.items()}
        results[case] = {
            name: {
                "fwd_us": med[f"{name} fwd"],
                "fwd_bwd_us": med[f"{name} fwd+bwd"],
                "fwd_over_eager": med[f"{name} fwd"] / med["eager fwd"],
                "fwd_bwd_over_eager": med[f"{name} fwd+bwd"] / med["eager fwd+bwd"],
            }  # fmt: skip
            for name in PATHS
        }
    if device == "cuda":
        torch.cuda.synchronize()
    return {"rounds": rounds, "calls_per_timer": calls, "shape": [rows, n], "order": ORDER, "cases": results}


# the device check (issue 52): y, s and every gradient of the native call against today's path
CHECK_SHAPES = ((8, 64), (256, 1024), (64, 4096))


def correctness(device: str = "cuda") -> list[dict]:
    """The native call against today's path on ``CHECK_SHAPES`` x fp32/bf16 x Pre/Post-LN x dropout
    (LayerNorm, a seed given): one row per combination, the largest absolute difference over y, s and
    every gradient (0 where the launches are the same kernels with the same arguments), and which path
    the call took (the grad_fn's name)."""
    import torch

    from addnorm import ops

    rows_out = []
    for rows, n in CHECK_SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            for prenorm in (False, True):
                for p in (0.0, 0.1):
                    g = torch.Generator().manual_seed(rows + n)
                    x, r = (
                        torch.randn(rows, n, generator=g).to(device, dtype).requires_grad_() for _ in "xr"
                    )
                    w = torch.randn(n, generator=g).to(device).requires_grad_()
                    b = torch.randn(n, generator=g).to(device).requires_grad_()
                    leaves = (x, r, w, b)
                    got = {}
                    for path in ("python", "native"):
                        ops.set_call_path(path)
                        for _ in range(2):  # the second call: kernels registered, launched natively
                            out = ops.add_norm(x, r, w, b, prenorm=prenorm, dropout_p=p, seed=7)
                        outs = out if isinstance(out, tuple) else (out,)
                        loss = sum((o.float() * (i + 1.5)).sum() for i, o in enumerate(outs))
                        got[path] = ([o.detach() for o in outs], torch.autograd.grad(loss, leaves))
                        got[path + " node"] = type(outs[0].grad_fn).__name__
                    ops.set_call_path("python")
                    py_all = [*got["python"][0], *got["python"][1]]
                    nat_all = [*got["native"][0], *got["native"][1]]
                    diffs = [
                        (u.float() - v.float()).abs().max().item()
                        for u, v in zip(py_all, nat_all, strict=True)
                    ]
                    rows_out.append({
                        "shape": [rows, n], "dtype": str(dtype).removeprefix("torch."), "prenorm": prenorm,
                        "p": p, "max_abs_diff": max(diffs), "node": got["native node"],
                    })  # fmt: skip
    return rows_out


def to_markdown(report: dict) -> str:
    from benchmarks.common.machine import machine_line

    fake = (
        "(real launches)"
        if report["machine"]["device"] != "cpu"
        else (
            "Triton's real launcher (and the native call's cuLaunchKernel) onto a fake driver that returns "
            "at once"
        )
    )
    lines = [
        "# Per-call host time: eager aten, today's op, the native call, the Python floor",
        "",
        machine_line(report["machine"]),
        "",
        f"{report['shape'][0]}x{report['shape'][1]} fp32, Post-LN, one thread; {fake}; medians of "
        f"{report['rounds']} interleaved rounds ({report['order']}), each timer {report['calls_per_timer']} "
        "calls.",
        "",
        "| case | path | forward (us) | fwd+bwd (us) | forward / eager | fwd+bwd / eager |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for case, rows in report["cases"].items():
        for name in PATHS:
            c = rows[name]
            lines.append(
                f"| {case} | {name} | {c['fwd_us']:.1f} | {c['fwd_bwd_us']:.1f} | "
                f"{c['fwd_over_eager']:.2f}x | {c['fwd_bwd_over_eager']:.2f}x |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    from benchmarks.common.machine import machine_info, write_results
    from benchmarks.common.results_path import add_out_argument

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--calls", type=int, default=50, help="calls per timer (a batch)")
    parser.add_argument("--gpu", action="store_true", help="on CUDA: real launches, and --check")
    parser.add_argument("--check", action="store_true", help="--gpu: also the correctness grid")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.gpu:
        return _main_gpu(args)
    fake_driver.install(STREAM)
    ext = build.extension()
    if ext is None:
        raise SystemExit(f"host_call: the native extension did not build: {build.failure()}")
    ext.install_fake_cuda_guard(STREAM)
    with fake_driver.cpu_as_cuda():
        report = run(args.rounds, args.calls)
    report["machine"] = machine_info("cpu")
    write_results(args.out, "host_call_cpu", to_markdown(report), report)


def _main_gpu(args) -> None:
    """The device's A/B: real launches on the current stream, the native call beside today's."""
    import torch

    from benchmarks.common.machine import machine_info, write_results
    from benchmarks.common.results_path import device_slug

    if build.extension() is None:
        raise SystemExit(f"host_call: the native extension did not build: {build.failure()}")
    report = {"check": correctness() if args.check else []}
    report |= run(args.rounds, args.calls, device="cuda")
    report["machine"] = machine_info("cuda")
    md = to_markdown(report)
    if report["check"]:
        md += "\n| shape | dtype | Pre-LN | p | max abs diff (y, s, grads) | node |\n"
        md += "| --- | --- | --- | --- | ---: | --- |\n"
        md += "".join(
            f"| {c['shape'][0]}x{c['shape'][1]} | {c['dtype']} | {c['prenorm']} | {c['p']} | "
            f"{c['max_abs_diff']:.3g} | {c['node']} |\n"
            for c in report["check"]
        )
    write_results(args.out, f"host_call_{device_slug(torch.cuda.get_device_name())}", md, report)


if __name__ == "__main__":
    main()
