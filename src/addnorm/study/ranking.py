"""Rankings with confidence: placements ranked by mean outcome over seeds, with intervals, and grouped
where the data cannot tell them apart.

For each placement: mean, sample standard deviation and the 95% confidence interval of the mean,
``mean ± t_{0.975, n-1} * sd / sqrt(n)``. Every pair of placements is compared by Welch's t-test
(Welch 1947; unequal variances, Welch-Satterthwaite degrees of freedom), and the p-values of all pairs
are adjusted together by Holm's step-down method (Holm 1979), which bounds the family-wise error rate at
``alpha`` (0.05). Tied groups (tiers), in order of the means: the best placement not yet grouped leads a
tier, and every placement not yet grouped that the adjusted test does not find worse than the leader
joins it. A placement with a diverged seed ranks after every placement without one (its group: the
diverged tier); fewer than two finite seeds cannot be tested and ties with everything.

The Student t distribution is computed here from the regularised incomplete beta function (continued
fraction, Numerical Recipes 6.4), so the library needs no scipy at run time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

ALPHA = 0.05
DIVERGED = "diverged"


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
class Ranked:
    """One placement's row: its outcomes' mean, sd, 95% interval of the mean, rank and tier (1 = tied
    with the best; ``DIVERGED`` for placements with a diverged seed)."""

    name: str
    n: int
    mean: float
    sd: float
    low: float
    high: float
    rank: int = 0
    tier: int | str = 0
    diverged: int = 0

    def text(self) -> str:
        if not math.isfinite(self.mean):
            return f"diverged ({self.diverged} of {self.n})"
        spread = "" if math.isnan(self.sd) else f" ± {self.sd:.3f}"
        return f"{self.mean:.3f}{spread}"


def rank(samples: dict[str, list[float]], alpha: float = ALPHA) -> list[Ranked]:
    """``samples``: name -> outcomes over seeds (lower is better; ``inf``/``nan`` for a diverged seed).
    Returns the rows in rank order with their tiers (see the module docstring)."""
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
    rows.sort(key=lambda r: (r.diverged > 0, r.mean, r.name))
    clean = [r for r in rows if not r.diverged]
    pairs = [(i, j) for i in range(len(clean)) for j in range(i + 1, len(clean))]
    finite = {r.name: [float(v) for v in samples[r.name]] for r in clean}
    adjusted = holm([welch(finite[clean[i].name], finite[clean[j].name]) for i, j in pairs])
    differs = {(clean[i].name, clean[j].name): p < alpha for (i, j), p in zip(pairs, adjusted, strict=True)}
    tier = 0
    for i, row in enumerate(clean):
        if row.tier:
            continue
        tier += 1
        row.tier = tier
        for other in clean[i + 1 :]:
            if not other.tier and not differs[(row.name, other.name)]:
                other.tier = tier
    for position, row in enumerate(rows):
        row.rank = position + 1
        if row.diverged:
            row.tier = DIVERGED
    return rows


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
