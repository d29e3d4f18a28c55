"""The study report: one self-contained HTML file (PNG plots embedded), a template over the study's
records (:func:`.analysis.analyse`) and the figures drawn from them (:mod:`.figures`).

It opens on a summary, what a reader came for (:func:`summary_section`): the headline plots (training
curves of the placements compared with and without warmup, per-layer gradient profiles at
initialisation) beside a compact verdict table, one line per finding with its verdict and one number.
The detail follows: the findings with their rule and evidence, the ranking when the spec asks for one,
one section per experiment, and last what was run (the base configuration, each experiment's settings,
the runs' provenance). The summary's verdicts are the findings' own, word for word; it computes nothing.
"""

from __future__ import annotations

import html
import math
import re
from datetime import datetime
from pathlib import Path

from . import figures
from .analysis import analyse, value
from .figures import MAX_INLINE, palette  # noqa: F401 - the report's figure settings, importable here
from .figures import facets as _facets  # noqa: F401
from .figures import robust_top as _robust_top  # noqa: F401
from .ranking import ALPHA, POWER, SPLIT_FRACTION, SPLIT_REFERENCE, SPLIT_WITHIN, Sensitivity
from .records import (
    Configuration,
    ExperimentRecord,
    Finding,
    RankingRecord,
    RankingTable,
    RuleAsTest,
    RunRow,
    StudyRecords,
)
from .rule import INCONCLUSIVE, NOT_SUPPORTED, NOT_TESTED, RULE, SUPPORTED, VERDICTS, K
from .store import Store, write_atomic

STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222;line-height:1.4}
table{border-collapse:collapse;margin:0.6em 0;font-size:13px}td,th{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.supported{color:#0a6d2a;font-weight:600}.not{color:#b3261e;font-weight:600}.inconclusive{color:#8a5a00;font-weight:600}
.untested{color:#777}img{max-width:100%;height:auto;display:block;margin:0.8em 0}.note{color:#555;font-size:13px}
.kv th{font-weight:normal;background:#fafafa}.kv td.given{font-weight:600}.cols{display:flex;flex-wrap:wrap;gap:2em}.cols>div{flex:1 1 420px;min-width:0}
.findings td:nth-child(3){min-width:28em}summary{cursor:pointer;color:#245}
.summary{display:grid;grid-template-columns:minmax(0,0.95fr) minmax(0,1.05fr);gap:1.5em;align-items:start}.summary img{margin:0}
.verdict-summary{font-size:12px;margin-top:0}.verdict-summary td{padding:3px 6px}.verdict-summary td+td{white-space:nowrap}.headline-note{margin:0.1em 0 0.5em}"""


def img(figure: tuple[str, str] | None) -> str:
    if figure is None:
        return ""
    alt, data = figure
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{data}">'


def esc(text: object) -> str:
    return html.escape(str(text))


# --- what was run -------------------------------------------------------------------------------------
def kv_table(pairs: list[tuple[str, str]]) -> str:
    cells = "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in pairs)
    return f"<table class='kv'>{cells}</table>"


def sweep_text(sweep: dict) -> str:
    parts = []
    for axis, values in sweep.items():
        if axis == "variant":
            parts.append(
                "variant: "
                + "; ".join(
                    str(v.get("label"))
                    + (
                        " (" + ", ".join(f"{k}={value(x)}" for k, x in v.items() if k != "label") + ")"
                        if len(v) > 1
                        else ""
                    )
                    for v in values
                )
            )
        else:
            parts.append(f"{axis} ∈ {{{', '.join(value(v) for v in values)}}}")
    return "; ".join(parts) or "—"


def configuration(config: Configuration) -> str:
    """The base config, each experiment's settings and sweep, and the runs' provenance."""
    cells = [
        f"<th>{esc(k)}</th><td{' class=given' if k in config.given else ''}>{esc(value(v))}</td>"
        for k, v in config.base.items()
    ]
    half = (len(cells) + 1) // 2  # two columns of key: value
    base_rows = "".join(
        f"<tr>{cells[i]}{cells[i + half] if i + half < len(cells) else '<td></td><td></td>'}</tr>"
        for i in range(half)
    )
    exp_rows = "".join(
        f"<tr><td><a href='#{esc(e.name)}'>{esc(e.name)}</a></td><td>{e.runs}</td>"
        f"<td>{esc(', '.join(f'{k}={value(v)}' for k, v in e.set.items()) or '—')}</td>"
        f"<td>{esc(sweep_text(e.sweep))}</td></tr>"
        for e in config.experiments
    )
    prov = kv_table(config.provenance) if config.provenance else "<p>none recorded</p>"
    return (
        "<h2 id='configuration'>Configuration</h2><div class='cols'><div><h3>Base configuration</h3>"
        "<p class='note'>Every run starts from these; bold: given by the spec, the rest are defaults.</p>"
        f"<table class='kv'>{base_rows}</table></div><div><h3>Experiments</h3>"
        "<table><tr><th>experiment</th><th>runs</th><th>set</th><th>sweep</th></tr>"
        f"{exp_rows}</table><h3>Provenance</h3>{prov}</div></div>"
    )


# --- the first screen: the headline plots and every finding's verdict in one line ----------------------
DIFFERENCE = re.compile(r"difference ([+-]\d+(?:\.\d+)?) = ([+-]\d+(?:\.\d+)?) pooled sd")
RATIO = re.compile(r"top/first layer = (\d+(?:\.\d+)?)")
ALL_DIVERGED = re.compile(r"diverged \((\d+) of (\d+) seeds\)")
SOME_DIVERGED = re.compile(r"(\d+) of (\d+) diverged")
CSS = {SUPPORTED: "supported", NOT_SUPPORTED: "not", INCONCLUSIVE: "inconclusive"}


def headline_number(finding: Finding) -> str:
    """The one number of a finding on the first screen, read from its evidence (nothing is recomputed):
    a gradient profile's top/first-layer ratio; else the difference the verdict rests on, with that
    difference in pooled standard deviations (the rule counts it beyond ``K`` = 2): the largest that
    counts in the verdict's direction (positive: as the claim predicts), else how many seeds diverged,
    else the largest difference measured; else "" (one seed, or nothing measured)."""
    if m := RATIO.search(finding.evidence):
        return f"top/first layer {m[1]}"
    diffs = DIFFERENCE.findall(finding.evidence)
    sign = {SUPPORTED: 1, NOT_SUPPORTED: -1}.get(finding.verdict, 0)
    counted = [d for d in diffs if sign * float(d[1]) > K]
    diverged = ALL_DIVERGED.search(finding.evidence) or SOME_DIVERGED.search(finding.evidence)
    if diverged and not counted:
        return f"{diverged[1]} of {diverged[2]} seeds diverged"
    if counted or diffs:
        diff, sds = max(counted or diffs, key=lambda d: abs(float(d[1])))
        unit = "" if "log(" in finding.evidence.split(":", 1)[0] else " nats"
        return f"{diff}{unit} ({sds} sd)"
    return ""


def setting_tags(group: list[Finding]) -> list[str]:
    """What tells the findings of one claim apart: the parts of their settings not shared by all (the
    seeds aside); "" for a claim measured at one setting."""
    if len(group) < 2:
        return [""]
    parts = [re.sub(r",? ?seeds [\d, ]+$", "", f.scale).replace("; ", ", ").split(", ") for f in group]
    common = set.intersection(*map(set, parts))
    return [", ".join(x for x in p if x not in common) for p in parts]


def verdict_table(found: list[Finding]) -> str:
    """Every tested finding in a line: the claim, its verdict (the findings table's word) and one number;
    the claims this study did not test named below the table."""
    groups: dict[str, list[Finding]] = {}
    for f in found:
        if f.verdict != NOT_TESTED:
            groups.setdefault(f.claim, []).append(f)
    rows = []
    for claim, group in groups.items():
        for i, (f, tag) in enumerate(zip(group, setting_tags(group), strict=True)):
            head = f"<td rowspan='{len(group)}'>{esc(claim)}</td>" if i == 0 else ""
            number = (f"{esc(tag)}: " if tag else "") + esc(headline_number(f) or "—")
            rows.append(
                f"<tr>{head}<td class='{CSS.get(f.verdict, 'untested')}'>{esc(f.verdict)}</td><td>{number}</td></tr>"
            )
    untested = list(dict.fromkeys(f.claim for f in found if f.verdict == NOT_TESTED))
    note = (
        f"<p class='note'>{esc(NOT_TESTED).capitalize()}: {esc('; '.join(untested))}.</p>" if untested else ""
    )
    table = (
        "<table class='verdict-summary'><tr><th>claim</th><th>verdict</th><th>the number</th></tr>"
        f"{''.join(rows)}</table>"
        if rows
        else "<p class='note'>No claim tested yet.</p>"
    )
    return table + note


def labelled(records: list, key: str) -> bool:
    return any(key in getattr(r, "label", "") for r in records)


def headline_figures(experiments: list[ExperimentRecord]) -> list[tuple[tuple[str, str] | None, str]]:
    """(figure, the experiment it comes from) for the first screen: the training loss of the first
    experiment that compares placements with and without warmup (else the first that compares
    placements), and the FFN weight-gradient profile at initialisation of the deepest experiment that
    compares placements, one panel per other setting."""
    out = []
    with_curves = [e for e in experiments if labelled(e.curves, "placement=")]
    warm = [e for e in with_curves if labelled(e.curves, "warmup=")] or with_curves
    if warm:
        e = warm[0]
        metric = "train_loss" if any(c.metric == "train_loss" for c in e.curves) else "val_loss"
        drawn = figures.curves(e.name, [c for c in e.curves if c.metric == metric])
        out += [(f, e.name) for f in drawn[:1]]
    profiles = [
        (max((max(s.layers, default=0) for s in p.series), default=0), -i, e, p)
        for i, e in enumerate(experiments)
        for p in e.layers
        if p.when == "init" and "weight_grad_norm" in p.metrics and labelled(p.series, "placement=")
    ]
    if profiles:
        _, _, e, p = max(profiles, key=lambda x: x[:2])
        out.append((figures.profile_row(e.name, p, "weight_grad_norm"), e.name))
    return [(f, name) for f, name in out if f is not None]


def summary_section(records: StudyRecords) -> str:
    """The report's first screen: the verdict table beside the headline plots, and where the detail is."""
    shown = "".join(
        img(f) + f"<p class='note headline-note'>From <a href='#{esc(n)}'>{esc(n)}</a>.</p>"
        for f, n in headline_figures(records.experiments)
    )
    return (
        "<h2 id='summary'>Summary</h2><div class='summary'><div>"
        f"{verdict_table(records.findings)}<p class='note'>Each verdict is the <a href='#findings'>findings"
        "</a>' own, under their rule; there are the evidence, the setting and what would change it. The "
        "number: a gradient profile's top/first-layer ratio, else the difference the verdict rests on "
        "(the largest that counts in its direction; in pooled standard deviations, counted beyond 2). Below: the findings, the ranking, each "
        "experiment, and the <a href='#configuration'>configuration</a> with the runs' provenance.</p>"
        f"</div><div>{shown}</div></div>"
    )


# --- findings -------------------------------------------------------------------------------------------
def rule_note(rule: RuleAsTest | None) -> str:
    """The findings' rule as the test it amounts to, and how it differs from the ranking's."""
    if rule is None:
        return ""
    return (
        f" As a test: with {rule.seeds} seeds per arm the rule is a two-sided t-test with |t| > {rule.crit:.2f} "
        f"(df {2 * (rule.seeds - 1)}), a level of about {rule.alpha:.3f} per claim, not corrected for the "
        "number of claims (each is one comparison stated in advance); it finds a true difference of "
        f"{rule.detectable_sd:.1f} standard deviations {POWER:.0%} of the time. The ranking asks another "
        "question, which placements differ among every pair at once, with a stricter test: a pair can count "
        "here and be tied there."
    )


def verdicts() -> str:
    """What each verdict means."""
    css = {SUPPORTED: "supported", NOT_SUPPORTED: "not", INCONCLUSIVE: "inconclusive"}
    items = "".join(
        f"<li><span class='{css.get(v, 'untested')}'>{esc(v)}</span>: {esc(meaning)}</li>"
        for v, meaning in VERDICTS.items()
    )
    return f"<p class='note'>The verdicts:</p><ul class='note verdicts'>{items}</ul>"


def findings(found: list[Finding], rule: RuleAsTest | None = None) -> str:
    css = {SUPPORTED: "supported", NOT_SUPPORTED: "not", INCONCLUSIVE: "inconclusive"}
    rows = "".join(
        f"<tr><td>{esc(f.claim)}<br><small>{esc(f.source)}</small></td>"
        f"<td>{esc(f.scale)}</td><td>{esc(f.evidence)}</td>"
        f"<td class='{css.get(f.verdict, 'untested')}'>{f.verdict}</td><td><small>{esc(f.caveat)}</small></td></tr>"
        for f in found
    )
    return (
        f"<h2 id='findings'>Findings</h2><p class='note'>Rule: {esc(RULE)}.{esc(rule_note(rule))} Numbers "
        "are held-out cross-entropy in nats, mean ± standard deviation over seeds.</p>"
        "<table class='findings'><tr><th>claim</th><th>measured at</th><th>what this study measured</th>"
        f"<th>verdict</th><th>what would change it</th></tr>{rows}</table>{verdicts()}"
    )


# --- ranking --------------------------------------------------------------------------------------------
def seeds_cell(n: int, diverged: int, failed: int) -> str:
    """The seeds a placement's rank rests on: those that finished, with how many of them diverged and
    how many runs failed (left out)."""
    notes = [f"{diverged} diverged"] * bool(diverged) + [f"{failed} failed, left out"] * bool(failed)
    return f"{n} ({'; '.join(notes)})" if notes else str(n)


def detectable_note(sens: Sensitivity | None) -> str:
    """What a ranking could tell apart, under which test, and the seeds a tie with the best would need."""
    if sens is None:
        return ""
    if not math.isfinite(sens.detectable):
        return (
            "<p class='note'>What this ranking can detect: nothing, one seed per placement leaves no "
            "spread to judge by (every placement is tied); sweep <code>seed</code>.</p>"
        )
    test = (
        f"pooled sd {sens.sd:.3f} over {sens.seeds} seeds; Welch's t-test at Holm's first step, "
        f"α = {ALPHA:g} / {sens.pairs} pair{'s' if sens.pairs != 1 else ''} = {sens.alpha:.2g}"
    )
    text = (
        f"What this ranking can detect: placements {sens.detectable:.3f} nats apart or more are told apart "
        f"{POWER:.0%} of the time ({test})."
    )
    if sens.gap_name:
        need = (
            f"{sens.seeds_needed} seeds per placement would tell a gap of {sens.gap:.3f} apart {POWER:.0%} "
            "of the time"
            if sens.seeds_needed
            else "more than 1000 seeds per placement would be needed to tell that gap apart"
        )
        text += f" Tied with the best though {sens.gap:.3f} behind it: {sens.gap_name}; {need}."
    return f"<p class='note'>{esc(text)}</p>"


def split_note(table: RankingTable) -> str:
    """The line on the placements whose seeds split between trained and not (:func:`.ranking.split`)."""
    split = [r for r in table.rows if r.split is not None]
    if not split:
        return ""
    which = "; ".join(f"{r.name}: {r.split.text().removeprefix('split ')}" for r in split)
    return (
        f"<p class='note'>Seeds split between trained and not trained ({esc(which)}): a mean would describe "
        "neither cluster, so these are not lettered or compared, and rank after the others. Split: the "
        f"largest gap between a placement's sorted outcomes exceeds {SPLIT_WITHIN:g} times the spread "
        f"within its two clusters, {SPLIT_REFERENCE:g} times this setting's usual seed spread (the median "
        f"sd of its placements) and {SPLIT_FRACTION:.0%} of the lower cluster's mean; more seeds tell how "
        "often it trains.</p>"
    )


def ranking_table(table: RankingTable) -> str:
    rows = "".join(
        f"<tr><td>{r.rank}</td><td>{esc(r.name)}</td><td>{r.text()}</td>"
        f"<td>{'' if math.isnan(r.low) or math.isinf(r.low) or r.split else f'{r.low:.3f} to {r.high:.3f}'}</td>"
        f"<td>{r.groups}</td><td>{'yes' if r.best else ''}</td>"
        f"<td>{seeds_cell(r.n, r.diverged, table.failed.get(r.name, 0))}</td></tr>"
        for r in table.rows
    )
    ranked = {r.name for r in table.rows}
    unranked = [f"{esc(p)} ({n} failed)" for p, n in table.failed.items() if p not in ranked]
    note = f"<p class='note'>Not ranked, no run finished: {', '.join(unranked)}.</p>" if unranked else ""
    where = f"<p class='note'>Measured on {esc(' and '.join(table.devices))}.</p>" if table.devices else ""
    return (
        f"<h3>{esc(table.title)}</h3>{where}<table><tr><th>rank</th><th>placement</th><th>final loss</th>"
        f"<th>95% interval</th><th>groups</th><th>tied with the best</th><th>seeds</th></tr>{rows}</table>"
        f"{split_note(table)}{detectable_note(table.sensitivity)}{note}"
    )


def side_by_side(record: RankingRecord) -> str:
    """Every setting's rank and letter groups per placement in one table, with Spearman's rank
    correlation of each setting's ranking with the first one's over the placements both ran: does the
    ranking transfer?"""
    rows = [{r.name: r for r in t.rows} for t in record.tables]
    names = sorted(
        {n for t in rows for n in t}, key=lambda n: (rows[0][n].rank if n in rows[0] else math.inf, n)
    )
    head = "".join(f"<th>{esc(t.title)}</th>" for t in record.tables)
    body = "".join(
        f"<tr><td>{esc(n)}</td>"
        + "".join(f"<td>{f'{t[n].rank} ({t[n].groups})' if n in t else 'n/a'}</td>" for t in rows)
        + "</tr>"
        for n in names
    )
    rho = "".join(
        f"<td>{'' if i == 0 else ('n/a' if math.isnan(s) else f'{s:+.2f}')}</td>"
        for i, s in enumerate(record.spearman)
    )
    return (
        "<h3>Side by side: does the ranking transfer?</h3><p class='note'>Rank (letter groups) of each "
        "placement in each setting; the last row is Spearman's rank correlation with the first setting's "
        "ranking over the placements both ran (+1: the same order). Tied with the best in every setting: "
        f"{esc(', '.join(record.shared_best) or 'none')}.</p>"
        f"<table><tr><th>placement</th>{head}</tr>{body}<tr><th>Spearman vs first</th>{rho}</tr></table>"
    )


def lr_tolerance(rows: list[tuple[str, list[float]]]) -> str:
    body = "".join(
        f"<tr><td>{i + 1}</td><td>{esc(p)}</td><td>{', '.join(f'{x:g}' for x in lrs)}</td></tr>"
        for i, (p, lrs) in enumerate(rows)
    )
    return (
        "<h3>Learning-rate tolerance</h3><p class='note'>The learning rates at which the placement's loss "
        "(any seed) is within 10% of the best loss any placement reached at that rate.</p>"
        f"<table><tr><th>rank by lr tolerance</th><th>placement</th><th>tolerated learning rates</th></tr>{body}</table>"
    )


def ranking(record: RankingRecord | None) -> str:
    if record is None:
        return ""
    parts = [
        "<h2 id='ranking'>Ranking</h2><p class='note'>Per setting (every setting but placement and seed), "
        "placements ranked by final held-out loss: mean ± sd over seeds and the 95% interval of the mean. "
        "Groups: two placements that share a letter are tied (the test does not separate them, which is "
        "not the same as equal), two that share none differ (Welch's t-test between every pair, "
        f"Holm-corrected at {ALPHA:g}); letters follow the rank order, and a placement with a wide spread "
        "may carry the letters of neighbours that differ from each other. Tied with the best: shares a "
        "letter with rank 1. A placement with a diverged seed ranks last; one whose seeds split between trained and not trained is shown as split, after the others, without letters. A failed run (an error, a "
        "killed worker) is missing data, not an outcome: it is left out and counted in the seeds column; "
        "the placement is ranked on the seeds that finished. Few seeds separate little "
        "(one seed: nothing): sweep more seeds for a ranking to cite.</p>"
    ]
    parts += [f"<p class='note'>{esc(line)}.</p>" for line in record.notes]
    parts += [ranking_table(table) for table in record.tables]
    if record.tables:
        parts.append(img(figures.ranking(record.tables)))
    if len(record.tables) > 1:
        parts.append(side_by_side(record))
    if record.lr_tolerance:
        parts.append(lr_tolerance(record.lr_tolerance))
    parts.append(img(figures.growth(record.placements, record.growth_depth, record.growth)))
    return "".join(parts)


# --- experiments -------------------------------------------------------------------------------------
def fmt(v) -> str:
    return "" if v is None else f"{v:.3f}"


def runs_table(runs: list[RunRow]) -> str:
    head = (
        "<tr><th>run</th><th>status</th><th>final train loss</th><th>final held-out loss</th><th>metric</th>"
        "<th>time</th><th>device</th></tr>"
    )
    body = []
    for r in runs:
        metric = "" if r.metric_value is None else f"{r.metric} {r.metric_value:.3f}"
        status = r.status + (f" at step {r.diverged_step}" if r.diverged_step is not None else "")
        if r.error:
            status += f": {esc(r.error[:160])}"
        body.append(
            f"<tr><td>{esc(r.label)}</td><td>{status}</td><td>{fmt(r.train_loss)}</td>"
            f"<td>{fmt(r.val_loss)}</td><td>{metric}</td><td>{r.wall_s:.1f}s</td><td>{esc(r.device)}</td></tr>"
        )
    return f"<details><summary>{len(runs)} runs</summary><table>{head}{''.join(body)}</table></details>"


def experiment(record: ExperimentRecord) -> str:
    parts = [f"<h2 id='{esc(record.name)}'>{esc(record.name)}</h2>"]
    if record.description:
        parts.append(f"<p>{esc(record.description)}</p>")
    parts.append(runs_table(record.runs))
    drawn = figures.curves(record.name, record.curves)
    drawn += [figures.finals_vs(record.name, f) for f in record.finals]
    drawn += [figures.layer_panels(record.name, p) for p in record.layers]
    if record.residual is not None:
        drawn.append(figures.residual_bars(record.name, record.residual))
    parts += [img(f) for f in drawn]
    return "\n".join(parts)


def not_applicable(lines: list[str]) -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{esc(line)}</li>" for line in lines)
    return (
        "<h2 id='not-applicable'>Not applicable</h2><p class='note'>Runs of the spec left out of the plan: "
        f"addnorm.hf.with_placement cannot apply these placements to the model.</p><ul>{items}</ul>"
    )


def page(records: StudyRecords) -> str:
    """The whole report page for ``records``."""
    summary = ", ".join(f"{v} {k}" for k, v in records.status_counts.items()) or "none stored yet"
    notes = []
    if records.planned > records.runs:
        notes.append(
            f"{records.planned - records.runs} of the spec's {records.planned} runs have no stored result yet"
        )
    if records.stale:
        notes.append(
            f"{records.stale} stored runs are not part of this spec and are left out (<code>addnorm study --prune</code> deletes them)"
        )
    return f"""<!doctype html><html><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>addnorm study: {esc(records.name)}</title><style>{STYLE}</style></head><body>
<h1>addnorm study: {esc(records.name)}</h1>
<p>{esc(records.description)}</p>
<p>{records.runs} runs ({summary}). {". ".join(notes) + ". " if notes else ""}Every number below is read from <code>study.sqlite</code>;
built {datetime.now().astimezone().isoformat(timespec="seconds")}.</p>
{summary_section(records)}
{findings(records.findings, records.rule)}
{ranking(records.ranking)}
{not_applicable(records.not_applicable)}
{"".join(experiment(e) for e in records.experiments)}
{configuration(records.configuration)}
</body></html>"""


def build_report(out_dir: str | Path, mix_devices: bool = False) -> Path:
    """Write ``out_dir/report.html`` from ``out_dir/study.sqlite`` alone.

    Args:
        out_dir: the study's folder.
        mix_devices: rank runs of one setting measured on different devices in one table (by default
            one table per device).

    Returns:
        The report's path.

    Raises:
        ValueError: ``out_dir`` holds no study database.
    """
    out = Path(out_dir)
    db = out / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"out: no study database at {str(db)!r}; run `addnorm study` first")
    with Store(db) as store:
        records = analyse(store, mix_devices)
    return write_atomic(out / "report.html", page(records))
