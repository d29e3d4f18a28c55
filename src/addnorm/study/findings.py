"""The claims of our source texts, each checked against a study's stored runs under a stated rule.

Runs that are identical except for the compared setting and the seed form an *arm*; an arm's outcome is
its held-out loss, mean ± sample standard deviation over its seeds. The rule (:data:`RULE`): a
difference counts when the difference of the two means exceeds ``K = 2`` pooled standard deviations;
an arm whose every seed diverged is worse than an arm with no diverged seed. A verdict is

- "supported" when the claimed difference counts,
- "not supported" when the opposite difference counts,
- "inconclusive" when neither does (seeds disagree, one seed only, or mixed divergence),
- "not tested by this study" when the study has no runs that bear on the claim.

Gradient profiles are judged on the ratio of the top layer's FFN weight-gradient norm to the first
layer's at initialisation, per seed, on a log scale: "grows" above :data:`GROWTH`, "shrinks" below its
inverse, "flat" between (the one definition, also used by ``addnorm inspect``); the mean log-ratio
must clear the threshold by ``K`` standard deviations. Failed runs (errors) are not evidence.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

SUPPORTED, NOT_SUPPORTED, INCONCLUSIVE = "supported", "not supported", "inconclusive"
NOT_TESTED = "not tested by this study"
K = 2.0  # a difference counts when it exceeds K pooled standard deviations
FFN_SUBLAYERS = ("ff", "mlp")  # addnorm's transformer, Hugging Face models
GROWTH = 1.2  # a top/first-layer ratio above this grows, below 1/GROWTH shrinks, between is flat
RULE = (
    f"a difference counts when the difference of the means exceeds {K:g} pooled standard deviations "
    "over seeds (an arm whose every seed diverged is worse than one with none diverged); a gradient "
    f"profile grows above a top/first-layer ratio of {GROWTH}, shrinks below 1/{GROWTH}, is flat "
    f"between, judged when the mean log-ratio clears the threshold by {K:g} standard deviations; "
    "otherwise the verdict is inconclusive"
)


# --- trends (one definition for the study and `addnorm inspect`) ------------------------------------
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


# --- arms and the rule --------------------------------------------------------------------------------
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


def _margin(a: Arm, b: Arm) -> str:
    """The difference of means in pooled standard deviations, for the evidence text."""
    if not a.finite or not b.finite or a.diverged or b.diverged:
        return ""
    sd = pooled_std(a, b)
    if math.isnan(sd):
        return "; one seed: no spread to judge by"
    if sd == 0:
        return ""
    return f"; difference {a.mean - b.mean:+.3f} = {(a.mean - b.mean) / sd:+.1f} pooled sd"


@dataclass
class Finding:
    claim: str
    source: str
    evidence: str
    verdict: str
    scale: str = ""  # the setting the verdict was measured at
    caveat: str = ""  # what would change it
    seeds: list[int] = field(default_factory=list)


def outcome(run: dict) -> float:
    """Held-out loss of a finished run; +inf for a diverged one (or a finished run without a loss)."""
    if run["status"] != "done" or run["final_val_loss"] is None:
        return math.inf
    return float(run["final_val_loss"])


def _results(runs: list[dict]) -> list[dict]:
    """Runs that are evidence: done or diverged (a failed run is an error, retried next time)."""
    return [r for r in runs if r["status"] in ("done", "diverged")]


def arms(
    runs: list[dict], vary: str, where: dict | None = None, value: Callable[[dict], float] = None
) -> list[tuple[dict, dict]]:
    """Groups of runs identical except for ``vary`` and the seed: [(shared config, {value: Arm})]; an
    arm holds ``value(run)`` per seed (default: :func:`outcome`, the held-out loss)."""
    value = value or outcome
    groups: dict[str, tuple[dict, dict]] = {}
    for run in _results(runs):
        cfg = run["config"]
        if any(cfg.get(k) != v for k, v in (where or {}).items()):
            continue
        rest = {k: v for k, v in cfg.items() if k not in (vary, "seed")}
        key = repr(sorted(rest.items()))
        group = groups.setdefault(key, (rest, defaultdict(Arm)))[1]
        group[_hashable(cfg.get(vary))].add(value(run), cfg.get("seed", 0))
    out = [(rest, dict(v)) for rest, v in groups.values() if len(v) > 1]
    return sorted(out, key=lambda g: (g[0].get("n_layers", 0), repr(sorted(g[0].items()))))


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value


def scale(cfg: dict, seeds: list[int] | None = None, skip: tuple[str, ...] = ()) -> str:
    """The setting in words: task, depth, width, budget, learning rate, init (and the seeds)."""
    parts = []
    for key, fmt in (
        ("task", "{}"),
        ("n_layers", "{} layers"),
        ("d_model", "d_model {}"),
        ("steps", "{} steps"),
        ("batch_size", "batch {}"),
        ("lr", "lr {:g}"),
        ("warmup", "warmup {}"),
        ("init", "init {}"),
        ("placement", "{}"),
    ):
        if key in cfg and key not in skip:
            parts.append(fmt.format(cfg[key]))
    if seeds:
        parts.append(f"seeds {', '.join(map(str, sorted(set(seeds))))}")
    return ", ".join(parts)


def _seeds(*arm_list: Arm) -> list[int]:
    return sorted({s for a in arm_list for s in a.seeds})


def _min_seeds(*arm_list: Arm) -> int:
    return min(len(a.values) for a in arm_list)


# --- the claims -------------------------------------------------------------------------------------
def warmup_claim(runs, layer_rows) -> list[Finding]:
    claim = "Pre-LN trains without warmup where Post-LN needs it"
    source = "Xiong et al. 2020; our source texts' Post-LN vs Pre-LN comparison"
    caveat = "the learning rate (at a low one Post-LN trains without warmup), depth and training length"
    by_setting: dict[str, dict[str, tuple[dict, dict]]] = defaultdict(dict)
    for placement in ("post", "pre"):
        for rest, group in arms(runs, "warmup", {"placement": placement}):
            if 0 in group and any(k > 0 for k in group):
                key = repr(sorted((k, repr(v)) for k, v in rest.items() if k != "placement"))
                by_setting[key][placement] = (rest, group)
    out = []
    for pair in by_setting.values():
        if len(pair) < 2:
            continue
        (rest, post), (_, pre) = pair["post"], pair["pre"]
        warm = min(k for k in post if k > 0)
        if warm not in pre:
            continue
        post_cmp, pre_cmp = differ(post[0], post[warm]), differ(pre[0], pre[warm])
        if post_cmp == 1 and pre_cmp <= 0:
            verdict = SUPPORTED
        elif post_cmp == -1 or pre_cmp == 1:
            verdict = NOT_SUPPORTED
        else:
            verdict = INCONCLUSIVE
        evidence = (
            f"held-out loss, no warmup vs {warm} warmup steps: Post-LN {post[0].text()} vs "
            f"{post[warm].text()}{_margin(post[0], post[warm])}; Pre-LN {pre[0].text()} vs "
            f"{pre[warm].text()}{_margin(pre[0], pre[warm])}. Supported when Post-LN is worse without "
            "warmup by the rule and Pre-LN is not"
        )
        seeds = _seeds(post[0], post[warm], pre[0], pre[warm])
        where = scale(rest, seeds, ("warmup", "placement"))
        out.append(Finding(claim, source, evidence, verdict, where, caveat, seeds))
    return out or [Finding(claim, source, "needs post and pre runs with and without warmup", NOT_TESTED)]


def ffn_grad_profile(layer_rows: list[dict]) -> list[float]:
    """Per-layer FFN weight-gradient norm sqrt(sum of squared matrix norms) at the first probed step."""
    rows = [r for r in layer_rows if r["metric"] == "weight_grad_norm" and r["sublayer"] in FFN_SUBLAYERS]
    if not rows:
        return []
    first = min(r["step"] for r in rows)
    per_layer: dict[int, float] = defaultdict(float)
    for r in rows:
        if r["step"] == first:
            per_layer[r["layer"]] += r["value"] ** 2
    return [math.sqrt(per_layer[k]) for k in sorted(per_layer)]


def stream_rms_profile(layer_rows: list[dict]) -> list[float]:
    """Per-layer RMS of the residual stream at each layer's output at the first probed step."""
    rows = [r for r in layer_rows if r["metric"] == "act_rms" and r["sublayer"] == ""]
    if not rows:
        return []
    first = min(r["step"] for r in rows)
    return [r["value"] for r in sorted(rows, key=lambda r: r["layer"]) if r["step"] == first]


