"""The tables of ``benchmarks/step/lm_step.py``: its report (a record: machine, configurations, rows of cells)
rendered as Markdown, and the targets each row is judged by. Ratios between columns are the paired
rounds' medians where the row has them (``timing.speedup``)."""

from __future__ import annotations

from collections.abc import Callable

from benchmarks.common.machine import machine_line
from benchmarks.common.timing import PREVIOUS_ORDER, speedup, speedup_cell

# the ratios the table and the targets read, (a, b): a's speed over b's
KERNEL_SUMS = "fused (kernel_sums)"  # the column of the candidate backward "kernel_sums" (bench_lm_step)
# the column of the candidate: a sublayer's normed input written by the op in autocast's dtype
AUTOCAST_H = "fused (autocast h)"
CANDIDATES = (KERNEL_SUMS, AUTOCAST_H)  # eager-only columns, each against "fused"
RATIOS = (
    ("default", "fused=False"),
    ("fused", "fused=False"),
    ("default", "nn.TransformerEncoder"),
    (KERNEL_SUMS, "fused"),  # the candidate backward against the default's, both fused (rows that have it)
    (AUTOCAST_H, "fused"),  # the candidate h dtype against the stream's, both fused (rows that have it)
)


def _ratio_of(row: dict) -> Callable[[str, str], float]:
    """``ratio(a, b)``: column ``a``'s speed over ``b``'s in ``row`` (``timing.speedup``: the median of
    the paired rounds' ratios where the row has them)."""
    tokens = {k: v["tokens_per_s"] for k, v in row["cells"].items()}
    return lambda a, b: speedup(row.get("paired", {}), tokens, a, b)


def check_targets(report: dict) -> list[dict]:
    """Per row: default / fused=False >= 0.98 (never slower than the unfused modules beyond the runs'
    spread); fused / fused=False >= 1.05 eager on a GPU (issue 38), else >= 1.0; on a GPU also default /
    nn.TransformerEncoder >= 1.0 (where that column ran), peak memory default <= fused=False, and with a
    profile the realised share of the removable time >= 70%."""
    out = []
    gpu = report["device"] == "cuda"
    for r in report["rows"]:
        c = r["cells"]
        if "fused=False" not in c:
            continue
        ratio = _ratio_of(r)
        checks = []  # a row without "default" (compiled rows timed without it: --compiled-columns) has none
        if "default" in c:
            checks.append(("default / fused=False >= 0.98", ratio("default", "fused=False"), 0.98, "{:.3f}x"))
        if "fused" in c:
            bound = 1.05 if r["mode"] == "eager" and gpu else 1.0
            checks.append(
                (f"fused / fused=False >= {bound}", ratio("fused", "fused=False"), bound, "{:.3f}x")
            )
        if gpu and "nn.TransformerEncoder" in c and "default" in c:
            te = ratio("default", "nn.TransformerEncoder")
            checks.append(("default / nn.TransformerEncoder >= 1.0", te, 1.0, "{:.3f}x"))
        if gpu and "default" in c:
            mem = c["fused=False"]["peak_mib"] / c["default"]["peak_mib"]
            checks.append(("peak memory fused=False / default >= 1.0", mem, 1.0, "{:.3f}"))
        share = (r.get("realised") or {}).get("share")
        if gpu and share is not None:
            checks.append(("realised share of removable time >= 70%", share, 0.7, "{:.0%}"))
        for name, value, bound, fmt in checks:
            out.append(
                {
                    "model": r.get("model", "gelu"),
                    "placement": r["placement"],
                    "mode": r["mode"],
                    "target": name,
                    "value": value,
                    "shown": fmt.format(value),
                    "met": value >= bound,
                }
            )
    return out


def _model_line(name: str, cfg: dict) -> str:
    act = {"gelu": "GELU", "swiglu": "SwiGLU"}.get(cfg["activation"], cfg["activation"])
    norm = {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}.get(cfg["norm"], cfg["norm"])
    return (
        f"- `{name}`: d_model {cfg['d_model']}, {cfg['n_layers']} layers, {cfg['n_heads']} heads, {norm} + "
        f"{act}, d_ff {cfg['d_ff']}, {'biases' if cfg['bias'] else 'no biases'}, dropout {cfg['dropout']}, "
        f"vocab {cfg['vocab']}, batch {cfg['batch']} x seq {cfg['seq']}"
    )


