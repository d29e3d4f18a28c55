"""The op table of ``benchmarks/op/add_norm.py``: its columns (the op's default backward variant and each
other one timed beside it, the other implementations, in table order) and their rendering: the Markdown
report, the targets checked against the rows they cover, and the line printed per row."""

from __future__ import annotations

from addnorm.ops import launch_config as lc
from benchmarks.common.machine import machine_line

# every backward variant's column (launch_config.BWD_VARIANTS) as a report may hold it: one recorded
# under an earlier default has another than this run's (the H200 tables at 7722722: addnorm_row_sums)
VARIANT_COLUMNS = {f"addnorm_{v}": v for v in lc.BWD_VARIANTS}
# the op's eager columns and the backward variant each times: "addnorm" the default, then every other
# variant in its own column (``--impls addnorm_<variant>``); a GPU run times by default the candidates
# (launch_config.BWD_CANDIDATES) beside the default, until a measurement decides
OPS = {"addnorm": lc.BWD_VARIANT} | {f"addnorm_{v}": v for v in lc.BWD_VARIANTS if v != lc.BWD_VARIANT}
CANDIDATES = tuple(f"addnorm_{v}" for v in lc.BWD_CANDIDATES if v != lc.BWD_VARIANT)
IMPLS = (*OPS, "eager", "compiled", "liger", "flash_attn", "addnorm_compiled")
GPU_IMPLS = ("addnorm", *CANDIDATES, "eager", "compiled", "liger", "flash_attn")
# a report's columns in table order, the variant columns of earlier defaults included
COLUMNS = ("addnorm", *VARIANT_COLUMNS, *(i for i in IMPLS if i not in OPS))
PHASES = ("fwd", "fwd_bwd")


def speed_key(ours: str, other: str) -> str:
    """A row's key of ``other``'s fwd+bwd time over the op column ``ours``'s (>= 1: ours no slower)."""
    return f"speedup_fwd_bwd_vs_{other}" if ours == "addnorm" else f"speedup_{ours}_fwd_bwd_vs_{other}"


def check_targets(report: dict) -> list[dict]:
    """The targets, each with the rows it covers, the worst value and whether it holds: on CUDA, in bf16
    fwd+bwd no slower than torch.compile (issue 30) and than Liger-Kernel where it ran (bf16 and the
    autocast mix), each for every backward variant timed (a column ``addnorm_<variant>``: "(<variant>)"
    after the name, e.g. "(slices)"), forward >= 95% of the copy bandwidth (issue 10); on the CPU,
    RMSNorm fwd+bwd >= eager."""
    rows = report["results"]
    specs = []
    if report["device"] == "cuda":
        bf16 = [r for r in rows if r["dtype"] == "bfloat16"]
        lowp = [r for r in rows if r["dtype"] in ("bfloat16", "mixed")]
        ops = ("addnorm", *VARIANT_COLUMNS)
        for ours in (k for k in ops if k == "addnorm" or any(speed_key(k, "compiled") in r for r in rows)):
            tag = "" if ours == "addnorm" else f" ({VARIANT_COLUMNS[ours]})"
            for name, covered, other in (
                (f"bf16 fwd+bwd >= torch.compile on every shape{tag}", bf16, "compiled"),
                (f"fwd+bwd >= Liger where it ran (bf16 and the autocast mix){tag}", lowp, "liger"),
            ):
                key = speed_key(ours, other)
                specs.append((name, [r for r in covered if key in r], lambda r, k=key: r[k], 1.0, "{:.2f}x"))
        pct = lambda r: r["GBps"]["addnorm_fwd"] / r["GBps"]["copy"]  # noqa: E731
        specs.append(("bf16 forward >= 95% of copy bandwidth", bf16, pct, 0.95, "{:.0%}"))
    else:
        rms = [r for r in rows if r["norm"] == "rmsnorm" and "speedup_fwd_bwd_vs_eager" in r]
        name = "CPU add + RMSNorm forward+backward no slower than eager"
        specs.append((name, rms, lambda r: r["speedup_fwd_bwd_vs_eager"], 1.0, "{:.2f}x"))
    out = []
    for name, covered, value, bound, fmt in specs:
        if not covered:
            out.append({"target": name, "rows": 0, "worst": "-", "met": None})
            continue
        worst = min(value(r) for r in covered)
        out.append({"target": name, "rows": len(covered), "worst": fmt.format(worst), "met": worst >= bound})
    return out


def _label(row: dict) -> str:
    place = "pre " if row["prenorm"] else "post"
    return f"{row['norm']:9s} {place} p={row.get('dropout', 0):.1f} {row['dtype']:8s} h={row['hidden']:5d}"


