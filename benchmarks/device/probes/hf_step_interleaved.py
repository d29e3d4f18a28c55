"""One-off device probe (issue 38): the HF 134M step, variants interleaved step by step (order reversed
every other round), so that drift in the machine hits every variant alike."""

import json
import os
import statistics

import torch

from benchmarks.common.timing import interleaved
from benchmarks.step import hf_step as b

dev = torch.device("cuda")
out = {}
for name, setup in (("134m", b.GPU), ("gpu-bound", b.GPU_BOUND)):
    tokens = b.tokens_for(setup, dev)
    variants = {"plain": ("plain", None), "fused": ("fused", None)}
    if name == "134m":
        variants |= {
            "plain, backward on the calling thread": ("plain", "backward on the calling thread"),
            "fused, backward on the calling thread": ("fused", "backward on the calling thread"),
        }
    steps = {
        k: b.make_step(b.build(v, setup, dev), tokens, gpu=True, compiled=False, variant=v, switch=sw)
        for k, (v, sw) in variants.items()
    }
    rounds = int(os.environ.get("ROUNDS", "40"))
    wall, _ = interleaved(steps, rounds if name == "134m" else rounds // 2, 3)
    tok = setup.batch * setup.seq
    row = {}
    for k, v in wall.items():
        q = statistics.quantiles(v, n=4)
        row[k] = {
            "median_ms": round(statistics.median(v) * 1e3, 2),
            "q1_ms": round(q[0] * 1e3, 2),
            "q3_ms": round(q[2] * 1e3, 2),
            "tok_s": round(tok / statistics.median(v)),
        }
    # paired ratio per round: fused / plain step time in the same round
    pairs = [p / f for p, f in zip(wall["plain"], wall["fused"], strict=True)]
    row["fused/plain speed, median of paired rounds"] = round(statistics.median(pairs), 3)
    out[name] = row
    print(name, json.dumps(row, indent=1), flush=True)
    del steps
    torch.cuda.empty_cache()
