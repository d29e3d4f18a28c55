"""Rankings with confidence: placements ranked by mean outcome over seeds, with intervals, and grouped
where the data cannot tell them apart.

For each placement: mean, sample standard deviation and the 95% confidence interval of the mean,
``mean ± t_{0.975, n-1} * sd / sqrt(n)``. Every pair of placements is compared by Welch's t-test
(Welch 1947; unequal variances, Welch-Satterthwaite degrees of freedom), and the p-values of all pairs
are adjusted together by Holm's step-down method (Holm 1979), which bounds the family-wise error rate at
``alpha`` (0.05). Two placements are *tied* when their adjusted p-value is at least ``alpha``.

Tied groups are shown as a compact letter display (Piepho 2004, "An algorithm for a letter-based
representation of all-pairwise comparisons"): each group is a largest set of placements tied with one
another (a maximal clique of the "tied" relation), groups are lettered a, b, c, ... in rank order (by
their best member, then their next), and each placement carries the letters of every group it is in.
The rule a reader needs: **two placements share a letter exactly when the test cannot tell them
apart**; sharing none, they differ. Groups are runs of neighbours in rank order except where a
placement with a wide spread is tied with two placements that differ from each other: it then carries
both their letters (e.g. ``a``, ``b``, ``ab``), and a letter may skip the placement between. A group
whose every tied pair (and member) another group already shows is dropped, so the display stays
compact. The placements that share a letter with rank 1 are the ones *tied with the best*.

A placement with a diverged seed ranks after every placement without one (its group: ``diverged``);
fewer than two finite seeds cannot be tested and ties with everything.

A placement whose seeds *split* between training and not (:func:`split`: two clusters of outcomes far
apart, by the rule there; looked for with ``rank(..., splits=True)``, as the report ranks) has a mean
that describes neither cluster: it is shown as ``split (k of n trained)`` with each cluster's mean,
ranked after every placement that is not split (before those with a diverged seed), left out of the
pairwise tests and of the letters (its group: ``split``), and never tied with the best. It is reported,
not ranked: more seeds tell how often it trains.

What a ranking could detect (:func:`sensitivity`): the *minimum detectable difference*, the true
difference of means that Welch's test between two placements of ``n`` seeds each (pooled standard
deviation ``s``, ``df = 2(n - 1)``) finds with probability :data:`POWER` (0.8) at Holm's first step,
level ``alpha / pairs``: ``delta* s sqrt(2 / n)`` where ``delta*`` solves ``P(|T'| > t_{1-a/2, df}) = 0.8``
for T' noncentral t with noncentrality ``delta*`` (:func:`t_power`, an integral over the chi
distribution); and the seeds per placement that would tell apart the largest gap still tied with the
best (:func:`seeds_needed`).

The Student t distribution is computed here from the regularised incomplete beta function (continued
fraction, Numerical Recipes 6.4), so the library needs no scipy at run time.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass

ALPHA = 0.05
DIVERGED = "diverged"
SPLIT = "split"
SPLIT_WITHIN = 4.0  # the gap between the clusters, in spreads within them (see split)
SPLIT_REFERENCE = 8.0  # in the seed spreads usual at the setting
SPLIT_FRACTION = 0.05  # and as a fraction of the lower cluster's mean


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        for aa in (
            m * (b - m) * x / ((qam + m2) * (a + m2)),
            -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularised incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_two_sided_p(t: float, df: float) -> float:
    """P(|T| >= |t|) for Student's t with ``df`` degrees of freedom: I_{df/(df+t^2)}(df/2, 1/2)."""
    if math.isinf(t):
        return 0.0
    return betainc(df / 2.0, 0.5, df / (df + t * t))


def t_quantile(q: float, df: float) -> float:
    """The ``q`` quantile (q in (0.5, 1)) of Student's t, by bisection on :func:`t_two_sided_p`."""
    target = 2.0 * (1.0 - q)
    lo, hi = 0.0, 1.0
    while t_two_sided_p(hi, df) > target:
        hi *= 2.0
    for _ in range(100):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_two_sided_p(mid, df) > target else (lo, mid)
    return (lo + hi) / 2.0