def _line(row: dict, impls) -> str:
    ms, bw = row["ms"], row["GBps"]
    parts = [_label(row)]
    for name in impls:
        parts.append(f"{name}: fwd {ms[name + '_fwd']:.3f}ms fwd+bwd {ms[name + '_fwd_bwd']:.3f}ms")
    speeds = ", ".join(
        f"{k[8:].replace('_fwd_bwd_vs_', ' vs ').replace('fwd_bwd_vs_', '')} {v:.2f}x"
        for k, v in row.items()
        if k.startswith("speedup")
    )
    parts.append(f"copy {bw['copy']:.0f}GB/s; reps {row['reps']}; fwd+bwd speed vs {speeds}")
    return " | ".join(parts)


def to_markdown(report: dict) -> str:
    m = report["machine"]
    present = {k.rsplit("_", 1)[0] for r in report["results"] for k in r["ms"] if k.endswith("_fwd")}
    impls = [i for i in COLUMNS if i in present]
    variants = [(i, VARIANT_COLUMNS[i]) for i in impls if i in VARIANT_COLUMNS]
    # the default's variant where the report records it (reports before it did not)
    default = report.get("bwd_variants", {}).get("addnorm") if "addnorm" in impls else None
    gpu = report["device"] == "cuda"
    reps = sorted({r["reps"] for r in report["results"]})
    reps_text = f"{reps[0]}-{reps[-1]}" if len(reps) > 1 else (str(reps[0]) if reps else "-")
    lines = [
        f"# addnorm.ops.add_norm vs eager PyTorch, torch.compile, Liger ({'GPU' if gpu else 'CPU'})",
        "",
        machine_line(m),
        "",
        f"Median of {reps_text} calls per cell (sized to the budget: {report.get('budget_s') or 'none'} s), "
        "implementations timed in alternation. fwd = the training forward (inputs require grad); "
        "fwd+bwd = forward and backward. GB/s counts the minimum bytes (fwd prenorm: x, r, y, s; fwd "
        "post: x, r, y; bwd prenorm: dy, ds, s, dx; bwd post: dy, y, dx; fwd+bwd: both; mixed = bf16 x, "
        "fp32 r / s / y). % copy = our bandwidth / a device-to-device copy of x in the same row. speed vs "
        "X = X's fwd+bwd time / ours (>= 1: ours no slower"
        + (f'; addnorm: the default backward variant "{default}"' if default else "")
        + "".join(f'; {i}: the backward variant "{v}", its own speeds beside' for i, v in variants)
        + "). p = dropout on x.",
        "",
    ]
    if report.get("warm"):
        w = report["warm"]
        bad = {k: v for k, v in w["status"].items() if v != "ok"}
        lines += [f"Warm-up: every shape run once in {w['processes']} processes ({w['seconds']:.0f} s); "
                  f"failed: {bad or 'none'}.", ""]  # fmt: skip
    if report.get("note"):
        lines += [report["note"], ""]
    head = ["norm", "placement", "p", "dtype", "hidden", "rows"]
    for i in impls:
        head += [f"{i} fwd ms", f"{i} fwd+bwd ms"]
    ops = ("addnorm", *VARIANT_COLUMNS)
    speeds = [(o, i) for o in ops if o in impls for i in impls if i != o and (o == "addnorm" or i not in ops)]
    head += ["copy GB/s", "ours fwd % copy", "ours fwd+bwd % copy"]
    head += [f"{'' if o == 'addnorm' else o + ' '}speed vs {i}" for o, i in speeds]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for r in report["results"]:
        ms, bw = r["ms"], r["GBps"]
        cells = [r["norm"], "Pre-LN" if r["prenorm"] else "Post-LN", f"{r.get('dropout', 0):g}", r["dtype"]]
        cells += [str(r["hidden"]), str(r["rows"])]
        for i in impls:
            cells += [f"{ms[i + '_' + ph]:.3f}" if i + "_" + ph in ms else "-" for ph in PHASES]
        cells += [f"{bw['copy']:.0f}"]
        cells += [
            f"{bw['addnorm_' + ph] / bw['copy']:.0%}" if "addnorm_" + ph in bw else "-" for ph in PHASES
        ]
        cells += [f"{r[speed_key(o, i)]:.2f}x" if speed_key(o, i) in r else "-" for o, i in speeds]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, why in report.get("missing", {}).items():
        lines.append(f"- {name}: {why}")
    if report.get("not_reached"):
        left = report["not_reached"]
        names = ", ".join(" ".join(_label(s).split()) for s in left[:8]) + (", ..." if len(left) > 8 else "")
        lines.append(f"- not reached within the budget: {len(left)} shapes ({names})")
    lines += ["", "## Targets", "", "| target | rows | worst | met |", "| --- | --- | --- | --- |"]
    for t in check_targets(report):
        met = "-" if t["met"] is None else ("yes" if t["met"] else "NO")
        lines.append(f"| {t['target']} | {t['rows']} | {t['worst']} | {met} |")
    return "\n".join(lines) + "\n"