def _timing_line(report: dict) -> str:
    """How the columns were timed against each other, where the rows were recorded with ``paired``
    ratios (interleaved steps; rows recorded before have none)."""
    if not any(r.get("paired") for r in report["rows"]):
        return ""
    line = (
        " The columns are built side by side and timed step by step in alternation, "
        f"{report.get('order', PREVIOUS_ORDER)}; a ratio is the median over rounds of the two steps' times "
        "in the same round, [quartiles]."
    )
    if report["device"] == "cuda":
        line += (
            " Peak memory: one more step of each, less what the other columns hold (CUDA graphs: one "
            "column at a time, without ratios' quartiles)."
        )
    return line


def to_markdown(report: dict) -> str:
    m = report["machine"]
    gpu = report["device"] == "cuda"
    cols = list(dict.fromkeys(k for r in report["rows"] for k in r["cells"]))
    lines = [
        f"# Training step: addnorm.LanguageModel default vs fused=False ({'GPU' if gpu else 'CPU'})",
        "",
        machine_line(m),
        "",
        *[_model_line(name, cfg) for name, cfg in report["configs"].items()],
        "",
        f"{report['dtype']}; AdamW{' (fused)' if gpu else ''}. Step = forward + cross-entropy + backward + "
        f"optimizer; tokens/s of the median of {report['steps']} steps after {report['warmup']} warmup "
        f"steps. Default compile path of the op: {report['compile_path_default']}.{_timing_line(report)}",
        "",
    ]
    if report.get("warm"):
        w = report["warm"]
        failed = {k: v for k, v in w["cells"].items() if v != "ok"}
        lines += [
            f"Compiled cells precompiled in parallel ({w['seconds']:.0f} s); failed: {failed or 'none'}.",
            "",
        ]
    if report.get("compile_backend", "inductor") != "inductor":  # earlier reports: Inductor
        lines += [
            f"Compiled rows: torch.compile backend {report['compile_backend']}, not Inductor's times.",
            "",
        ]
    if report.get("note"):
        lines += [report["note"], ""]
    # the candidate's ratio only in reports that time it (earlier tables render as they were)
    ratios = [(a, b) for a, b in RATIOS if a not in CANDIDATES or a in cols]
    head = (
        ["model", "placement", "mode"] + [f"{c} tokens/s" for c in cols] + [f"{a} / {b}" for a, b in ratios]
    )
    if gpu:
        head += [f"{c} peak MiB" for c in cols]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["rows"]:
        c = r["cells"]
        cells = [r.get("model", "gelu"), r["placement"], r["mode"]]
        cells += [f"{c[k]['tokens_per_s']:,.0f}" if k in c else "-" for k in cols]
        tokens = {k: v["tokens_per_s"] for k, v in c.items()}
        for col, other in ratios:
            shown = col in c and other in c
            cells.append(speedup_cell(r.get("paired", {}), tokens, col, other) if shown else "-")
        if gpu:
            cells += [f"{c[k]['peak_mib']:,.0f}" if k in c else "-" for k in cols]
        lines.append("| " + " | ".join(cells) + " |")
    profiled = [r for r in report["rows"] if r.get("realised")]
    if profiled:
        lines += [
            "",
            "## What fusion can remove (torch profiler)",
            "",
            f"Removable time: what the fused=False step spends in the branch dropout, the residual add and "
            f"the norms, forward and backward ({'kernel time' if gpu else 'CPU time of the ops'}, mean of "
            f"{report['profile_steps']} profiled steps; how ops are classified: "
            "`benchmarks/step/removable_time.py`). "
            "Saving: fused=False step time - fused step time (the timed medians; fused: the op wherever the "
            "model can fuse). Realised = saving / removable. Remaining: what the fused step still spends in "
            "add & norm (the fused op's kernels included).",
            "",
            "| model | placement | mode | removable ms/step | norm | dropout | add | saving ms/step "
            "| realised | remaining ms/step |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for r in profiled:
            x = r["realised"]
            share = f"{x['share']:.0%}" if x["share"] is not None else "n/a (nothing classified)"
            rem = f"{x['fused_remaining_ms']:.2f}" if x["fused_remaining_ms"] is not None else "-"
            by = x["by_class_ms"]
            lines.append(
                f"| {r.get('model', 'gelu')} | {r['placement']} | {r['mode']} | {x['removable_ms']:.2f} | "
                f"{by['norm']:.2f} | {by['dropout']:.2f} | {by['add']:.2f} | {x['saving_ms']:.2f} | {share} "
                f"| {rem} |"
            )
    lines += [
        "",
        "## Targets",
        "",
        "| model | placement | mode | target | value | met |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for t in check_targets(report):
        met = "yes" if t["met"] else "NO"
        lines.append(
            f"| {t['model']} | {t['placement']} | {t['mode']} | {t['target']} | {t['shown']} | {met} |"
        )
    return "\n".join(lines) + "\n"
