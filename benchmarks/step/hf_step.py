"""A Hugging Face Llama's training step, untouched vs ``addnorm.hf.fuse`` (vs Liger-Kernel's RMSNorm patch
on a GPU where ``liger_kernel`` imports): tokens/s and, on a GPU, peak memory.

One step = forward with labels (the model's own loss) + backward + AdamW. Random weights from a config;
random tokens.

CPU (default): a small Llama (hidden 256, 4 layers, 8 heads, 4 key/value heads, intermediate 688,
vocab 2048, batch 4 x seq 128), float32, eager, one torch thread, AdamW; variants interleaved step by
step after a warmup, medians, best of ``--rounds`` rounds. Writes ``hf_step_cpu.{md,json}``.

GPU (``--gpu``): the issue's 134M Llama (hidden 768, 12 layers, 12 heads, intermediate 2048, vocab 32000,
batch 8 x seq 1024) and a step the GPU bounds (``--setups gpu-bound``), bf16 autocast, fused AdamW,
eager and ``torch.compile``; the variants built side by side and timed step by step in alternation, as
on the CPU (:func:`run_row`), each one's peak memory measured apart. Writes ``hf_step_<device>.{md,json}``
(``h100``, ``h200``, ...); Liger missing is a line in the table, "liger: not installed". Targets (issue
38): fused >= 1.10x plain eager at 134M, >= 1.05x at the GPU-bound size, >= 1.0x compiled, >= Liger,
peak memory no more than plain's.

``--profile`` (eager): the removable time of the plain step (``benchmarks/step/removable_time.py``: its
RMSNorms, hand-written in transformers, scoped by module; the residual adds by shape) and the share of it the
fused step saves.

    python -m benchmarks.step.hf_step [--reps 30] [--rounds 3] [--profile] [--out DIR | --record]
    python -m benchmarks.step.hf_step --gpu [--modes eager,compile] [--profile]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

import addnorm.hf as anhf
from addnorm.ops import policy
from benchmarks.common import timing
from benchmarks.common.machine import device_slug, machine_info, machine_line, package_version, write_results
from benchmarks.common.results_path import add_out_argument
from benchmarks.common.timing import ORDER, interleaved, paired_speedup, peak_apart, resident_bytes
from benchmarks.common.variant_plans import BackwardVariant


@dataclass(frozen=True)
class Setup:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq: int


CPU = Setup(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=688, vocab=2048, batch=4, seq=128)
GPU = Setup(hidden=768, layers=12, heads=12, kv_heads=12, intermediate=2048, vocab=32000, batch=8, seq=1024)
# a step the GPU bounds (issue 38): wide, few layers, one long sequence; the trace step reports its
# GPU-busy share (benchmarks/host/step_trace.py)
GPU_BOUND = Setup(
    hidden=2048, layers=4, heads=16, kv_heads=16, intermediate=5632, vocab=32000, batch=1, seq=4096
)
SETUPS = {"134m": GPU, "gpu-bound": GPU_BOUND}
VARIANTS = ("plain", "fused", "liger")
# compiled, the fused model also through the op's other compile path (the registered Triton kernels)
KERNEL_PATH = "fused (compile path kernel)"


def build(variant: str, setup: Setup, device: torch.device) -> torch.nn.Module:
    """The same random Llama (seed 0) untouched, fused by addnorm, or with Liger's RMSNorm patch only."""
    model = anhf.tiny_model(
        "llama",
        seed=0,
        layers=setup.layers,
        hidden=setup.hidden,
        heads=setup.heads,
        vocab=setup.vocab,
        intermediate=setup.intermediate,
        positions=setup.seq,
        num_key_value_heads=setup.kv_heads,
    ).to(device)
    if variant.startswith("fused"):
        anhf.fuse(model)
    elif variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        from transformers.models.llama import modeling_llama

        # Liger patches the given model's modules, and also transformers' module itself
        # (``modeling_llama.LlamaRMSNorm = LigerRMSNorm``), which would make every Llama built after it in
        # this process a Liger one, "plain" included: the module's names are put back after the call
        before = dict(vars(modeling_llama))
        try:
            apply_liger_kernel_to_llama(
                rope=False, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True,
                swiglu=False, model=model,
            )  # fmt: skip
        finally:
            for name in [k for k in vars(modeling_llama) if k not in before]:
                delattr(modeling_llama, name)
            for name, value in before.items():
                if vars(modeling_llama).get(name) is not value:
                    setattr(modeling_llama, name, value)
    return model.train()


