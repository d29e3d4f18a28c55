"""The claims of our source texts, one declaration each, judged by the rule of :mod:`.rule`.

A claim is one of three kinds:

- :class:`Comparison`: "``better`` beats ``worse``" on one setting (``vary``), judged per setting where
  both ran on a per-seed measure (the held-out loss, or a per-layer growth measure) by a *judge*:
  :func:`every_setting` (the usual), :func:`worse_when_deep` or :func:`diverges_or_deepest`;
- :class:`GradientTrend`: a placement's per-layer gradient profile at initialisation grows, shrinks or
  stays flat (per initialisation, with the mechanism in this study's numbers);
- :class:`NeedsWarmup`: one placement needs warmup where another does not.

Each takes the runs (finished ones, with their per-layer profiles, see :func:`.findings.compute_findings`)
and returns its findings, one per setting it was measured at, or one "not tested" finding.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from .records import Finding
from .rule import (
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTED,
    SUPPORTED,
    TREND_WORDS,
    Arm,
    arms,
    differ,
    finished,
    judged_trend,
    margin,
    outcome,
    trend,
)

DEEP = 6  # "at depth": 6 layers or more


# --- the setting in words -------------------------------------------------------------------------------
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


def seeds_of(*arm_list: Arm) -> list[int]:
    return sorted({s for a in arm_list for s in a.seeds})


def where(rest: dict) -> str:
    """The depth of a setting, and its model when that is not addnorm's transformer (with its ``hf_init``
    when that is not the family's own)."""
    model = rest.get("model", "addnorm")
    if rest.get("hf_init", "own") != "own":
        model += f", hf_init {rest['hf_init']}"
    return f"{rest.get('n_layers')} layers" + ("" if model == "addnorm" else f" ({model})")


Pairs = list[tuple[dict, Arm, Arm]]  # (shared config, the worse-claimed arm, the better-claimed arm)


# --- judges of a comparison: (verdict, what replaces the "supported when" sentence or None) ------------
def every_setting(pairs: Pairs) -> tuple[str, str | None]:
    """Supported when the first arm is worse by the rule at every setting, not supported when better at
    one, inconclusive otherwise."""
    signs = [differ(a, b) for _, a, b in pairs]
    verdict = SUPPORTED if all(s == 1 for s in signs) else NOT_SUPPORTED if -1 in signs else INCONCLUSIVE
    return verdict, None


def worse_when_deep(pairs: Pairs) -> tuple[str, str | None]:
    """Worse at every depth of :data:`DEEP`+ layers by the rule, with a loss ratio (worse/better) larger
    at every deep depth than at every shallow one; not tested without a deep setting."""
    deep = [(r, a, b) for r, a, b in pairs if r.get("n_layers", 0) >= DEEP]
    shallow = [(r, a, b) for r, a, b in pairs if r.get("n_layers", 0) < DEEP]
    if not deep:
        return NOT_TESTED, f" (no run at {DEEP}+ layers)"
    penalty = lambda a, b: a.mean / b.mean if math.isfinite(b.mean) else math.nan  # noqa: E731
    deep_signs = [differ(a, b) for _, a, b in deep]
    gap_grows = all(penalty(a, b) < min(penalty(x, y) for _, x, y in deep) for _, a, b in shallow)
    if all(s == 1 for s in deep_signs) and gap_grows:
        return SUPPORTED, None
    if -1 in deep_signs or (all(s == 1 for s in deep_signs) and not gap_grows):
        return NOT_SUPPORTED, None
    return INCONCLUSIVE, None


def diverges_or_deepest(pairs: Pairs) -> tuple[str, str | None]:
    """Supported when a seed of the first arm diverges where the second's do not, or when the first is
    worse by the rule at the deepest setting (pairs are sorted by depth)."""
    diverged = any(a.diverged > 0 and b.diverged == 0 for _, a, b in pairs)
    deepest = differ(pairs[-1][1], pairs[-1][2])
    verdict = SUPPORTED if diverged or deepest == 1 else NOT_SUPPORTED if deepest == -1 else INCONCLUSIVE
    return verdict, None


