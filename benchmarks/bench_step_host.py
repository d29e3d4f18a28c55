"""Host work per training step, plain vs fused, with the GPU path's Python exactly as it runs on CUDA:
a CPU proxy for what the H200 measured (issue 38: the fused step slower than the plain one while its
kernels save GPU time).

Each model is built twice from one seed: untouched (``plain``: the HF model as transformers writes it,
addnorm's LM with ``fused=False``) and ``fused`` (``addnorm.hf.fuse``; addnorm's LM with the op wherever
it can fuse, whatever the device policy says). The fused one runs the op's CUDA path on CPU tensors:
Triton's driver faked, every kernel "compiled" to a launch that does no work
(:mod:`fake_launch`), so what is left of a fused call is the Python, autograd and allocations of
``add_norm``'s eager Triton path, its direct launch included. The plain step's torch ops compute on
tensors so small (batch 1 x seq 16, hidden 64) that their CPU kernels cost about what a GPU launch
does; the fused step's launches are modelled as ``--launch-us`` of CPU time each (spun in the faked
launch; the H200 table gives no launch cost apart from the Python around it, so 0 and the default are
both shown: ``launches`` says how many a step makes, for any other cost).

Per step (one torch thread, AdamW fused as on a GPU, steps interleaved, medians, best of ``--rounds``):

- ``CPU ms``: this process's CPU time (what other work on a shared machine does not inflate);
- ``Python calls``: cProfile's count of function calls in one step (torch's Python included): host
  work that does not depend on the machine at all;
- ``launches``: kernels a GPU would launch: the aten ops that run a kernel (the torch profiler's
  top-level ops, views and allocations left out) plus the fused op's Triton launches.

Targets (issue 38): fused / plain CPU time <= 0.9 for the HF family, <= 1.0 for addnorm's LM.

    python benchmarks/bench_step_host.py [--models hf lm-gelu lm-llama] [--reps 40] [--launch-us 4]
        [--out DIR | --record]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
from collections.abc import Callable

from fake_launch import faked_launches, require_jit

require_jit()  # the real JIT kernels, before anything imports triton
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from machine import machine_info, machine_line, write_results  # noqa: E402
from results_path import add_out_argument  # noqa: E402
from timing import interleaved  # noqa: E402

import addnorm as an  # noqa: E402
from addnorm.ops import policy  # noqa: E402

LAYERS, HIDDEN, HEADS, BATCH, SEQ, VOCAB = 12, 64, 4, 1, 16, 256
TARGETS = {"hf": 0.9, "lm-gelu": 1.0, "lm-llama": 1.0}
MODELS = {
    "hf": "Hugging Face Llama (addnorm.hf.fuse)",
    "lm-gelu": "addnorm LM, LayerNorm + GELU, dropout 0.1",
    "lm-llama": "addnorm LM, RMSNorm + SwiGLU",
}
# aten ops that launch no kernel on a GPU: views, metadata and allocations
_NO_KERNEL = frozenset(
    "view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as unsqueeze squeeze "
    "slice select as_strided detach alias split chunk unbind narrow flatten unflatten view_as empty "
    "empty_like empty_strided new_empty new_empty_strided resolve_conj resolve_neg contiguous lift_fresh "
    "_has_compatible_shallow_copy_type is_same_size size stride numel dim result_type to set_ "
    "_local_scalar_dense item promote_types".split()
)


def build(name: str, fused: bool, layers: int = LAYERS) -> torch.nn.Module:
    """Model ``name`` of ``layers`` layers from seed 0, plain or fused."""
    torch.manual_seed(0)
    if name == "hf":
        import addnorm.hf as anhf

        model = anhf.tiny_model(
            "llama", seed=0, layers=layers, hidden=HIDDEN, heads=HEADS, vocab=VOCAB,
            intermediate=4 * HIDDEN, positions=SEQ, num_key_value_heads=HEADS,
        )  # fmt: skip
        return anhf.fuse(model) if fused else model
    gelu = name == "lm-gelu"
    cfg = an.TransformerConfig(
        d_model=HIDDEN, n_heads=HEADS, d_ff=4 * HIDDEN, n_layers=layers, dropout=0.1 if gelu else 0.0,
        activation="gelu" if gelu else "swiglu", norm="layernorm" if gelu else "rmsnorm", bias=gelu,
        placement="pre", max_len=SEQ,
    )  # fmt: skip
    model = an.LanguageModel(cfg, VOCAB)
    for m in model.modules():
        if isinstance(m, an.AddNorm):
            m.fused = fused
    return model


def make_step(name: str, model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One training step: forward (the HF model's own loss), backward, fused AdamW (as on a GPU)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if name == "hf":
            loss = model(input_ids=inp, labels=inp, use_cache=False).loss
        else:
            loss = F.cross_entropy(model(inp).reshape(-1, VOCAB), tgt)
        loss.backward()
        opt.step()

    return step


def python_calls(step: Callable[[], None]) -> int:
    profile = cProfile.Profile()
    profile.runcall(step)
    return pstats.Stats(profile).total_calls


def aten_launches(step: Callable[[], None]) -> int:
    """The aten ops of one step that would run a kernel on a GPU: the profiler's outermost aten ops
    (an op inside another is part of its kernel or its decomposition), less views and allocations."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    events = [e for e in prof.events() if e.name.startswith("aten::")]
    count = 0
    for e in events:
        parent, nested = e.cpu_parent, False
        while parent is not None:
            if parent.name.startswith("aten::"):
                nested = True
                break
            parent = parent.cpu_parent
        if not nested and e.name[len("aten::") :] not in _NO_KERNEL:
            count += 1
    return count


