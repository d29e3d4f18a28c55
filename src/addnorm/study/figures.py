"""The report's figures, drawn from records (:mod:`.records`) alone: each function takes records and
returns ``(alt text, PNG as base64)``, or None when there is nothing to draw.

Plots stay readable with many series: past :data:`MAX_INLINE` series the legend moves outside the axes
and curves split into small multiples; colours come from a qualitative palette with a distinct colour
(and marker) per series; loss axes clip first-step spikes and say so on the plot.
"""

from __future__ import annotations

import base64
import io
import math
import textwrap
from collections import defaultdict

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FormatStrFormatter, LogLocator, MaxNLocator, NullFormatter  # noqa: E402

from .ranking import DIVERGED  # noqa: E402
from .records import Curve, FinalsVs, LayerPanels, LayerSeries, RankingTable, ResidualBars  # noqa: E402

MAX_INLINE = 6  # more series than this: legend outside the axes, curves in small multiples
MARKERS = "osD^vP*Xh<>"
plt.rcParams.update({"font.size": 9, "axes.titlesize": 10, "axes.labelsize": 9, "legend.fontsize": 8})
TITLES = {"train_loss": "training loss", "val_loss": "held-out loss"}
LAYER_TITLES = {
    "weight_grad_norm": "FFN weight-gradient norm",
    "grad_norm": "residual-stream gradient norm",
    "act_rms": "residual-stream RMS",
    "update_ratio": "FFN update / weight (mean)",
}


def png(fig) -> str:
    """``fig`` as a PNG, base64-encoded (and closed)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
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


def legend(fig, axes, n: int, title: str | None = None) -> None:
    """Inside the first panel for a few series; for more, right of the panels, in as many columns as
    its height needs (at least 2 past 20 series), the figure widened by it so the panels keep their
    size (constrained layout places it; the PNG is the figure, with no tight-bbox pass)."""
    handles, labels = axes[0].get_legend_handles_labels()
    if not handles:
        return
    if n <= MAX_INLINE and len(axes) == 1:
        axes[0].legend(title=title)
        return
    renderer, height = fig.canvas.get_renderer(), fig.get_size_inches()[1] * fig.dpi
    ncol = 1 if n <= 20 else 2
    while True:
        placed = fig.legend(
            handles, labels, loc="outside center right", ncol=ncol, title=title, frameon=False
        )
        box = placed.get_window_extent(renderer)
        if box.height <= height or ncol >= len(handles):
            break
        placed.remove()
        ncol += 1
    fig.set_size_inches(fig.get_size_inches() + (box.width / fig.dpi, 0.0))


def layer_axis(ax) -> None:
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("layer (1 = nearest the input)")


def log_axis(ax, values: list[float]) -> None:
    """A log y axis with plain tick labels that spans at least a factor of 2, so a constant profile
    reads as flat instead of magnifying rounding noise into a zigzag, and labels at least three ticks:
    evenly spaced ones within a factor of 3, the minor ticks within a decade, 2x and 5x of each power
    of ten within three decades, the powers of ten beyond."""
    ax.set_yscale("log")
    positive = [v for v in values if v > 0 and math.isfinite(v)]
    if positive:
        lo, hi = min(positive), max(positive)
        if hi / lo < 2:
            mid = math.sqrt(lo * hi)
            ax.set_ylim(min(lo, mid / 1.42) / 1.05, max(hi, mid * 1.42) * 1.05)
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    low, high = ax.get_ylim()
    if high / low < 3:  # less than half a decade: evenly spaced labels, as on a linear axis
        ax.yaxis.set_major_locator(MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10]))
        ax.yaxis.set_minor_formatter(NullFormatter())
    elif high / low < 12:  # within about a decade the minor ticks need labels; beyond, they would collide
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    elif high / low < 1000:  # one to three decades: two or three powers of ten; label 2x and 5x too
        ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
        ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    else:
        ax.yaxis.set_minor_formatter(NullFormatter())


CLIP_AFTER = 0.05  # the first 5% of the steps may be clipped off a loss axis, never a later point
CLIP_MIN_STEPS = 10  # ... and only on a curve of at least this many later steps


def robust_top(values: list[float], steps: list[int]) -> tuple[float, float] | None:
    """(clip, highest) when the first steps' spike would squash the rest of a loss axis, else None. The
    clip sits above every point after the first :data:`CLIP_AFTER` of the steps, so no later point is
    hidden, and a curve with fewer than :data:`CLIP_MIN_STEPS` such steps (a held-out loss evaluated a
    few times) is never clipped."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return None
    late = [
        (v, s)
        for v, s in zip(values, steps, strict=True)
        if math.isfinite(v) and s >= max(steps) * CLIP_AFTER
    ]
    if len({s for _, s in late}) < CLIP_MIN_STEPS:
        return None
    top, lo = max(v for v, _ in late), min(finite)
    clip = top + 0.25 * (top - lo)
    return (clip, max(finite)) if max(finite) > clip * 1.05 else None


