"""The findings' statistical rule: arms of seeds, when a difference counts, and what a verdict means.

Runs that are identical except for the compared setting and the seed form an *arm*; an arm's outcome is
its held-out loss (or another measure), mean ± sample standard deviation over its seeds. The rule
(:data:`RULE`): a difference counts when the difference of the two means exceeds ``K = 2`` pooled
standard deviations; an arm whose every seed diverged is worse than an arm with no diverged seed.
A per-layer gradient profile's trend is judged on the ratio of the top layer's value to the first
layer's, per seed, on a log scale: "grows" above :data:`GROWTH`, "shrinks" below its inverse, "flat"
between (the one definition, also used by ``addnorm inspect``); the mean log-ratio must clear the
threshold by ``K`` standard deviations. The claims themselves are declared in :mod:`.claims`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .ranking import POWER, detectable_shift, t_two_sided_p

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
NOT_TESTED = "not tested by this study"
K = 2.0  # a difference counts when it exceeds K pooled standard deviations
GROWTH = 1.2  # a top/first-layer ratio above this grows, below 1/GROWTH shrinks, between is flat
RULE = (
    f"a difference counts when the difference of the means exceeds {K:g} pooled standard deviations "
    "over seeds (an arm whose every seed diverged is worse than one with none diverged); a gradient "
    f"profile grows above a top/first-layer ratio of {GROWTH}, shrinks below 1/{GROWTH}, is flat "
    f"between, judged when the mean log-ratio clears the threshold by {K:g} standard deviations; "
    "otherwise the verdict is inconclusive"
)
# What each verdict means, as the report and the README explain it.
VERDICTS = {
    SUPPORTED: "the study measured what the claim predicts: its difference counts under the rule (the "
    "evidence column says when, for each claim)",
    NOT_SUPPORTED: "the opposite difference counts under the rule: this study measured the reverse of the "
    "claim (at the settings shown, which may be far from the source's)",
    INCONCLUSIVE: "neither difference counts: the seeds disagree, there is one seed, or divergence is "
    "mixed; more seeds (or a setting closer to the source's) could settle it",
    NOT_TESTED: "the study has no runs that bear on the claim; the evidence column says which runs it needs",
}
FINISHED = ("done", "diverged")  # runs that are evidence; a failed run (an error, killed) is missing data


def trend(ratio: float) -> str:
    """ "grows", "shrinks" or "flat" for a top-layer / first-layer ratio ("undefined" if not finite)."""
    if not math.isfinite(ratio) or ratio <= 0:
        return "undefined"
    return "grows" if ratio > GROWTH else "shrinks" if ratio < 1 / GROWTH else "flat"


TREND_WORDS = {
    "grows": "grows toward the top layers",
    "shrinks": "shrinks toward the top layers",
    "flat": "nearly flat across depth",
    "undefined": "undefined (no gradient)",
}


def outcome(run: dict) -> float:
    """Held-out loss of a finished run; +inf for a diverged one (or a finished run without a loss)."""
    if run["status"] != "done" or run["final_val_loss"] is None:
        return math.inf
    return float(run["final_val_loss"])


def finished(runs: list[dict]) -> list[dict]:
    """Runs that are evidence: done or diverged (a failed run is an error, retried next time)."""
    return [r for r in runs if r["status"] in FINISHED]


@dataclass
class Arm:
    """The outcomes of one setting over its seeds (``inf`` for a diverged seed)."""

    values: list[float] = field(default_factory=list)
    seeds: list[int] = field(default_factory=list)

    def add(self, value: float, seed: int) -> None:
        self.values.append(value)
        self.seeds.append(seed)

    @property
    def finite(self) -> list[float]:
        return [v for v in self.values if math.isfinite(v)]

    @property
    def diverged(self) -> int:
        return len(self.values) - len(self.finite)

    @property
    def mean(self) -> float:
        f = self.finite
        return sum(f) / len(f) if f else math.inf

    @property
    def std(self) -> float:
        """Sample standard deviation of the finite outcomes (nan with fewer than two)."""
        f = self.finite
        if len(f) < 2:
            return math.nan
        m = sum(f) / len(f)
        return math.sqrt(sum((v - m) ** 2 for v in f) / (len(f) - 1))

    def text(self) -> str:
        n = len(self.values)
        if not self.finite:
            return f"diverged ({n} of {n} seeds)"
        spread = "" if math.isnan(self.std) else f" ± {self.std:.3f}"
        extra = f"; {self.diverged} of {n} diverged" if self.diverged else ""
        return f"{self.mean:.3f}{spread} ({n} seed{'s' if n != 1 else ''}{extra})"


def pooled_std(*arms: Arm) -> float:
    """sqrt(sum (n_i - 1) s_i^2 / sum (n_i - 1)) over the arms' finite outcomes (nan without spread)."""
    dof = sum(len(a.finite) - 1 for a in arms if len(a.finite) >= 2)
    if dof <= 0:
        return math.nan
    return math.sqrt(sum((len(a.finite) - 1) * a.std**2 for a in arms if len(a.finite) >= 2) / dof)


