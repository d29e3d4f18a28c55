"""The report: self-contained HTML built from the database alone, plots only where the data exists, and
readable with many series (distinct colours, legends outside, small multiples, clipped spikes)."""

from __future__ import annotations

import html
import re

from addnorm.study import Store, build_report, parse_spec, run_study
from addnorm.study.records import Finding
from addnorm.study.report import MAX_INLINE, _facets, _robust_top, headline_number, palette
from addnorm.study.rule import INCONCLUSIVE, NOT_SUPPORTED, NOT_TESTED, SUPPORTED

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=4, batch_size=4, seq_len=16, eval_batches=1)


def figures(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', page)


def section(page: str, name: str, end: str | None = None) -> str:
    start = page.index(f"<h2 id='{name}'>")
    return page[start : page.index(f"<h2 id='{end}'>") if end else None]


def test_plots_follow_the_data(tmp_path):
    spec = {
        "name": "plots",
        "base": {**TINY, "eval_every": 2},
        "experiments": {
            "lrs": {"sweep": {"placement": ["post", "pre"], "lr": [0.001, 0.01], "seed": [0, 1]}},
            "noeval": {"set": {"eval_every": 0, "seed": 7}},
        },
    }
    run_study(parse_spec(spec), tmp_path, workers=1, progress=False)
    page = (tmp_path / "report.html").read_text()
    assert not re.search(r'src="(?!data:)', page)  # nothing to fetch: one self-contained file
    lrs = figures(section(page, "lrs", "noeval"))
    assert "lrs: final loss vs lr" in lrs and not any("vs warmup" in f for f in lrs)
    assert "lrs: training loss and held-out loss, mean over seeds (shaded: min to max)" in lrs
    init = [f for f in lrs if f.endswith("at initialisation")]
    assert init == [
        "lrs: per-layer FFN weight-gradient norm, residual-stream gradient norm, residual-stream RMS at "
        "initialisation"
    ]  # the stream's RMS beside the gradient profile
    assert any(f.startswith("lrs: per-layer") and f.endswith("at step 3") for f in lrs)
    assert "lrs: RMS of x, F(x), x + F(x)" in lrs
    noeval = figures(section(page, "noeval"))
    assert (
        not any("vs lr" in f for f in noeval)
        and "noeval: training loss, mean over seeds (shaded: min to max)" in noeval
    )


def test_report_is_rebuilt_from_the_database_alone(tmp_path):
    spec = {"name": "r", "base": {**TINY, "eval_every": 0}, "experiments": {"a": {"sweep": {"seed": [0, 1]}}}}
    run_study(parse_spec(spec), tmp_path, workers=1, progress=False)
    first = (tmp_path / "report.html").read_text()
    (tmp_path / "report.html").unlink()
    with Store(tmp_path / "study.sqlite") as store:  # a stored number changes: the report follows
        run_id = store.runs()[0]["id"]
        store.db.execute("UPDATE runs SET final_val_loss = 12.345 WHERE id = ?", (run_id,))
        store.db.commit()
    second = build_report(tmp_path).read_text()
    assert "12.345" in second and "12.345" not in first
    assert second.count("<tr>") == first.count("<tr>")


def test_many_series_get_distinct_styles_and_small_multiples():
    styles = palette(16)
    assert len(set(styles)) == 16 and len({c for c, _ in styles}) == 16  # 16 colours for 16 placements
    assert len(set(palette(64))) == 64  # markers on top of the colours beyond 20
    placements = [f"p{i}" for i in range(16)]
    labels = [f"placement={p}, n_layers={n}, warmup={w}" for p in placements for n in (2, 8) for w in (0, 50)]
    split, facets, series = _facets(labels)
    assert series == [f"placement={p}" for p in placements]  # colour: the axis with the most values
    assert facets == [
        "n_layers=2, warmup=0",
        "n_layers=2, warmup=50",
        "n_layers=8, warmup=0",
        "n_layers=8, warmup=50",
    ]
    few = [f"placement={p}" for p in placements[:MAX_INLINE]]
    assert _facets(few)[1] == [""]  # few series: one panel


def test_first_step_spikes_are_clipped_not_plotted_to_scale():
    steps = list(range(100))
    values = [30.0] + [2.0 + 0.01 * (100 - s) for s in steps[1:]]  # one first-step spike of 30
    clip, highest = _robust_top(values, steps)
    assert 3.0 < clip < 4.0 and highest == 30.0
    assert _robust_top([2.0 + 0.01 * s for s in steps], steps) is None  # nothing to clip


def rows_of(table: str) -> list[tuple[str, str]]:
    """(claim, verdict) per finding row of the summary's verdict table (the claim cell spans its rows)."""
    out, claim = [], ""
    for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]:
        cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
        if len(cells) == 3:
            claim = cells.pop(0)
        out.append((html.unescape(claim), html.unescape(cells[0])))
    return out


