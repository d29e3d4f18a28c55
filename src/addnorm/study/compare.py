"""``addnorm compare DIR [DIR ...]``: the rankings and verdicts of several studies side by side, as
Markdown (a GPU ranking beside the CPU ones it is meant to confirm, say).

For each study folder, read from its database as the report reads it (:func:`~.analysis.ranking`,
:func:`~.findings.compute_findings`; failed runs are missing data): each ranked setting's table (mean ±
sd over seeds, 95% interval, letter groups, tied with the best; a placement whose seeds split shown as
split, with which seeds trained), and its findings' verdicts. Then every ranked setting of every study in
one table (a row per placement: its rank and letters in each), and Spearman's rank correlation between
every pair of settings over the placements both ranked (:func:`~.ranking.spearman`).

A study still growing (runs left for the next device window) is compared on what is stored: the counts
say how far it is, and a setting with fewer than three placements ranked has no table yet.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from .analysis import device_of, ranked_of, ranking
from .findings import compute_findings
from .ranking import spearman
from .records import Finding, RankingTable
from .rule import NOT_TESTED
from .store import FINISHED, Store


@dataclass
class Compared:
    """One study as compared: its name and folder, how many of its planned runs are stored, the devices
    they trained on, its ranked settings and its findings."""

    name: str
    folder: Path
    stored: int
    planned: int
    devices: list[str]
    tables: list[RankingTable]
    findings: list[Finding]


def read(folder: Path, mix_devices: bool = False) -> Compared:
    """The study in ``folder`` (its ``study.sqlite``, opened read-only) as :class:`Compared`."""
    db = Path(folder) / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"compare: no study database at {str(db)!r}")
    with Store(db, readonly=True) as store:
        name, spec = store.study_spec() or ("study", {"experiments": {}})
        runs = store.runs()
        ranked_runs, lr_experiments = ranked_of(spec.get("experiments") or {}, runs)
        record = ranking(store, ranked_runs, lr_experiments, mix_devices) if ranked_runs else None
        findings = compute_findings(store)
        planned = len({run_id for run_id, _, _ in store.planned()}) or len(runs)
    done = [r for r in runs if r["status"] in FINISHED]
    devices = sorted({device_of(r) for r in done})
    return Compared(
        name, Path(folder), len(done), planned, devices, record.tables if record else [], findings
    )


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    return lines + ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]


def _ranking(table: RankingTable) -> list[str]:
    """One ranked setting as a Markdown table, and a line per placement whose seeds split."""
    rows = []
    for row in table.rows:
        interval = f"{row.low:.3f} to {row.high:.3f}" if math.isfinite(row.low) and row.split is None else ""
        seeds = f"{row.n} seed{'s' if row.n != 1 else ''}"
        rows.append(
            [
                str(row.rank),
                row.name,
                f"{row.text()} ({seeds})",
                interval,
                row.groups,
                "yes" if row.best else "",
            ]
        )
    head = ["rank", "placement", "final loss (mean ± sd)", "95% interval", "groups", "tied with the best"]
    lines = _table(head, rows)
    for row in table.rows:
        trained, untrained = table.split_seeds(row)
        if trained or untrained:
            low, high = (sum(c) / len(c) for c in (row.split.trained, row.split.untrained))
            lines.append(
                f"\n{row.name} split: seed(s) {', '.join(map(str, trained))} trained ({low:.3f}), "
                f"{', '.join(map(str, untrained))} did not ({high:.3f})."
            )
    failed = ", ".join(f"{p}: {n}" for p, n in sorted(table.failed.items()))
    if failed:
        lines.append(f"\nFailed runs (missing data, not ranked): {failed}.")
    return lines


def render(studies: list[Compared]) -> str:
    """The comparison of ``studies`` as Markdown (see the module docstring)."""
    out = [f"# Rankings compared: {', '.join(s.name for s in studies)}", ""]
    settings: list[tuple[str, RankingTable]] = []
    for study in studies:
        devices = ", ".join(study.devices) or "no run stored"
        out += [f"## {study.name} (`{study.folder}`)", ""]
        out += [f"{study.stored} of {study.planned} runs stored; trained on {devices}.", ""]
        if not study.tables:
            out += ["No ranking yet: fewer than three placements of a ranked setting are stored.", ""]
        for table in study.tables:
            settings.append((f"{study.name}: {table.title}", table))
            out += [f"### {study.name}: {table.title}", "", *_ranking(table), ""]
        judged = [f for f in study.findings if f.verdict != NOT_TESTED]
        if judged:
            rows = [[f.claim, f.scale, f.verdict, ", ".join(map(str, f.seeds))] for f in judged]
            out += [
                f"### {study.name}: findings",
                "",
                *_table(["claim", "measured at", "verdict", "seeds"], rows),
            ]
            out.append("")
    if len(settings) > 1:
        placements = sorted({row.name for _, t in settings for row in t.rows})
        rows = []
        for p in placements:
            cells = [p]
            for _, t in settings:
                row = next((r for r in t.rows if r.name == p), None)
                cells.append("" if row is None else f"{row.rank} ({row.groups})")
            rows.append(cells)
        out += [
            "## Side by side: rank (groups)",
            "",
            *_table(["placement", *[n for n, _ in settings]], rows),
            "",
        ]
        ranks = [{r.name: r.rank for r in t.rows} for _, t in settings]
        rows = []
        for i, (a, _) in enumerate(settings):
            for j in range(i + 1, len(settings)):
                common = len(set(ranks[i]) & set(ranks[j]))
                rho = spearman(ranks[i], ranks[j])
                rows.append([a, settings[j][0], f"{rho:+.2f}" if math.isfinite(rho) else "n/a", str(common)])
        out += [
            "## Spearman's rank correlation",
            "",
            *_table(["setting", "setting", "rho", "placements"], rows),
        ]
        out.append("")
    return "\n".join(out).rstrip() + "\n"
