"""The study report: one self-contained HTML file (PNG plots embedded) built from the store alone."""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .findings import compute_findings, outcome  # noqa: E402
from .store import Store  # noqa: E402


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def _label(run: dict, experiment: str) -> str:
    return next((lab for exp, lab in run["experiments"] if exp == experiment), run["id"])


def _seedless(label: str) -> str:
    return ", ".join(p for p in label.split(", ") if not p.startswith("seed=")) or label


def _by_variant(runs: list[dict], experiment: str) -> dict[str, list[dict]]:
    """Runs grouped by their label without the seed (the seeds of one variant)."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[_seedless(_label(r, experiment))].append(r)
    return dict(sorted(groups.items()))


def _curves(store: Store, runs: list[dict], experiment: str):
    """Train and validation loss per variant: mean over seeds, shaded min-max; the held-out panel only
    when the runs evaluated during training."""
    wanted = [name for name in ("train_loss", "val_loss") if any(store.metric(r["id"], name) for r in runs)]
    if not wanted:
        return None
    fig, axes = plt.subplots(1, len(wanted), figsize=(5.5 * len(wanted), 3.8), squeeze=False)
    axes = list(axes[0])
    for label, group in _by_variant(runs, experiment).items():
        for ax, name in zip(axes, wanted, strict=True):
            series = [store.metric(r["id"], name) for r in group]
            series = [s for s in series if s]
            if not series:
                continue
            n = min(len(s) for s in series)
            steps = [s for s, _ in series[0][:n]]
            values = [[v for _, v in s[:n]] for s in series]
            if name == "train_loss" and n > 20:  # moving average for readability
                k = max(1, n // 30)
                values = [
                    [sum(v[max(0, i - k) : i + 1]) / len(v[max(0, i - k) : i + 1]) for i in range(n)]
                    for v in values
                ]
            mean = [sum(col) / len(col) for col in zip(*values, strict=True)]
            line = ax.plot(
                steps,
                mean,
                label=label + (" (diverged)" if any(r["status"] == "diverged" for r in group) else ""),
            )
            if len(values) > 1:
                lo = [min(col) for col in zip(*values, strict=True)]
                hi = [max(col) for col in zip(*values, strict=True)]
                ax.fill_between(steps, lo, hi, alpha=0.2, color=line[0].get_color())
    titles = {"train_loss": "training loss", "val_loss": "held-out loss"}
    for ax, name in zip(axes, wanted, strict=True):
        ax.set_xlabel("step")
        ax.set_ylabel("cross-entropy (nats)")
        ax.set_title(f"{experiment}: {titles[name]}")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _png(fig)


def _layer_profile(rows: list[dict], step: int, metric: str) -> dict[int, float]:
    """layer -> value at ``step``; several rows of one layer combine as sqrt(sum of squares) for
    weight-gradient norms and as their mean otherwise (update-to-weight ratios of a layer's matrices)."""
    per_layer: dict[int, list[float]] = defaultdict(list)
    for x in rows:
        if x["step"] == step and x["value"] is not None:
            per_layer[x["layer"]].append(x["value"])
    if metric == "weight_grad_norm":
        return {k: math.sqrt(sum(v * v for v in vs)) for k, vs in per_layer.items()}
    return {k: sum(vs) / len(vs) for k, vs in per_layer.items()}


def _per_layer(store: Store, runs: list[dict], experiment: str, metric: str, title: str, sublayer: str):
    """A per-layer metric at initialisation (left) and at the last probed step (right), one line per
    variant: the mean over its seeds."""
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    drawn = False
    for label, group in _by_variant(runs, experiment).items():
        profiles: list[tuple[dict[int, float], dict[int, float]]] = []
        first_step = last_step = None
        for r in group:
            rows = [x for x in store.layer_metric(r["id"], metric) if x["sublayer"] == sublayer]
            if not rows:
                continue
            steps = sorted({x["step"] for x in rows})
            first_step, last_step = steps[0], steps[-1]
            profiles.append((_layer_profile(rows, steps[0], metric), _layer_profile(rows, steps[-1], metric)))
        if not profiles:
            continue
        for i, (ax, step) in enumerate(zip(axes, (first_step, last_step), strict=True)):
            layers = sorted(set.intersection(*(set(p[i]) for p in profiles)))
            values = [sum(p[i][k] for p in profiles) / len(profiles) for k in layers]
            seeds = f" ({len(profiles)} seeds)" if len(profiles) > 1 else ""
            ax.plot([k + 1 for k in layers], values, marker="o", ms=3, label=label + seeds)
            ax.set_title(f"{title}, step {step}")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    for ax in axes:
        ax.set_xlabel("layer (1 = nearest the input)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    return _png(fig)


def _final_vs(runs: list[dict], experiment: str, axis: str, xlog: bool = False):
    """Final held-out loss against ``axis`` (learning rate, warmup, depth), one line per other setting."""
    lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for r in runs:
        label = ", ".join(
            p for p in _seedless(_label(r, experiment)).split(", ") if not p.startswith(axis + "=")
        )
        lines[label or "all"].append((r["config"][axis], outcome(r)))
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    finite = [y for pts in lines.values() for _, y in pts if math.isfinite(y)]
    cap = max(finite) * 1.15 if finite else 1.0
    for label, pts in sorted(lines.items()):
        pts.sort()
        xs = [x for x, _ in pts]
        ys = [y if math.isfinite(y) else cap for _, y in pts]
        ax.plot(xs, ys, marker="o", label=label)
        for x, (_, y) in zip(xs, pts, strict=True):
            if not math.isfinite(y):
                ax.annotate("diverged", (x, cap), fontsize=7, ha="center")
    if xlog:
        ax.set_xscale("log")
    ax.set_xlabel(axis)
    ax.set_ylabel("final held-out loss")
    ax.set_title(f"{experiment}: final loss vs {axis}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return _png(fig)


def _residual_picture(store: Store, runs: list[dict], experiment: str):
    """RMS of x, F(x) and x + F(x) at the middle layer's FFN connection, at init and after training."""
    names = ("xf_x_rms", "xf_f_rms", "xf_sum_rms")
    rows = []
    for label, group in _by_variant(runs, experiment).items():
        measured = [{n: store.metric(r["id"], n) for n in names} for r in group]
        measured = [m for m in measured if all(len(v) >= 2 for v in m.values())]
        if measured:  # mean over seeds of (value at init, value at the end)
            vals = {
                n: [(0, sum(m[n][i][1] for m in measured) / len(measured)) for i in (0, -1)] for n in names
            }
            rows.append((label, vals))
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(11, 0.5 + 0.45 * len(rows) + 1.5), sharex=True)
    for ax, idx, when in ((axes[0], 0, "initialisation"), (axes[1], -1, "end of training")):
        for i, (_, vals) in enumerate(rows):
            for j, (name, color) in enumerate((("xf_x_rms", "C0"), ("xf_f_rms", "C1"), ("xf_sum_rms", "C2"))):
                ax.barh(
                    i + (j - 1) * 0.25,
                    vals[name][idx][1],
                    height=0.25,
                    color=color,
                    label=("x", "F(x)", "x + F(x)")[j] if i == 0 else None,
                )
        ax.set_yticks(range(len(rows)), [lab for lab, _ in rows], fontsize=7)
        ax.set_title(f"RMS at {when}")
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        "the Add of Add & Norm: RMS of x, F(x) and x + F(x) at the middle layer's FFN", fontsize=10, y=1.04
    )
    axes[0].legend(fontsize=7)
    return _png(fig)


def _experiment_section(store: Store, name: str, spec_exp: dict, runs: list[dict]) -> str:
    axes = set((spec_exp.get("sweep") or {}).keys())
    parts = [f"<h2>{html.escape(name)}</h2>"]
    if spec_exp.get("description"):
        parts.append(f"<p>{html.escape(spec_exp['description'])}</p>")
    parts.append(_table(runs, name))
    figs = [("loss curves", _curves(store, runs, name))]
    for axis, log in (("lr", True), ("warmup", False), ("n_layers", False)):
        if axis in axes and len({r["config"][axis] for r in runs}) > 1:
            figs.append((f"final loss vs {axis}", _final_vs(runs, name, axis, log)))
    for metric, title, sublayer in (
        ("weight_grad_norm", "FFN weight-gradient norm", "ff"),
        ("grad_norm", "residual-stream gradient norm", ""),
        ("act_rms", "residual stream RMS", ""),
        ("update_ratio", "FFN update / weight (mean)", "ff"),
    ):
        figs.append((f"per layer: {title}", _per_layer(store, runs, name, metric, title, sublayer)))
    figs.append(("x, F(x), x + F(x)", _residual_picture(store, runs, name)))
    parts += [f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{f}">' for alt, f in figs if f]
    return "\n".join(parts)


def _table(runs: list[dict], experiment: str) -> str:
    head = "<tr><th>run</th><th>status</th><th>final train loss</th><th>final held-out loss</th><th>metric</th><th>time</th></tr>"
    body = []
    for r in runs:
        metric = "" if r["final_val_metric"] is None else f"{r['metric']} {r['final_val_metric']:.3f}"
        status = r["status"] + (f" at step {r['diverged_step']}" if r["diverged_step"] is not None else "")
        if r["error"]:
            status += f": {html.escape(r['error'][:120])}"
        fmt = lambda v: "" if v is None else f"{v:.3f}"  # noqa: E731
        body.append(
            f"<tr><td>{html.escape(_label(r, experiment))}</td><td>{status}</td>"
            f"<td>{fmt(r['final_train_loss'])}</td><td>{fmt(r['final_val_loss'])}</td><td>{metric}</td>"
            f"<td>{r['wall_s']:.1f}s</td></tr>"
        )
    return f"<table>{head}{''.join(body)}</table>"


def _ranking(store: Store, runs: list[dict], lr_experiments: set[str]) -> str:
    """Placements ranked by final held-out loss (runs outside learning-rate sweeps) and by learning-rate
    tolerance (in the sweeps: how many learning rates give a loss within 10% of the best any placement
    reached at that rate), with the residual stream's RMS per layer at the end of training."""
    placements = sorted({r["config"]["placement"] for r in runs})
    if len(placements) < 3:
        return ""
    in_sweep = lambda r: any(e in lr_experiments for e, _ in r["experiments"])  # noqa: E731
    # Compare like with like: only settings (all but placement and seed) that every placement ran.
    matched: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        if not all(e in lr_experiments for e, _ in r["experiments"]):
            rest = sorted((k, repr(v)) for k, v in r["config"].items() if k not in ("placement", "seed"))
            matched[repr(rest)].append(r)
    loss: dict[str, list[float]] = defaultdict(list)
    for group in matched.values():
        if {r["config"]["placement"] for r in group} == set(placements):
            for r in group:
                loss[r["config"]["placement"]].append(outcome(r))
    best_at: dict[float, float] = {}
    for r in filter(in_sweep, runs):
        best_at[r["config"]["lr"]] = min(best_at.get(r["config"]["lr"], math.inf), outcome(r))
    tolerant: dict[str, list[float]] = defaultdict(list)
    for r in filter(in_sweep, runs):
        if outcome(r) <= 1.1 * best_at[r["config"]["lr"]]:
            tolerant[r["config"]["placement"]].append(r["config"]["lr"])

    def mean_finite(v):
        finite = [x for x in v if math.isfinite(x)]
        return sum(finite) / len(finite) if finite else math.inf

    if not loss and not any(in_sweep(r) for r in runs):
        return ""
    rows = []
    for p in placements:
        v = loss.get(p, [])
        rows.append(
            (sum(math.isinf(x) for x in v), mean_finite(v), p, len(v), sorted(set(tolerant.get(p, []))))
        )
    rows.sort(key=lambda t: (t[0], t[1]))
    by_tol = sorted(rows, key=lambda t: (-len(t[4]), t[1]))
    tol_rank = {t[2]: i + 1 for i, t in enumerate(by_tol)}
    body = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(p)}</td><td>{'' if math.isinf(m) else f'{m:.3f}'}</td>"
        f"<td>{d} of {n}</td><td>{tol_rank[p] if best_at else ''}</td><td>{', '.join(f'{x:g}' for x in lrs)}</td></tr>"
        for i, (d, m, p, n, lrs) in enumerate(rows)
    )
    table = (
        "<h2>Ranking</h2><p>Final held-out loss: mean over the runs outside learning-rate sweeps whose "
        "settings every placement ran (diverged runs rank last). Learning-rate tolerance: the learning rates at which the placement's loss is "
        "within 10% of the best loss any placement reached at that rate.</p>"
        "<table><tr><th>rank by loss</th><th>placement</th><th>mean final loss</th><th>diverged</th>"
        f"<th>rank by lr tolerance</th><th>tolerated learning rates</th></tr>{body}</table>"
    )
    deepest = max(r["config"]["n_layers"] for r in runs)
    fig, ax = plt.subplots(figsize=(8, 4.2))
    drawn = set()
    for r in runs:
        p = r["config"]["placement"]
        if r["config"]["n_layers"] != deepest or p in drawn or r["status"] != "done":
            continue
        rows_ = [x for x in store.layer_metric(r["id"], "act_rms") if x["sublayer"] == ""]
        if not rows_:
            continue
        last = max(x["step"] for x in rows_)
        pts = sorted((x["layer"] + 1, x["value"]) for x in rows_ if x["step"] == last)
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", ms=3, label=p)
        drawn.add(p)
    if not drawn:
        plt.close(fig)
        return table
    ax.set_yscale("log")
    ax.set_xlabel("layer (1 = nearest the input)")
    ax.set_ylabel("residual stream RMS")
    ax.set_title(f"activation growth per layer at the end of training, {deepest} layers")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return table + f'<img src="data:image/png;base64,{_png(fig)}">'


