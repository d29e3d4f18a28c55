"""Wall time of `addnorm study` (default: the `quick` preset) on an idle machine and beside one other
CPU-bound process, to check that the study never oversubscribes the cores (goal: contended <= 2x idle).

    python -m benchmarks.study.contention [--preset quick] [--rivals busy,torch] [--single]
        [--out benchmarks/results]

Each measurement runs the whole CLI (`python -m addnorm study PRESET --out TMP --quiet`, default
`--workers auto`) into a fresh folder. A rival is started first and killed after:

- ``busy``: one single-threaded Python busy loop;
- ``torch``: a torch matrix-multiply loop with torch's default threads (one per core), like another
  engineer's test suite.

``--single`` also times one 6-layer training run in-process at 1 and 2 torch threads, idle and beside
each rival: the oversubscription the study's default avoids. Run it under the machine-wide lock
(`flock /tmp/addnorm-cpu.lock python -m benchmarks.study.contention`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common.machine import cpu_model
from benchmarks.common.results_path import add_out_argument

RIVALS = {
    "busy": [sys.executable, "-c", "while True: pass"],
    "torch": [
        sys.executable,
        "-c",
        "import torch\na = torch.randn(512, 512)\nwhile True: a = torch.tanh(a @ a / 512)",
    ],
}
SINGLE = (
    "import time, torch, sys\n"
    "torch.set_num_threads(int(sys.argv[1]))\n"
    "from addnorm.train import RunConfig, train\n"
    "train(RunConfig(steps=2, eval_every=0))\n"  # warm the corpus cache
    "t = time.perf_counter()\n"
    "train(RunConfig(n_layers=6, steps=150, eval_every=75, placement='pre'))\n"
    "print(time.perf_counter() - t)\n"
)


def with_rival(rival: str | None, command: list[str]) -> tuple[float, str]:
    """(wall seconds, stdout) of ``command`` while ``rival`` runs beside it."""
    proc = subprocess.Popen(RIVALS[rival], stdout=subprocess.DEVNULL) if rival else None
    try:
        time.sleep(1.0 if rival else 0.0)  # let the rival get going
        start = time.perf_counter()
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        return time.perf_counter() - start, out
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="quick")
    parser.add_argument("--rivals", default="busy,torch", help="comma-separated: busy, torch")
    parser.add_argument("--single", action="store_true", help="also time one run at 1 and 2 threads")
    add_out_argument(parser)
    args = parser.parse_args()
    rivals = [None] + [r for r in args.rivals.split(",") if r]
    rows = []
    for rival in rivals:
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, "-m", "addnorm", "study", args.preset, "--out", tmp, "--quiet"]
            wall, out = with_rival(rival, cmd)
        rows.append(
            {"what": f"`addnorm study {args.preset}`", "rival": rival or "none", "wall_s": round(wall, 1)}
        )
        print(rows[-1], out.strip().splitlines()[0], flush=True)
    if args.single:
        for threads in (1, 2):
            for rival in rivals:
                wall, out = with_rival(rival, [sys.executable, "-c", SINGLE, str(threads)])
                rows.append({"what": f"one run, {threads} thread(s)", "rival": rival or "none",
                             "wall_s": round(float(out.strip()), 1)})  # fmt: skip
                print(rows[-1], flush=True)
    idle = {r["what"]: r["wall_s"] for r in rows if r["rival"] == "none"}
    for r in rows:
        r["vs_idle"] = round(r["wall_s"] / idle[r["what"]], 2)
    record = {
        "machine": f"{cpu_model()}, {os.cpu_count()} cores",
        "torch": torch.__version__,
        "date": dt.date.today().isoformat(),
        "rivals": {k: " ".join(v[2:]) if len(v) > 2 else v for k, v in RIVALS.items()},
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"study_{args.preset}_contention.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
