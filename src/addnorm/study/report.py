"""The study report: one self-contained HTML file (PNG plots embedded) built from the store alone.

It starts with what was run (the base configuration, each experiment's settings, the provenance of the
runs), then the findings with their rule, the ranking when the spec asks for one, and one section per
experiment. Plots stay readable with many series: past :data:`MAX_INLINE` series the legend moves
outside the axes and curves split into small multiples; colours come from a qualitative palette with a
distinct colour (and marker) per series; loss axes clip first-step spikes and say so on the plot.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections import defaultdict
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, MaxNLocator, NullFormatter  # noqa: E402

from .findings import INCONCLUSIVE, NOT_SUPPORTED, RULE, SUPPORTED, compute_findings, outcome  # noqa: E402
from .ranking import ALPHA, DIVERGED, rank, spearman  # noqa: E402
from .spec import SpecError, parse_spec  # noqa: E402
from .store import Store, write_atomic  # noqa: E402

MAX_INLINE = 6  # more series than this: legend outside the axes, curves in small multiples
MARKERS = "osD^vP*Xh<>"
plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8})


def _png(fig) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode()


def palette(n: int) -> list[tuple[str, str]]:
    """(colour, marker) for ``n`` series: tab10 up to 10; past that tab20 (darker shades first, so
    neighbours differ) with a marker per series, distinct pairs up to 20 x 11."""
    if n <= 10:
        colours = [plt.get_cmap("tab10")(i) for i in range(10)]
    else:
        cmap = plt.get_cmap("tab20")
        colours = [cmap(i) for i in range(0, 20, 2)] + [cmap(i) for i in range(1, 20, 2)]
    if n <= 10:
        return [(colours[i], "o") for i in range(n)]
    # past ten series a marker per series as well, so neighbours differ in two ways
    return [(colours[i % len(colours)], MARKERS[i % len(MARKERS)]) for i in range(n)]


def _legend(fig, axes, n: int, title: str | None = None) -> None:
    """Inside the first panel for a few series; to the right of the figure, in columns, for more."""
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        return
    if n <= MAX_INLINE and len(axes) == 1:
        axes[0].legend(title=title)
        return
    ncol = 1 if n <= 20 else 2
    fig.legend(
        handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), ncol=ncol, title=title, frameon=False
    )


def _layer_axis(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (1 = nearest the input)")


def _log_axis(ax, values: list[float]) -> None:
    """A log y axis with plain tick labels that spans at least a factor of 2, so a constant profile
    reads as flat instead of magnifying rounding noise into a zigzag."""
    ax.set_yscale("log")
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive:
        lo, hi = min(positive), max(positive)
        if hi / lo < 2:
            mid = math.sqrt(lo * hi)
            ax.set_ylim(min(lo, mid / 1.42) / 1.05, max(hi, mid * 1.42) * 1.05)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    low, high = ax.get_ylim()
    if high / low < 12:  # within about a decade the minor ticks need labels; beyond, they would collide
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


def _robust_top(values: list[float], steps: list[int]) -> tuple[float, float] | None:
    """(clip, highest) when the first steps' spike would squash the rest of a loss axis, else None."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    late = sorted(
        v for v, s in zip(values, steps, strict=True) if math.isfinite(v) and s >= max(steps) * 0.05
    )
    if not late:
        return None
    q = late[int(0.98 * (len(late) - 1))]
    lo = min(finite)
    clip = q + 0.25 * (q - lo)
    return (clip, max(finite)) if max(finite) > clip * 1.05 else None


def _clip_note(ax, top: tuple[float, float] | None) -> None:
    if top is None:
        return
    ax.set_ylim(top=top[0])
    ax.text(
        0.99,
        0.98,
        f"y clipped at {top[0]:.2f} (early steps reach {top[1]:.1f})",
        transform=ax.transAxes,
        ha="right",
        va="top",
        fontsize=7,
        color="#555",
    )


# --- runs, labels and facets ---------------------------------------------------------------------------
def _label(run: dict, experiment: str) -> str:
    return next((lab for exp, lab in run["experiments"] if exp == experiment), run["id"])


def _seedless(label: str) -> str:
    return ", ".join(p for p in label.split(", ") if not p.startswith("seed=")) or label