def _mean_sd(values: list[float]) -> tuple[float, float]:
    n = len(values)
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else math.nan
    return mean, sd


def welch(a: list[float], b: list[float]) -> float:
    """Two-sided p-value of Welch's t-test that ``a`` and ``b`` have the same mean (1.0 when either has
    fewer than two values; with no spread in either, 0.0 for different means and 1.0 for equal ones)."""
    if len(a) < 2 or len(b) < 2:
        return 1.0
    (ma, sa), (mb, sb) = _mean_sd(a), _mean_sd(b)
    va, vb = sa * sa / len(a), sb * sb / len(b)
    if va + vb == 0.0:
        return 0.0 if ma != mb else 1.0
    t = (ma - mb) / math.sqrt(va + vb)
    df = (va + vb) ** 2 / (va * va / (len(a) - 1) + vb * vb / (len(b) - 1))
    return t_two_sided_p(t, df)


def holm(pvalues: list[float]) -> list[float]:
    """Holm's step-down adjustment: the k-th smallest p (k from 0) times (m - k), made monotone, capped
    at 1; a pair is significant at level alpha when its adjusted p is below alpha."""
    m = len(pvalues)
    order = sorted(range(m), key=lambda i: pvalues[i])
    adjusted, running = [0.0] * m, 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (m - k) * pvalues[i]))
        adjusted[i] = running
    return adjusted


@dataclass
class Split:
    """A placement's seeds in two clusters: ``trained`` the lower outcomes, ``untrained`` the higher."""

    trained: list[float]
    untrained: list[float]

    @property
    def gap(self) -> float:
        return min(self.untrained) - max(self.trained)

    def text(self) -> str:
        n = len(self.trained) + len(self.untrained)
        low, high = (sum(c) / len(c) for c in (self.trained, self.untrained))
        return f"split ({len(self.trained)} of {n} trained): {low:.3f} vs {high:.3f}"


def split(values: list[float], reference_sd: float = math.nan) -> Split | None:
    """Whether the outcomes ``values`` of one placement's seeds split into seeds that trained and seeds
    that did not (bimodal), rather than spreading around one mean.

    The rule: sort the finite outcomes and cut them at the largest gap ``g`` between neighbours into a
    lower cluster (*trained*) and a higher one (*not trained*: stalled, or trained far worse). They are
    split when

    - ``g > SPLIT_WITHIN x s_w`` (4), ``s_w`` the pooled standard deviation within the two clusters
      (sqrt(sum over both clusters of (x - cluster mean)^2 / (n - 2)); undefined for two seeds), and
    - ``g > SPLIT_REFERENCE x reference_sd`` (8), the seed spread usual at this setting (the median of the
      placements' standard deviations in the ranking, :func:`reference_sd`: many degrees of freedom,
      which two or three seeds of one placement do not have), and
    - ``g > SPLIT_FRACTION x`` the lower cluster's mean (5%: a material difference even where seeds agree
      to the last digit),

    each spread test applying where its spread is defined, at least one of them; a diverged seed (not
    finite) makes no cluster (the placement is ``diverged``). A placement whose seeds scatter normally
    with the setting's usual spread is practically never split (the largest gap between three normal
    draws exceeds 8 standard deviations with probability below 1e-6); a seed that stalls at the unigram
    loss (4.06 nats against 3.30 for one that trains, 2.3 for one that trains well, usual spread 0.07)
    clears every test. The spread tests are what one placement's few seeds can say; a placement far
    noisier than its setting's others can be called split by them (:func:`rank` looks for splits only
    when asked: the report asks). Returns the :class:`Split` or None."""
    if any(not math.isfinite(v) for v in values):
        return None
    x = sorted(float(v) for v in values)
    if len(x) < 2:
        return None
    cut = max(range(len(x) - 1), key=lambda i: x[i + 1] - x[i])
    low, high = x[: cut + 1], x[cut + 1 :]
    gap = high[0] - low[-1]
    squares = sum((v - sum(c) / len(c)) ** 2 for c in (low, high) for v in c)
    within = math.sqrt(squares / (len(x) - 2)) if len(x) > 2 else math.nan
    tests = [(within, SPLIT_WITHIN), (reference_sd, SPLIT_REFERENCE)]
    tests = [(sd, k) for sd, k in tests if math.isfinite(sd)]
    if not tests or gap <= SPLIT_FRACTION * abs(sum(low) / len(low)):
        return None
    return Split(low, high) if all(gap > k * sd for sd, k in tests) else None


