"""The report's ranking on stored results with a known answer: a failed (killed) run is missing data, not
a diverged one; the ranking and the findings each state their rule, the ranking what it could have
detected (against scipy's noncentral t) and the seeds a tie would need."""

from __future__ import annotations

import math
import re
import statistics
import time

import pytest

from addnorm.placements import PLACEMENTS
from addnorm.study import Store, build_report
from addnorm.study.analysis import analyse
from addnorm.study.ranking import POWER, detectable, seeds_needed, t_power
from addnorm.study.rule import as_t_test
from addnorm.train import RunConfig, RunResult

SPEC = {"name": "r", "experiments": {"main": {"sweep": {"placement": [], "seed": []}, "rank": True}}}


def store_runs(path, results: dict[str, list[float | str]], n_layers: int = 2) -> None:
    """One run per (placement, seed): a float is a finished run's held-out loss, "failed" a run killed
    before it finished, "diverged" one whose loss blew up; the plan holds them all."""
    members = []
    with Store(path / "study.sqlite") as store:
        for placement, values in results.items():
            for seed, value in enumerate(values):
                cfg = RunConfig(placement=placement, seed=seed, n_layers=n_layers).to_dict()
                run_id = RunConfig(**cfg).run_id
                label = f"placement={placement}, seed={seed}"
                if isinstance(value, float):
                    final = {"train_loss": value, "val_loss": value, "val_metric": 0.0, "metric": "bpb"}
                    result = RunResult(status="done", final=final)
                elif value == "failed":
                    result = RunResult(status="failed", error="worker killed (SIGKILL)")
                else:
                    result = RunResult(status="diverged", diverged_step=3)
                store.save_run("r", run_id, [("main", label)], cfg, result, time.time())
                members.append((run_id, "main", label))
        store.save_plan("r", SPEC, {}, members)


def seeds_column(page: str, placement: str) -> str:
    row = re.search(rf"<tr><td>(\d+)</td><td>{placement}</td>(?:<td>[^<]*</td>){{4}}<td>([^<]*)</td>", page)
    return row.group(1), row.group(2)


def test_a_failed_run_is_missing_data_not_a_diverged_one(tmp_path):
    store_runs(
        tmp_path,
        {
            "post": [2.00, "failed", 2.02],  # the best placement, one run killed
            "pre": [2.50, 2.52, 2.51],
            "rezero": [3.00, 3.01, "diverged"],
            "sandwich": ["failed", "failed", "failed"],  # nothing finished: not ranked, still named
        },
    )
    with Store(tmp_path / "study.sqlite") as store:
        (table,) = analyse(store).ranking.tables
    rows = {r.name: r for r in table.rows}
    assert [r.name for r in table.rows] == ["post", "pre", "rezero"]  # ranked on what finished
    assert rows["post"].n == 2 and rows["post"].diverged == 0 and rows["post"].mean == 2.01
    assert (
        rows["rezero"].diverged == 1 and rows["rezero"].groups == "diverged"
    )  # a diverged seed still ranks last
    assert table.failed == {"post": 1, "sandwich": 3}
    page = build_report(tmp_path).read_text()
    ranking = page[page.index("<h2 id='ranking'>") : page.index("<h2 id='main'>")]
    assert seeds_column(ranking, "post") == ("1", "2 (1 failed, left out)")
    assert seeds_column(ranking, "rezero") == ("3", "3 (1 diverged)")
    assert "Not ranked, no run finished: sandwich (3 failed)." in ranking
    assert "A failed run (an error, a killed worker) is missing data" in ranking


def scipy_power(delta, df, crit):
    """P(|T'| > crit) by scipy's noncentral t; the lower tail P(T'_delta < -crit) as P(T'_-delta > crit),
    since scipy's cdf gives NaN far out in that tail (scipy 1.17, e.g. nct.cdf(-11, 4, 13))."""
    stats = pytest.importorskip("scipy.stats")
    return stats.nct.sf(crit, df, delta) + stats.nct.sf(crit, df, -delta)


def scipy_detectable(sd, n, alpha, power=POWER):
    """The oracle: the noncentrality at which scipy's noncentral t gives the power, by Brent's method."""
    optimize, stats = pytest.importorskip("scipy.optimize"), pytest.importorskip("scipy.stats")
    df = 2 * (n - 1)
    crit = stats.t.ppf(1 - alpha / 2, df)
    delta = optimize.brentq(lambda d: scipy_power(d, df, crit) - power, 0.0, 100.0, xtol=1e-12)
    return delta * sd * math.sqrt(2 / n)


