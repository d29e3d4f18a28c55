"""The study's memory estimate (``addnorm.study.limits.estimate_memory``) against the measured peak
resident memory of real training runs, each in a fresh process (2 steps, both probed, the final
evaluation), on the CPU. The estimate must be above every measured peak (it refuses runs, so it
errs high); the ratio says by how much.

    python -m benchmarks.study.memory_estimate [--quick]

writes ``memory_estimate_cpu.md`` and ``.json`` (recorded: ``benchmarks/results/cpu/2026-11-25-b9179c0/``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from addnorm.study.limits import estimate_memory, fmt_bytes
from addnorm.train import RunConfig
from benchmarks.common.machine import machine_info, machine_line, write_results
from benchmarks.common.results_path import add_record_argument, out_dir

SRC = Path(__file__).resolve().parents[2] / "src"
COMMON = dict(steps=2, eval_every=0, eval_batches=1, corpus_bytes=400_000)


def size(d: int, heads: int, ff: int, layers: int, batch: int, seq: int, **other) -> dict:
    return dict(d_model=d, n_heads=heads, d_ff=ff, n_layers=layers, batch_size=batch, seq_len=seq, **other)


CONFIGS = {
    "wide (d 512, 4 layers, B 16, T 128)": size(512, 8, 2048, 4, 16, 128),
    "activations (d 64, 8 layers, B 64, T 256)": size(64, 4, 256, 8, 64, 256),
    "attention dropout (as above, dropout 0.1)": size(64, 4, 256, 8, 64, 256, dropout=0.1),
    "swiglu (d 256, 4 layers, B 32, T 128)": size(256, 4, 1024, 4, 32, 128, activation="swiglu"),
    "ngpt (d 128, 4 layers, B 32, T 128)": size(128, 4, 512, 4, 32, 128, placement="ngpt"),
    "sandwich rmsnorm (d 256, 6 layers, B 32, T 128)": size(
        256, 4, 1024, 6, 32, 128, placement="sandwich", norm="rmsnorm"
    ),
    "deep post (d 64, 32 layers, B 32, T 64)": size(64, 4, 256, 32, 32, 64, placement="post"),
    "big matrices (d 1024, 2 layers, B 8, T 64)": size(1024, 8, 4096, 2, 8, 64),
    "copy task, dropout 0.1 (d 128, 3+3 layers, B 32, T 64)": size(
        128, 4, 512, 3, 32, 64, task="copy", dropout=0.1
    ),
    "hf-llama (d 256, 4 layers, B 16, T 128)": size(256, 4, 1024, 4, 16, 128, model="hf-llama"),
    "hf-gpt2, dropout 0.1 (d 256, 4 layers, B 16, T 128)": size(
        256, 4, 1024, 4, 16, 128, model="hf-gpt2", dropout=0.1
    ),
    "hf-gemma2 (d 128, 4 layers, B 16, T 256)": size(128, 4, 512, 4, 16, 256, model="hf-gemma2"),
}
QUICK = ("activations (d 64, 8 layers, B 64, T 256)", "wide (d 512, 4 layers, B 16, T 128)")

# The child: imports, then one run; prints its peak resident memory (bytes) after imports and after.
# The peak is this process image's own high-water mark (VmHWM): ``ru_maxrss`` would carry over the
# parent's resident size at fork across exec (Linux keeps the larger), so a big parent (a test
# session) would be measured instead of the run.
CHILD = """
import json, resource, sys, torch
torch.set_num_threads(1)
from addnorm.train import RunConfig, train

def peak():
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except OSError:  # not Linux: the rusage peak (a fresh process's own there)
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

cfg = RunConfig(**json.loads(sys.argv[1]))
if cfg.arch != "addnorm":
    import transformers  # noqa: F401 - the process a study's hf run lives in imports it
base = peak()
result = train(cfg)
print(json.dumps({"base": base, "peak": peak(), "status": result.status, "error": result.error}))
"""


def measure(settings: dict) -> dict:
    """Peak resident memory of one run in a fresh single-threaded process (``CHILD``)."""
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings)],
        env=env, capture_output=True, text=True, timeout=900, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"only {len(QUICK)} configs")
    add_record_argument(parser)
    args = parser.parse_args()
    rows = []
    for name, settings in CONFIGS.items():
        if args.quick and name not in QUICK:
            continue
        settings = {**COMMON, **settings}
        got = measure(settings)
        assert got["status"] == "done", got
        est = estimate_memory(RunConfig(**settings))
        rows.append(
            {"config": name, "settings": settings, "measured_peak": got["peak"], "after_imports": got["base"],
             "estimate": est.total, "estimate_parts": est.__dict__, "ratio": est.total / got["peak"]}
        )  # fmt: skip
        print(f"{name}: measured {fmt_bytes(got['peak'])}, estimate {fmt_bytes(est.total)} "
              f"({est.total / got['peak']:.2f}x)", flush=True)  # fmt: skip
    torch.set_num_threads(1)  # as each measured run does (the machine line says this process's threads)
    machine = machine_info("cpu")
    lines = [
        "# Memory estimate vs measured peak (CPU)",
        "",
        machine_line(machine) + " Shared with other work (resident memory does not depend on the load).",
        "",
        "Each run: a fresh process, torch at 1 thread, 2 training steps (both probed, as a study's first",
        "and last steps are), the final evaluation; its peak resident set size (`VmHWM`) against",
        "`addnorm.study.limits.estimate_memory`, which counts the process and the corpus too",
        "(`python -m benchmarks.study.memory_estimate`).",
        "",
        "| run | after imports | measured peak | estimate | estimate / measured |",
        "| --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {fmt_bytes(r['after_imports'])} | {fmt_bytes(r['measured_peak'])} | "
            f"{fmt_bytes(r['estimate'])} | {r['ratio']:.2f}x |"
        )
    under = [r["config"] for r in rows if r["ratio"] < 1]
    lines += ["", f"Estimate below the measured peak: {', '.join(under) if under else 'none'}."]
    name = "memory_estimate_cpu" + ("_quick" if args.quick else "")
    write_results(out_dir(args), name, "\n".join(lines) + "\n", {"machine": machine, "runs": rows})
    print("\n".join(lines))


if __name__ == "__main__":
    main()