@dataclass
class Ranked:
    """One placement's row: its outcomes' mean, sd, 95% interval of the mean, rank, the letters of its
    tied groups (``DIVERGED`` for a placement with a diverged seed, ``SPLIT`` for one whose seeds split,
    see :func:`split`) and whether it is tied with the best (shares a letter with rank 1)."""

    name: str
    n: int
    mean: float
    sd: float
    low: float
    high: float
    rank: int = 0
    groups: str = ""
    best: bool = False
    diverged: int = 0
    split: Split | None = None

    def text(self) -> str:
        if not math.isfinite(self.mean):
            return f"diverged ({self.diverged} of {self.n})"
        if self.split is not None:
            return self.split.text()
        spread = "" if math.isnan(self.sd) else f" ± {self.sd:.3f}"
        return f"{self.mean:.3f}{spread}"


def _maximal_cliques(adjacent: list[set[int]]) -> list[set[int]]:
    """Every maximal clique of the graph ``adjacent`` (vertex -> neighbours), by Bron and Kerbosch's
    algorithm with a pivot (Bron & Kerbosch 1973; Tomita et al. 2006)."""
    found: list[set[int]] = []

    def extend(clique: set[int], candidates: set[int], excluded: set[int]) -> None:
        if not candidates and not excluded:
            found.append(clique)
            return
        pivot = max(candidates | excluded, key=lambda v: len(adjacent[v] & candidates))
        for v in sorted(candidates - adjacent[pivot]):
            extend(clique | {v}, candidates & adjacent[v], excluded & adjacent[v])
            candidates, excluded = candidates - {v}, excluded | {v}

    extend(set(), set(range(len(adjacent))), set())
    return found


def letter_groups(count: int, tied) -> list[list[int]]:
    """The groups of a compact letter display over items ``0 .. count-1`` (in rank order) given the
    relation ``tied(i, j)``: the maximal sets of mutually tied items, each sorted, ordered by their
    members' positions (first member, then the next, ...), without groups whose every pair and member
    the other groups already cover. Two items share a group exactly when they are tied."""
    adjacent = [{j for j in range(count) if j != i and tied(i, j)} for i in range(count)]
    groups = sorted((sorted(c) for c in _maximal_cliques(adjacent)), key=tuple)
    for g in reversed(list(groups)):  # drop redundant groups, the last-lettered first
        rest = [set(h) for h in groups if h is not g]
        covered = all(any(i in h for h in rest) for i in g) and all(
            any(i in h and j in h for h in rest) for i in g for j in g if i < j
        )
        if covered:
            groups.remove(g)
    return groups


def _letter(index: int) -> str:
    """a .. z, A .. Z, then a numbered letter (more than 52 groups)."""
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return letters[index] if index < len(letters) else f"[{index + 1}]"