def test_power_detectable_difference_and_seeds_against_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df, crit, delta in (
        (2, 4.30, 1.0),
        (4, 2.776, 3.7),
        (4, 2.449, 0.0),
        (10, 3.5, 5.0),
        (1, 12.7, 20.0),
        (60, 2.0, 2.8),
    ):
        assert t_power(delta, df, crit) == pytest.approx(scipy_power(delta, df, crit), abs=1e-7)
    for sd, n, alpha in ((0.048, 3, 0.05 / 136), (1.0, 2, 0.05), (0.2, 10, 0.05 / 3)):
        assert detectable(sd, n, alpha) == pytest.approx(scipy_detectable(sd, n, alpha), rel=1e-6)
    gap, sd, alpha = 0.43, 0.2, 0.05 / 136
    n = seeds_needed(gap, sd, alpha)
    crit = lambda n: stats.t.ppf(1 - alpha / 2, 2 * (n - 1))  # noqa: E731
    power = lambda n: scipy_power(gap / (sd * math.sqrt(2 / n)), 2 * (n - 1), crit(n))  # noqa: E731
    assert power(n) >= POWER > power(n - 1)  # the fewest seeds that reach 80% power
    assert seeds_needed(gap, sd, alpha, most=n - 1) is None and seeds_needed(0.0, sd, alpha) is None
    # the findings' rule (|d| > 2 pooled sd) between two arms of 3 seeds: |t| > 2 sqrt(3/2), df 4
    crit3, level, shift = as_t_test(3)
    assert crit3 == pytest.approx(2 * math.sqrt(1.5)) and level == pytest.approx(
        2 * stats.t.sf(crit3, 4), rel=1e-9
    )
    assert 0.06 < level < 0.08 and shift == pytest.approx(scipy_detectable(1.0, 3, level), rel=1e-6)


def test_the_findings_and_the_ranking_disagree_and_say_why(tmp_path):
    """DeepNorm 0.43 nats below Post-LN (about 11 standard errors, 3 seeds): the findings' rule (one
    comparison, 2 pooled sd) supports the claim while the ranking (every pair of 17 placements, Holm)
    ties them. The report states each rule beside its result, the difference the ranking could have
    detected and the seeds that would separate the tie."""
    others = [p for p in PLACEMENTS if p not in ("post", "deepnorm")]
    results = {"deepnorm": [2.952, 3.0, 3.048], "post": [3.382, 3.43, 3.478]}
    results |= {p: [3.05 + 0.02 * i + d for d in (-0.3, 0.0, 0.3)] for i, p in enumerate(others)}
    store_runs(tmp_path, results, n_layers=8)
    with Store(tmp_path / "study.sqlite") as store:
        records = analyse(store)
    (finding,) = [f for f in records.findings if f.claim == "DeepNorm trains better than Post-LN at depth"]
    assert finding.verdict == "supported"  # 0.43 = 9 pooled sd of these two arms
    (table,) = records.ranking.tables
    rows = {r.name: r for r in table.rows}
    assert set(rows["post"].groups) & set(rows["deepnorm"].groups) and rows["post"].best  # tied
    sens = table.sensitivity
    pooled = math.sqrt(sum(statistics.variance(v) for v in results.values()) / len(results))
    assert sens.sd == pytest.approx(pooled) and sens.pairs == 136 and sens.seeds == 3
    assert sens.detectable == pytest.approx(scipy_detectable(pooled, 3, 0.05 / 136), rel=1e-6)
    assert sens.detectable > 0.43  # the ranking could not have told this gap apart
    assert sens.gap_name == "post" and sens.gap == pytest.approx(0.43)
    assert sens.seeds_needed == seeds_needed(0.43, pooled, 0.05 / 136) and sens.seeds_needed > 3
    page = build_report(tmp_path).read_text()
    findings = page[page.index("<h2 id='findings'>") : page.index("<h2 id='ranking'>")]
    ranking = page[page.index("<h2 id='ranking'>") : page.index("<h2 id='main'>")]
    _, level, shift = as_t_test(3)
    assert "Rule: a difference counts when the difference of the means exceeds 2 pooled standard" in findings
    assert f"a level of about {level:.3f} per claim, not corrected for the number of claims" in findings
    assert f"finds a true difference of {shift:.1f} standard deviations 80% of the time" in findings
    assert "a pair can count here and be tied there" in findings
    assert "Welch's t-test between every pair, Holm-corrected at 0.05" in ranking
    assert (
        f"placements {sens.detectable:.3f} nats apart or more are told apart 80% of the time (pooled sd "
        f"{pooled:.3f} over 3 seeds; Welch&#x27;s t-test at Holm&#x27;s first step, α = 0.05 / 136 pairs"
    ) in ranking
    assert (
        f"Tied with the best though 0.430 behind it: post; {sens.seeds_needed} seeds per placement would "
        "tell a gap of 0.430 apart 80% of the time"
    ) in ranking
