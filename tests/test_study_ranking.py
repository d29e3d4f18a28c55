"""The ranking statistics (addnorm.study.ranking) on synthetic results with a known answer, its t
distribution and Welch test against scipy's, and its letter groups against the pairwise tests computed
with scipy and a Holm correction written out here."""

from __future__ import annotations

import math
import random

import pytest

from addnorm.study.ranking import (
    DIVERGED,
    holm,
    letter_groups,
    rank,
    spearman,
    t_quantile,
    t_two_sided_p,
    welch,
)


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


def test_known_groups_and_intervals():
    # three clusters 1 nat apart with seed noise of 0.01: three groups of two, lettered in rank order
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
    assert [r.groups for r in rows] == ["a", "a", "b", "b", "c", "c", DIVERGED]
    assert [r.best for r in rows] == [True, True, False, False, False, False, False]
    assert [r.rank for r in rows] == [1, 2, 3, 4, 5, 6, 7]
    a1 = rows[0]
    half = 4.302652729911275 * 0.01 / math.sqrt(3)  # t_{0.975, 2} * sd / sqrt(n)
    assert (a1.mean, a1.sd) == pytest.approx((2.0, 0.01))
    assert (a1.low, a1.high) == pytest.approx((2.0 - half, 2.0 + half))
    assert rows[-1].diverged == 1 and rows[-1].mean == pytest.approx(2.0)


def test_a_high_variance_placement_carries_the_letters_of_both_neighbours():
    # "wide" is tied with "a" and with "b", which differ from each other. The old rule (a tier is what
    # is not worse than its leader) put it in tier 1 below tier-2 "b"; letters keep the rank order and
    # say exactly which pairs are tied.
    rows = rank({"a": [2.00, 2.01, 1.99], "b": [2.10, 2.11, 2.09], "wide": [1.6, 2.2, 2.8]})
    assert [(r.name, r.groups, r.best) for r in rows] == [
        ("a", "a", True),
        ("b", "b", False),
        ("wide", "ab", True),
    ]


def test_a_chain_of_neighbours_gives_overlapping_groups():
    # means 1 apart, sd 0.35, three seeds: each placement is tied with its neighbours only
    rows = rank({f"p{i}": [i - 0.35, i, i + 0.35] for i in range(5)})
    assert [r.groups for r in rows] == ["a", "ab", "bc", "cd", "d"]
    assert [r.best for r in rows] == [True, True, False, False, False]


def scipy_tied(samples: dict[str, list[float]], alpha: float = 0.05) -> set[frozenset[str]]:
    """The oracle: scipy's Welch test on every pair, Holm's step-down adjustment written out here."""
    stats = pytest.importorskip("scipy.stats")
    names = sorted(samples)
    pairs = [(a, b) for i, a in enumerate(names) for b in names[i + 1 :]]
    p = [stats.ttest_ind(samples[a], samples[b], equal_var=False).pvalue for a, b in pairs]
    order = sorted(range(len(p)), key=p.__getitem__)
    tied, reject = set(), True
    for k, i in enumerate(order):  # reject while p_(k) < alpha / (m - k); from the first failure, keep
        reject = reject and p[i] < alpha / (len(p) - k)
        if not reject:
            tied.add(frozenset(pairs[i]))
    return tied


@pytest.mark.parametrize("seed", range(12))
def test_letters_are_exactly_the_pairs_scipy_cannot_separate(seed):
    rng = random.Random(seed)
    samples = {
        f"p{i}": [0.03 * i + rng.gauss(0, rng.choice((0.005, 0.02, 0.08))) for _ in range(rng.randint(3, 5))]
        for i in range(rng.randint(4, 12))
    }
    rows = rank(samples)
    tied = scipy_tied(samples)
    letters = {r.name: set(r.groups) for r in rows}
    for a in samples:
        for b in samples:
            if a < b:
                assert bool(letters[a] & letters[b]) == (frozenset((a, b)) in tied), (a, b)
    groups = {c: {n for n, ls in letters.items() if c in ls} for c in set().union(*letters.values())}
    for members in groups.values():  # a group is a largest set of mutually tied placements
        assert not [
            o for o in samples if o not in members and all(frozenset((o, m)) in tied for m in members)
        ]
    first_seen = "".join(dict.fromkeys(c for r in rows for c in r.groups))
    assert first_seen == "abcdefghijklmnopqrstuvwxyz"[: len(first_seen)]  # lettered in rank order
    assert [r.best for r in rows] == [r is rows[0] or frozenset((rows[0].name, r.name)) in tied for r in rows]


def test_redundant_groups_are_dropped():
    # the octahedron: each item tied with all but its opposite. Its 8 maximal cliques (triangles) hold
    # every edge twice; 4 of them show every tied pair once, and the other 4 are dropped as redundant.
    opposite = {0: 1, 1: 0, 2: 3, 3: 2, 4: 5, 5: 4}
    groups = letter_groups(6, lambda i, j: opposite[i] != j)
    assert groups == [[0, 2, 4], [0, 3, 5], [1, 2, 5], [1, 3, 4]]
    shown = {frozenset((i, j)) for g in groups for i in g for j in g if i != j}
    assert shown == {frozenset((i, j)) for i in range(6) for j in range(6) if i != j and opposite[i] != j}
    assert letter_groups(3, lambda i, j: True) == [[0, 1, 2]]
    assert letter_groups(3, lambda i, j: False) == [[0], [1], [2]]


def test_noise_larger_than_the_gaps_ties_everything():
    rng = random.Random(1)
    samples = {f"p{i}": [2.0 + 0.001 * i + rng.gauss(0, 0.1) for _ in range(3)] for i in range(6)}
    assert {r.groups for r in rank(samples)} == {"a"}


def test_one_seed_cannot_separate():
    rows = rank({"a": [1.0], "b": [5.0], "c": [9.0]})
    assert [r.groups for r in rows] == ["a", "a", "a"] and all(r.best for r in rows)


def test_spearman():
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 1, "b": 2, "c": 3}) == 1.0
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 3, "b": 2, "c": 1}) == -1.0
    assert spearman({"a": 1, "b": 2, "c": 3, "x": 4}, {"c": 1, "a": 2, "b": 3}) == pytest.approx(-0.5)
    assert math.isnan(spearman({"a": 1, "b": 2}, {"a": 1, "b": 2}))