def _by_variant(runs: list[dict], experiment: str) -> dict[str, list[dict]]:
    """Runs grouped by their label without the seed (the seeds of one variant), in spec order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[_seedless(_label(r, experiment))].append(r)
    return dict(groups)


def _facets(labels: list[str]) -> tuple[dict[str, tuple[str, str]], list[str], list[str]]:
    """Split labels "a=1, b=2, c=3" into (facet, series) when there are more than MAX_INLINE: the part
    with the most distinct values names the series (one colour each), the other parts the panel.
    Returns {label: (facet, series)}, the facets and the series in order."""
    parts = [lab.split(", ") for lab in labels]
    width = {len(p) for p in parts}
    if len(labels) <= MAX_INLINE or len(width) != 1 or width.pop() < 2:
        split = {lab: ("", lab) for lab in labels}
    else:
        n = len(parts[0])
        colour = max(  # most distinct values; on a tie the placement, which the findings compare
            range(n),
            key=lambda i: (len(dict.fromkeys(p[i] for p in parts)), parts[0][i].startswith("placement=")),
        )
        split = {
            lab: (", ".join(x for i, x in enumerate(p) if i != colour), p[colour])
            for lab, p in zip(labels, parts, strict=True)
        }
    facets = list(dict.fromkeys(f for f, _ in split.values()))
    series = list(dict.fromkeys(s for _, s in split.values()))
    return split, facets, series


def _grid(n_panels: int, width: float = 5.2, height: float = 3.4, max_cols: int = 4):
    cols = min(max_cols, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout="constrained"
    )
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def _smooth(values: list[float], k: int) -> list[float]:
    return [
        sum(values[max(0, i - k) : i + 1]) / len(values[max(0, i - k) : i + 1]) for i in range(len(values))
    ]


def _mean_curve(store: Store, group: list[dict], name: str):
    """(steps, mean over seeds, min, max) of a per-step metric; None when no run recorded it."""
    series = [s for s in (store.metric(r["id"], name) for r in group) if s]
    if not series:
        return None
    n = min(len(s) for s in series)
    steps = [s for s, _ in series[0][:n]]
    values = [[v for _, v in s[:n]] for s in series]
    if name == "train_loss" and n > 20:  # moving average for readability
        values = [_smooth(v, max(1, n // 30)) for v in values]
    cols = list(zip(*values, strict=True))
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def _curves(store: Store, runs: list[dict], experiment: str) -> list[tuple[str, str]]:
    """Loss curves per variant (mean over seeds, shaded min-max): train and held-out side by side, or
    one figure per metric in small multiples when there are many variants."""
    names = [n for n in ("train_loss", "val_loss") if any(len(store.metric(r["id"], n)) >= 2 for r in runs)]
    if not names:  # nothing that makes a curve (e.g. runs of one step that only probe the initialisation)
        return []
    groups = _by_variant(runs, experiment)
    split, facets, series = _facets(list(groups))
    colours = dict(zip(series, palette(len(series)), strict=True))
    titles = {"train_loss": "training loss", "val_loss": "held-out loss"}
    layouts = [(names, [""])] if facets == [""] else [([n], facets) for n in names]
    out = []
    for metrics, panel_facets in layouts:
        fig, axes = _grid(len(metrics) * len(panel_facets), width=5.2 if facets == [""] else 4.2)
        panel = {
            (m, f): axes[i * len(panel_facets) + j]
            for i, m in enumerate(metrics)
            for j, f in enumerate(panel_facets)
        }
        spans: dict = defaultdict(lambda: ([], []))
        for label, group in groups.items():
            facet, name_ = split[label]
            colour, marker = colours[name_]
            diverged = any(r["status"] == "diverged" for r in group)
            for m in metrics:
                curve = _mean_curve(store, group, m)
                if curve is None:
                    continue
                ax = panel[(m, facet)]
                steps, mean, lo, hi = curve
                ax.plot(
                    steps,
                    mean,
                    color=colour,
                    marker=marker,
                    markevery=max(1, len(steps) // 6),
                    ms=3,
                    label=name_ + (" (diverged)" if diverged else ""),
                )
                if len(group) > 1:
                    ax.fill_between(steps, lo, hi, alpha=0.15, color=colour)
                spans[ax][0].extend(hi)
                spans[ax][1].extend(steps)
        for (m, facet), ax in panel.items():
            ax.set_xlabel("step")
            ax.set_ylabel(f"{titles[m]} (nats)")
            ax.set_title(f"{titles[m]}" + (f": {facet}" if facet else ""))
            ax.grid(alpha=0.3)
            if ax in spans:
                _clip_note(ax, _robust_top(*spans[ax]))
        _legend(fig, axes, len(series))
        what = " and ".join(titles[m] for m in metrics)
        out.append((f"{experiment}: {what}, mean over seeds (shaded: min to max)", _png(fig)))
    return out


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


LAYER_PANELS = {
    "weight_grad_norm": ("ff", "FFN weight-gradient norm"),
    "grad_norm": ("", "residual-stream gradient norm"),
    "act_rms": ("", "residual-stream RMS"),
    "update_ratio": ("ff", "FFN update / weight (mean)"),
}


def _per_layer(store: Store, runs: list[dict], experiment: str, metrics: list[str], when: str):
    """Per-layer metrics side by side (one column each) at initialisation (``when="init"``) or at the
    last probed step (``"end"``), one line per variant (mean over seeds), one row per facet."""
    groups = _by_variant(runs, experiment)
    split, facets, series = _facets(list(groups))
    colours = dict(zip(series, palette(len(series)), strict=True))
    data: dict = {}
    steps_seen = set()
    for label, group in groups.items():
        for m in metrics:
            sub = LAYER_PANELS[m][0]
            profiles = []
            for r in group:
                rows = [x for x in store.layer_metric(r["id"], m) if x["sublayer"] == sub]
                if rows:
                    steps = sorted({x["step"] for x in rows})
                    step = steps[0] if when == "init" else steps[-1]
                    if when == "end" and step == 0:
                        continue
                    steps_seen.add(step)
                    profiles.append(_layer_profile(rows, step, m))
            if profiles:
                layers = sorted(set.intersection(*(set(p) for p in profiles)))
                data[(label, m)] = (
                    [k + 1 for k in layers],
                    [sum(p[k] for p in profiles) / len(profiles) for k in layers],
                    len(profiles),
                )
    shown = [m for m in metrics if any(key[1] == m for key in data)]
    if not shown:
        return None
    fig, axes = _grid(len(facets) * len(shown), width=4.4, height=3.1, max_cols=len(shown))
    panel = {(f, m): axes[i * len(shown) + j] for i, f in enumerate(facets) for j, m in enumerate(shown)}
    plotted: dict = defaultdict(list)
    for (label, m), (xs, ys, n) in data.items():
        facet, name_ = split[label]
        colour, marker = colours[name_]
        seeds = f" ({n} seeds)" if n > 1 and len(series) <= MAX_INLINE else ""
        panel[(facet, m)].plot(xs, ys, color=colour, marker=marker, ms=3.5, label=name_ + seeds)
        plotted[(facet, m)] += ys
    moment = "at initialisation" if when == "init" else f"at step {max(steps_seen)}"
    for (facet, m), ax in panel.items():
        _layer_axis(ax)
        _log_axis(ax, plotted[(facet, m)])
        ax.set_ylabel(LAYER_PANELS[m][1] + " (log)")
        ax.set_title(LAYER_PANELS[m][1] + (f"\n{facet}" if facet else ""))
        ax.grid(alpha=0.3, which="both")
    _legend(fig, axes, len(series))
    fig.suptitle(f"{experiment}: per layer {moment}, mean over seeds", fontsize=10)
    return f"{experiment}: per-layer {', '.join(LAYER_PANELS[m][1] for m in shown)} {moment}", _png(fig)


def _final_vs(runs: list[dict], experiment: str, axis: str, xlog: bool = False):
    """Final held-out loss against ``axis`` (learning rate, warmup, depth), one line per other setting:
    the mean over seeds, each seed a faint point; small multiples when there are many lines."""
    lines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in runs:
        label = ", ".join(
            p for p in _seedless(_label(r, experiment)).split(", ") if not p.startswith(axis + "=")
        )
        lines[label or "all"][r["config"][axis]].append(outcome(r))
    finite = [y for pts in lines.values() for ys in pts.values() for y in ys if math.isfinite(y)]
    cap = max(finite) * 1.1 if finite else 1.0
    split, facets, series = _facets(list(lines))
    styles = dict(zip(series, palette(len(series)), strict=True))
    fig, axes = _grid(len(facets), width=7.5 if len(facets) == 1 else 5.2, height=4.2, max_cols=2)
    panel = dict(zip(facets, axes, strict=True))
    for label, pts in lines.items():
        facet, name = split[label]
        ax, (colour, marker) = panel[facet], styles[name]
        xs = sorted(pts)
        means = []
        for x in xs:
            ys = pts[x]
            ok = [y for y in ys if math.isfinite(y)]
            means.append(sum(ok) / len(ok) if len(ok) == len(ys) else cap)
            if len(ys) > 1:
                ax.scatter([x] * len(ok), ok, color=colour, alpha=0.35, s=10)
            if len(ok) < len(ys):
                ax.annotate("diverged", (x, cap), fontsize=7, ha="center", va="bottom")
        ax.plot(xs, means, color=colour, marker=marker, label=name)
    for facet, ax in panel.items():
        if xlog:
            ax.set_xscale("log")
        if axis in ("n_layers", "warmup"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(axis)
        ax.set_ylabel("final held-out loss (nats)")
        ax.set_title(facet)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{experiment}: final loss vs {axis} (mean over seeds; diverged runs drawn at the top)")
    _legend(fig, axes, len(series))
    return f"{experiment}: final loss vs {axis}", _png(fig)


def _residual_picture(store: Store, runs: list[dict], experiment: str):
    """RMS of x, F(x) and x + F(x) at the middle layer's FFN connection, at init and after training."""
    names = ("xf_x_rms", "xf_f_rms", "xf_sum_rms")
    rows = []
    for label, group in _by_variant(runs, experiment).items():
        measured = [{n: store.metric(r["id"], n) for n in names} for r in group]
        measured = [m for m in measured if all(len(v) >= 2 for v in m.values())]
        if measured:  # mean over seeds of (value at init, value at the end)
            rows.append(
                (
                    label,
                    {n: [sum(m[n][i][1] for m in measured) / len(measured) for i in (0, -1)] for n in names},
                )
            )
    if not rows:
        return None
    height = 1.2 + 0.42 * len(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, height), sharey=True, layout="constrained")
    colours = palette(3)
    for ax, idx, when in ((axes[0], 0, "initialisation"), (axes[1], -1, "end of training")):
        for i, (_, vals) in enumerate(rows):
            for j, name in enumerate(names):
                ax.barh(
                    i + (j - 1) * 0.27,
                    vals[name][idx],
                    height=0.27,
                    color=colours[j][0],
                    label=("x", "F(x)", "x + F(x)")[j] if i == 0 else None,
                )
        ax.set_yticks(range(len(rows)), [lab for lab, _ in rows])
        ax.invert_yaxis()
        ax.set_xlabel("RMS")
        ax.set_title(f"at {when}")
        ax.grid(alpha=0.3, axis="x")
    axes[1].tick_params(labelleft=False)
    axes[1].legend(loc="lower right")
    fig.suptitle(
        f"{experiment}: the Add of Add & Norm, RMS of x, F(x) and x + F(x) at the middle layer's FFN"
    )
    return f"{experiment}: RMS of x, F(x), x + F(x)", _png(fig)