def measure(name: str, reps: int, warmup: int, rounds: int, launch_us: float, layers: int = LAYERS) -> dict:
    """Plain and fused (the op forced wherever the model can fuse), interleaved; fused with the
    launches free and with ``launch_us`` each."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=gen)
    with policy.fusion("always"):
        with faked_launches(0.0) as launches:
            steps = {"plain": make_step(name, build(name, False, layers), tokens)}
            fused = make_step(name, build(name, True, layers), tokens)
            steps["fused"] = fused

            def fused_costed() -> None:
                launches.launch_s = launch_us * 1e-6
                try:
                    fused()
                finally:
                    launches.launch_s = 0.0

            steps[f"fused, {launch_us:g} us a launch"] = fused_costed
            for step in steps.values():
                step()
            launches.count = 0
            fused()
            triton_launches = launches.count
            calls = {k: python_calls(steps[k]) for k in ("plain", "fused")}
            aten = {k: aten_launches(steps[k]) for k in ("plain", "fused")}
            timers = {k: _timer(s) for k, s in steps.items()}
            cpu_rounds: dict[str, list[float]] = {k: [] for k in steps}
            for _ in range(rounds):
                _, cpu = interleaved(timers, reps, warmup)
                for k, v in cpu.items():
                    cpu_rounds[k].append(statistics.median(v) * 1e3)
    cpu_ms = {k: min(v) for k, v in cpu_rounds.items()}
    return {
        "model": name,
        "cpu_ms": cpu_ms,
        "cpu_rounds_ms": cpu_rounds,
        "python_calls": calls,
        "launches": {"plain": aten["plain"], "fused": aten["fused"] + triton_launches},
        "triton_launches": triton_launches,
        "launch_us": launch_us,
        "layers": layers,
    }


def _timer(step: Callable[[], None]) -> Callable[[], float]:
    import time

    def timer() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    return timer


def to_markdown(rows: list[dict], machine: dict, reps: int, rounds: int, layers: int) -> str:
    launch_us = rows[0]["launch_us"]
    costed = f"fused, {launch_us:g} us a launch"
    lines = [
        "# Host work per training step, plain vs fused: the GPU path's Python on the CPU",
        "",
        machine_line(machine),
        "",
        f"{layers} layers, hidden {HIDDEN}, {HEADS} heads, FFN {4 * HIDDEN}, vocab {VOCAB}, batch {BATCH} x "
        f"seq {SEQ}, float32, one torch thread; step = forward + loss + backward + fused AdamW. Fused: "
        "the op's CUDA path (direct launch included) on CPU tensors, Triton's driver faked and each "
        f"kernel a launch that does no work, or that spins {launch_us:g} us (the modelled launch cost). "
        f"CPU ms: median of {reps} interleaved steps, best of {rounds} rounds. Python calls: cProfile's "
        "count in one step. Launches: kernels a GPU would launch (aten ops that run a kernel, plus the "
        "op's Triton launches). Target (issue 38): fused / plain CPU time <= 0.9 (HF), <= 1.0 (LM).",
        "",
        "| model | plain CPU ms | fused CPU ms | fused / plain | "
        f"{costed} / plain | target | met | plain Python calls | fused Python calls | calls ratio "
        "| plain launches | fused launches |",
        "| --- " * 13 + "|",
    ]
    for r in rows:
        c, calls, la = r["cpu_ms"], r["python_calls"], r["launches"]
        ratio, ratio_costed = c["fused"] / c["plain"], c[costed] / c["plain"]
        target = TARGETS[r["model"]]
        lines.append(
            f"| {MODELS[r['model']]} | {c['plain']:.2f} | {c['fused']:.2f} | {ratio:.3f}x | "
            f"{ratio_costed:.3f}x | <= {target} | {'yes' if ratio_costed <= target else 'NO'} | "
            f"{calls['plain']} | {calls['fused']} | {calls['fused'] / calls['plain']:.3f}x | {la['plain']} | "
            f"{la['fused']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--launch-us", type=float, default=4.0, help="modelled cost of one kernel launch")
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--label", default=None, help="a note recorded with the run")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        rows.append(measure(name, args.reps, args.warmup, args.rounds, args.launch_us, args.layers))
        r = rows[-1]
        print(name, {k: round(v, 2) for k, v in r["cpu_ms"].items()}, r["python_calls"], r["launches"],
              file=sys.stderr, flush=True)  # fmt: skip
    machine = machine_info("cpu")
    text = to_markdown(rows, machine, args.reps, args.rounds, args.layers)
    if args.label:
        text += f"\n{args.label}\n"
    print(text)
    write_results(args.out, "step_host_cpu", text, {"machine": machine, "results": rows, "label": args.label})
    return rows


if __name__ == "__main__":
    main()
