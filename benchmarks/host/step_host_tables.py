"""The host-work proxy's table (``benchmarks/host/step_host.py``): its models, targets and variants, the host
work of a recorded row and its paired ratios, and the Markdown report. No torch: rows are records
(``step_host_cpu.json``), rendered here.
"""

from __future__ import annotations

import statistics

from benchmarks.common.machine import machine_line
from benchmarks.common.timing import pair_cell, paired_speedup

LAYERS, HIDDEN, HEADS, BATCH, SEQ, VOCAB = 12, 64, 4, 1, 16, 256
TARGETS = {"hf": 0.9, "lm-gelu": 1.0, "lm-llama": 1.0}
SEEDED = ("lm-gelu",)  # the models with dropout: their fused step also timed with the previous seeds
PREVIOUS = "fused (randint seeds)"
KERNEL_SUMS = "fused (kernel_sums)"  # the fused step, backward variant "kernel_sums" (``with_variant``)
FLOOR = "floor"  # the fused model, a do-nothing autograd.Function in the op's place (``floored``)
# addnorm's LMs also under autocast to bfloat16, as the GPU's steps run (``with_autocast``): plain, fused
# and fused with the candidate sublayer input in autocast's dtype (``stream.AUTOCAST_SUBLAYER_INPUT``)
AUTOCAST_PLAIN, AUTOCAST_FUSED, AUTOCAST_H = "plain (autocast)", "fused (autocast)", "fused (autocast h)"
AUTOCAST = (AUTOCAST_PLAIN, AUTOCAST_FUSED, AUTOCAST_H)
MODELS = {
    "hf": "Hugging Face Llama (addnorm.hf.fuse)",
    "lm-gelu": "addnorm LM, LayerNorm + GELU, dropout 0.1",
    "lm-llama": "addnorm LM, RMSNorm + SwiGLU",
}


def host_work(row: dict, launch_us: float, cpu_ms: dict[str, float] | None = None) -> dict[str, float]:
    """Modelled host work per step (ms) of each variant: CPU time + launches x ``launch_us``; the CPU
    times ``cpu_ms`` (default the row's best-of-rounds ones)."""
    cpu = row["cpu_ms"] if cpu_ms is None else cpu_ms
    return {k: cpu[k] + n * launch_us / 1e3 for k, n in row["launches"].items() if k in cpu}


def round_work(row: dict, launch_us: float, variant: str) -> list[float]:
    """``variant``'s host work in each round (ms), from that round's median CPU time."""
    launches = row["launches"][variant] * launch_us / 1e3
    return [cpu + launches for cpu in row["cpu_rounds_ms"][variant]]


def paired_ratio(
    row: dict, launch_us: float, variant: str = "fused", base: str = "plain"
) -> dict[str, float]:
    """``variant``'s host work over ``base``'s as the table gives it: per round, the ratio of the two
    variants' medians in that round (timed interleaved, under the same load: a paired ratio, which load
    that drifts between rounds moves less than a ratio of best-of-rounds times), then the median of
    those ratios and their quartiles, as the GPU step tables give theirs (``timing.paired_speedup``).
    The targets read the median."""
    work = {k: round_work(row, launch_us, k) for k in (variant, base)}
    return paired_speedup(work, variant, base)


def round_ratios(row: dict, launch_us: float, variant: str = "fused", base: str = "plain") -> list[float]:
    """The rounds' paired ratios of :func:`paired_ratio`, in round order."""
    return [
        v / b
        for v, b in zip(round_work(row, launch_us, variant), round_work(row, launch_us, base), strict=True)
    ]


def _section(title: str, prose: str, head: str, rows: list[dict], row_lines) -> list[str]:
    """A Markdown section of the rows ``rows`` (none where that is empty): its title, its prose, its
    table's head (``head`` the columns, ``|``-separated) and ``row_lines(row)``'s lines for each row."""
    if not rows:
        return []
    columns = head.count("|") + 1
    head_lines = ["", f"## {title}", "", prose, "", f"| {head} |", "| --- " * columns + "|"]
    return head_lines + [line for r in rows for line in row_lines(r)]


def _having(rows: list[dict], variant: str) -> list[dict]:
    """The rows that timed ``variant``."""
    return [r for r in rows if variant in r["cpu_ms"]]


def _met(value: float, target: float) -> str:
    """A row's target and whether ``value`` meets it: two cells."""
    return f"<= {target} | {'yes' if value <= target else 'NO'}"


def _variant_cells(r: dict, k: str, label: str, work: dict[str, float]) -> str:
    """A side-by-side row's first cells: the model, the variant ``k`` as ``label``, its CPU ms,
    launches and host work."""
    return f"| {MODELS[r['model']]} | {label} | {r['cpu_ms'][k]:.2f} | {r['launches'][k]} | {work[k]:.2f} |"