def _experiment_section(store: Store, name: str, spec_exp: dict, runs: list[dict]) -> str:
    axes = set((spec_exp.get("sweep") or {}).keys())
    parts = [f"<h2 id='{html.escape(name)}'>{html.escape(name)}</h2>"]
    if spec_exp.get("description"):
        parts.append(f"<p>{html.escape(' '.join(str(spec_exp['description']).split()))}</p>")
    parts.append(_table(runs, name))
    figs = _curves(store, runs, name)
    for axis, log in (("lr", True), ("warmup", False), ("n_layers", False)):
        if axis in axes and len({r["config"][axis] for r in runs}) > 1:
            figs.append(_final_vs(runs, name, axis, log))
    figs.append(_per_layer(store, runs, name, ["weight_grad_norm", "grad_norm", "act_rms"], "init"))
    figs.append(_per_layer(store, runs, name, ["weight_grad_norm", "act_rms", "update_ratio"], "end"))
    figs.append(_residual_picture(store, runs, name))
    parts += [
        f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{f}">' for alt, f in filter(None, figs)
    ]
    return "\n".join(parts)


def _fmt(v) -> str:
    return "" if v is None else f"{v:.3f}"


def _table(runs: list[dict], experiment: str) -> str:
    head = "<tr><th>run</th><th>status</th><th>final train loss</th><th>final held-out loss</th><th>metric</th><th>time</th></tr>"
    body = []
    for r in runs:
        metric = "" if r["final_val_metric"] is None else f"{r['metric']} {r['final_val_metric']:.3f}"
        status = r["status"] + (f" at step {r['diverged_step']}" if r["diverged_step"] is not None else "")
        if r["error"]:
            status += f": {html.escape(r['error'][:160])}"
        body.append(
            f"<tr><td>{html.escape(_label(r, experiment))}</td><td>{status}</td>"
            f"<td>{_fmt(r['final_train_loss'])}</td><td>{_fmt(r['final_val_loss'])}</td><td>{metric}</td>"
            f"<td>{(r['wall_s'] or 0):.1f}s</td></tr>"
        )
    return f"<details><summary>{len(runs)} runs</summary><table>{head}{''.join(body)}</table></details>"


