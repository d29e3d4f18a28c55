"""Compile every Triton kernel variant the dispatcher launches for sm_80 and sm_90 (no GPU needed) and
record registers, spills, shared memory and launch configuration per variant.

``triton.compile`` with a ``GPUTarget`` builds the real cubin with the ptxas in triton's wheel;
``ptxas -v`` (same flags) reads it. The default set is the one the CI test compiles
(per launch configuration and path, the variant with every optional input); ``--full`` adds RMSNorm,
bf16 / fp16 / the autocast mix, no-dropout and no-affine variants and unaligned hidden sizes.
Exits with status 1 if any variant spills.

    python -m benchmarks.kernels.kernel_compile [--full] [--workers 2] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time

import triton

from benchmarks.common.machine import cpu_model, machine_info, write_results
from benchmarks.common.results_path import add_out_argument
from benchmarks.kernels.triton_variants import ARCHS, compile_all, variants


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every option, not only the register-heaviest")
    ap.add_argument("--workers", type=int, default=None)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    vs = variants(full=args.full)
    t0 = time.perf_counter()
    results = compile_all(vs, ARCHS, workers=args.workers)
    wall = time.perf_counter() - t0
    rows = []
    for r in results:
        v = r.pop("variant")
        rows.append(
            {"kernel": v.kernel, "launch": v.launch, "options": v.options, "hidden": list(v.hidden), **r}
        )
    spilled = [r for r in rows if r["spill_bytes"]]
    head = (
        f"Triton {triton.__version__}; commit {machine_info('cpu').get('commit', '?')}; compiled on "
        f"{cpu_model()} ({os.cpu_count()} cores, no GPU) in {wall:.0f} s; "
        f"{dt.date.today()}. {len(vs)} variants x sm_{'/sm_'.join(map(str, ARCHS))}"
        f"{' (--full)' if args.full else ''}; {len(spilled)} spill."
    )
    lines = [
        "# Triton kernel variants compiled for NVIDIA targets: registers, spills, shared memory",
        "",
        head,
        "",
        "regs: registers per thread; spill: local-memory bytes per thread (spill stores + stack); "
        "shared: static + dynamic shared memory per program (bytes). Launch: rows x columns per tile "
        "(chunked: column chunks of a wider row), warps. hidden: the sizes of the test grid that launch it.",
        "",
        "| kernel | launch | options | hidden | arch | regs | spill | shared |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in sorted(rows, key=lambda r: (r["kernel"] == "bwd", r["hidden"][0], r["options"], r["arch"])):
        hidden = ", ".join(map(str, r["hidden"][:4])) + (" ..." if len(r["hidden"]) > 4 else "")
        lines.append(
            f"| {r['kernel']} | {r['launch']} | {r['options']} | {hidden} | sm_{r['arch']} | {r['regs']} "
            f"| {r['spill_bytes']} | {r['static_shared'] + r['dynamic_shared']} |"
        )
    name = "kernel_compile_full" if args.full else "kernel_compile"
    print(head)
    write_results(args.out, name, "\n".join(lines) + "\n", {"summary": head, "rows": rows})
    return 1 if spilled else 0


if __name__ == "__main__":
    sys.exit(main())