@dataclass
class Profile:
    """Per-seed top/first-layer ratios of a (placement, init) at one depth, and the stream's growth."""

    ratios: list[float]
    seeds: list[int]
    growth: list[float]  # per seed: stream RMS at the top layer's output / at the first layer's
    branch_gain: list[float]  # per seed: RMS(x + F(x)) / RMS(x) at the middle layer's FFN connection
    cfg: dict

    @property
    def log_mean(self) -> float:
        return sum(map(math.log, self.ratios)) / len(self.ratios)

    @property
    def log_std(self) -> float:
        if len(self.ratios) < 2:
            return math.nan
        m = self.log_mean
        return math.sqrt(sum((math.log(r) - m) ** 2 for r in self.ratios) / (len(self.ratios) - 1))

    @property
    def ratio(self) -> float:
        """The geometric mean of the per-seed ratios."""
        return math.exp(self.log_mean)

    def text(self) -> str:
        sd = "" if math.isnan(self.log_std) else f" (x/÷ {math.exp(self.log_std):.2f})"
        per_seed = ", ".join(f"{r:.2f}" for r in self.ratios)
        seeds = ", ".join(map(str, self.seeds))
        return f"top/first layer = {self.ratio:.2f}{sd}, per seed {per_seed} (seeds {seeds})"

    def judged(self) -> str:
        """The trend the rule can vouch for: grows/shrinks/flat, or "" when the seeds do not settle it."""
        if len(self.ratios) < 2:
            return ""
        lo, hi, t = self.log_mean - K * self.log_std, self.log_mean + K * self.log_std, math.log(GROWTH)
        if lo > t:
            return "grows"
        if hi < -t:
            return "shrinks"
        if -t < lo and hi < t:
            return "flat"
        return ""