def coincident(series: list[tuple[str, list[float], list[float]]]) -> list[list[str]]:
    """Groups (of two or more) of the named series (name, xs, ys) whose points are the same (to 1e-9
    relative): drawn on top of each other, only the last would show."""
    groups: list[tuple[tuple[list[float], list[float]], list[str]]] = []

    def same(a: list[float], b: list[float]) -> bool:
        return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9) for x, y in zip(a, b, strict=True))

    for name, xs, ys in series:
        for (gx, gy), names in groups:
            if same(xs, gx) and same(ys, gy):
                names.append(name)
                break
        else:
            groups.append(((list(xs), list(ys)), [name]))
    return [names for _, names in groups if len(names) > 1]


def title_with_overlaps(ax, title: str, series: list[tuple[str, list[float], list[float]]], **kwargs) -> None:
    """``title``, and below it the series that coincide in this panel (one line would hide the others)."""
    groups = coincident(series)
    if groups:
        note = "identical, drawn on top of each other: " + "; ".join(" ≡ ".join(g) for g in groups)
        title += "\n" + textwrap.fill(note, 55)
        kwargs = {**kwargs, "fontsize": min(kwargs.get("fontsize", 8), 8)}
    ax.set_title(title, **kwargs)


def clip_note(ax, top: tuple[float, float] | None) -> None:
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


def facets(labels: list[str]) -> tuple[dict[str, tuple[str, str]], list[str], list[str]]:
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
    facet_list = list(dict.fromkeys(f for f, _ in split.values()))
    series = list(dict.fromkeys(s for _, s in split.values()))
    return split, facet_list, series


def grid(n_panels: int, width: float = 5.2, height: float = 3.4, max_cols: int = 4):
    cols = min(max_cols, n_panels)
    rows = math.ceil(n_panels / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(width * cols, height * rows), squeeze=False, layout="constrained"
    )
    flat = list(axes.flat)
    for ax in flat[n_panels:]:
        ax.set_visible(False)
    return fig, flat[:n_panels]