def rank(samples: dict[str, list[float]], alpha: float = ALPHA, splits: bool = False) -> list[Ranked]:
    """``samples``: name -> outcomes over seeds (lower is better; ``inf``/``nan`` for a diverged seed).
    Returns the rows in rank order with their letter groups and tied-with-the-best flags (see the
    module docstring). ``splits``: find the placements whose seeds split between trained and not
    (:func:`split`, against this ranking's :func:`reference_sd`) and show them apart, unlettered (the
    report's rankings do)."""
    rows = []
    for name, values in samples.items():
        finite = [float(v) for v in values if math.isfinite(v)]
        diverged = len(values) - len(finite)
        if not finite:
            rows.append(Ranked(name, len(values), math.inf, math.nan, math.inf, math.inf, diverged=diverged))
            continue
        mean, sd = _mean_sd(finite)
        half = (
            t_quantile(0.975, len(finite) - 1) * sd / math.sqrt(len(finite)) if len(finite) > 1 else math.nan
        )
        rows.append(Ranked(name, len(values), mean, sd, mean - half, mean + half, diverged=diverged))
    reference = reference_sd(samples)
    for row in rows:
        if splits and not row.diverged:
            row.split = split(samples[row.name], reference)
    rows.sort(key=lambda r: (r.diverged > 0, r.split is not None, r.mean, r.name))
    clean = [r for r in rows if not r.diverged and r.split is None]
    pairs = [(i, j) for i in range(len(clean)) for j in range(i + 1, len(clean))]
    adjusted = holm([welch(samples[clean[i].name], samples[clean[j].name]) for i, j in pairs])
    tied = {pair: p >= alpha for pair, p in zip(pairs, adjusted, strict=True)}
    for letter, group in enumerate(letter_groups(len(clean), lambda i, j: tied[(min(i, j), max(i, j))])):
        for i in group:
            clean[i].groups += _letter(letter)
    for i, row in enumerate(clean):
        row.best = i == 0 or tied[(0, i)]
    for position, row in enumerate(rows):
        row.rank = position + 1
        if row.diverged:
            row.groups = DIVERGED
        elif row.split is not None:
            row.groups = SPLIT
    return rows


def reference_sd(samples: dict[str, list[float]]) -> float:
    """The seed spread usual in one ranking: the median of the standard deviations of the placements
    with two or more seeds and none diverged (nan without any); robust to the few placements that
    split."""
    sds = sorted(
        _mean_sd([float(v) for v in values])[1]
        for values in samples.values()
        if len(values) >= 2 and all(math.isfinite(v) for v in values)
    )
    return statistics.median(sds) if sds else math.nan


def spearman(a: dict[str, int], b: dict[str, int]) -> float:
    """Spearman's rank correlation of two rankings (name -> rank) over the names both rank, re-ranked
    among those names; nan with fewer than three."""
    common = [n for n in a if n in b]
    if len(common) < 3:
        return math.nan
    ra = {n: i for i, n in enumerate(sorted(common, key=lambda n: a[n]))}
    rb = {n: i for i, n in enumerate(sorted(common, key=lambda n: b[n]))}
    m = len(common)
    return 1.0 - 6.0 * sum((ra[n] - rb[n]) ** 2 for n in common) / (m * (m * m - 1))


# --- what a ranking can detect -------------------------------------------------------------------------
POWER = 0.8  # the power at which a detectable difference is stated
_NODES = 600  # Simpson intervals for the power integral (accurate to ~1e-9 against scipy's nct)


def normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2.0))


def _chi_density(s: float, df: float) -> float:
    """Density of S = sqrt(V / df), V ~ chi-squared(df): 2 df s f_V(df s^2)."""
    if s <= 0.0:
        return math.sqrt(2.0 / math.pi) if df == 1 else 0.0
    v = df * s * s
    log_f = (df / 2.0 - 1.0) * math.log(v) - v / 2.0 - (df / 2.0) * math.log(2.0) - math.lgamma(df / 2.0)
    return 2.0 * df * s * math.exp(log_f)


def t_power(delta: float, df: float, crit: float) -> float:
    """The power of a two-sided t-test with critical value ``crit`` and ``df`` degrees of freedom when the
    true standardised difference (the noncentrality) is ``delta``: P(|T'| > crit) for T' = (Z + delta) / S,
    S = sqrt(V / df), V ~ chi-squared(df), that is the integral over s of f_S(s) [Phi(delta - crit s) +
    Phi(-delta - crit s)] (Simpson's rule; the noncentral t distribution without scipy)."""
    top = 1.0 + 12.0 / math.sqrt(2.0 * df)
    h = top / _NODES
    total = 0.0
    for i in range(_NODES + 1):
        s = i * h
        weight = 1 if i in (0, _NODES) else 4 if i % 2 else 2
        inner = normal_cdf(delta - crit * s) + normal_cdf(-delta - crit * s)
        total += weight * _chi_density(s, df) * inner
    return min(1.0, total * h / 3.0)


