"""The ranking statistics (addnorm.study.ranking) on synthetic results with a known answer, and its t
distribution and Welch test against scipy's."""

from __future__ import annotations

import math
import random

import pytest

from addnorm.study.ranking import DIVERGED, holm, rank, spearman, t_quantile, t_two_sided_p, welch


def test_t_distribution_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    for df in (1, 2, 3.7, 10, 60):
        for t in (0.0, 0.3, 1.0, 2.5, 8.0):
            assert t_two_sided_p(t, df) == pytest.approx(2 * stats.t.sf(t, df), rel=1e-9, abs=1e-14)
        assert t_quantile(0.975, df) == pytest.approx(stats.t.ppf(0.975, df), rel=1e-9)


def test_welch_matches_scipy():
    stats = pytest.importorskip("scipy.stats")
    rng = random.Random(0)
    for _ in range(20):
        a = [rng.gauss(0, 1) for _ in range(rng.randint(2, 6))]
        b = [rng.gauss(0.5, 2) for _ in range(rng.randint(2, 6))]
        assert welch(a, b) == pytest.approx(stats.ttest_ind(a, b, equal_var=False).pvalue, rel=1e-8)


def test_closed_form_values():
    assert t_two_sided_p(0.0, 5) == 1.0
    assert t_quantile(0.975, 1) == pytest.approx(12.706204736, rel=1e-9)  # tan(0.475 pi)
    assert t_two_sided_p(1.0, 1) == pytest.approx(0.5)  # Cauchy: P(|T| >= 1) = 1/2
    assert welch([1.0, 1.0], [2.0, 2.0]) == 0.0 and welch([1.0, 1.0], [1.0, 1.0]) == 1.0
    assert welch([1.0], [5.0, 6.0]) == 1.0


def test_holm_adjustment():
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])


def test_known_tiers_and_intervals():
    # three clusters 1 nat apart with seed noise of 0.01: three tiers of two, in order of the means
    samples = {
        "a1": [2.00, 2.01, 1.99],
        "a2": [2.005, 2.015, 1.995],
        "b1": [3.00, 3.01, 2.99],
        "b2": [3.01, 3.02, 3.00],
        "c1": [4.00, 4.02, 3.98],
        "c2": [4.01, 4.02, 4.0],
        "bad": [2.0, math.inf, 2.0],
    }
    rows = rank(samples)
    assert [r.name for r in rows] == ["a1", "a2", "b1", "b2", "c1", "c2", "bad"]
    assert [r.tier for r in rows] == [1, 1, 2, 2, 3, 3, DIVERGED]
    assert [r.rank for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    a1 = rows[0]
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert (a1.mean, a1.sd) == pytest.approx((2.0, 0.01))
    assert (a1.low, a1.high) == pytest.approx((2.0 - half, 2.0 + half))
    assert rows[-1].diverged == 1 and rows[-1].mean == pytest.approx(2.0)


def test_noise_larger_than_the_gaps_ties_everything():
    rng = random.Random(1)
    samples = {f"p{i}": [2.0 + 0.001 * i + rng.gauss(0, 0.1) for _ in range(3)] for i in range(6)}
    assert {r.tier for r in rank(samples)} == {1}


def test_one_seed_cannot_separate():
    assert {r.tier for r in rank({"a": [1.0], "b": [5.0], "c": [9.0]})} == {1}


def test_spearman():
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}) == 1.0
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 3, "b": 2, "c": 1}) == -1.0
    assert spearman({"a": 1, "b": 2, "c": 3, "x": 4}, {"c": 1, "a": 2, "b": 3}) == pytest.approx(-0.5)
    assert math.isnan(spearman({"a": 1, "b": 2}, {"a": 1, "b": 2}))
