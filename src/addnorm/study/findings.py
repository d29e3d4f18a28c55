"""The claims of our source texts checked against a study's stored runs: :func:`compute_findings`.

The claims are declared in :mod:`.claims`, the rule that judges them lives in :mod:`.rule` (a
difference counts when it exceeds ``K = 2`` pooled standard deviations over seeds; see :data:`RULE`).
A verdict is

- "supported" when the claimed difference counts,
- "not supported" when the opposite difference counts,
- "inconclusive" when neither does (seeds disagree, one seed only, or mixed divergence),
- "not tested by this study" when the study has no runs that bear on the claim.

Failed runs (errors, killed runs) are missing data, not evidence. Per-layer measures come from the
profile rule of :mod:`.profiles`: the FFN weight-gradient norm and the stream's RMS per layer at
initialisation (step 0) and at the last probed step.
"""

from __future__ import annotations

from .claims import CLAIMS, DEEP, TRAINING_ONLY, GradientProfile, act_growth, scale, top_grad_shortfall
from .profiles import FFN_SUBLAYERS, ffn_grad_profile, profile_list
from .records import Finding
from .rule import (
    GROWTH,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTED,
    RULE,
    SUPPORTED,
    TREND_WORDS,
    Arm,
    K,
    arms,
    differ,
    outcome,
    pooled_std,
    trend,
)

__all__ = [
    "CLAIMS", "DEEP", "FFN_SUBLAYERS", "GROWTH", "INCONCLUSIVE", "K", "NOT_SUPPORTED", "NOT_TESTED", "RULE",
    "SUPPORTED", "TRAINING_ONLY", "TREND_WORDS", "Arm", "Finding", "GradientProfile", "act_growth", "arms",
    "compute_findings", "differ", "ffn_grad_profile", "outcome", "pooled_std", "scale", "top_grad_shortfall",
    "trend", "with_profiles",
]  # fmt: skip

PROFILED = ("weight_grad_norm", "act_rms")  # the per-layer metrics the claims read
PARTS = {"weight_grad_norm": "ffn", "act_rms": "stream"}


def with_profiles(store, runs: list[dict]) -> list[dict]:
    """Copies of ``runs`` with what the claims read of their per-layer rows: ``init_rows`` (the rows of
    :data:`PROFILED` at step 0), ``init_profile`` and ``last_profile`` (metric -> per-layer values at step 0
    and at the last probed step, by :func:`.profiles.layer_profile`) and ``branch_gain`` (RMS(x + F(x)) /
    RMS(x) at the middle layer's FFN connection at initialisation, for the gradient findings' mechanism)."""
    out = []
    for run in runs:
        r = dict(run)
        x, total = store.metric(r["id"], "xf_x_rms")[:1], store.metric(r["id"], "xf_sum_rms")[:1]
        r["branch_gain"] = total[0][1] / x[0][1] if x and total and x[0][1] else None
        rows = {m: store.layer_metric(r["id"], m) for m in PROFILED}
        r["init_rows"] = [x for m in PROFILED for x in rows[m] if x["step"] == 0]
        r["init_profile"] = {m: profile_list(rows[m], m, PARTS[m], 0) for m in PROFILED}
        r["last_profile"] = {m: profile_list(rows[m], m, PARTS[m], "last") for m in PROFILED}
        out.append(r)
    return out


def compute_findings(store) -> list[Finding]:
    """Every claim's findings (one per setting it was measured at) from the current plan's runs."""
    runs = with_profiles(store, store.runs())
    return [finding for claim in CLAIMS for finding in claim(runs)]