# Keys that set how a model is built, which differ between addnorm's transformer and a Hugging Face family
# by construction (the family keeps its own activation, norm and positions; kv_heads etc. are its own).
ARCH_KEYS = (
    "model",
    "activation",
    "norm",
    "bias",
    "norm_bias",
    "positional",
    "init",
    "kv_heads",
    "rope_theta",
    "fused",
)
HF_ONLY_KEYS = ("hf_init",)  # shown for Hugging Face families only (addnorm's model has one value)


def _settings(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """Runs grouped by setting (every key but placement and seed), each named by the keys that differ
    between the settings (``n_layers=8, model=hf-llama``); in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        rest = sorted((k, repr(v)) for k, v in r["config"].items() if k not in ("placement", "seed"))
        groups.setdefault(repr(rest), []).append(r)
    configs = [g[0]["config"] for g in groups.values()]
    keys = sorted(
        {
            k
            for c in configs
            for k in c
            if k not in ("placement", "seed") and len({repr(x.get(k)) for x in configs}) > 1
        }
    )
    if "model" in keys:  # across architectures, the keys one of them ignores would only add noise
        keys = ["model"] + [k for k in keys if k not in ARCH_KEYS]

    def title(config: dict) -> str:
        shown = [k for k in keys if not (k in HF_ONLY_KEYS and config.get("model", "addnorm") == "addnorm")]
        return ", ".join(f"{k}={config.get(k)}" for k in shown) or "all runs"

    return [(title(g[0]["config"]), g) for g in groups.values()]


def _ranking_plot(tables: list[tuple[str, list]]) -> str:
    """Each setting's placements in rank order: the mean and its 95% interval, the letters of its tied
    groups beside it, dark where tied with the best."""
    fig, axes = plt.subplots(
        1,
        len(tables),
        figsize=(4.6 * len(tables), 0.28 * max(len(r) for _, r in tables) + 1.4),
        layout="constrained",
        squeeze=False,
    )
    for ax, (title, rows) in zip(axes[0], tables, strict=True):
        rows = [r for r in rows if math.isfinite(r.mean)]
        for y, r in enumerate(rows):
            colour = "#999" if r.groups == DIVERGED else ("#1f4e99" if r.best else "#e08a2c")
            err = 0.0 if math.isnan(r.high) else r.high - r.mean
            ax.errorbar(r.mean, y, xerr=err, fmt="o", color=colour, ms=4, capsize=3)
            ax.annotate(
                r.groups,
                (r.mean + err, y),
                xytext=(5, 0),
                textcoords="offset points",
                va="center",
                fontsize=8,
            )
        ax.set_yticks(range(len(rows)), [r.name for r in rows])
        ax.invert_yaxis()
        ax.margins(x=0.12)
        ax.set_xlabel("final held-out loss (nats), mean and 95% interval")
        ax.set_title(title, fontsize=8, wrap=True)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        "letters: placements sharing one are tied; blue: tied with the best, orange: worse than the best",
        fontsize=8,
    )
    return f'<img alt="ranking with intervals" src="data:image/png;base64,{_png(fig)}">'


def _side_by_side(tables: list[tuple[str, list]]) -> str:
    """Every setting's rank and letter groups per placement in one table, with Spearman's rank
    correlation of each setting's ranking with the first one's over the placements both ran: does the
    ranking transfer?"""
    rows = [{r.name: r for r in ranked} for _, ranked in tables]
    ranks = [{n: r.rank for n, r in table.items()} for table in rows]
    names = sorted({n for t in ranks for n in t}, key=lambda n: (ranks[0].get(n, math.inf), n))
    head = "".join(f"<th>{html.escape(t)}</th>" for t, _ in tables)
    body = "".join(
        f"<tr><td>{html.escape(n)}</td>"
        + "".join(f"<td>{f'{t[n].rank} ({t[n].groups})' if n in t else 'n/a'}</td>" for t in rows)
        + "</tr>"
        for n in names
    )
    rho = "".join(
        f"<td>{'' if i == 0 else ('n/a' if math.isnan(s := spearman(ranks[0], ranks[i])) else f'{s:+.2f}')}</td>"
        for i in range(len(tables))
    )
    best = [{n for n, r in table.items() if r.best} for table in rows]
    shared = ", ".join(sorted(set.intersection(*best))) or "none"
    return (
        "<h3>Side by side: does the ranking transfer?</h3><p class='note'>Rank (letter groups) of each "
        "placement in each setting; the last row is Spearman's rank correlation with the first setting's "
        "ranking over the placements both ran (+1: the same order). Tied with the best in every setting: "
        f"{html.escape(shared)}.</p>"
        f"<table><tr><th>placement</th>{head}</tr>{body}<tr><th>Spearman vs first</th>{rho}</tr></table>"
    )


def _lr_tolerance(runs: list[dict]) -> str:
    """How many learning rates of the sweeps give a placement a loss within 10% of the best any placement
    reached at that rate."""
    best_at: dict[float, float] = {}
    for r in runs:
        best_at[r["config"]["lr"]] = min(best_at.get(r["config"]["lr"], math.inf), outcome(r))
    tolerant: dict[str, set[float]] = defaultdict(set)
    for r in runs:
        p = str(r["config"]["placement"])
        tolerant[p]
        if outcome(r) <= 1.1 * best_at[r["config"]["lr"]]:
            tolerant[p].add(r["config"]["lr"])
    order = sorted(tolerant, key=lambda p: (-len(tolerant[p]), p))
    body = "".join(
        f"<tr><td>{i + 1}</td><td>{html.escape(p)}</td><td>{', '.join(f'{x:g}' for x in sorted(tolerant[p]))}</td></tr>"
        for i, p in enumerate(order)
    )
    return (
        "<h3>Learning-rate tolerance</h3><p class='note'>The learning rates at which the placement's loss "
        "(any seed) is within 10% of the best loss any placement reached at that rate.</p>"
        f"<table><tr><th>rank by lr tolerance</th><th>placement</th><th>tolerated learning rates</th></tr>{body}</table>"
    )


def _ranking(store: Store, runs: list[dict], lr_experiments: set[str]) -> str:
    """Placements ranked per setting by final held-out loss over seeds (:mod:`addnorm.study.ranking`:
    mean ± sd, 95% intervals, letter groups of statistically tied placements), the settings side by side, the
    learning-rate tolerance in the sweeps, and the residual stream's RMS per layer at the end of training."""
    placements = sorted({str(r["config"]["placement"]) for r in runs})
    if len(placements) < 3:
        return ""
    only_sweep = lambda r: all(e in lr_experiments for e, _ in r["experiments"])  # noqa: E731
    tables = []
    for title, group in _settings([r for r in runs if not only_sweep(r)]):
        samples: dict[str, list[float]] = defaultdict(list)
        for r in group:
            samples[str(r["config"]["placement"])].append(outcome(r))
        if len(samples) >= 3:
            tables.append((title, rank(samples)))
    parts = [
        "<h2 id='ranking'>Ranking</h2><p class='note'>Per setting (every setting but placement and seed), "
        "placements ranked by final held-out loss: mean ± sd over seeds and the 95% interval of the mean. "
        "Groups: two placements that share a letter are tied (the test does not separate them, which is "
        "not the same as equal), two that share none differ (Welch's t-test between every pair, "
        f"Holm-corrected at {ALPHA:g}); letters follow the rank order, and a placement with a wide spread "
        "may carry the letters of neighbours that differ from each other. Tied with the best: shares a "
        "letter with rank 1. A placement with a diverged seed ranks last. Few seeds separate little "
        "(one seed: nothing): sweep more seeds for a ranking to cite.</p>"
    ]
    for title, rows in tables:
        body = "".join(
            f"<tr><td>{r.rank}</td><td>{html.escape(r.name)}</td><td>{r.text()}</td>"
            f"<td>{'' if math.isnan(r.low) or math.isinf(r.low) else f'{r.low:.3f} to {r.high:.3f}'}</td>"
            f"<td>{r.groups}</td><td>{'yes' if r.best else ''}</td>"
            f"<td>{r.n}{f' ({r.diverged} diverged)' if r.diverged else ''}</td></tr>"
            for r in rows
        )
        parts.append(
            f"<h3>{html.escape(title)}</h3><table><tr><th>rank</th><th>placement</th><th>final loss</th>"
            f"<th>95% interval</th><th>groups</th><th>tied with the best</th><th>seeds</th></tr>{body}</table>"
        )
    if tables:
        parts.append(_ranking_plot(tables))
    if len(tables) > 1:
        parts.append(_side_by_side(tables))
    swept = [r for r in runs if any(e in lr_experiments for e, _ in r["experiments"])]
    if swept:
        parts.append(_lr_tolerance(swept))
    return "".join(parts) + _growth_plot(store, runs, placements)


def _growth_plot(store: Store, runs: list[dict], placements: list[str]) -> str:
    """The residual stream's RMS per layer at the end of training, deepest runs, one line per placement."""
    deepest = max(r["config"]["n_layers"] for r in runs)
    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    drawn: list[str] = []
    styles = dict(zip(placements, palette(len(placements)), strict=True))
    for r in runs:
        p = str(r["config"]["placement"])
        if r["config"]["n_layers"] != deepest or p in drawn or r["status"] != "done":
            continue
        rows_ = [x for x in store.layer_metric(r["id"], "act_rms") if x["sublayer"] == ""]
        if not rows_:
            continue
        last = max(x["step"] for x in rows_)
        pts = sorted((x["layer"] + 1, x["value"]) for x in rows_ if x["step"] == last)
        colour, marker = styles[p]
        ax.plot([a for a, _ in pts], [b for _, b in pts], color=colour, marker=marker, ms=4, label=p)
        drawn.append(p)
    if not drawn:
        plt.close(fig)
        return ""
    _log_axis(ax, [y for line in ax.get_lines() for y in line.get_ydata()])
    _layer_axis(ax)
    ax.set_ylabel("residual-stream RMS (log)")
    ax.set_title(f"activation growth per layer at the end of training, {deepest} layers (first seed)")
    ax.grid(alpha=0.3, which="both")
    _legend(fig, [ax], len(drawn), title="placement")
    return f'<img alt="activation growth per layer" src="data:image/png;base64,{_png(fig)}">'


def _kv_table(pairs: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in pairs)
    return f"<table class='kv'>{cells}</table>"


def _value(v) -> str:
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_value(x)}" for k, x in v.items()) + "}" if v else "{}"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _configuration(spec: dict, base: dict, runs: list[dict]) -> str:
    """The base config, each experiment's settings and sweep, and the runs' provenance."""
    base = base or spec.get("base") or {}
    given = set((spec.get("base") or {}).keys())
    cells = [
        f"<th>{html.escape(k)}</th><td{' class=given' if k in given else ''}>{html.escape(_value(v))}</td>"
        for k, v in base.items()
    ]
    half = (len(cells) + 1) // 2  # two columns of key: value
    base_rows = "".join(
        f"<tr>{cells[i]}{cells[i + half] if i + half < len(cells) else '<td></td><td></td>'}</tr>"
        for i in range(half)
    )
    exp_rows = []
    for name, exp in (spec.get("experiments") or {}).items():
        exp = exp or {}
        sets = ", ".join(f"{k}={_value(v)}" for k, v in (exp.get("set") or {}).items()) or "—"
        sweep = []
        for axis, values in (exp.get("sweep") or {}).items():
            if axis == "variant":
                sweep.append(
                    "variant: "
                    + "; ".join(
                        str(v.get("label"))
                        + (
                            " (" + ", ".join(f"{k}={_value(x)}" for k, x in v.items() if k != "label") + ")"
                            if len(v) > 1
                            else ""
                        )
                        for v in values
                    )
                )
            else:
                sweep.append(f"{axis} ∈ {{{', '.join(_value(v) for v in values)}}}")
        n = sum(1 for r in runs if any(e == name for e, _ in r["experiments"]))
        exp_rows.append(
            f"<tr><td><a href='#{html.escape(name)}'>{html.escape(name)}</a></td><td>{n}</td>"
            f"<td>{html.escape(sets)}</td><td>{html.escape('; '.join(sweep) or '—')}</td></tr>"
        )
    prov: dict[str, set] = defaultdict(set)
    for r in runs:
        for k, v in (r.get("provenance") or {}).items():
            prov[k].add(_value(v))
    rows = []
    for key, title in (
        ("addnorm", "addnorm"),
        ("git_commit", "git commit"),
        ("git_dirty", "uncommitted changes"),
        ("torch", "torch"),
        ("python", "Python"),
        ("device", "device"),
        ("threads", "torch threads per run"),
        ("platform", "platform"),
    ):
        if prov.get(key):
            rows.append((title, ", ".join(sorted(prov[key]))))
    if prov.get("date"):
        dates = sorted(prov["date"])
        rows.append(("run dates (UTC)", dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"))
    missing = sum(1 for r in runs if not r.get("provenance"))
    if missing:
        rows.append(("runs without provenance", f"{missing} (stored by an older addnorm)"))
    return (
        "<h2 id='configuration'>Configuration</h2><div class='cols'><div><h3>Base configuration</h3>"
        "<p class='note'>Every run starts from these; bold: given by the spec, the rest are defaults.</p>"
        f"<table class='kv'>{base_rows}</table></div><div><h3>Experiments</h3>"
        "<table><tr><th>experiment</th><th>runs</th><th>set</th><th>sweep</th></tr>"
        f"{''.join(exp_rows)}</table><h3>Provenance</h3>{_kv_table(rows) if rows else '<p>none recorded</p>'}"
        "</div></div>"
    )


def _findings(findings) -> str:
    css = {SUPPORTED: "supported", NOT_SUPPORTED: "not", INCONCLUSIVE: "inconclusive"}
    rows = []
    for f in findings:
        rows.append(
            f"<tr><td>{html.escape(f.claim)}<br><small>{html.escape(f.source)}</small></td>"
            f"<td>{html.escape(f.scale)}</td><td>{html.escape(f.evidence)}</td>"
            f"<td class='{css.get(f.verdict, 'untested')}'>{f.verdict}</td><td><small>{html.escape(f.caveat)}</small></td></tr>"
        )
    return (
        f"<h2 id='findings'>Findings</h2><p class='note'>Rule: {html.escape(RULE)}. Numbers are held-out "
        "cross-entropy in nats, mean ± standard deviation over seeds.</p>"
        "<table class='findings'><tr><th>claim</th><th>measured at</th><th>what this study measured</th>"
        f"<th>verdict</th><th>what would change it</th></tr>{''.join(rows)}</table>"
    )


STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
table{border-collapse:collapse;margin:0.6em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.supported{color:#0a6d2a;font-weight:600}.not{color:#b3261e;font-weight:600}.inconclusive{color:#8a5a00;font-weight:600}
.untested{color:#777}img{max-width:100%;height:auto;display:block;margin:0.8em 0}.note{color:#555;font-size:13px}
.kv th{font-weight:normal;background:#fafafa}.kv td.given{font-weight:600}.cols{display:flex;flex-wrap:wrap;gap:2em}.cols>div{flex:1 1 420px;min-width:0}
.findings td:nth-child(3){min-width:28em}summary{cursor:pointer;color:#245}"""


def _not_applicable(spec: dict) -> str:
    """The stored spec's runs left out as not applicable, one line each (none when it no longer parses)."""
    try:
        rows = parse_spec(spec).not_applicable()
    except (SpecError, TypeError, ValueError):
        return ""
    if not rows:
        return ""
    lines = dict.fromkeys(f"{e}: {_seedless(label)}: not applicable ({why})" for e, label, why in rows)
    items = "".join(f"<li>{html.escape(line)}</li>" for line in lines)
    return (
        "<h2 id='not-applicable'>Not applicable</h2><p class='note'>Runs of the spec left out of the plan: "
        f"addnorm.hf.with_placement cannot apply these placements to the model.</p><ul>{items}</ul>"
    )


def build_report(out_dir: str | Path) -> Path:
    """Write ``out_dir/report.html`` from ``out_dir/study.sqlite``; returns its path."""
    out = Path(out_dir)
    db = out / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"out: no study database at {str(db)!r}; run `addnorm study` first")
    with Store(db) as store:
        name, spec = store.study_spec() or ("study", {"experiments": {}})
        runs = store.runs()
        stale = len(store.stale_ids()) if store.planned() else 0
        findings = compute_findings(store)
        experiments = spec.get("experiments") or {}
        sections = []
        for exp_name, exp in experiments.items():
            exp_runs = [r for r in runs if any(e == exp_name for e, _ in r["experiments"])]
            if exp_runs:
                sections.append(_experiment_section(store, exp_name, exp or {}, exp_runs))
        ranked = {n for n, e in experiments.items() if (e or {}).get("rank")}
        lr_experiments = {n for n in ranked if "lr" in ((experiments[n] or {}).get("sweep") or {})}
        ranked_runs = [r for r in runs if any(e in ranked for e, _ in r["experiments"])]
        ranking = _ranking(store, ranked_runs, lr_experiments) if ranked_runs else ""
        configuration = _configuration(spec, store.base_config(), runs)
        planned = len({run_id for run_id, _, _ in store.planned()}) or len(runs)
    counts: dict[str, int] = defaultdict(int)
    for r in runs:
        counts[r["status"]] += 1
    summary = ", ".join(f"{v} {k}" for k, v in sorted(counts.items())) or "none stored yet"
    notes = []
    if planned > len(runs):
        notes.append(f"{planned - len(runs)} of the spec's {planned} runs have no stored result yet")
    if stale:
        notes.append(
            f"{stale} stored runs are not part of this spec and are left out (<code>addnorm study --prune</code> deletes them)"
        )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>addnorm study: {html.escape(name)}</title><style>{STYLE}</style></head><body>
<h1>addnorm study: {html.escape(name)}</h1>
<p>{html.escape(" ".join(str(spec.get("description") or "").split()))}</p>
<p>{len(runs)} runs ({summary}). {". ".join(notes) + ". " if notes else ""}Every number below is read from <code>study.sqlite</code>;
built {datetime.now().astimezone().isoformat(timespec="seconds")}.</p>
{configuration}
{_findings(findings)}
{ranking}
{_not_applicable(spec)}
{"".join(sections)}
</body></html>"""
    return write_atomic(out / "report.html", page)