def differ(a: Arm, b: Arm) -> int:
    """+1 if ``a`` is worse (higher) than ``b`` by :data:`RULE`, -1 if better, 0 if the rule cannot tell."""
    if a.diverged or b.diverged:
        if a.diverged == len(a.values) and b.diverged == 0:
            return 1
        if b.diverged == len(b.values) and a.diverged == 0:
            return -1
        return 0
    if len(a.finite) < 2 or len(b.finite) < 2:
        return 0
    diff, sd = a.mean - b.mean, pooled_std(a, b)
    if abs(diff) > K * sd:  # with sd == 0 any difference counts
        return 1 if diff > 0 else -1
    return 0


def margin(a: Arm, b: Arm) -> str:
    """The difference of means in pooled standard deviations, for the evidence text."""
    if not a.finite or not b.finite or a.diverged or b.diverged:
        return ""
    sd = pooled_std(a, b)
    if math.isnan(sd):
        return "; one seed: no spread to judge by"
    if sd == 0:
        return ""
    return f"; difference {a.mean - b.mean:+.3f} = {(a.mean - b.mean) / sd:+.1f} pooled sd"


def judged_trend(ratios: list[float]) -> str:
    """The trend of per-seed top/first-layer ratios that the rule can vouch for: "grows", "shrinks" or
    "flat" when the mean log-ratio clears the threshold log(:data:`GROWTH`) by ``K`` standard deviations,
    "" when the seeds do not settle it (or there is one seed)."""
    if len(ratios) < 2:
        return ""
    logs = [math.log(r) for r in ratios]
    mean = sum(logs) / len(logs)
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (len(logs) - 1))
    lo, hi, t = mean - K * sd, mean + K * sd, math.log(GROWTH)
    if lo > t:
        return "grows"
    if hi < -t:
        return "shrinks"
    if -t < lo and hi < t:
        return "flat"
    return ""


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def arms(
    runs: list[dict], vary: str, where: dict | None = None, value: Callable[[dict], float] | None = None
) -> list[tuple[dict, dict]]:
    """Groups of finished runs identical except for ``vary`` and the seed: [(shared config, {value:
    Arm})], by depth; an arm holds ``value(run)`` per seed (default: :func:`outcome`, the held-out loss)."""
    value = value or outcome
    groups: dict[str, tuple[dict, dict]] = {}
    for run in finished(runs):
        cfg = run["config"]
        if any(cfg.get(k) != v for k, v in (where or {}).items()):
            continue
        rest = {k: v for k, v in cfg.items() if k not in (vary, "seed")}
        key = repr(sorted(rest.items()))
        group = groups.setdefault(key, (rest, defaultdict(Arm)))[1]
        group[_hashable(cfg.get(vary))].add(value(run), cfg.get("seed", 0))
    out = [(rest, dict(v)) for rest, v in groups.values() if len(v) > 1]
    return sorted(out, key=lambda g: (g[0].get("n_layers", 0), repr(sorted(g[0].items()))))


def as_t_test(n: int, power: float = POWER) -> tuple[float, float, float]:
    """The rule between two arms of ``n`` seeds each as a two-sided t-test: a difference counts when
    ``|d| > K s_pooled``, that is ``|t| > K sqrt(n / 2)`` with ``df = 2(n - 1)``. Returns (that critical
    value, the level it implies, uncorrected for the number of claims, and the true difference in
    standard deviations it detects with ``power``)."""
    crit, df = K * math.sqrt(n / 2.0), 2.0 * (n - 1)
    return crit, t_two_sided_p(crit, df), detectable_shift(df, crit, power) * math.sqrt(2.0 / n)
