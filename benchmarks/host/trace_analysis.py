"""What a torch profiler trace of training steps says about where a step's wall time goes, read from the
Chrome trace the profiler exports (``prof.export_chrome_trace``), so that anyone can read it again from
the file on a machine without a GPU.

Per step (each inside a ``record_function`` scope named ``STEP_SCOPE``, one per step):

- ``wall_ms``: the scope's duration;
- ``gpu_busy_ms`` / ``gpu_busy_share``: the union of the GPU's kernels, copies and memsets inside it;
- ``gaps``: the longest stretches inside the step with nothing on the GPU, each with what the host was
  doing at its middle (the innermost frames open on each CPU thread) and the launches and
  synchronisations that fell inside it;
- ``launches``: kernel launches the host made (runtime ``cudaLaunchKernel*`` and driver ``cuLaunchKernel*``,
  Triton's kernels launch through the driver);
- ``syncs``: calls that make the host wait for the GPU (``*Synchronize``, blocking ``cudaMemcpy``), with
  their count and time; ``copies``: ``cudaMemcpyAsync`` calls (which block the host for pageable memory)
  (None, with the GPU figures, for a trace without GPU activity);
- ``addnorm_ms``: the host time spent in addnorm's own Python frames (their self time: a frame's
  duration less its children's), and ``python_ms`` in all Python frames, where the trace has stacks;
- ``nodes``: the backward's host time by autograd node kind (``autograd::engine::evaluate_function: X``,
  the outermost only), {X: [calls, ms]}: what each kind of node costs the thread that runs the backward
  (a fused op's Python node against the C++ nodes it replaces).

Only the standard library: the trace is JSON.
"""

from __future__ import annotations

import re
from collections import defaultdict

__all__ = ["STEP_SCOPE", "analyze", "trim"]

STEP_SCOPE = "addnorm.step"
GPU_CATS = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
HOST_CATS = frozenset({"cpu_op", "python_function", "cuda_runtime", "cuda_driver", "user_annotation"})
LAUNCH = re.compile(r"^cu(da)?LaunchKernel")
SYNC = re.compile(r"Synchronize$|^cudaMemcpy$|^cuMemcpy(DtoH|HtoD)?(_v2)?$")
ADDNORM_FRAME = re.compile(r"(^|[/\\])addnorm[/\\]")
NODE = "autograd::engine::evaluate_function: "