# Settings that do not change a model or its first batch: runs differing only in these start alike.
TRAINING_ONLY = (
    "lr", "warmup", "schedule", "steps", "eval_every", "eval_batches", "probe_every", "diverge_factor",
    "weight_decay", "grad_clip",
)  # fmt: skip


def gradient_profiles(runs, layer_rows) -> dict[tuple[str, str], Profile]:
    """(placement, init) -> Profile at the deepest depth measured for it, one sample per seed: runs that
    differ only in training settings (warmup, learning rate, ...) share their initialisation and count
    once, so they never pass for independent seeds."""
    groups: dict[tuple[str, str], dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in _results(runs):
        cfg = r["config"]
        if layer_rows.get(r["id"]):
            start = repr(sorted((k, repr(v)) for k, v in cfg.items() if k not in (*TRAINING_ONLY, "seed")))
            groups[(str(cfg.get("placement")), str(cfg.get("init")))][start].setdefault(cfg.get("seed", 0), r)
    out = {}
    for key, starts in groups.items():
        # the deepest setting, and among equally deep ones the one with the most seeds
        by_seed = max(
            starts.values(), key=lambda g: (next(iter(g.values()))["config"].get("n_layers", 0), len(g))
        )
        ratios, seeds, growth, gain, cfg = [], [], [], [], {}
        for seed, r in sorted(by_seed.items()):
            p = ffn_grad_profile(layer_rows[r["id"]])
            if len(p) < 2 or p[0] <= 0 or p[-1] <= 0:
                continue
            ratios.append(p[-1] / p[0])
            seeds.append(seed)
            rms = stream_rms_profile(layer_rows[r["id"]])
            if len(rms) >= 2 and rms[0] > 0:
                growth.append(rms[-1] / rms[0])
            if r.get("branch_gain"):
                gain.append(r["branch_gain"])
            cfg = r["config"]
        if ratios:
            out[key] = Profile(ratios, seeds, growth, gain, cfg)
    return out


GRAD_SOURCE = "Xiong et al. 2020 (FFN weight gradients per layer at initialisation)"
GRAD_CAVEAT = (
    "the initialisation above all (it sets how fast the residual stream grows with depth), then depth "
    "and width; measured at initialisation, not during training"
)


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _mechanism(placement: str, prof: Profile) -> str:
    """The mechanism in one sentence, with this study's numbers where it measured them."""
    growth, gain = _mean(prof.growth), _mean(prof.branch_gain)
    if placement == "pre":
        measured = (
            "" if math.isnan(growth) else f" (x{growth:.2f} from the first layer's output to the top's)"
        )
        follows = (
            ""
            if math.isnan(growth)
            else f": that predicts 1/{growth:.2f} = {1 / growth:.2f}, measured {prof.ratio:.2f}"
        )
        return (
            f"Mechanism: the residual stream's RMS grows with depth{measured} and a Pre-LN layer's gradient "
            f"scales with the inverse of its input's norm (its input norm divides by it){follows}."
        )
    stays = "" if math.isnan(growth) else f" (its RMS changes x{growth:.2f} over depth)"
    here = "" if math.isnan(gain) else f" (x{gain:.2f} at the middle FFN here)"
    return (
        f"Mechanism: Post-LN renormalises the stream after every sublayer{stays}, and each sublayer's "
        f"LayerNorm divides the gradient flowing down by RMS(x + F(x)) / RMS(x){here}, so the larger the "
        "branch at initialisation the more the lower layers' gradients shrink relative to the top's."
    )


def _gradient_claim(runs, layer_rows, placement: str, claim: str, expected: str) -> list[Finding]:
    profiles = gradient_profiles(runs, layer_rows)
    out = []
    for (p, init), prof in sorted(profiles.items()):
        if p != placement:
            continue
        judged = prof.judged()
        verdict = INCONCLUSIVE if not judged else SUPPORTED if judged == expected else NOT_SUPPORTED
        evidence = (
            f"init {init}: {prof.text()}: {TREND_WORDS[trend(prof.ratio)]}"
            f"{'' if judged else ' (the seeds do not settle the trend)'}. {_mechanism(placement, prof)}"
        )
        out.append(
            Finding(
                claim,
                GRAD_SOURCE,
                evidence,
                verdict,
                scale(prof.cfg, prof.seeds, ("steps", "lr", "warmup")),
                GRAD_CAVEAT,
                prof.seeds,
            )
        )
    if not out:
        evidence = f"needs per-layer gradients at initialisation of {placement} runs"
        out.append(Finding(claim, GRAD_SOURCE, evidence, NOT_TESTED))
    return out


def post_gradient_claim(runs, layer_rows) -> list[Finding]:
    return _gradient_claim(
        runs, layer_rows, "post", "Post-LN gradient norms grow toward the top layers", "grows"
    )


def pre_gradient_claim(runs, layer_rows) -> list[Finding]:
    return _gradient_claim(runs, layer_rows, "pre", "Pre-LN gradient norms stay flat across layers", "flat")


def _per_depth(
    runs, vary: str, worse, better, where: dict | None = None, value=None
) -> list[tuple[dict, Arm, Arm]]:
    """(shared config, arm with ``vary = worse``, arm with ``vary = better``) for each matched setting."""
    out = []
    for rest, group in arms(runs, vary, where, value):
        if worse in group and better in group:
            out.append((rest, group[worse], group[better]))
    return out


def _every_depth(pairs) -> str:
    """Supported when the first arm is worse at every depth, not supported when better at some."""
    signs = [differ(a, b) for _, a, b in pairs]
    return SUPPORTED if all(s == 1 for s in signs) else NOT_SUPPORTED if -1 in signs else INCONCLUSIVE


def _depth_text(pairs, worse_name: str, better_name: str) -> str:
    return "; ".join(
        f"{rest.get('n_layers')} layers: {better_name} {b.text()}, {worse_name} {a.text()}{_margin(a, b)}"
        for rest, a, b in pairs
    )


def _where(rest: dict) -> str:
    """The depth of a setting, and its model when that is not addnorm's transformer (with its ``hf_init``
    when that is not the family's own)."""
    model = rest.get("model", "addnorm")
    if rest.get("hf_init", "own") != "own":
        model += f", hf_init {rest['hf_init']}"
    return f"{rest.get('n_layers')} layers" + ("" if model == "addnorm" else f" ({model})")


def _depth_scale(pairs) -> tuple[str, list[int]]:
    seeds = _seeds(*(x for _, a, b in pairs for x in (a, b)))
    depths = ", ".join(dict.fromkeys(str(rest.get("n_layers")) for rest, _, _ in pairs))
    return f"{depths} layers; " + scale(pairs[0][0], seeds, ("n_layers",)), seeds


def residual_claim(runs, layer_rows) -> list[Finding]:
    claim = "Removing the residual connection fails beyond about 6 layers"
    source = "our source texts' ablation (no residual)"
    caveat = "training length and learning rate; a deeper model widens the gap"
    pairs = _per_depth(runs, "residual", False, True)
    if not pairs:
        return [
            Finding(
                claim, source, "needs runs with and without the residual at the same settings", NOT_TESTED
            )
        ]
    evidence = _depth_text(pairs, "without residual", "with residual")
    deep = [(r, a, b) for r, a, b in pairs if r.get("n_layers", 0) >= 6]
    shallow = [(r, a, b) for r, a, b in pairs if r.get("n_layers", 0) < 6]
    sc, seeds = _depth_scale(pairs)
    if not deep:
        return [Finding(claim, source, evidence + " (no run at 6+ layers)", NOT_TESTED, sc, caveat, seeds)]
    penalty = lambda a, b: a.mean / b.mean if math.isfinite(b.mean) else math.nan  # noqa: E731
    deep_signs = [differ(a, b) for _, a, b in deep]
    gap_grows = all(penalty(a, b) < min(penalty(x, y) for _, x, y in deep) for _, a, b in shallow)
    if all(s == 1 for s in deep_signs) and gap_grows:
        verdict = SUPPORTED
    elif -1 in deep_signs or (all(s == 1 for s in deep_signs) and not gap_grows):
        verdict = NOT_SUPPORTED
    else:
        verdict = INCONCLUSIVE
    evidence += (
        ". Supported when the deep models are worse without the residual by the rule and the loss ratio "
        "(without/with) is larger at every deep depth than at the shallow ones"
    )
    return [Finding(claim, source, evidence, verdict, sc, caveat, seeds)]


def _norm_pairs(runs, other: str) -> list[tuple[dict, Arm, Arm]]:
    return _per_depth(runs, "norm", other, "layernorm")


def no_norm_claim(runs, layer_rows) -> list[Finding]:
    claim = "Removing the normalization is unstable"
    source = "our source texts' ablation (no norm)"
    caveat = "the learning rate and depth: higher rates and deeper stacks make divergence likelier"
    pairs = _norm_pairs(runs, "none")
    if not pairs:
        return [
            Finding(claim, source, "needs runs with norm none and layernorm at the same settings", NOT_TESTED)
        ]
    diverged = any(a.diverged > 0 and b.diverged == 0 for _, a, b in pairs)
    deepest = differ(pairs[-1][1], pairs[-1][2])  # pairs are sorted by depth
    verdict = SUPPORTED if diverged or deepest == 1 else NOT_SUPPORTED if deepest == -1 else INCONCLUSIVE
    evidence = _depth_text(pairs, "no norm", "LayerNorm") + (
        ". Supported when a no-norm run diverges (and no LayerNorm run does) or when no norm is worse by "
        "the rule at the deepest depth measured"
    )
    sc, seeds = _depth_scale(pairs)
    return [Finding(claim, source, evidence, verdict, sc, caveat, seeds)]


def batchnorm_claim(runs, layer_rows) -> list[Finding]:
    claim = "BatchNorm generalises worse than LayerNorm"
    source = "our source texts' pitfall (BatchNorm instead of LayerNorm)"
    caveat = "batch size (BatchNorm's statistics get noisier with smaller batches) and sequence length"
    pairs = _norm_pairs(runs, "batchnorm")
    if not pairs:
        return [
            Finding(claim, source, "needs runs with batchnorm and layernorm at the same settings", NOT_TESTED)
        ]
    evidence = (
        _depth_text(pairs, "BatchNorm", "LayerNorm") + ". Supported when worse by the rule at every depth"
    )
    sc, seeds = _depth_scale(pairs)
    return [Finding(claim, source, evidence, _every_depth(pairs), sc, caveat, seeds)]


def final_norm_claim(runs, layer_rows) -> list[Finding]:
    claim = "Pre-LN without a final norm is worse than with it"
    source = "Xiong et al. 2020; GPT-2; our source texts (final LayerNorm of Pre-LN stacks)"
    caveat = "depth and training length: the unnormalised stream grows with both"
    pairs = []
    for rest, group in arms(runs, "final_norm", {"placement": "pre"}):
        with_norm = group.get(True, group.get("auto"))
        if with_norm is not None and False in group:
            pairs.append((rest, group[False], with_norm))
    if not pairs:
        return [Finding(claim, source, "needs pre runs with and without the final norm", NOT_TESTED)]
    evidence = (
        _depth_text(pairs, "without", "with final norm") + ". Supported when worse by the rule at every depth"
    )
    sc, seeds = _depth_scale(pairs)
    return [Finding(claim, source, evidence, _every_depth(pairs), sc, caveat, seeds)]


# --- "placement A beats B" (the papers' claims, with the rule above) ------------------------------------
DEEP = 6  # "at depth": 6 layers or more


def _last_profile(run: dict, metric: str) -> list[float]:
    """Per-layer values of ``metric`` at the run's last probed step (stored in ``run['last_profile']``
    by :func:`compute_findings`)."""
    return (run.get("last_profile") or {}).get(metric, [])


def act_growth(run: dict) -> float:
    """log(RMS of the residual stream after the top layer / after the first layer) at the end of training;
    +inf for a run that did not finish (no profile)."""
    prof = _last_profile(run, "act_rms")
    if run["status"] != "done" or len(prof) < 2 or not prof[0] > 0 or not prof[-1] > 0:
        return math.inf
    return math.log(prof[-1] / prof[0])


def top_grad_shortfall(run: dict) -> float:
    """-log(FFN weight-gradient norm of the top layer / of the first layer) at the end of training: larger
    when the last layers get relatively smaller gradients; +inf without a profile."""
    prof = _last_profile(run, "weight_grad_norm")
    if run["status"] != "done" or len(prof) < 2 or not prof[0] > 0 or not prof[-1] > 0:
        return math.inf
    return -math.log(prof[-1] / prof[0])


def _placement_claim(
    claim: str, source: str, caveat: str, worse: str, better: str, value, measure: str, deep_only: bool
) -> Callable:
    """A claim "``better`` beats ``worse``" judged on ``value`` per seed (lower is better) by the rule, at
    every setting where both ran (at :data:`DEEP` layers or more with ``deep_only``): supported when
    ``worse`` is worse by the rule at every such setting, not supported when it is better at one."""

    def check(runs, layer_rows) -> list[Finding]:
        pairs = [
            (r, a, b)
            for r, a, b in _per_depth(runs, "placement", worse, better, value=value)
            if not deep_only or r.get("n_layers", 0) >= DEEP
        ]
        if not pairs:
            where = f" at {DEEP}+ layers" if deep_only else ""
            return [
                Finding(
                    claim, source, f"needs {worse} and {better} runs at the same settings{where}", NOT_TESTED
                )
            ]
        evidence = (
            f"{measure}: "
            + "; ".join(
                f"{_where(r)}: {better} {b.text()}, {worse} {a.text()}{_margin(a, b)}" for r, a, b in pairs
            )
            + f". Supported when {worse} is worse by the rule at every depth measured"
        )
        sc, seeds = _depth_scale(pairs)
        return [Finding(claim, source, evidence, _every_depth(pairs), sc, caveat, seeds)]

    check.__name__ = f"{better}_beats_{worse}"
    return check


deepnorm_claim = _placement_claim(
    "DeepNorm trains better than Post-LN at depth",
    "Wang et al. 2022 (DeepNet)",
    "depth (the paper's gap opens at tens to hundreds of layers), learning rate and warmup",
    "post",
    "deepnorm",
    outcome,
    "held-out loss (nats)",
    deep_only=True,
)
peri_growth_claim = _placement_claim(
    "Peri-LN (sandwich) keeps the residual stream's activations from growing with depth as Pre-LN's do",
    "Kim et al. 2025 (Peri-LN); Ding et al. 2021 (Sandwich-LN)",
    "training length: the growth under Pre-LN builds up over training",
    "pre",
    "sandwich",
    act_growth,
    "log(stream RMS after the top layer / after the first) at the end of training",
    deep_only=True,
)
mix_gradient_claim = _placement_claim(
    "Mix-LN gives the last layers larger gradients than Pre-LN",
    "Li et al. 2024 (Mix-LN)",
    "depth and training length (the paper measures the deeper layers of billion-parameter models)",
    "pre",
    "mix",
    top_grad_shortfall,
    "-log(FFN weight-gradient norm of the top layer / of the first) at the end of training",
    deep_only=True,
)

CLAIMS: list[Callable] = [
    warmup_claim,
    post_gradient_claim,
    pre_gradient_claim,
    residual_claim,
    no_norm_claim,
    batchnorm_claim,
    final_norm_claim,
    deepnorm_claim,
    peri_growth_claim,
    mix_gradient_claim,
]


def compute_findings(store) -> list[Finding]:
    """Every claim's findings (one per setting it was measured at) from the current plan's runs."""
    runs = store.runs()
    for r in runs:  # RMS(x + F(x)) / RMS(x) at initialisation, for the gradient findings' mechanism
        x, total = store.metric(r["id"], "xf_x_rms")[:1], store.metric(r["id"], "xf_sum_rms")[:1]
        r["branch_gain"] = total[0][1] / x[0][1] if x and total and x[0][1] else None
    for r in runs:  # per-layer profiles at the last probed step, for the placement claims
        r["last_profile"] = {}
        for metric, sublayers in (("act_rms", ("",)), ("weight_grad_norm", FFN_SUBLAYERS)):
            rows = [x for x in store.layer_metric(r["id"], metric) if x["sublayer"] in sublayers]
            last = max((x["step"] for x in rows), default=None)
            per_layer: dict[int, float] = defaultdict(float)
            for x in rows:
                if x["step"] == last:
                    per_layer[x["layer"]] += x["value"] ** 2 if metric == "weight_grad_norm" else x["value"]
            r["last_profile"][metric] = [
                math.sqrt(v) if metric == "weight_grad_norm" else v for _, v in sorted(per_layer.items())
            ]
    layer_rows = {
        r["id"]: store.layer_metric(r["id"], "weight_grad_norm", step=0)
        + store.layer_metric(r["id"], "act_rms", step=0)
        for r in runs
    }
    return [finding for claim in CLAIMS for finding in claim(runs, layer_rows)]
