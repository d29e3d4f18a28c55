"""The claims of our source texts, each checked against the numbers in a study's store.

Every verdict is computed from stored runs: "supported", "not supported", or "not tested by this study"
when the study has no runs that bear on the claim. Thresholds are stated in each finding's evidence.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

SUPPORTED, NOT_SUPPORTED, NOT_TESTED = "supported", "not supported", "not tested by this study"
MARGIN = 1.05  # "worse" means at least 5% higher held-out loss (or diverged)


@dataclass
class Finding:
    claim: str
    source: str
    evidence: str
    verdict: str


def outcome(run: dict) -> float:
    """Held-out loss of a finished run; +inf for a diverged or failed one."""
    if run["status"] != "done" or run["final_val_loss"] is None:
        return math.inf
    return float(run["final_val_loss"])


def _fmt(v: float) -> str:
    return "diverged" if math.isinf(v) else f"{v:.3f}"


def _pct(new: float, ref: float) -> str:
    """How much higher ``new`` is than ``ref``, e.g. "+2.3%" ("diverged" for an infinite loss)."""
    if math.isinf(new) or math.isinf(ref):
        return "diverged" if math.isinf(new) else "reference diverged"
    return f"{(new / ref - 1):+.1%}"


def _mean(values: list[float]) -> float:
    return math.inf if any(math.isinf(v) for v in values) else sum(values) / len(values)


def compare(runs: list[dict], vary: str, where: dict | None = None) -> list[tuple[dict, dict]]:
    """Groups of runs identical except for ``vary`` (and the seed): [(shared config, {value: mean loss})]."""
    groups: dict[str, tuple[dict, dict]] = {}
    for run in runs:
        cfg = run["config"]
        if any(cfg.get(k) != v for k, v in (where or {}).items()):
            continue
        rest = {k: v for k, v in cfg.items() if k not in (vary, "seed")}
        key = repr(sorted(rest.items()))
        groups.setdefault(key, (rest, defaultdict(list)))[1][cfg.get(vary)].append(outcome(run))
    out = [(rest, {k: _mean(v) for k, v in vals.items()}) for rest, vals in groups.values() if len(vals) > 1]
    return sorted(out, key=lambda g: (g[0].get("n_layers", 0), repr(sorted(g[0].items()))))


def warmup_claim(runs, layer_rows) -> Finding:
    claim = "Pre-LN trains without warmup where Post-LN needs it"
    source = "Xiong et al. 2020; our source texts' Post-LN vs Pre-LN comparison"
    found = {}
    for placement in ("post", "pre"):
        for rest, losses in compare(runs, "warmup", {"placement": placement}):
            if 0 in losses and any(k > 0 for k in losses):
                warm = min(k for k in losses if k > 0)
                found[placement] = (losses[0], losses[warm], warm, rest.get("lr"))
    if len(found) < 2:
        return Finding(claim, source, "needs post and pre runs with and without warmup", NOT_TESTED)
    (p0, pw, pk, lr), (q0, qw, _, _) = found["post"], found["pre"]
    post_needs = p0 > pw * MARGIN
    pre_fine = q0 <= qw * MARGIN
    evidence = (
        f"lr {lr}: Post-LN loss {_fmt(p0)} without warmup vs {_fmt(pw)} with {pk} warmup steps; "
        f"Pre-LN {_fmt(q0)} vs {_fmt(qw)} (needs warmup = > {MARGIN - 1:.0%} worse without it)"
    )
    return Finding(claim, source, evidence, SUPPORTED if post_needs and pre_fine else NOT_SUPPORTED)


def ffn_grad_profile(layer_rows: list[dict]) -> list[float]:
    """Per-layer FFN weight-gradient norm sqrt(sum of squared matrix norms) at the first probed step."""
    rows = [r for r in layer_rows if r["metric"] == "weight_grad_norm" and r["sublayer"] == "ff"]
    if not rows:
        return []
    first = min(r["step"] for r in rows)
    per_layer: dict[int, float] = defaultdict(float)
    for r in rows:
        if r["step"] == first:
            per_layer[r["layer"]] += r["value"] ** 2
    return [math.sqrt(per_layer[k]) for k in sorted(per_layer)]


def _grad_ratios(runs, layer_rows) -> dict[str, tuple[float, int]]:
    """placement -> (mean over seeds of top/first-layer FFN gradient at init, depth), deepest runs."""
    ratios = {}
    for placement in ("post", "pre"):
        candidates = [r for r in runs if r["config"]["placement"] == placement and layer_rows.get(r["id"])]
        if not candidates:
            continue
        depth = max(r["config"]["n_layers"] for r in candidates)
        profiles = [
            ffn_grad_profile(layer_rows[r["id"]]) for r in candidates if r["config"]["n_layers"] == depth
        ]
        profiles = [p for p in profiles if len(p) >= 2 and p[0] > 0]
        if profiles:
            ratios[placement] = (sum(p[-1] / p[0] for p in profiles) / len(profiles), depth)
    return ratios


GRAD_SOURCE = "Xiong et al. 2020 (FFN weight gradients per layer at initialisation)"


def post_gradient_claim(runs, layer_rows) -> Finding:
    claim = "Post-LN gradient norms grow toward the top layers"
    ratios = _grad_ratios(runs, layer_rows)
    if "post" not in ratios:
        return Finding(claim, GRAD_SOURCE, "needs per-layer gradients at init of post runs", NOT_TESTED)
    ratio, depth = ratios["post"]
    evidence = f"top layer / first layer = {ratio:.2f} at {depth} layers (grows = above 1.2)"
    return Finding(claim, GRAD_SOURCE, evidence, SUPPORTED if ratio > 1.2 else NOT_SUPPORTED)


def pre_gradient_claim(runs, layer_rows) -> Finding:
    claim = "Pre-LN gradient norms stay flat across layers"
    ratios = _grad_ratios(runs, layer_rows)
    if "pre" not in ratios:
        return Finding(claim, GRAD_SOURCE, "needs per-layer gradients at init of pre runs", NOT_TESTED)
    ratio, depth = ratios["pre"]
    direction = "shrink toward the top" if ratio < 1 else "grow toward the top"
    evidence = (
        f"top layer / first layer = {ratio:.2f} at {depth} layers: they {direction} (flat = within 0.5-2)"
    )
    return Finding(claim, GRAD_SOURCE, evidence, SUPPORTED if 0.5 <= ratio <= 2.0 else NOT_SUPPORTED)


def residual_claim(runs, layer_rows) -> Finding:
    claim = "Removing the residual connection fails beyond about 6 layers"
    source = "our source texts' ablation (no residual)"
    groups = [(rest.get("n_layers"), v) for rest, v in compare(runs, "residual") if True in v and False in v]
    if not groups:
        return Finding(
            claim, source, "needs runs with and without the residual at the same settings", NOT_TESTED
        )
    by_depth = {}
    for depth, v in groups:
        by_depth.setdefault(depth, v[False] / v[True] if math.isfinite(v[True]) else math.nan)
    depths = sorted(by_depth)
    shallow = [by_depth[d] for d in depths if d < 6]
    deep = [by_depth[d] for d in depths if d >= 6]
    evidence = "; ".join(
        f"{d} layers: loss without/with residual = "
        f"{'diverged' if math.isinf(by_depth[d]) else f'{by_depth[d]:.2f}'}"
        for d in depths
    )
    if not deep:
        return Finding(claim, source, evidence + " (no run at 6+ layers)", NOT_TESTED)
    fails_deep = all(r > MARGIN for r in deep)
    fine_shallow = all(r <= max(deep) for r in shallow) if shallow else True
    return Finding(claim, source, evidence, SUPPORTED if fails_deep and fine_shallow else NOT_SUPPORTED)


def _norm_vs(runs, other: str) -> list[tuple[int, float, float]]:
    out = []
    for rest, v in compare(runs, "norm"):
        if "layernorm" in v and other in v:
            out.append((rest.get("n_layers"), v["layernorm"], v[other]))
    return out


def no_norm_claim(runs, layer_rows) -> Finding:
    claim = "Removing the normalization is unstable"
    source = "our source texts' ablation (no norm)"
    pairs = _norm_vs(runs, "none")
    if not pairs:
        return Finding(
            claim, source, "needs runs with norm none and layernorm at the same settings", NOT_TESTED
        )
    diverged = [r for r in runs if r["config"]["norm"] == "none" and r["status"] == "diverged"]
    worse = [p for p in pairs if p[2] > p[1] * MARGIN]
    evidence = "; ".join(
        f"{d} layers: LayerNorm {_fmt(a)}, no norm {_fmt(b)} ({_pct(b, a)})" for d, a, b in pairs
    )
    evidence += (
        f"; {len(diverged)} no-norm run(s) diverged (unstable = a run diverged, or held-out loss "
        f"> {MARGIN - 1:.0%} worse than LayerNorm's at some depth)"
    )
    return Finding(claim, source, evidence, SUPPORTED if worse or diverged else NOT_SUPPORTED)


def batchnorm_claim(runs, layer_rows) -> Finding:
    claim = "BatchNorm generalises worse than LayerNorm"
    source = "our source texts' pitfall (BatchNorm instead of LayerNorm)"
    pairs = _norm_vs(runs, "batchnorm")
    if not pairs:
        return Finding(
            claim, source, "needs runs with batchnorm and layernorm at the same settings", NOT_TESTED
        )
    evidence = "; ".join(
        f"{d} layers: held-out loss LayerNorm {_fmt(a)}, BatchNorm {_fmt(b)} ({_pct(b, a)})"
        for d, a, b in pairs
    )
    evidence += f" (worse = > {MARGIN - 1:.0%} higher at every depth)"
    return Finding(
        claim, source, evidence, SUPPORTED if all(b > a * MARGIN for _, a, b in pairs) else NOT_SUPPORTED
    )


def final_norm_claim(runs, layer_rows) -> Finding:
    claim = "Pre-LN without a final norm is worse than with it"
    source = "Xiong et al. 2020; GPT-2; our source texts (final LayerNorm of Pre-LN stacks)"
    pairs = []
    for rest, v in compare(runs, "final_norm", {"placement": "pre"}):
        with_norm = v.get(True, v.get("auto"))
        if with_norm is not None and False in v:
            pairs.append((rest.get("n_layers"), with_norm, v[False]))
    if not pairs:
        return Finding(claim, source, "needs pre runs with and without the final norm", NOT_TESTED)
    evidence = "; ".join(
        f"{d} layers: with final norm {_fmt(a)}, without {_fmt(b)} ({_pct(b, a)})" for d, a, b in pairs
    )
    evidence += f" (worse = > {MARGIN - 1:.0%} higher at every depth)"
    return Finding(
        claim, source, evidence, SUPPORTED if all(b > a * MARGIN for _, a, b in pairs) else NOT_SUPPORTED
    )


CLAIMS: list[Callable] = [
    warmup_claim,
    post_gradient_claim,
    pre_gradient_claim,
    residual_claim,
    no_norm_claim,
    batchnorm_claim,
    final_norm_claim,
]


def compute_findings(store) -> list[Finding]:
    """Every claim's verdict from the runs and per-layer metrics in ``store``."""
    runs = store.runs()
    layer_rows = {r["id"]: store.layer_metric(r["id"], "weight_grad_norm") for r in runs}
    return [claim(runs, layer_rows) for claim in CLAIMS]
