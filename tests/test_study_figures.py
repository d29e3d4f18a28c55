"""The report's figures drawn from records: no legend over the data, no point clipped off a loss axis
after the first steps, curves that coincide said so, and a log axis with enough labelled ticks."""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import pytest

from addnorm.study import figures
from addnorm.study.records import Curve, LayerPanels, LayerSeries, ResidualBars


@pytest.fixture
def drawn(monkeypatch):
    """The figures the functions under test make, kept open instead of encoded."""
    kept = []
    monkeypatch.setattr(figures, "png", lambda fig: kept.append(fig) or "png")
    yield kept
    for fig in kept:
        plt.close(fig)


def overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


def test_the_residual_legend_covers_no_bar(drawn):
    same = {"xf_x_rms": [1.0, 2.0], "xf_f_rms": [1.0, 2.0], "xf_sum_rms": [1.0, 2.0]}  # every bar full width
    figures.residual_bars("e", ResidualBars([("a", same), ("b", same), ("c", same)]))
    (fig,) = drawn
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    legends = fig.legends + [ax.get_legend() for ax in fig.axes if ax.get_legend()]
    (legend,) = legends
    box = legend.get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for ax in fig.axes for p in ax.patches]
    assert len(bars) == 18 and not any(overlaps(box, bar) for bar in bars)


def curve(metric, steps, values, label="a"):
    return Curve(label, metric, steps, values, values, values, seeds=1, diverged=False)


def test_no_point_after_the_first_steps_is_clipped(drawn):
    assert figures.robust_top([5.5, 2.0], [0, 300]) is None  # two held-out points: both shown
    spike = [6.0] + [2.0] * 79 + [4.0] + [2.0] * 19  # a first-step spike and a late one at step 80
    clip, highest = figures.robust_top(spike, list(range(100)))
    assert clip > 4.0 and highest == 6.0  # the first step is clipped, the late spike is not
    figures.curves(
        "e", [curve("train_loss", list(range(100)), spike), curve("val_loss", [0, 300], [5.5, 2.0])]
    )
    (fig,) = drawn
    train, held_out = fig.axes
    assert train.get_ylim()[1] >= 4.0 and train.get_ylim()[1] < 6.0
    low, high = held_out.get_ylim()
    assert low < 2.0 and high > 5.5


def test_curves_drawn_on_top_of_each_other_are_named(drawn):
    values = [5.0, 4.0, 3.5]
    records = [
        curve("train_loss", [0, 1, 2], values, "warmup=0"),
        curve("train_loss", [0, 1, 2], list(values), "warmup=100"),
        curve("train_loss", [0, 1, 2], [5.0, 4.1, 3.6], "warmup=200"),
    ]
    figures.curves("e", records)
    series = [
        LayerSeries("post", "act_rms", [1, 2, 3], [1.0, 2.0, 4.0], 1),
        LayerSeries("resi_dual", "act_rms", [1, 2, 3], [1.0, 2.0, 4.0], 1),
        LayerSeries("pre", "act_rms", [1, 2, 3], [1.0, 3.0, 9.0], 1),
    ]
    figures.layer_panels("e", LayerPanels("init", 0, ["act_rms"], series))
    (curves_fig, layers_fig) = drawn
    (ax,) = curves_fig.axes
    assert "identical, drawn on top of each other: warmup=0 ≡ warmup=100" in ax.get_title().replace("\n", " ")
    assert "200" not in ax.get_title()
    (ax,) = layers_fig.axes
    assert (
        "post ≡ resi_dual" in ax.get_title().replace("\n", " ") and "pre" not in ax.get_title().split(":")[-1]
    )
    figures.curves("e", records[:1] + records[2:])  # nothing coincides: nothing said
    assert "identical" not in drawn[-1].axes[0].get_title()


def labelled_ticks(ax) -> list[float]:
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    ticks = ax.yaxis.get_major_ticks() + ax.yaxis.get_minor_ticks()
    return sorted(
        t.get_loc()
        for t in ticks
        if t.label1.get_visible() and t.label1.get_text() and low <= t.get_loc() <= high
    )


@pytest.mark.parametrize("low, high", [(0.006, 0.3), (0.02, 0.9), (0.3, 8.0), (1e-4, 0.5), (1.0, 1.5)])
def test_a_log_axis_labels_at_least_three_ticks(low, high):
    fig, ax = plt.subplots()
    ax.plot([1, 2], [low, high])
    figures.log_axis(ax, [low, high])
    labels = labelled_ticks(ax)
    plt.close(fig)
    assert len(labels) >= 3, labels


def test_the_readme_screenshots_are_rebuilt_from_the_reports(bench_module, tmp_path):
    """``make report-screenshots`` (``tools/report_screenshot.py --docs ROOT``): one PNG per docs screenshot,
    each from its study's report under ROOT; the quick one the whole page."""
    shot = bench_module("tools.report_screenshot")
    docs = Path(__file__).resolve().parents[1] / "docs"
    assert {Path(png).name for _, png, *_ in shot.DOCS} == {p.name for p in docs.glob("report-*.png")}
    with pytest.raises(SystemExit, match="run `addnorm study quick --out"):
        shot.docs_plan(tmp_path, docs)
    for study, *_ in shot.DOCS:
        (tmp_path / study).mkdir()
        (tmp_path / study / "report.html").write_text("<h2 id='ranking'>R</h2>")
    plan = shot.docs_plan(tmp_path, docs)
    assert [(r.parent.name, png.name, section) for r, png, section, _, _ in plan] == [
        ("quick", "report-quick.png", "all"),
        ("literature", "report-literature.png", "ranking"),
        ("llama", "report-llama.png", "ranking"),
    ]
    page = "<html><body><h1>t</h1><h2 id='findings'>F</h2><h2 id='ranking'>R</h2></body></html>"
    assert shot.section_page(page, "all") == page
    with pytest.raises(SystemExit):
        shot.main([])  # neither a report nor --docs


def test_a_long_legend_sits_right_of_the_panels_within_the_figure(drawn):
    """60 series on two panels: the legend is right of the panels, in as many columns as the figure's
    height needs (more than the 2 it starts with past 20 series), inside the PNG (no tight-bbox pass
    crops or grows it), and the figure is widened by it so the panels keep their width."""
    records = [
        curve(metric, [0, 1, 2], [3.0 + i / 60, 2.5, 2.0], label=f"run{i:02d}")
        for i in range(60)
        for metric in ("train_loss", "val_loss")
    ]
    figures.curves("e", records)
    (fig,) = drawn
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    (legend,) = fig.legends
    box = legend.get_window_extent(renderer)
    rows = -(-60 // legend._ncols)
    assert legend._ncols > 2 and len(legend.get_texts()) == 60
    assert box.height / rows * -(-60 // (legend._ncols - 1)) > fig.bbox.height  # one column fewer: too tall
    assert 0 <= box.x0 and box.x1 <= fig.bbox.x1 and 0 <= box.y0 and box.y1 <= fig.bbox.y1
    panels = [ax.get_tightbbox(renderer) for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2 and all(p.x1 <= box.x0 for p in panels)  # right of both, over neither
    assert fig.get_size_inches()[0] == pytest.approx(2 * 5.2 + box.width / fig.dpi, abs=0.3)
