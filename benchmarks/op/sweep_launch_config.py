"""Sweep the fused kernels' launch configurations on a GPU: which tile shape and warp count each hidden
size should get. Build-time tool (like ``benchmarks/kernels/triton_variants.py``): it swaps
``addnorm.ops.launch_config.fwd_config`` / ``bwd_config`` for each candidate rule, clears the cached
specs and plans, and times the op's training forward (phase ``fwd``) and forward + backward (phase
``bwd``: the rule swapped is the backward's, the forward's stays) in bf16, rows = ``--elements`` /
hidden (2**27), LayerNorm and RMSNorm, Pre-LN (y, s) and Post-LN (y), and Pre-LN LayerNorm with
dropout 0.1 (the backward's register-heavy variant). Inputs and calls are ``benchmarks/op/add_norm.py``'s;
bandwidth is its minimum bytes per phase (fwd+bwd: both phases' bytes). The winners go into
``launch_config.py`` by hand (2026-11-24: ``results/h100/2026-11-24-fcabca7/gpu_h100.md``). ``--device cpu``
runs the kernels in Triton's interpreter (``TRITON_INTERPRET=1``; small ``--elements``): what the tests check.

    python -m benchmarks.op.sweep_launch_config [--hidden 256 1024 ...] [--reps 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics

import triton

import addnorm.ops.launch_config as tk
from addnorm.ops import add_norm, policy
from addnorm.ops.triton import launchers as triton_launch
from benchmarks.common.machine import machine_info, machine_line
from benchmarks.common.results_path import add_out_argument
from benchmarks.op.add_norm import make_calls, make_inputs, min_bytes, time_once

Launch = tk.Launch


def one_pass(n: int, tile: int, elems_per_warp: int, max_warps: int = 16) -> Launch:
    block_n = max(tk.MIN_BLOCK_N, triton.next_power_of_2(n))
    block_m = max(1, tile // block_n)
    warps = min(max(block_m * block_n // elems_per_warp, 1), max_warps)
    return Launch(block_m, block_n, False, warps)


def rule(max_one_pass: int, tile: int, epw: int, chunk: Launch):
    """A forward rule: one pass up to ``max_one_pass`` columns, ``chunk`` beyond."""

    @functools.lru_cache(maxsize=256)
    def cfg(n: int) -> Launch:
        return one_pass(n, tile, epw) if n <= max_one_pass else chunk

    return cfg


def bwd_rule(max_one_pass: int, max_one_pass_heavy: int, slice_: Launch, narrow: Launch):
    """A backward rule as ``launch_config.bwd_config`` takes it, ``(n, heavy)``: one row per step in one
    pass up to ``max_one_pass`` (``max_one_pass_heavy`` for dropout or a gate) columns, beyond that in
    column slices of ``slice_`` (``narrow`` for the heavy variants and widths not a multiple of 16)."""

    @functools.lru_cache(maxsize=256)
    def cfg(n: int, heavy: bool = False, variant: str = "slices") -> Launch:  # the default variant's rule
        if n <= (max_one_pass_heavy if heavy else max_one_pass):
            return one_pass(n, 1, 256)
        return narrow if heavy or n % 16 else slice_

    return cfg


ORIGINAL = {"fwd": tk.fwd_config, "bwd": tk.bwd_config}
SLICE_4096, SLICE_2048 = Launch(1, 4096, True, 16), Launch(1, 2048, True, 16)
# candidate rules: (phase, name) -> config function; the backward's: where one pass stops and how wide
# the slices of a wider row are (no candidate spills:
# benchmarks/results/cpu/2026-11-28-afab0e4/kernel_compile_full.md and launch_config's notes: one pass at 4096
# does not spill for the heavy variants either)
CANDIDATES = {
    ("fwd", "current"): tk.fwd_config,
    ("fwd", "row1_epw512"): rule(8192, 1, 512, Launch(1, 2048, True, 8)),
    ("fwd", "row1_epw256"): rule(8192, 1, 256, Launch(1, 2048, True, 8)),
    ("fwd", "tile4096_epw512"): rule(8192, 4096, 512, Launch(1, 2048, True, 8)),
    ("bwd", "current"): tk.bwd_config,
    ("bwd", "heavy_one_pass_4096"): bwd_rule(4096, 4096, SLICE_4096, SLICE_2048),
    ("bwd", "slices_2048"): bwd_rule(4096, 2048, SLICE_2048, SLICE_2048),
    ("bwd", "one_pass_2048_slices_2048"): bwd_rule(2048, 2048, SLICE_2048, SLICE_2048),
}


def install(phase: str, fn) -> None:
    setattr(tk, f"{phase}_config", fn)
    triton_launch.clear_caches()
    policy.invalidate()


def fused(x, r, w, b, norm, prenorm, dropout_p=0.0):
    """The op on its kernels (``backend="triton"``), as ``bench_add_norm.make_calls`` calls it."""
    b = b if norm == "layernorm" else None
    return add_norm(x, r, w, b, norm=norm, prenorm=prenorm, dropout_p=dropout_p, seed=0, backend="triton")


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[256, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--elements", type=int, default=2**27, help="rows x hidden per call")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    add_out_argument(ap)
    args = ap.parse_args(argv)
    rows_out = []
    print(machine_line(machine_info(args.device)), flush=True)
    # the fourth case has dropout (a register-heavy backward variant: its own one-pass width and slices)
    cases = (
        ("layernorm", True, 0.0),
        ("layernorm", False, 0.0),
        ("rmsnorm", True, 0.0),
        ("layernorm", True, 0.1),
    )
    for norm, prenorm, p in cases:
        for n in args.hidden:
            rows = max(args.elements // n, 1)
            inputs = make_inputs(rows, n, "bfloat16", norm, prenorm, args.device)
            for (phase, name), fn in CANDIDATES.items():
                install("fwd", ORIGINAL["fwd"])
                install("bwd", ORIGINAL["bwd"])
                install(phase, fn)
                call = make_calls(fused, inputs, norm, prenorm, p)["fwd" if phase == "fwd" else "fwd_bwd"]
                for _ in range(3):
                    call()
                t = statistics.median(time_once(call, args.device) for _ in range(args.reps))
                nbytes = min_bytes(rows, n, 2, 2, prenorm) * (1 if phase == "fwd" else 2)
                cfg = fn(n) if phase == "fwd" else fn(n, p > 0)
                ms, gbps = t * 1e3, nbytes / t / 1e9
                row = {"norm": norm, "prenorm": prenorm, "dropout": p, "hidden": n, "phase": phase,
                       "rule": name, "config": list(cfg), "ms": ms, "GBps": gbps}  # fmt: skip
                rows_out.append(row)
                print(f"{norm:9s} pre={int(prenorm)} p={p} h={n:5d} {phase} {name:26s} {tuple(cfg)!s:24s} "
                      f"{t * 1e3:7.3f} ms {row['GBps']:7.1f} GB/s", flush=True)  # fmt: skip
                del call
                # written as it goes: a timeout keeps the rows measured so far
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "launch_config_sweep.json").write_text(json.dumps(rows_out, indent=1) + "\n")
    install("fwd", ORIGINAL["fwd"])
    install("bwd", ORIGINAL["bwd"])
    return rows_out


if __name__ == "__main__":
    main()