STYLE = """body{font-family:system-ui,sans-serif;max-width:1150px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:1em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left}
th{background:#f3f3f3}.supported{color:#0a6d2a;font-weight:600}.not{color:#b3261e;font-weight:600}
.untested{color:#777}img{max-width:100%;display:block;margin:0.6em 0}"""


def build_report(out_dir: str | Path) -> Path:
    """Write ``out_dir/report.html`` from ``out_dir/study.sqlite``; returns its path."""
    out = Path(out_dir)
    db = out / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"out: no study database at {str(db)!r}; run `addnorm study` first")
    with Store(db) as store:
        name, spec = store.study_spec() or ("study", {"experiments": {}})
        runs = store.runs()
        findings = compute_findings(store)
        rows = []
        for f in findings:
            css = {"supported": "supported", "not supported": "not"}.get(f.verdict, "untested")
            rows.append(
                f"<tr><td>{html.escape(f.claim)}<br><small>{html.escape(f.source)}</small></td>"
                f"<td>{html.escape(f.evidence)}</td><td class='{css}'>{f.verdict}</td></tr>"
            )
        sections = []
        for exp_name, exp in (spec.get("experiments") or {}).items():
            exp_runs = [r for r in runs if any(e == exp_name for e, _ in r["experiments"])]
            if exp_runs:
                sections.append(_experiment_section(store, exp_name, exp or {}, exp_runs))
        experiments = spec.get("experiments") or {}
        ranked = {n for n, e in experiments.items() if (e or {}).get("rank")}
        lr_experiments = {n for n in ranked if "lr" in ((experiments[n] or {}).get("sweep") or {})}
        ranked_runs = [r for r in runs if any(e in ranked for e, _ in r["experiments"])]
        ranking = _ranking(store, ranked_runs, lr_experiments) if ranked_runs else ""
        counts = defaultdict(int)
        for r in runs:
            counts[r["status"]] += 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()))
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>addnorm study: {html.escape(name)}</title>
<style>{STYLE}</style></head><body>
<h1>addnorm study: {html.escape(name)}</h1>
<p>{html.escape(spec.get("description") or "")}</p>
<p>{len(runs)} runs ({summary}). Every number below is read from <code>study.sqlite</code>.</p>
<h2>Findings</h2>
<table><tr><th>claim</th><th>what this study measured</th><th>verdict</th></tr>{"".join(rows)}</table>
{ranking}
{"".join(sections)}
</body></html>"""
    path = out / "report.html"
    path.write_text(page)
    return path