def _complete(events: list[dict]) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _self_times(events: list[dict]) -> dict[int, float]:
    """Each host event's own time (its duration less its direct children's on the same thread), by
    index in ``events``: events on one thread nest, so a stack walk in start order finds parents.
    ``record_function`` scopes take no part: they open and close inside Python calls without nesting in
    them (a scope entered inside the builtin that opens it would count as that builtin's child)."""
    own = {}
    by_thread = defaultdict(list)
    for i, e in enumerate(events):
        by_thread[(e.get("pid"), e.get("tid"))].append(i)
    for idx in by_thread.values():
        idx.sort(key=lambda i: (events[i]["ts"], -events[i]["dur"]))
        stack: list[int] = []
        for i in idx:
            e = events[i]
            own[i] = float(e["dur"])
            if e.get("cat") == "user_annotation":
                continue  # a record_function scope opens inside a Python call and outlasts it: no frame
            while stack and events[stack[-1]]["ts"] + events[stack[-1]]["dur"] <= e["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= e["dur"]
            stack.append(i)
    return own


def _nodes(events: list[dict]) -> dict[str, list[float]]:
    """The outermost autograd nodes among ``events`` by kind: {kind: [calls, ms]}, most time first."""
    out: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    end: dict[object, float] = {}  # per thread: where the node being counted ends
    for e in sorted((e for e in events if e["name"].startswith(NODE)), key=lambda e: e["ts"]):
        tid = (e.get("pid"), e.get("tid"))
        if e["ts"] < end.get(tid, float("-inf")):
            continue  # inside a node already counted (a node that runs another)
        end[tid] = e["ts"] + e["dur"]
        kind = out[e["name"][len(NODE) :]]
        kind[0] += 1
        kind[1] += e["dur"] / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


def _open_at(events: list[dict], t: float, depth: int) -> list[str]:
    """What each host thread was inside at time ``t``: its innermost ``depth`` frames, outer first."""
    by_thread = defaultdict(list)
    for e in events:
        if e["ts"] <= t < e["ts"] + e["dur"]:
            by_thread[e.get("tid")].append(e)
    out = []
    for tid, open_ in by_thread.items():
        open_.sort(key=lambda e: (e["ts"], -e["dur"]))
        names = [_short(e["name"]) for e in open_[-depth:]]
        out.append(f"thread {tid}: " + " > ".join(names))
    return out


def _short(name: str) -> str:
    """A frame's name without its directories (``.../addnorm/ops/functional.py(350): add_norm`` ->
    ``addnorm/ops/functional.py(350): add_norm``)."""
    m = re.search(r"((addnorm|transformers|torch|triton)[/\\].*)$", name)
    return (m.group(1) if m else name)[:100]


def analyze(trace: dict, *, gaps: int = 3, depth: int = 4) -> list[dict]:
    """One record per ``STEP_SCOPE`` scope of a Chrome ``trace`` (see the module docstring)."""
    events = _complete(trace.get("traceEvents", []))
    steps = sorted(
        (e for e in events if e["name"] == STEP_SCOPE and e.get("cat") == "user_annotation"),
        key=lambda e: e["ts"],
    )
    gpu = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS]
    host = [e for e in events if e.get("cat") in HOST_CATS and e["name"] != STEP_SCOPE]
    own = _self_times(host)
    records = []
    for s in steps:
        t0, t1 = s["ts"], s["ts"] + s["dur"]
        inside = [i for i, e in enumerate(host) if t0 <= e["ts"] < t1]
        busy = _merge([(max(a, t0), min(b, t1)) for a, b in gpu if b > t0 and a < t1])
        busy_us = sum(b - a for a, b in busy)
        idle, edge = [], t0
        for a, b in busy:
            idle.append((edge, a))
            edge = b
        idle.append((edge, t1))
        idle = sorted((g for g in idle if g[1] > g[0]), key=lambda g: g[0] - g[1])[:gaps] if gpu else []
        names = [host[i]["name"] for i in inside]
        launches = sum(1 for n in names if LAUNCH.match(n)) if gpu else None
        syncs = [host[i] for i in inside if SYNC.search(host[i]["name"])]
        copies = [host[i] for i in inside if host[i]["name"] in ("cudaMemcpyAsync", "cuMemcpyAsync")]
        py = [i for i in inside if host[i].get("cat") == "python_function"]
        records.append(
            {
                "wall_ms": s["dur"] / 1e3,
                "gpu_busy_ms": busy_us / 1e3 if gpu else None,
                "gpu_busy_share": busy_us / s["dur"] if gpu and s["dur"] else None,
                "gaps": [
                    {
                        "ms": (b - a) / 1e3,
                        "at_ms": (a - t0) / 1e3,
                        "host": _open_at(host, (a + b) / 2, depth),
                        "launches": sum(1 for e in host if a <= e["ts"] < b and LAUNCH.match(e["name"])),
                        "syncs": sum(1 for e in host if a <= e["ts"] < b and SYNC.search(e["name"])),
                    }
                    for a, b in idle
                ],
                "launches": launches,
                "syncs": len(syncs) if gpu else None,
                "sync_ms": sum(e["dur"] for e in syncs) / 1e3,
                "sync_names": sorted({e["name"] for e in syncs}),
                "copies": len(copies) if gpu else None,
                "copy_ms": sum(e["dur"] for e in copies) / 1e3,
                "python_ms": sum(own[i] for i in py) / 1e3 if py else None,
                "addnorm_ms": sum(own[i] for i in py if ADDNORM_FRAME.search(host[i]["name"])) / 1e3
                if py
                else None,
                "nodes": _nodes([host[i] for i in inside]),
            }
        )
    return records


def trim(trace: dict, label: str, keep_frame: re.Pattern[str] | None = None) -> list[dict]:
    """``trace``'s events for a combined trace file: every process renamed ``label: <pid>`` (so several
    runs sit side by side in one viewer), and Python frames kept only where ``keep_frame`` matches
    their name (default: addnorm's, the model's and the benchmark's own), the rest of the stack being
    torch's module plumbing."""
    keep = keep_frame or re.compile(r"addnorm[/\\]|transformers[/\\]models|benchmarks[/\\]")
    out = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "python_function" and not keep.search(e.get("name", "")):
            continue
        e = dict(e)
        if "pid" in e:
            e["pid"] = f"{label}: {e['pid']}"
        out.append(e)
    return out