@functools.lru_cache(maxsize=256)
def detectable_shift(df: float, crit: float, power: float = POWER) -> float:
    """The noncentrality at which the test of :func:`t_power` has the given ``power`` (bisection; a pure
    function of its three numbers, kept per argument triple: a report asks for the same few seed counts
    and levels once per row, ~60 power integrals each)."""
    lo, hi = 0.0, 1.0
    while t_power(hi, df, crit) < power:
        hi *= 2.0
    for _ in range(60):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_power(mid, df, crit) < power else (lo, mid)
    return (lo + hi) / 2.0


def detectable(sd: float, n: int, alpha: float, power: float = POWER) -> float:
    """The minimum detectable difference of means between two arms of ``n`` seeds each with standard
    deviation ``sd``: the true difference that a two-sided t-test at level ``alpha`` (df = 2(n - 1), the
    Welch degrees of freedom for equal arms) finds with probability ``power``,
    ``delta* x sd x sqrt(2 / n)`` with ``t_power(delta*, df, t_{1 - alpha/2, df}) = power``."""
    if n < 2 or not math.isfinite(sd):
        return math.nan
    df = 2.0 * (n - 1)
    return detectable_shift(df, t_quantile(1.0 - alpha / 2.0, df), power) * sd * math.sqrt(2.0 / n)


def seeds_needed(gap: float, sd: float, alpha: float, power: float = POWER, most: int = 1000) -> int | None:
    """The fewest seeds per arm whose :func:`detectable` difference is at most ``gap``; None past
    ``most`` (or for no gap)."""
    if not gap > 0 or not math.isfinite(sd):
        return None
    if sd == 0 or detectable(sd, 2, alpha, power) <= gap:
        return 2
    lo, hi = 2, 4  # detectable(lo) > gap >= detectable(hi), found by doubling
    while detectable(sd, hi, alpha, power) > gap:
        if hi >= most:
            return None
        lo, hi = hi, min(2 * hi, most)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if detectable(sd, mid, alpha, power) > gap else (lo, mid)
    return hi


@dataclass
class Sensitivity:
    """What one ranking could detect: the pooled sd of its placements without a diverged seed that do not
    split, their usual number of seeds, the pairs Holm's correction covers and the level of its first step
    (``alpha / pairs``), the difference detected with :data:`POWER` there, and the largest gap between the
    best and a placement still tied with it, with the seeds per placement that would detect that gap."""

    sd: float
    seeds: int
    pairs: int
    alpha: float
    detectable: float
    gap: float = math.nan
    gap_name: str = ""
    seeds_needed: int | None = None


def sensitivity(samples: dict[str, list[float]], rows: list[Ranked], alpha: float = ALPHA) -> Sensitivity:
    """:class:`Sensitivity` of the ranking ``rows`` of ``samples`` (see :func:`rank`), over the
    placements without a diverged seed that do not split."""
    clean = [r for r in rows if not r.diverged and r.split is None]
    finite = {r.name: [v for v in samples[r.name] if math.isfinite(v)] for r in clean}
    spread = [(len(v) - 1, _mean_sd(v)[1]) for v in finite.values() if len(v) >= 2]
    dof = sum(d for d, _ in spread)
    sd = math.sqrt(sum(d * s * s for d, s in spread) / dof) if dof else math.nan
    counts = sorted(len(v) for v in finite.values())
    seeds = max(set(counts), key=lambda c: (counts.count(c), -c)) if counts else 0
    pairs = max(1, len(clean) * (len(clean) - 1) // 2)
    first = alpha / pairs
    out = Sensitivity(sd, seeds, pairs, first, detectable(sd, seeds, first))
    tied = [r for r in clean[1:] if r.best]
    if clean and tied:
        worst = max(tied, key=lambda r: r.mean)
        out.gap, out.gap_name = worst.mean - clean[0].mean, worst.name
        out.seeds_needed = seeds_needed(out.gap, sd, first)
    return out