@dataclass(frozen=True)
class Comparison:
    """ "``better`` beats ``worse``" on the setting ``vary`` (``better`` may list alternatives: the first
    present counts), measured per seed by ``value`` (lower is better; default the held-out loss) at every
    setting where both ran, among runs with the settings ``only`` and at least ``min_layers`` layers."""

    claim: str
    source: str
    caveat: str
    vary: str
    worse: object
    better: object
    names: tuple[str, str]  # how the evidence names (worse, better)
    needs: str  # the evidence when nothing bears on the claim
    supported_when: str = "Supported when worse by the rule at every depth"
    judge: Callable[[Pairs], tuple[str, str | None]] = every_setting
    value: Callable[[dict], float] = outcome
    measure: str = ""  # what value measures, leading the evidence
    only: dict = field(default_factory=dict)
    min_layers: int = 0

    def pairs(self, runs: list[dict]) -> Pairs:
        better = self.better if isinstance(self.better, tuple) else (self.better,)
        out = []
        for rest, group in arms(runs, self.vary, self.only, self.value):
            arm = next((group[b] for b in better if b in group), None)
            if arm is not None and self.worse in group and rest.get("n_layers", 0) >= self.min_layers:
                out.append((rest, group[self.worse], arm))
        return out

    def __call__(self, runs: list[dict]) -> list[Finding]:
        pairs = self.pairs(runs)
        if not pairs:
            return [Finding(self.claim, self.source, self.needs, NOT_TESTED)]
        worse, better = self.names
        text = "; ".join(
            f"{where(r)}: {better} {b.text()}, {worse} {a.text()}{margin(a, b)}" for r, a, b in pairs
        )
        verdict, instead = self.judge(pairs)
        evidence = (f"{self.measure}: " if self.measure else "") + text
        evidence += instead if instead is not None else f". {self.supported_when}"
        seeds = seeds_of(*(x for _, a, b in pairs for x in (a, b)))
        depths = ", ".join(dict.fromkeys(str(rest.get("n_layers")) for rest, _, _ in pairs))
        setting = f"{depths} layers; " + scale(pairs[0][0], seeds, ("n_layers",))
        return [Finding(self.claim, self.source, evidence, verdict, setting, self.caveat, seeds)]


# --- per-layer measures of a run at the end of training (its profiles, see findings) ------------------
def _top_over_first(run: dict, key: str) -> float | None:
    """log(the top layer's value / the first layer's) of the per-layer profile ``key`` at the end of
    training; None for a run that did not finish or has no such profile."""
    prof = (run.get("last_profile") or {}).get(key, [])
    if run["status"] != "done" or len(prof) < 2 or not prof[0] > 0 or not prof[-1] > 0:
        return None
    return math.log(prof[-1] / prof[0])


def act_growth(run: dict) -> float:
    """log(RMS of the residual stream after the top layer / after the first layer) at the end of training;
    +inf for a run that did not finish (no profile)."""
    v = _top_over_first(run, "act_rms")
    return math.inf if v is None else v


def top_grad_shortfall(run: dict) -> float:
    """-log(FFN weight-gradient norm of the top layer / of the first layer) at the end of training: larger
    when the last layers get relatively smaller gradients; +inf without a profile."""
    v = _top_over_first(run, "weight_grad_norm")
    return math.inf if v is None else -v


# --- gradient profiles at initialisation -------------------------------------------------------------
@dataclass
class GradientProfile:
    """Per-seed top/first-layer ratios of a (placement, init) at one depth, and the stream's growth."""

    ratios: list[float]
    seeds: list[int]
    growth: list[float]  # per seed: stream RMS at the top layer's output / at the first layer's
    branch_gain: list[float]  # per seed: RMS(x + F(x)) / RMS(x) at the middle layer's FFN connection
    cfg: dict

    @property
    def ratio(self) -> float:
        """The geometric mean of the per-seed ratios."""
        return math.exp(sum(map(math.log, self.ratios)) / len(self.ratios))

    def text(self) -> str:
        logs = [math.log(r) for r in self.ratios]
        m = sum(logs) / len(logs)
        sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (len(logs) - 1)) if len(logs) > 1 else math.nan
        spread = "" if math.isnan(sd) else f" (x/÷ {math.exp(sd):.2f})"
        per_seed = ", ".join(f"{r:.2f}" for r in self.ratios)
        seeds = ", ".join(map(str, self.seeds))
        return f"top/first layer = {self.ratio:.2f}{spread}, per seed {per_seed} (seeds {seeds})"


# Settings that do not change a model or its first batch: runs differing only in these start alike.
TRAINING_ONLY = (
    "lr", "warmup", "schedule", "steps", "eval_every", "eval_batches", "probe_every", "diverge_factor",
    "weight_decay", "grad_clip",
)  # fmt: skip


