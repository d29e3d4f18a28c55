"""A study's results as typed records: what :mod:`.analysis` reads out of the store, what
:mod:`.figures` draws and :mod:`.report`'s page shows. Plain data (no store, no matplotlib, no torch).

- :class:`Finding`: one claim's verdict at one setting (:mod:`.claims`, :mod:`.findings`).
- :class:`RankingTable`, :class:`RankingRecord`: placements ranked per setting (:mod:`.ranking`).
- :class:`Curve`, :class:`LayerSeries`, :class:`LayerPanels`, :class:`FinalsVs`, :class:`ResidualBars`:
  an experiment's per-step curves, per-layer profiles (:mod:`.profiles`), final loss against a swept
  setting, and the Add of Add & Norm at the middle layer.
- :class:`RunRow`, :class:`ExperimentRecord`, :class:`Configuration`, :class:`StudyRecords`: the runs
  table, one experiment's section, what was run (with the runs' provenance) and the whole study.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .ranking import Ranked, Sensitivity


@dataclass
class Finding:
    """One claim checked at one setting: what was measured (``evidence``), the ``verdict`` under the rule,
    the setting (``scale``), what would change it (``caveat``) and the seeds it rests on."""

    claim: str
    source: str
    evidence: str
    verdict: str
    scale: str = ""  # the setting the verdict was measured at
    caveat: str = ""  # what would change it
    seeds: list[int] = field(default_factory=list)


@dataclass
class Curve:
    """A per-step metric of one variant (its seeds): the mean, min and max over seeds per step."""

    label: str  # the variant: the run label without its seed
    metric: str  # train_loss or val_loss
    steps: list[int]
    mean: list[float]
    low: list[float]
    high: list[float]
    seeds: int
    diverged: bool  # a seed of the variant diverged


@dataclass
class LayerSeries:
    """A per-layer profile of one variant, mean over its seeds (layers numbered from 1)."""

    label: str
    metric: str
    layers: list[int]
    values: list[float]
    seeds: int


@dataclass
class LayerPanels:
    """Per-layer profiles of several metrics at initialisation (``when="init"``) or at the last probed
    step (``"end"``; ``step`` the latest such step)."""

    when: str
    step: int
    metrics: list[str]  # the metrics that have a series, in panel order
    series: list[LayerSeries]


@dataclass
class FinalsVs:
    """The final held-out loss against a swept setting ``axis``: line label -> value of the axis -> the
    seeds' outcomes (``inf`` for a diverged seed)."""

    axis: str
    log: bool
    lines: dict[str, dict[float, list[float]]]


@dataclass
class ResidualBars:
    """RMS of x, F(x) and x + F(x) at the middle layer's FFN connection, per variant: label -> metric ->
    [at initialisation, at the end], mean over seeds."""

    rows: list[tuple[str, dict[str, list[float]]]]


@dataclass
class RunRow:
    """One run in an experiment's table."""

    label: str
    status: str
    diverged_step: int | None
    error: str | None
    train_loss: float | None
    val_loss: float | None
    metric: str | None
    metric_value: float | None
    wall_s: float
    device: str = ""  # where it trained (provenance.device): a CPU model or a GPU's name


@dataclass
class ExperimentRecord:
    name: str
    description: str
    runs: list[RunRow]
    curves: list[Curve]
    finals: list[FinalsVs]
    layers: list[LayerPanels]
    residual: ResidualBars | None


@dataclass
class RankingTable:
    """One setting's ranking: its title (the keys that differ between settings; with the device where the
    setting's runs were measured on several), the ranked rows, per placement the runs left out because
    they failed (missing data, not an outcome), and the devices its runs trained on."""

    title: str
    rows: list[Ranked]
    failed: dict[str, int] = field(default_factory=dict)
    sensitivity: Sensitivity | None = None  # what the ranking could detect, and the seeds it would need
    devices: list[str] = field(default_factory=list)  # where its runs trained (one unless mixed on purpose)
    outcomes: dict[str, list[tuple[int, float]]] = field(default_factory=dict)  # placement -> (seed, loss)

    def split_seeds(self, row: Ranked) -> tuple[list[int], list[int]]:
        """(the seeds that trained, those that did not) of a placement whose seeds split (the lower
        outcomes trained); ([], []) for one whose seeds did not split."""
        if row.split is None:
            return [], []
        ordered = [seed for seed, _ in sorted(self.outcomes.get(row.name, []), key=lambda x: x[1])]
        cut = len(row.split.trained)
        return sorted(ordered[:cut]), sorted(ordered[cut:])


@dataclass
class RankingRecord:
    placements: list[str]  # every ranked placement, sorted (a placement keeps its colour in every figure)
    tables: list[RankingTable]
    spearman: list[float]  # per table: rank correlation with the first table's ranking (nan: too few)
    shared_best: list[str]  # placements tied with the best in every table
    lr_tolerance: list[tuple[str, list[float]]]  # placement -> tolerated learning rates, best first
    growth_depth: int
    growth: list[LayerSeries]  # the residual stream's RMS per layer at the end, first seed per placement
    notes: list[str] = field(default_factory=list)  # a setting ranked per device (one line each)


@dataclass
class ExperimentSettings:
    name: str
    runs: int
    set: dict
    sweep: dict


@dataclass
class Configuration:
    """What was run: the resolved base config (``given``: the keys the spec set), each experiment's
    settings and sweep, and the runs' provenance as (field, values) rows."""

    base: dict
    given: set[str]
    experiments: list[ExperimentSettings]
    provenance: list[tuple[str, str]]


@dataclass
class RuleAsTest:
    """The findings' rule (:mod:`.rule`) as the t-test it amounts to at the study's usual number of seeds
    per arm: its critical value, its level (uncorrected) and the difference, in standard deviations, it
    detects with 80% power."""

    seeds: int
    crit: float
    alpha: float
    detectable_sd: float


@dataclass
class StudyRecords:
    """Everything the report shows, read from one study database."""

    name: str
    description: str
    status_counts: dict[str, int]
    runs: int
    planned: int
    stale: int
    configuration: Configuration
    findings: list[Finding]
    rule: RuleAsTest | None
    ranking: RankingRecord | None
    not_applicable: list[str]
    experiments: list[ExperimentRecord]