def curves(experiment: str, records: list[Curve]) -> list[tuple[str, str]]:
    """Loss curves per variant (mean over seeds, shaded min-max): train and held-out side by side, or
    one figure per metric in small multiples when there are many variants."""
    if not records:
        return []
    names = [n for n in ("train_loss", "val_loss") if any(c.metric == n for c in records)]
    variants = list(dict.fromkeys(c.label for c in records))
    split, facet_list, series = facets(variants)
    colours = dict(zip(series, palette(len(series)), strict=True))
    layouts = [(names, [""])] if facet_list == [""] else [([n], facet_list) for n in names]
    out = []
    for metrics, panel_facets in layouts:
        fig, axes = grid(len(metrics) * len(panel_facets), width=5.2 if facet_list == [""] else 4.2)
        panel = {
            (m, f): axes[i * len(panel_facets) + j]
            for i, m in enumerate(metrics)
            for j, f in enumerate(panel_facets)
        }
        spans: dict = defaultdict(lambda: ([], []))
        drawn: dict = defaultdict(list)
        for c in records:
            if c.metric not in metrics:
                continue
            facet, name_ = split[c.label]
            colour, marker = colours[name_]
            ax = panel[(c.metric, facet)]
            ax.plot(
                c.steps,
                c.mean,
                color=colour,
                marker=marker,
                markevery=max(1, len(c.steps) // 6),
                ms=3,
                label=name_ + (" (diverged)" if c.diverged else ""),
            )
            if c.seeds > 1:
                ax.fill_between(c.steps, c.low, c.high, alpha=0.15, color=colour)
            spans[ax][0].extend(c.high)
            spans[ax][1].extend(c.steps)
            drawn[ax].append((name_, c.steps, c.mean))
        for (m, facet), ax in panel.items():
            ax.set_xlabel("step")
            ax.set_ylabel(f"{TITLES[m]} (nats)")
            title_with_overlaps(ax, f"{TITLES[m]}" + (f": {facet}" if facet else ""), drawn[ax])
            ax.grid(alpha=0.3)
            if ax in spans:
                clip_note(ax, robust_top(*spans[ax]))
        legend(fig, axes, len(series))
        what = " and ".join(TITLES[m] for m in metrics)
        out.append((f"{experiment}: {what}, mean over seeds (shaded: min to max)", png(fig)))
    return out


def layer_panels(experiment: str, record: LayerPanels) -> tuple[str, str]:
    """Per-layer profiles side by side (one column per metric), one line per variant, one row per facet."""
    split, facet_list, series = facets(list(dict.fromkeys(s.label for s in record.series)))
    colours = dict(zip(series, palette(len(series)), strict=True))
    shown = record.metrics
    fig, axes = grid(len(facet_list) * len(shown), width=4.4, height=3.1, max_cols=len(shown))
    panel = {(f, m): axes[i * len(shown) + j] for i, f in enumerate(facet_list) for j, m in enumerate(shown)}
    plotted: dict = defaultdict(list)
    for s in record.series:
        facet, name_ = split[s.label]
        colour, marker = colours[name_]
        seeds = f" ({s.seeds} seeds)" if s.seeds > 1 and len(series) <= MAX_INLINE else ""
        panel[(facet, s.metric)].plot(
            s.layers, s.values, color=colour, marker=marker, ms=3.5, label=name_ + seeds
        )
        plotted[(facet, s.metric)].append((name_, s.layers, s.values))
    moment = "at initialisation" if record.when == "init" else f"at step {record.step}"
    for (facet, m), ax in panel.items():
        layer_axis(ax)
        log_axis(ax, [y for _, _, ys in plotted[(facet, m)] for y in ys])
        ax.set_ylabel(LAYER_TITLES[m] + " (log)")
        title_with_overlaps(ax, LAYER_TITLES[m] + (f"\n{facet}" if facet else ""), plotted[(facet, m)])
        ax.grid(alpha=0.3, which="both")
    legend(fig, axes, len(series))
    fig.suptitle(f"{experiment}: per layer {moment}, mean over seeds", fontsize=10)
    return f"{experiment}: per-layer {', '.join(LAYER_TITLES[m] for m in shown)} {moment}", png(fig)


def finals_vs(experiment: str, record: FinalsVs) -> tuple[str, str]:
    """Final held-out loss against the swept setting, one line per other setting: the mean over seeds,
    each seed a faint point; small multiples when there are many lines."""
    axis, lines = record.axis, record.lines
    finite = [y for pts in lines.values() for ys in pts.values() for y in ys if math.isfinite(y)]
    cap = max(finite) * 1.1 if finite else 1.0
    split, facet_list, series = facets(list(lines))
    styles = dict(zip(series, palette(len(series)), strict=True))
    fig, axes = grid(len(facet_list), width=7.5 if len(facet_list) == 1 else 5.2, height=4.2, max_cols=2)
    panel = dict(zip(facet_list, axes, strict=True))
    drawn: dict = defaultdict(list)
    for name, pts in lines.items():
        facet, series_name = split[name]
        ax, (colour, marker) = panel[facet], styles[series_name]
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
        ax.plot(xs, means, color=colour, marker=marker, label=series_name)
        drawn[ax].append((series_name, xs, means))
    for facet, ax in panel.items():
        if record.log:
            ax.set_xscale("log")
        if axis in ("n_layers", "warmup"):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(axis)
        ax.set_ylabel("final held-out loss (nats)")
        title_with_overlaps(ax, facet, drawn[ax])
        ax.grid(alpha=0.3)
    fig.suptitle(f"{experiment}: final loss vs {axis} (mean over seeds; diverged runs drawn at the top)")
    legend(fig, axes, len(series))
    return f"{experiment}: final loss vs {axis}", png(fig)


def residual_bars(experiment: str, record: ResidualBars) -> tuple[str, str]:
    """RMS of x, F(x) and x + F(x) at the middle layer's FFN connection, at init and after training."""
    names = ("xf_x_rms", "xf_f_rms", "xf_sum_rms")
    rows = record.rows
    height = 1.2 + 0.42 * len(rows)
    fig, axes = plt.subplots(1, 2, figsize=(11, height), sharey=True, layout="constrained")
    colours = palette(3)
    for ax, idx, when in ((axes[0], 0, "initialisation"), (axes[1], 1, "end of training")):
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
        ax.set_xlabel("RMS")
        ax.set_title(f"at {when}")
        ax.grid(alpha=0.3, axis="x")
    axes[0].invert_yaxis()  # the first variant on top (the axes share y: invert it once)
    axes[1].tick_params(labelleft=False)
    handles, labels = axes[0].get_legend_handles_labels()  # below both panels: never over a bar
    fig.legend(handles, labels, loc="outside lower center", ncol=3, frameon=False)
    fig.suptitle(
        f"{experiment}: the Add of Add & Norm, RMS of x, F(x) and x + F(x) at the middle layer's FFN"
    )
    return f"{experiment}: RMS of x, F(x), x + F(x)", png(fig)


def ranking(tables: list[RankingTable]) -> tuple[str, str]:
    """Each setting's placements in rank order: the mean and its 95% interval, the letters of its tied
    groups beside it, dark where tied with the best."""
    fig, axes = plt.subplots(
        1,
        len(tables),
        figsize=(4.6 * len(tables), 0.28 * max(len(t.rows) for t in tables) + 1.4),
        layout="constrained",
        squeeze=False,
    )
    split = any(r.split is not None for t in tables for r in t.rows)
    for ax, table in zip(axes[0], tables, strict=True):
        rows = [r for r in table.rows if math.isfinite(r.mean)]
        for y, r in enumerate(rows):
            if r.split is not None:  # no mean to draw: each seed, and how many trained
                seeds = r.split.trained + r.split.untrained
                ax.plot(seeds, [y] * len(seeds), "x", color="#b3261e", ms=5)
                label = f"split {len(r.split.trained)}/{len(seeds)}"
                ax.annotate(
                    label, (max(seeds), y), xytext=(5, 0), textcoords="offset points", va="center", fontsize=8
                )
                continue
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
        ax.set_title(table.title, fontsize=8, wrap=True)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle(
        "letters: placements sharing one are tied; blue: tied with the best, orange: worse than the best"
        + ("\nred crosses: the seeds of a placement that split between trained and not" if split else ""),
        fontsize=8,
    )
    return "ranking with intervals", png(fig)


def growth(placements: list[str], depth: int, series: list[LayerSeries]) -> tuple[str, str] | None:
    """The residual stream's RMS per layer at the end of training, deepest runs, one line per placement
    (each placement in its colour among ``placements``)."""
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 4.4), layout="constrained")
    styles = dict(zip(placements, palette(len(placements)), strict=True))
    for s in series:
        colour, marker = styles[s.label]
        ax.plot(s.layers, s.values, color=colour, marker=marker, ms=4, label=s.label)
    log_axis(ax, [y for s in series for y in s.values])
    layer_axis(ax)
    ax.set_ylabel("residual-stream RMS (log)")
    title = f"activation growth per layer at the end of training, {depth} layers (first seed)"
    title_with_overlaps(ax, title, [(s.label, s.layers, s.values) for s in series])
    ax.grid(alpha=0.3, which="both")
    legend(fig, [ax], len(series), title="placement")
    return "activation growth per layer", png(fig)