def to_markdown(rows: list[dict], machine: dict, reps: int, rounds: int, launch_us: float, how: str) -> str:
    layers = rows[0]["layers"]
    lines = [
        "# Host work per training step, plain vs fused: the GPU path's Python on the CPU",
        "",
        machine_line(machine),
        "",
        f"{layers} layers, hidden {HIDDEN}, {HEADS} heads, FFN {4 * HIDDEN}, vocab {VOCAB}, batch {BATCH} x "
        f"seq {SEQ}, float32, one torch thread; step = forward + loss + backward + fused AdamW. Fused: the "
        "op wherever the model can fuse, on its CUDA path (direct launch included) on CPU tensors, "
        "Triton's driver faked and each kernel a launch that does no work; its backward on several "
        "programs, their partial parameter gradients summed after it (an aten sum each), as at the H200's "
        "sizes (`gpu_sized_backward`). CPU ms: this process's CPU "
        f"time, median of {reps} interleaved steps, best of {rounds} rounds. Python calls: cProfile's count "
        "in one step. Launches: kernels a GPU would launch (aten ops that run a kernel, plus the op's Triton "
        f"launches). Host work: CPU ms + launches x L, L = {launch_us:.1f} us a launch ({how}). Ratios "
        f"(fused / plain): per round, the two variants' medians in that round (interleaved: the same load), "
        f"then the median of the {rounds} rounds' ratios [their quartiles], as the GPU step tables give "
        "theirs; the target is met where that median is within it. Target (issue 38): fused / plain host "
        "work <= 0.9 (HF), <= 1.0 (LM).",
        "",
        "| model | plain CPU ms | fused CPU ms | CPU fused / plain | plain launches | fused launches | "
        "plain host work ms | fused host work ms | host work fused / plain | target | met | plain Python "
        "calls | fused Python calls | calls fused / plain |",
        "| --- " * 14 + "|",
    ]
    for r in rows:
        c, calls, la = r["cpu_ms"], r["python_calls"], r["launches"]
        work, pair = host_work(r, launch_us), paired_ratio(r, launch_us)
        cpu = paired_speedup(r["cpu_rounds_ms"], "fused", "plain")
        lines.append(
            f"| {MODELS[r['model']]} | {c['plain']:.2f} | {c['fused']:.2f} | {pair_cell(cpu)} | "
            f"{la['plain']} | {la['fused']} | {work['plain']:.2f} | {work['fused']:.2f} | "
            f"{pair_cell(pair)} | {_met(pair['median'], TARGETS[r['model']])} | "
            f"{calls['plain']} | {calls['fused']} | {calls['fused'] / calls['plain']:.3f}x |"
        )

    def by_round(r: dict) -> list[str]:
        per, best = round_ratios(r, launch_us), host_work(r, launch_us)
        met = sum(x <= TARGETS[r["model"]] for x in per)
        return [
            f"| {MODELS[r['model']]} | {min(per):.3f}x | {statistics.median(per):.3f}x | {max(per):.3f}x | "
            f"{best['fused'] / best['plain']:.3f}x | {met} of {len(per)} |"
        ]

    def floor(r: dict) -> list[str]:
        over_floor = paired_speedup(r["cpu_rounds_ms"], "fused", FLOOR)
        floor_pair, fused_pair = paired_ratio(r, launch_us, FLOOR), paired_ratio(r, launch_us)
        return [
            f"| {MODELS[r['model']]} | {r['cpu_ms'][FLOOR]:.2f} | {pair_cell(floor_pair)} | "
            f"{pair_cell(fused_pair)} | {pair_cell(over_floor)} | {r['python_calls'][FLOOR]} |"
        ]

    def seeded(r: dict) -> list[str]:
        work = host_work(r, launch_us)
        return [
            f"{_variant_cells(r, k, label, work)} {pair_cell(paired_ratio(r, launch_us, k))} |"
            for k, label in (("fused", "host (default)"), (PREVIOUS, "randint (previous)"))
        ]

    def kernel_sums(r: dict) -> list[str]:
        work, pairs = (
            host_work(r, launch_us),
            {k: paired_ratio(r, launch_us, k) for k in ("fused", KERNEL_SUMS)},
        )
        return [
            f"{_variant_cells(r, k, label, work)} {pair_cell(pairs[k])} | "
            f"{_met(pairs[k]['median'], TARGETS[r['model']])} |"
            for k, label in (("fused", "default"), (KERNEL_SUMS, '"kernel_sums"'))
        ]

    def autocast(r: dict) -> list[str]:
        work = host_work(r, launch_us)
        over = {
            (k, base): "-" if k == base else pair_cell(paired_ratio(r, launch_us, k, base))
            for k in AUTOCAST
            for base in (AUTOCAST_PLAIN, AUTOCAST_FUSED)
        }
        return [
            f"{_variant_cells(r, k, k, work)} {over[k, AUTOCAST_PLAIN]} | {over[k, AUTOCAST_FUSED]} |"
            for k in AUTOCAST
        ]

    def instructions(r: dict) -> list[str]:
        ins, la = r["instructions"], r["launches"]
        rate = ins["plain"] / (r["cpu_ms"]["plain"] * 1e3)
        work = {k: ins[k] + la[k] * launch_us * rate for k in ins}
        ratio = work["fused"] / work["plain"]
        extra = [
            f"{ins[k] / 1e6:.1f} | {work[k] / work['plain']:.3f}x |" if k in ins else "- | - |"
            for k in (FLOOR, KERNEL_SUMS)
        ]
        return [
            f"| {MODELS[r['model']]} | {ins['plain'] / 1e6:.1f} | {ins['fused'] / 1e6:.1f} | "
            f"{ins['fused'] / ins['plain']:.3f}x | {ratio:.3f}x | {_met(ratio, TARGETS[r['model']])} | "
            + " ".join(extra)
        ]

    lines += _section(
        "Round by round",
        f"Host work fused / plain in each of the {rounds} rounds (each round's own medians, the variants "
        "interleaved in it): how far the machine's noise moves the ratio, and in how many rounds the "
        "target holds. Best of rounds: the ratio of the two variants' best-of-rounds host work (the "
        "table's ratio before 2026-11-28: each variant's quietest round, not necessarily the same one).",
        "model | min | median | max | best of rounds | rounds within target",
        rows,
        by_round,
    )
    lines += _section(
        "The floor: a do-nothing Python op in the op's place",
        "The fused model with each fused add & norm replaced by an `autograd.Function` that only "
        "allocates its outputs and gradients (`_Floor`: nothing computed, the fused step's launches "
        "counted for it): the least any Python op can cost this step. Fused over floor: the op's own "
        "host code, beyond what calling a Python op at all costs.",
        "model | floor CPU ms | floor host work / plain | fused host work / plain | "
        "fused / floor CPU time | floor Python calls",
        _having(rows, FLOOR),
        floor,
    )
    lines += _section(
        "The dropout seed's source, side by side",
        "The fused step as above (dropout seeds drawn on the host from the generator's Philox state, "
        "`addnorm.ops.seeds`) and with the previous source (`set_seed_source('randint')`: a one-element "
        "`torch.randint` on the device per dropout call), timed in the same interleaved rounds.",
        "model | seeds | CPU ms | launches | host work ms | host work / plain",
        _having(rows, PREVIOUS),
        seeded,
    )
    lines += _section(
        'The backward\'s partial sums added up in its kernel (variant "kernel_sums"), side by side',
        "The fused step as above (the default backward variant: its programs' partial parameter "
        "gradients summed after the kernel, an aten sum each) and with the candidate variant "
        '"kernel_sums" (the last programs add them up inside the kernel: no sum launched), timed in the '
        "same interleaved rounds. A candidate made without a GPU: it becomes the default only where a "
        "GPU measures it no slower (`launch_config.BWD_CANDIDATES`).",
        "model | backward | CPU ms | launches | host work ms | host work / plain | target | met",
        _having(rows, KERNEL_SUMS),
        kernel_sums,
    )
    lines += _section(
        "Under autocast to bfloat16, and the candidate sublayer input, side by side",
        "addnorm's LMs as the GPU's steps run them, under `torch.autocast` to bfloat16 (here the CPU's: "
        "its linear layers compute in bfloat16 on this CPU, the same work in each of the three): plain, "
        "fused as above, and fused with the candidate `stream.AUTOCAST_SUBLAYER_INPUT` (the op writes "
        "each sublayer's normed input in bfloat16, which its linear layer would cast it to: no cast, no "
        "cast's backward), timed in the same interleaved rounds. A candidate made without a GPU: the "
        'default where the GPU suite\'s LM step measures it no slower (column "fused (autocast h)").',
        "model | step | CPU ms | launches | host work ms | host work / plain (autocast) | "
        "host work / fused (autocast)",
        _having(rows, AUTOCAST_H),
        autocast,
    )
    lines += _section(
        "Instructions per step (valgrind's callgrind; the same count whatever the machine's load)",
        "Each variant in its own process under callgrind, counters zeroed after 3 warmup steps, 5 steps "
        "counted. Host work in instructions: instructions + launches x L x r, r = the plain step's "
        "instructions per us of its CPU time above.",
        "model | plain M instr/step | fused M instr/step | fused / plain | host work fused / plain | "
        'target | met | floor M instr/step | host work floor / plain | "kernel_sums" M instr/step | '
        'host work "kernel_sums" / plain',
        [r for r in rows if r.get("instructions")],
        instructions,
    )
    return "\n".join(lines) + "\n"