def test_the_first_screen_is_the_summary_and_its_verdicts_are_the_findings(tmp_path):
    """Issue 51 item 4: the page opens on the headline plots and a verdict table (claim, verdict, one
    number), then the findings, the experiments and, last, the configuration with the provenance; each
    verdict of the summary is the findings table's word for that claim, in the same order."""
    spec = {
        "name": "first",
        "base": {**TINY, "eval_every": 2},
        "experiments": {"warm": {"sweep": {"placement": ["post", "pre"], "warmup": [0, 2], "seed": [0, 1]}}},
    }
    run_study(parse_spec(spec), tmp_path, workers=1, progress=False)
    page = (tmp_path / "report.html").read_text()
    order = [page.index(f"<h2 id='{name}'>") for name in ("summary", "findings", "warm", "configuration")]
    assert order == sorted(order) and page.index("<h3>Provenance</h3>") > order[-1]
    top = section(page, "summary", "findings")
    assert figures(top) == [
        "warm: training loss, mean over seeds (shaded: min to max)",
        "warm: per-layer FFN weight-gradient norm at initialisation",
    ]
    table = top[top.index("<table class='verdict-summary'>") : top.index("</table>")]
    assert "<th>claim</th><th>verdict</th><th>the number</th>" in table
    found = section(page, "findings", "warm")
    found = found[found.index("<table class='findings'>") : found.index("</table>")]
    detail = [
        (html.unescape(c), html.unescape(v))
        for c, v in re.findall(
            r"<tr><td>(.*?)<br><small>.*?</small></td>.*?<td class='[a-z]+'>([^<]*)</td>", found
        )
    ]
    tested = [(c, v) for c, v in detail if v != NOT_TESTED]
    assert rows_of(table) == tested and len(tested) >= 3  # warmup and both gradient claims at least
    untested = [c for c, v in detail if v == NOT_TESTED]
    assert html.unescape(top).count(NOT_TESTED.capitalize() + ": " + "; ".join(untested) + ".") == 1
    numbers = re.findall(r"<td>([^<]*)</td></tr>", table)
    assert all(n != "—" for n in numbers) and any("top/first layer" in n for n in numbers)


def test_each_finding_gets_one_number_from_its_evidence():
    f = lambda evidence: Finding("c", "s", evidence, SUPPORTED)  # noqa: E731
    warm = (
        "held-out loss, no warmup vs 50 warmup steps: Post-LN 3.9 ± 0.1 (3 seeds) vs 3.1 ± 0.1 (3 seeds); "
        "difference +0.800 = +8.0 pooled sd; Pre-LN 3.0 ± 0.1 (3 seeds) vs 3.0 ± 0.1 (3 seeds); difference "
        "+0.010 = +0.1 pooled sd. Supported when Post-LN is worse without warmup and Pre-LN is not"
    )
    assert headline_number(f(warm)) == "+0.800 nats (+8.0 sd)"  # the difference that counts
    # supported at the deepest depth (+2.5 sd) though better without a norm at 2 layers (-17.0 sd): the
    # number is the one the verdict rests on, in its direction
    both = "2 layers: difference -0.262 = -17.0 pooled sd; 8 layers: difference +0.240 = +2.5 pooled sd"
    assert headline_number(f(both)) == "+0.240 nats (+2.5 sd)"
    against = Finding("c", "s", both, NOT_SUPPORTED)
    assert headline_number(against) == "-0.262 nats (-17.0 sd)"
    assert headline_number(Finding("c", "s", both, INCONCLUSIVE)) == "-0.262 nats (-17.0 sd)"  # the largest
    assert headline_number(f("init xavier: top/first layer = 0.52 (x/÷ 1.03), per seed ...")) == (
        "top/first layer 0.52"
    )
    growth = "log(stream RMS after the top layer / after the first) at the end of training: 8 layers: "
    assert headline_number(f(growth + "a 0.1 ± 0.01 (2 seeds), b 0.5 ± 0.01 (2 seeds); difference +0.400 = "
                             "+40.0 pooled sd")) == "+0.400 (+40.0 sd)"  # fmt: skip
    assert headline_number(f("8 layers: LayerNorm 3.0 (3 seeds), no norm diverged (3 of 3 seeds)")) == (
        "3 of 3 seeds diverged"
    )
    assert (
        headline_number(f("2 layers: a 3.0 (1 seed), b 3.1 (1 seed); one seed: no spread to judge by")) == ""
    )