def profile_row(experiment: str, record: LayerPanels, metric: str) -> tuple[str, str] | None:
    """One per-layer metric of ``record`` in one row of panels (one per facet), for the report's first
    screen: the same lines as :func:`layer_panels` draws for that metric, none of the other metrics."""
    kept = [s for s in record.series if s.metric == metric]
    if not kept:
        return None
    split, facet_list, series = facets(list(dict.fromkeys(s.label for s in kept)))
    colours = dict(zip(series, palette(len(series)), strict=True))
    fig, axes = grid(len(facet_list), width=2.8, height=2.4, max_cols=len(facet_list))
    panel = dict(zip(facet_list, axes, strict=True))
    plotted: dict = defaultdict(list)
    for s in kept:
        facet, name_ = split[s.label]
        colour, marker = colours[name_]
        panel[facet].plot(s.layers, s.values, color=colour, marker=marker, ms=3.5, label=name_)
        plotted[facet].append((name_, s.layers, s.values))
    moment = "at initialisation" if record.when == "init" else f"at step {record.step}"
    for i, (facet, ax) in enumerate(panel.items()):
        layer_axis(ax)
        log_axis(ax, [y for _, _, ys in plotted[facet] for y in ys])
        if i == 0:  # one y label for the row: the panels show one metric
            ax.set_ylabel(LAYER_TITLES[metric] + " (log)")
        title_with_overlaps(ax, facet or LAYER_TITLES[metric], plotted[facet], fontsize=9)
        ax.grid(alpha=0.3, which="both")
    legend(fig, axes, len(series))
    fig.suptitle(f"{experiment}: {LAYER_TITLES[metric]} per layer {moment}, mean over seeds", fontsize=10)
    return f"{experiment}: per-layer {LAYER_TITLES[metric]} {moment}", png(fig)