def gradient_profiles(runs: list[dict]) -> dict[tuple[str, str], GradientProfile]:
    """(placement, init) -> profile at the deepest depth measured for it, one sample per seed: runs that
    differ only in training settings (warmup, learning rate, ...) share their initialisation and count
    once, so they never pass for independent seeds."""
    groups: dict[tuple[str, str], dict[str, dict[int, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in finished(runs):
        cfg = r["config"]
        if r.get("init_rows"):
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
            p = r["init_profile"]["weight_grad_norm"]
            if len(p) < 2 or p[0] <= 0 or p[-1] <= 0:
                continue
            ratios.append(p[-1] / p[0])
            seeds.append(seed)
            rms = r["init_profile"]["act_rms"]
            if len(rms) >= 2 and rms[0] > 0:
                growth.append(rms[-1] / rms[0])
            if r.get("branch_gain"):
                gain.append(r["branch_gain"])
            cfg = r["config"]
        if ratios:
            out[key] = GradientProfile(ratios, seeds, growth, gain, cfg)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def mechanism(placement: str, prof: GradientProfile) -> str:
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


GRAD_SOURCE = "Xiong et al. 2020 (FFN weight gradients per layer at initialisation)"
GRAD_CAVEAT = (
    "the initialisation above all (it sets how fast the residual stream grows with depth), then depth "
    "and width; measured at initialisation, not during training"
)


@dataclass(frozen=True)
class GradientTrend:
    """``placement``'s FFN weight-gradient profile at initialisation is ``expected`` (grows, shrinks or
    flat) by the rule, one finding per initialisation."""

    claim: str
    placement: str
    expected: str

    def __call__(self, runs: list[dict]) -> list[Finding]:
        out = []
        for (p, init), prof in sorted(gradient_profiles(runs).items()):
            if p != self.placement:
                continue
            judged = judged_trend(prof.ratios)
            verdict = INCONCLUSIVE if not judged else SUPPORTED if judged == self.expected else NOT_SUPPORTED
            evidence = (
                f"init {init}: {prof.text()}: {TREND_WORDS[trend(prof.ratio)]}"
                f"{'' if judged else ' (the seeds do not settle the trend)'}. {mechanism(p, prof)}"
            )
            setting = scale(prof.cfg, prof.seeds, ("steps", "lr", "warmup"))
            out.append(Finding(self.claim, GRAD_SOURCE, evidence, verdict, setting, GRAD_CAVEAT, prof.seeds))
        if not out:
            needs = f"needs per-layer gradients at initialisation of {self.placement} runs"
            out.append(Finding(self.claim, GRAD_SOURCE, needs, NOT_TESTED))
        return out


@dataclass(frozen=True)
class NeedsWarmup:
    """``needs`` trains worse without warmup than with it (the least warmup both ran) by the rule, and
    ``fine`` does not."""

    claim: str
    source: str
    caveat: str
    needs: str = "post"
    fine: str = "pre"
    names: tuple[str, str] = ("Post-LN", "Pre-LN")

    def __call__(self, runs: list[dict]) -> list[Finding]:
        by_setting: dict[str, dict[str, tuple[dict, dict]]] = defaultdict(dict)
        for placement in (self.needs, self.fine):
            for rest, group in arms(runs, "warmup", {"placement": placement}):
                if 0 in group and any(k > 0 for k in group):
                    key = repr(sorted((k, repr(v)) for k, v in rest.items() if k != "placement"))
                    by_setting[key][placement] = (rest, group)
        out = []
        for pair in by_setting.values():
            if len(pair) < 2:
                continue
            (rest, needs), (_, fine) = pair[self.needs], pair[self.fine]
            warm = min(k for k in needs if k > 0)
            if warm not in fine:
                continue
            needs_cmp, fine_cmp = differ(needs[0], needs[warm]), differ(fine[0], fine[warm])
            if needs_cmp == 1 and fine_cmp <= 0:
                verdict = SUPPORTED
            elif needs_cmp == -1 or fine_cmp == 1:
                verdict = NOT_SUPPORTED
            else:
                verdict = INCONCLUSIVE
            a, b = self.names
            evidence = (
                f"held-out loss, no warmup vs {warm} warmup steps: {a} {needs[0].text()} vs "
                f"{needs[warm].text()}{margin(needs[0], needs[warm])}; {b} {fine[0].text()} vs "
                f"{fine[warm].text()}{margin(fine[0], fine[warm])}. Supported when {a} is worse without "
                f"warmup by the rule and {b} is not"
            )
            seeds = seeds_of(needs[0], needs[warm], fine[0], fine[warm])
            setting = scale(rest, seeds, ("warmup", "placement"))
            out.append(Finding(self.claim, self.source, evidence, verdict, setting, self.caveat, seeds))
        needs = f"needs {self.needs} and {self.fine} runs with and without warmup"
        return out or [Finding(self.claim, self.source, needs, NOT_TESTED)]


def deeper(claim: str, source: str, caveat: str, worse: str, better: str, **kwargs) -> Comparison:
    """``better`` beats ``worse`` (two placements) at :data:`DEEP`+ layers, at every depth measured."""
    return Comparison(
        claim,
        source,
        caveat,
        vary="placement",
        worse=worse,
        better=better,
        names=(worse, better),
        needs=f"needs {worse} and {better} runs {SAME_SETTINGS} at {DEEP}+ layers",
        supported_when=f"Supported when {worse} is worse by the rule at every depth measured",
        min_layers=DEEP,
        **kwargs,
    )


# --- the catalogue -------------------------------------------------------------------------------------
SAME_SETTINGS = "at the same settings"
CLAIMS: list[Callable[[list[dict]], list[Finding]]] = [
    NeedsWarmup(
        "Pre-LN trains without warmup where Post-LN needs it",
        "Xiong et al. 2020; our source texts' Post-LN vs Pre-LN comparison",
        "the learning rate (at a low one Post-LN trains without warmup), depth and training length",
    ),
    GradientTrend("Post-LN gradient norms grow toward the top layers", "post", "grows"),
    GradientTrend("Pre-LN gradient norms stay flat across layers", "pre", "flat"),
    Comparison(
        "Removing the residual connection fails beyond about 6 layers",
        "our source texts' ablation (no residual)",
        "training length and learning rate; a deeper model widens the gap",
        vary="residual",
        worse=False,
        better=True,
        names=("without residual", "with residual"),
        needs=f"needs runs with and without the residual {SAME_SETTINGS}",
        supported_when="Supported when the deep models are worse without the residual by the rule and the "
        "loss ratio (without/with) is larger at every deep depth than at the shallow ones",
        judge=worse_when_deep,
    ),
    Comparison(
        "Removing the normalization is unstable",
        "our source texts' ablation (no norm)",
        "the learning rate and depth: higher rates and deeper stacks make divergence likelier",
        vary="norm",
        worse="none",
        better="layernorm",
        names=("no norm", "LayerNorm"),
        needs=f"needs runs with norm none and layernorm {SAME_SETTINGS}",
        supported_when="Supported when a no-norm run diverges (and no LayerNorm run does) or when no norm is "
        "worse by the rule at the deepest depth measured",
        judge=diverges_or_deepest,
    ),
    Comparison(
        "BatchNorm generalises worse than LayerNorm",
        "our source texts' pitfall (BatchNorm instead of LayerNorm)",
        "batch size (BatchNorm's statistics get noisier with smaller batches) and sequence length",
        vary="norm",
        worse="batchnorm",
        better="layernorm",
        names=("BatchNorm", "LayerNorm"),
        needs=f"needs runs with batchnorm and layernorm {SAME_SETTINGS}",
    ),
    Comparison(
        "Pre-LN without a final norm is worse than with it",
        "Xiong et al. 2020; GPT-2; our source texts (final LayerNorm of Pre-LN stacks)",
        "depth and training length: the unnormalised stream grows with both",
        vary="final_norm",
        worse=False,
        better=(True, "auto"),
        names=("without", "with final norm"),
        needs="needs pre runs with and without the final norm",
        only={"placement": "pre"},
    ),
    deeper(
        "DeepNorm trains better than Post-LN at depth",
        "Wang et al. 2022 (DeepNet)",
        "depth (the paper's gap opens at tens to hundreds of layers), learning rate and warmup",
        "post",
        "deepnorm",
        measure="held-out loss (nats)",
    ),
    deeper(
        "Peri-LN (sandwich) keeps the residual stream's activations from growing with depth as Pre-LN's do",
        "Kim et al. 2025 (Peri-LN); Ding et al. 2021 (Sandwich-LN)",
        "training length: the growth under Pre-LN builds up over training",
        "pre",
        "sandwich",
        value=act_growth,
        measure="log(stream RMS after the top layer / after the first) at the end of training",
    ),
    deeper(
        "Mix-LN gives the last layers larger gradients than Pre-LN",
        "Li et al. 2024 (Mix-LN)",
        "depth and training length (the paper measures the deeper layers of billion-parameter models)",
        "pre",
        "mix",
        value=top_grad_shortfall,
        measure="-log(FFN weight-gradient norm of the top layer / of the first) at the end of training",
    ),
]