@contextlib.contextmanager
def _gc_off():
    """Python's garbage collector off for the block, on again after it if it was on (collections then
    resume at the collector's next threshold)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


# issue 38's diagnostics: one switch each on a step otherwise the same, each testing one suspect for the
# time the fused (and Liger's) eager step lost on the H200 with its kernels idle half the step: the
# backward of a Python autograd.Function runs on the CUDA device's autograd thread, which must take the
# GIL (the plain step's backward is all C++ nodes); a garbage collection inside the step (the fused
# step makes more Python objects, autograd contexts among them); the aten sums of the backward's
# partial parameter gradients (a launch each)
SWITCHES = {
    "backward on the calling thread": lambda: torch.autograd.set_multithreading_enabled(False),
    "gc off in the step": _gc_off,
    # the backward variant "kernel_sums": the partial parameter gradients added up in the kernel, no aten
    # sum per parameter after it (plain runs no add & norm: its row is a control, which at 81f67f7 moved
    # as much as the fused row did)
    'backward "kernel_sums"': BackwardVariant("kernel_sums"),
}


def make_step(
    model: torch.nn.Module, tokens: torch.Tensor, *, gpu: bool, compiled: bool, variant: str = "plain",
    switch: str | None = None,
):  # fmt: skip
    """A closure running one training step and returning its wall time in seconds. A ``fused`` variant
    runs with the op wherever the model can fuse (``set_fusion("always")``, whatever the device's
    recorded steps say: this is the measurement they come from), :data:`KERNEL_PATH` compiled through
    the registered kernels. ``switch``: one of :data:`SWITCHES`, on for the whole step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=gpu)
    forward = torch.compile(model) if compiled else model
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=gpu)
    fusion = "always" if variant.startswith("fused") else "measured"
    path = "kernel" if variant == KERNEL_PATH else policy.compile_path()
    switched = contextlib.nullcontext if switch is None else SWITCHES[switch]

    def step() -> float:
        if gpu:
            torch.cuda.synchronize()
        with switched():
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            with autocast, policy.fusion(fusion), policy.using_compile_path(path):
                loss = forward(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            opt.step()
            if gpu:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

    step.optimizer = opt  # what the step holds besides its model (timing.resident_bytes)
    return step


def tokens_for(setup: Setup, device: torch.device) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(3, setup.vocab, (setup.batch, setup.seq), generator=gen).to(device)


def _profile(step, model, setup: Setup, device: str) -> dict:
    from benchmarks.step import removable_time

    return removable_time.profile_steps(
        step,
        device=device,
        steps=2,
        model=model,
        d_model=setup.hidden,
        stream_shape=(setup.batch, setup.seq, setup.hidden),
    )


def realised(row: dict) -> dict | None:
    """The fused step's saving over plain as a share of plain's removable time (None unprofiled)."""
    prof = row.get("profile", {})
    if "plain" not in prof or "fused" not in row["ms"]:
        return None
    saving = row["ms"]["plain"] - row["ms"]["fused"]
    removable = prof["plain"]["removable_ms"]
    return {
        "removable_ms": removable,
        "saving_ms": saving,
        "share": saving / removable if removable > 0 else None,
        "fused_remaining_ms": sum(prof.get("fused", {}).get("ms", {}).get(k, 0.0) for k in
                                  ("norm", "dropout", "add", "fused")),
    }  # fmt: skip


def run_cpu(setup: Setup, reps: int, warmup: int, rounds: int, profile: bool = False) -> dict:
    """Plain and fused on the CPU (one torch thread): :func:`run_row` with ``rounds`` rounds."""
    torch.set_num_threads(1)
    tokens = tokens_for(setup, torch.device("cpu"))
    return run_row("cpu", setup, "eager", ["plain", "fused"], tokens, reps=reps, warmup=warmup,
                   rounds=rounds, profile=profile)  # fmt: skip


def run_row(
    name: str, setup: Setup, mode: str, variants: list[str], tokens: torch.Tensor, *, reps: int, warmup: int,
    rounds: int = 1, profile: bool = False, diagnose: bool = False,
) -> dict:  # fmt: skip
    """One (setup, mode) row: every variant built side by side (compiled, each compiled) and timed step
    by step in alternation (``timing.interleaved``: ``warmup`` steps each, then ``reps`` rounds, none
    right after itself), so that drift in the host's speed hits every variant alike; a
    host-bound GPU step timed one variant after another moved by 25% between runs minutes apart (H200,
    7722722). Per variant: the median step of the best of ``rounds`` rounds and the median CPU time of
    this process in a step; per pair (``paired``): the median and quartiles of the per-round ratio of
    the two steps' times (``timing.paired_speedup``). On a GPU, peak memory per variant from one more
    step of each, less what the other variants hold (``timing.peak_apart``). ``diagnose``: plain and
    fused also with each of :data:`SWITCHES` (the same models, in the same rounds). ``profile`` (eager):
    the plain and fused steps profiled one after the other."""
    device = tokens.device
    gpu = device.type == "cuda"
    compiled = mode == "compile"
    torch._dynamo.reset()
    models = {v: build(v, setup, device) for v in variants}
    steps = {v: make_step(m, tokens, gpu=gpu, compiled=compiled, variant=v) for v, m in models.items()}
    timers = dict(steps)
    switched = [(v, sw) for sw in SWITCHES for v in ("plain", "fused")] if diagnose else []
    for v, sw in switched:
        timers[f"{v}, {sw}"] = make_step(models[v], tokens, gpu=gpu, compiled=compiled, variant=v, switch=sw)
    medians: dict[str, list[float]] = {k: [] for k in timers}
    cpu_medians: dict[str, list[float]] = {k: [] for k in timers}
    walls: dict[str, list[float]] = {k: [] for k in timers}
    for _ in range(rounds):
        wall, cpu = interleaved(timers, reps, warmup)
        for k in timers:
            medians[k].append(statistics.median(wall[k]))
            cpu_medians[k].append(statistics.median(cpu[k]))
            walls[k] += wall[k]
    best = {k: min(m) for k, m in medians.items()}
    best_cpu = {k: min(m) for k, m in cpu_medians.items()}
    tok = setup.batch * setup.seq
    pairs = [(v, "plain") for v in variants if v != "plain"]
    pairs += [("fused", "liger")] if "liger" in variants else []
    row = {
        "setup": name,
        "mode": mode,
        "params": sum(p.numel() for p in models[variants[0]].parameters()),
        "ms": {v: best[v] * 1e3 for v in variants},
        "cpu_ms": {v: best_cpu[v] * 1e3 for v in variants},
        "round_ms": {v: [m * 1e3 for m in medians[v]] for v in variants},
        # every timed step in round order (timing.round_order), switches too: what the pairs were made of
        "steps_ms": {k: [round(w * 1e3, 4) for w in walls[k]] for k in timers},
        "tokens_per_s": {v: tok / best[v] for v in variants},
        "paired": {f"{a}/{b}": paired_speedup(walls, b, a) for a, b in pairs},
        "fused_over_plain": best["plain"] / best["fused"],
        "fused_over_plain_cpu_time": best_cpu["plain"] / best_cpu["fused"],
        "profile": {},
    }
    if switched:
        row["diagnostics"] = {
            sw: {v: tok / best[f"{v}, {sw}"] for v in ("plain", "fused")} for sw in SWITCHES
        }
    if gpu:
        row["peak_gib"] = {
            v: peak_apart(steps[v], resident_bytes(models[v], steps[v].optimizer)) / 2**30 for v in variants
        }
    if profile and not compiled:
        row["profile"] = {v: _profile(steps[v], models[v], setup, device.type) for v in ("plain", "fused")}
    del models, steps, timers
    if gpu:
        torch.cuda.empty_cache()
    return row


def liger_missing() -> str | None:
    """Why Liger-Kernel's Llama patch cannot run here, or None."""
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama  # noqa: F401
    except Exception as e:  # not installed, or built for another torch / Triton
        return "not installed" if isinstance(e, ModuleNotFoundError) else f"does not import ({e})"
    return None


def run_gpu(
    setups: dict[str, Setup], reps: int, warmup: int, modes: list[str], profile: bool = False, on_row=None,
    diagnose: bool = False,
) -> list[dict]:  # fmt: skip
    """A :func:`run_row` per setup and mode (eager rows first) on CUDA: plain, fused and Liger (where it
    imports); compiled, the fused model through each compile path too; ``profile`` on the eager rows,
    ``diagnose`` on the first setup's eager row. ``on_row(rows)`` after each row (the table is written
    as the rows come)."""
    device = torch.device("cuda")
    missing = liger_missing()
    rows = []
    for mode in modes:
        for i, (name, setup) in enumerate(setups.items()):
            tokens = tokens_for(setup, device)
            variants = [v for v in VARIANTS if v != "liger" or missing is None]
            variants += [KERNEL_PATH] if mode == "compile" else []
            row = run_row(name, setup, mode, variants, tokens, reps=reps, warmup=warmup, profile=profile,
                          diagnose=diagnose and mode == "eager" and i == 0)  # fmt: skip
            if missing:
                row["missing"] = {"liger": missing}
            rows.append(row)
            if on_row is not None:
                on_row(rows)
    return rows


def _machine(gpu: bool) -> dict:
    return machine_info("cuda" if gpu else "cpu") | {"transformers": package_version("transformers")}


# issue 38's acceptance: eager, fused >= 1.10x plain at 134M, >= 1.05x where the GPU bounds the step
EAGER_TARGETS = {"134m": 1.10, "gpu-bound": 1.05}


def row_label(row: dict, rows: list[dict]) -> str:
    """A row's name in the tables: its mode, after its setup where the rows have several."""
    several = len({r.get("setup") for r in rows}) > 1
    return f"{row['setup']} {row['mode']}" if several else row["mode"]


def speedup(row: dict, a: str, b: str) -> float:
    """``a``'s speed over ``b``'s in ``row`` (``timing.speedup``: the paired rounds' median)."""
    return timing.speedup(row.get("paired", {}), row["tokens_per_s"], a, b)


def check_targets(rows: list[dict], gpu: bool) -> list[dict]:
    """On a GPU, per row: fused / plain >= 1.10 eager at 134M (issue 38), >= 1.05 eager where the GPU
    bounds the step, >= 1.0 compiled (each compile path); fused >= Liger (where it ran); peak memory
    fused <= plain. On the CPU fused no slower than plain."""
    out = []
    for row in rows:
        t = row["tokens_per_s"]
        bound = EAGER_TARGETS.get(row.get("setup", "134m"), 1.05) if gpu and row["mode"] == "eager" else 1.0
        checks = [(f"fused / plain >= {bound:g}", speedup(row, "fused", "plain"), bound)]
        if KERNEL_PATH in t:
            checks.append((f"{KERNEL_PATH} / plain >= 1.0", speedup(row, KERNEL_PATH, "plain"), 1.0))
        if gpu and "liger" in t:
            checks.append(("fused / Liger >= 1.0", speedup(row, "fused", "liger"), 1.0))
        if gpu and row.get("peak_gib"):
            checks.append(
                ("peak memory plain / fused >= 1.0", row["peak_gib"]["plain"] / row["peak_gib"]["fused"], 1.0)
            )
        for name, value, b in checks:
            out.append({"mode": row_label(row, rows), "target": name, "value": value, "met": value >= b})
    return out


def _setup_line(name: str, s: Setup, params: int | None) -> str:
    count = f", {params:,} parameters" if params else ""
    return (
        f"- `{name}`: Llama, hidden {s.hidden}, {s.layers} layers, {s.heads} heads ({s.kv_heads} key/value), "
        f"intermediate {s.intermediate}, vocab {s.vocab}{count}; batch {s.batch} x seq {s.seq}"
    )


def report(
    setups: dict[str, Setup], rows: list[dict], machine: dict | str, *, gpu: bool, reps: int, warmup: int,
    rounds: int,
) -> str:  # fmt: skip
    """The Markdown table of ``rows`` (one per setup and mode)."""
    params = {r.get("setup", next(iter(setups))): r.get("params") for r in rows}
    what = "Step = forward with labels + backward + AdamW"
    if gpu:
        what += (
            f", bf16 autocast, fused AdamW. The variants are built side by side and timed step by step in "
            f"alternation, {ORDER} ({warmup} warmup + {reps} timed steps "
            "each): tokens/s of the median step; X/plain is the median over rounds of plain's step time / "
            "X's in the same round, [quartiles]; peak memory from one more step of each, less what the "
            "other variants hold. "
            'fused: `addnorm.hf.fuse` with the op wherever the model can fuse (`set_fusion("always")`; '
            "the policy's default decides from recorded steps like these); compiled, the fused model through "
            f"the op's composite and (`{KERNEL_PATH}`) its registered kernels."
        )
    else:
        what += (
            f", float32, one torch thread; {warmup} warmup + {reps} timed steps interleaved, median, best of "
            f"{rounds} rounds; tokens/s from wall time, and the process's CPU time per step (which time "
            "spent descheduled while other work runs does not inflate); fused/plain is the median over all "
            "rounds of plain's step time / fused's in the same round, [quartiles]."
        )
    variants = list(dict.fromkeys(v for r in rows for v in r["tokens_per_s"]))
    head = [f"{v} tokens/s" for v in variants] + [f"{v}/plain" for v in variants if v != "plain"]
    if gpu:
        head += [f"{v} peak GiB" for v in variants]
    else:
        head += [f"{v} CPU ms/step" for v in variants] + ["fused/plain by CPU time"]
    lines = [
        f"# Hugging Face Llama training step: untouched vs addnorm.hf.fuse ({'GPU' if gpu else 'CPU'})",
        "",
        machine_line(machine) + f" transformers {machine.get('transformers', '?')}."
        if isinstance(machine, dict)
        else f"Machine: {machine}.",
        "",
        *[_setup_line(name, s, params.get(name)) for name, s in setups.items() if name in params],
        "",
        what,
        "",
        "| mode | " + " | ".join(head) + " |",
        "| --- " * (len(head) + 1) + "|",
    ]
    for row in rows:
        t = row["tokens_per_s"]
        cells = [f"{t[v]:.0f}" if v in t else "-" for v in variants]
        cells += [
            timing.speedup_cell(row.get("paired", {}), t, v, "plain") if v in t else "-"
            for v in variants
            if v != "plain"
        ]
        if gpu:
            cells += [f"{row['peak_gib'][v]:.2f}" if v in t else "-" for v in variants]
        else:
            cells += [f"{row['cpu_ms'][v]:.1f}" for v in variants]
            cells.append(f"{row['fused_over_plain_cpu_time']:.3f}x")
        lines.append(f"| {row_label(row, rows)} | " + " | ".join(cells) + " |")
    lines.append("")
    for row in rows:
        for name, why in row.get("missing", {}).items():
            lines.append(f"- {row_label(row, rows)}: {name}: {why}")
    profiled = [(row, realised(row)) for row in rows if realised(row)]
    if profiled:
        lines += [
            "",
            "## What fusion can remove (torch profiler)",
            "",
            "Removable: what the plain step spends in its RMSNorms and residual adds, forward and backward "
            f"({'kernel' if gpu else 'CPU'} time, mean of 2 profiled steps; "
            "`benchmarks/step/removable_time.py`). "
            "Saving: plain step - fused step (the timed medians). Remaining: what the fused step still "
            "spends in add & norm.",
            "",
            "| mode | removable ms/step | saving ms/step | realised | remaining ms/step |",
            "| --- | --- | --- | --- | --- |",
        ]
        for row, r in profiled:
            share = f"{r['share']:.0%}" if r["share"] is not None else "n/a"
            lines.append(
                f"| {row_label(row, rows)} | {r['removable_ms']:.2f} | {r['saving_ms']:.2f} | {share} "
                f"| {r['fused_remaining_ms']:.2f} |"
            )
    lines += diagnostics_table(rows)
    lines += ["", "## Targets", "", "| mode | target | value | met |", "| --- | --- | --- | --- |"]
    for t in check_targets(rows, gpu):
        lines.append(f"| {t['mode']} | {t['target']} | {t['value']:.3f} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines) + "\n"


def diagnostics_table(rows: list[dict]) -> list[str]:
    """The ``diagnostics`` of the rows that have them: plain and fused tokens/s with each switch, and
    each against the same variant without it (the row's own timing)."""
    diagnosed = [r for r in rows if r.get("diagnostics")]
    if not diagnosed:
        return []
    lines = [
        "",
        "## Diagnostics: the same step with one switch on",
        "",
        "Each switch tests one suspect for the time the fused eager step lost with the GPU idle "
        "(`SWITCHES` in `benchmarks/step/hf_step.py`): a variant against itself without the switch "
        "(the table above) says what the suspect costs it; fused / plain with the switch says what is left.",
        "",
        "| mode | switch | plain tokens/s | fused tokens/s | fused/plain | plain vs without | fused vs "
        "without |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for row in diagnosed:
        t = row["tokens_per_s"]
        for switch, d in row["diagnostics"].items():
            lines.append(
                f"| {row_label(row, rows)} | {switch} | {d['plain']:.0f} | {d['fused']:.0f} | "
                f"{d['fused'] / d['plain']:.3f}x | {d['plain'] / t['plain']:.3f}x | "
                f"{d['fused'] / t['fused']:.3f}x |"
            )
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="the issue's configurations on CUDA")
    parser.add_argument("--setups", nargs="+", default=["134m"], choices=list(SETUPS), help="GPU: which")
    parser.add_argument("--modes", default="eager,compile", help="GPU: comma-separated eager,compile")
    parser.add_argument("--reps", type=int, default=None, help="timed steps (CPU 30, GPU 20)")
    parser.add_argument("--warmup", type=int, default=None, help="warmup steps (CPU 5, GPU 5)")
    parser.add_argument("--rounds", type=int, default=3, help="CPU: rounds, best median kept")
    parser.add_argument("--setup", type=json.loads, default=None, help="JSON overriding Setup fields")
    parser.add_argument("--profile", action="store_true", help="removable time and the share fused saves")
    parser.add_argument(
        "--diagnose",
        action="store_true",
        help="GPU: plain and fused again with each of SWITCHES (first setup)",
    )
    add_out_argument(parser)
    args = parser.parse_args(argv)
    setups = {name: SETUPS[name] for name in args.setups} if args.gpu else {"cpu": CPU}
    if args.setup:
        setups = {name: Setup(**{**asdict(s), **args.setup}) for name, s in setups.items()}
    reps = args.reps or (20 if args.gpu else 30)
    warmup = args.warmup if args.warmup is not None else 5
    if not args.gpu:
        torch.set_num_threads(1)  # before the machine is described: the line names the threads used
    machine = _machine(args.gpu)
    name = f"hf_step_{device_slug(machine['device'])}"

    def write(rows: list[dict]) -> dict:
        text = report(setups, rows, machine, gpu=args.gpu, reps=reps, warmup=warmup, rounds=args.rounds)
        for row in rows:
            row["realised"] = realised(row)
        payload = {"machine": machine, "setups": {k: asdict(s) for k, s in setups.items()}, "reps": reps}
        write_results(args.out, name, text, payload | {"results": rows})
        return payload | {"results": rows, "text": text}

    if args.gpu:
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device")
        modes = [m for m in args.modes.split(",") if m]
        rows = run_gpu(setups, reps, warmup, modes, args.profile, on_row=write, diagnose=args.diagnose)
    else:
        rows = [run_cpu(next(iter(setups.values())), reps, warmup, args.rounds, args.profile)]
    payload = write(rows)
    print(payload.pop("text"))
    return payload


if __name__ == "__main__":
    main()
