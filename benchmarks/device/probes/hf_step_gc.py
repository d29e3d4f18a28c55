"""One-off device probe (issue 38): which garbage collections run in the HF 134M step, on which thread,
for how long; plain and fused each as the suite times them (one variant after another), as is, with
gc.freeze() after warmup, and with the backward on the calling thread."""

import gc
import json
import statistics
import threading
import time

import torch

from benchmarks.step import hf_step as b

events = []


def cb(phase, info):
    if phase == "start":
        cb.t0 = time.perf_counter()
    else:
        events.append(
            (
                info["generation"],
                (time.perf_counter() - cb.t0) * 1e3,
                threading.current_thread().name == "MainThread",
            )
        )


gc.callbacks.append(cb)
dev = torch.device("cuda")
setup = b.GPU
tokens = b.tokens_for(setup, dev)
out = {}
for variant in ("plain", "fused"):
    for mode in ("default", "freeze", "threads off"):
        torch._dynamo.reset()
        gc.unfreeze()
        gc.collect()
        model = b.build(variant, setup, dev)
        step = b.make_step(
            model,
            tokens,
            gpu=True,
            compiled=False,
            variant=variant,
            switch="backward on the calling thread" if mode == "threads off" else None,
        )
        for _ in range(3):
            step()
        if mode == "freeze":
            gc.collect()
            gc.freeze()
        events.clear()
        times = [step() for _ in range(6)]
        ev = list(events)
        by = {}
        for g, ms, main in ev:
            k = f"gen{g} {'main' if main else 'other'}"
            by.setdefault(k, [0, 0.0])
            by[k][0] += 1
            by[k][1] += ms
        row = {
            "ms": round(statistics.median(times) * 1e3, 2),
            "tok_s": round(setup.batch * setup.seq / statistics.median(times)),
            "gc per 6 steps": {k: [n, round(t, 2)] for k, (n, t) in by.items()},
            "objects": len(gc.get_objects()),
        }
        out[f"{variant} {mode}"] = row
        print(variant, mode, row, flush=True)
        del model, step
        torch.cuda.empty_cache()
print(json.dumps(out, indent=1))
