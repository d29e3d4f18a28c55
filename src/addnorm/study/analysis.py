"""A study database read into records (:mod:`.records`): :func:`analyse` is what the report shows.

Everything here reads the store and computes; nothing draws or formats HTML (:mod:`.figures` and
:mod:`.report` do, from the records). Per-layer values come from the profile rule of :mod:`.profiles`,
verdicts from :mod:`.findings`, rankings from :mod:`.ranking`. Failed runs (an error, a killed worker)
are missing data, not outcomes: they are listed in the runs table and counted beside a ranking, and
never ranked, drawn or judged (a diverged run is an outcome: it trained and its loss blew up).
"""

from __future__ import annotations

import json
import math
from collections import defaultdict

from .findings import compute_findings
from .profiles import layer_profile, profile_steps
from .ranking import rank, sensitivity, spearman
from .records import (
    Configuration,
    Curve,
    ExperimentRecord,
    ExperimentSettings,
    FinalsVs,
    LayerPanels,
    LayerSeries,
    RankingRecord,
    RankingTable,
    ResidualBars,
    RuleAsTest,
    RunRow,
    StudyRecords,
)
from .rule import FINISHED, NOT_TESTED, as_t_test, finished, outcome
from .store import Store

# The per-layer panels: metric -> the part of the layer it is read at (see profiles.PARTS).
LAYER_PARTS = {"weight_grad_norm": "ffn", "grad_norm": "stream", "act_rms": "stream", "update_ratio": "ffn"}
INIT_PANELS = ("weight_grad_norm", "grad_norm", "act_rms")
END_PANELS = ("weight_grad_norm", "act_rms", "update_ratio")
RESIDUAL_METRICS = ("xf_x_rms", "xf_f_rms", "xf_sum_rms")
# Keys that set how a model is built, which differ between addnorm's transformer and a Hugging Face family
# by construction (the family keeps its own activation, norm and positions; kv_heads etc. are its own).
ARCH_KEYS = (
    "model", "activation", "norm", "bias", "norm_bias", "positional", "init", "kv_heads", "rope_theta",
    "fused",
)  # fmt: skip
HF_ONLY_KEYS = ("hf_init",)  # shown for Hugging Face families only (addnorm's model has one value)
# Provenance fields in the order the report lists them, with their titles; a field not named here (one
# a newer training loop stores) follows under its own name.
PROVENANCE_FIELDS = (
    ("addnorm", "addnorm"),
    ("git_commit", "git commit"),
    ("git_dirty", "uncommitted changes"),
    ("commit_source", "commit from"),
    ("torch", "torch"),
    ("transformers", "transformers"),
    ("python", "Python"),
    ("device", "device"),
    ("threads", "torch threads per run"),
    ("precision", "precision"),
    ("compile", "compiled"),
    ("distributed", "distributed"),
    ("platform", "platform"),
    ("packed", "runs sharing the device (mean over a run)"),
    ("peak_memory", "peak GPU memory per run (bytes reserved)"),
)
RANGE_FIELDS = ("packed", "peak_memory")  # one number per run: shown as the range of the runs' values


# --- runs, labels and variants -------------------------------------------------------------------------
def label(run: dict, experiment: str) -> str:
    return next((lab for exp, lab in run["experiments"] if exp == experiment), run["id"])


def seedless(text: str) -> str:
    return ", ".join(p for p in text.split(", ") if not p.startswith("seed=")) or text


def by_variant(runs: list[dict], experiment: str) -> dict[str, list[dict]]:
    """Runs grouped by their label without the seed (the seeds of one variant), in spec order."""
    groups: dict[str, list[dict]] = defaultdict(list)
    for r in runs:
        groups[seedless(label(r, experiment))].append(r)
    return dict(groups)


def value(v) -> str:
    """A setting's value as YAML writes it (``true``, ``null``, ``[a, b]``, ``{k: v}``)."""
    if isinstance(v, list):
        return "[" + ", ".join(value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {value(x)}" for k, x in v.items()) + "}" if v else "{}"
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


# --- per-step curves ---------------------------------------------------------------------------------
def smooth(values: list[float], k: int) -> list[float]:
    return [
        sum(values[max(0, i - k) : i + 1]) / len(values[max(0, i - k) : i + 1]) for i in range(len(values))
    ]


def mean_curve(store: Store, group: list[dict], name: str) -> tuple | None:
    """(steps, mean over seeds, min, max) of a per-step metric (a moving average for a training loss of
    more than 20 steps); None when no run recorded it."""
    series = [s for s in (store.metric(r["id"], name) for r in group) if s]
    if not series:
        return None
    n = min(len(s) for s in series)
    steps = [s for s, _ in series[0][:n]]
    values = [[v for _, v in s[:n]] for s in series]
    if name == "train_loss" and n > 20:  # moving average for readability
        values = [smooth(v, max(1, n // 30)) for v in values]
    cols = list(zip(*values, strict=True))
    return steps, [sum(c) / len(c) for c in cols], [min(c) for c in cols], [max(c) for c in cols]


def curves(store: Store, runs: list[dict], experiment: str) -> list[Curve]:
    """Training and held-out loss per variant, mean over its seeds (metrics no run has two points of are
    left out: runs of one step that only probe the initialisation make no curve)."""
    runs = finished(runs)
    names = [n for n in ("train_loss", "val_loss") if any(len(store.metric(r["id"], n)) >= 2 for r in runs)]
    out = []
    for variant, group in by_variant(runs, experiment).items():
        diverged = any(r["status"] == "diverged" for r in group)
        for m in names:
            curve = mean_curve(store, group, m)
            if curve is not None:
                out.append(Curve(variant, m, *curve, seeds=len(group), diverged=diverged))
    return out


# --- per-layer profiles ---------------------------------------------------------------------------
def layer_panels(store: Store, runs: list[dict], experiment: str, metrics, when: str) -> LayerPanels | None:
    """Per-layer profiles (:func:`.profiles.layer_profile`) of ``metrics`` at initialisation (``"init"``)
    or at the last probed step (``"end"``: runs probed at step 0 only have none), one series per variant,
    the mean over its seeds on the layers every seed has."""
    series, seen = [], set()
    for variant, group in by_variant(finished(runs), experiment).items():
        for m in metrics:
            profiles = []
            for r in group:
                rows = store.layer_metric(r["id"], m)
                steps = profile_steps(rows, m, LAYER_PARTS[m])
                if not steps or (when == "end" and steps[-1] == 0):
                    continue
                step = steps[0] if when == "init" else steps[-1]
                seen.add(step)
                profiles.append(layer_profile(rows, m, LAYER_PARTS[m], step))
            if profiles:
                layers = sorted(set.intersection(*(set(p) for p in profiles)))
                values = [sum(p[k] for p in profiles) / len(profiles) for k in layers]
                series.append(LayerSeries(variant, m, [k + 1 for k in layers], values, len(profiles)))
    shown = [m for m in metrics if any(s.metric == m for s in series)]
    return LayerPanels(when, max(seen), shown, series) if shown else None


def growth_profiles(store: Store, runs: list[dict]) -> tuple[int, list[LayerSeries]]:
    """The residual stream's RMS per layer at the end of training for the deepest runs: the first seed
    of each placement that is done."""
    deepest = max(r["config"]["n_layers"] for r in runs)
    out: list[LayerSeries] = []
    for r in runs:
        p = str(r["config"]["placement"])
        if r["config"]["n_layers"] != deepest or p in {s.label for s in out} or r["status"] != "done":
            continue
        prof = layer_profile(store.layer_metric(r["id"], "act_rms"), "act_rms", "stream", "last")
        if prof:
            out.append(LayerSeries(p, "act_rms", [k + 1 for k in prof], list(prof.values()), 1))
    return deepest, out


# --- final loss against a swept setting, the residual picture, the runs table ----------------------
def finals_vs(runs: list[dict], experiment: str, axis: str, log: bool) -> FinalsVs:
    """Final held-out loss against ``axis``, one line per other setting (without the seed)."""
    lines: dict[str, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in finished(runs):
        name = ", ".join(
            p for p in seedless(label(r, experiment)).split(", ") if not p.startswith(axis + "=")
        )
        lines[name or "all"][r["config"][axis]].append(outcome(r))
    return FinalsVs(axis, log, {k: dict(v) for k, v in lines.items()})


def residual_bars(store: Store, runs: list[dict], experiment: str) -> ResidualBars | None:
    """RMS of x, F(x) and x + F(x) at the middle layer's FFN connection, at init and after training."""
    rows = []
    for variant, group in by_variant(finished(runs), experiment).items():
        measured = [{n: store.metric(r["id"], n) for n in RESIDUAL_METRICS} for r in group]
        measured = [m for m in measured if all(len(v) >= 2 for v in m.values())]
        if measured:  # mean over seeds of (value at init, value at the end)
            means = {
                n: [sum(m[n][i][1] for m in measured) / len(measured) for i in (0, -1)]
                for n in RESIDUAL_METRICS
            }
            rows.append((variant, means))
    return ResidualBars(rows) if rows else None


def run_rows(runs: list[dict], experiment: str) -> list[RunRow]:
    return [
        RunRow(
            label(r, experiment),
            r["status"],
            r["diverged_step"],
            r["error"],
            r["final_train_loss"],
            r["final_val_loss"],
            r["metric"],
            r["final_val_metric"],
            r["wall_s"] or 0.0,
            device_of(r),
        )
        for r in runs
    ]


UNKNOWN_DEVICE = "device not recorded"


def device_of(run: dict) -> str:
    """Where a stored run trained: its provenance's device (a CPU model or a GPU's name)."""
    return str((run.get("provenance") or {}).get("device") or UNKNOWN_DEVICE)


def by_device(title: str, group: list[dict], mix: bool) -> tuple[list[tuple[str, list[dict]]], str | None]:
    """One setting's runs as the tables to rank: one table when they were measured on one device (or
    ``mix``), else one per device, titled ``<setting>, on <device>``, with the one line that says so."""
    devices: dict[str, list[dict]] = {}
    for r in group:
        devices.setdefault(device_of(r), []).append(r)
    if len(devices) <= 1 or mix:
        return [(title, group)], None
    counts = ", ".join(f"{d}: {len(runs)} runs" for d, runs in devices.items())
    note = (
        f"{title}: its runs were measured on {len(devices)} devices ({counts}); each device is ranked in "
        "its own table, since timings and float rounding differ between devices (--mix-devices ranks "
        "them in one)"
    )
    return [(f"{title}, on {d}", runs) for d, runs in devices.items()], note


def experiment(store: Store, name: str, spec_exp: dict, runs: list[dict]) -> ExperimentRecord:
    axes = set((spec_exp.get("sweep") or {}).keys())
    finals = [
        finals_vs(runs, name, axis, log)
        for axis, log in (("lr", True), ("warmup", False), ("n_layers", False))
        if axis in axes and len({r["config"][axis] for r in finished(runs)}) > 1
    ]
    layers = [
        layer_panels(store, runs, name, INIT_PANELS, "init"),
        layer_panels(store, runs, name, END_PANELS, "end"),
    ]
    return ExperimentRecord(
        name,
        " ".join(str(spec_exp.get("description") or "").split()),
        run_rows(runs, name),
        curves(store, runs, name),
        finals,
        [p for p in layers if p is not None],
        residual_bars(store, runs, name),
    )


# --- the ranking ------------------------------------------------------------------------------------
def settings(runs: list[dict]) -> list[tuple[str, list[dict]]]:
    """Runs grouped by setting (every key but placement and seed), each named by the keys that differ
    between the settings (``n_layers=8, model=hf-llama``); in order of first appearance."""
    groups: dict[str, list[dict]] = {}
    for r in runs:
        rest = sorted((k, repr(v)) for k, v in r["config"].items() if k not in ("placement", "seed"))
        groups.setdefault(repr(rest), []).append(r)
    configs = [g[0]["config"] for g in groups.values()]
    keys = sorted(
        {
            k
            for c in configs
            for k in c
            if k not in ("placement", "seed") and len({repr(x.get(k)) for x in configs}) > 1
        }
    )
    if "model" in keys:  # across architectures, the keys one of them ignores would only add noise
        keys = ["model"] + [k for k in keys if k not in ARCH_KEYS]

    def title(config: dict) -> str:
        shown = [k for k in keys if not (k in HF_ONLY_KEYS and config.get("model", "addnorm") == "addnorm")]
        return ", ".join(f"{k}={config.get(k)}" for k in shown) or "all runs"

    return [(title(g[0]["config"]), g) for g in groups.values()]


def lr_tolerance(runs: list[dict]) -> list[tuple[str, list[float]]]:
    """Per placement, the learning rates of the sweeps at which its loss (any seed) is within 10% of the
    best loss any placement reached at that rate; most tolerant first."""
    best_at: dict[float, float] = {}
    runs = finished(runs)
    for r in runs:
        best_at[r["config"]["lr"]] = min(best_at.get(r["config"]["lr"], math.inf), outcome(r))
    tolerant: dict[str, set[float]] = defaultdict(set)
    for r in runs:
        p = str(r["config"]["placement"])
        tolerant[p]
        if outcome(r) <= 1.1 * best_at[r["config"]["lr"]]:
            tolerant[p].add(r["config"]["lr"])
    order = sorted(tolerant, key=lambda p: (-len(tolerant[p]), p))
    return [(p, sorted(tolerant[p])) for p in order]


def ranking(
    store: Store, runs: list[dict], lr_experiments: set[str], mix_devices: bool = False
) -> RankingRecord | None:
    """Placements ranked per setting by final held-out loss over the seeds that finished (a failed run is
    counted in :attr:`RankingTable.failed`, not ranked), the settings side by side, the
    learning-rate tolerance in the sweeps, and the residual stream's RMS per layer at the end of training.
    A setting whose runs were measured on several devices is ranked per device unless ``mix_devices``
    (:func:`by_device`)."""
    placements = sorted({str(r["config"]["placement"]) for r in runs})
    if len(placements) < 3:
        return None
    only_sweep = lambda r: all(e in lr_experiments for e, _ in r["experiments"])  # noqa: E731
    tables, notes = [], []
    for setting, whole in settings([r for r in runs if not only_sweep(r)]):
        split_up, note = by_device(setting, whole, mix_devices)
        notes += [note] if note else []
        for title, group in split_up:
            table = rank_setting(title, group)
            if table is not None:
                tables.append(table)
    ranks = [{r.name: r.rank for r in t.rows} for t in tables]
    rho = [math.nan] + [spearman(ranks[0], ranks[i]) for i in range(1, len(tables))]
    best = [{r.name for r in t.rows if r.best} for t in tables]
    shared = sorted(set.intersection(*best)) if best else []
    swept = [r for r in runs if any(e in lr_experiments for e, _ in r["experiments"])]
    depth, growth = growth_profiles(store, runs)
    tolerance = lr_tolerance(swept) if swept else []
    return RankingRecord(placements, tables, rho, shared, tolerance, depth, growth, notes)


def rank_setting(title: str, group: list[dict]) -> RankingTable | None:
    """One table: the placements of ``group`` ranked (None with fewer than three placements)."""
    samples: dict[str, list[float]] = defaultdict(list)
    seeds: dict[str, list[tuple[int, float]]] = defaultdict(list)
    failed: dict[str, int] = defaultdict(int)
    for r in group:
        placement = str(r["config"]["placement"])
        if r["status"] in FINISHED:
            samples[placement].append(outcome(r))
            seeds[placement].append((r["config"]["seed"], outcome(r)))
        else:  # missing data, not an outcome: counted beside the ranking
            failed[placement] += 1
    if len(samples) < 3:
        return None
    rows = rank(samples, splits=True)
    devices = sorted({device_of(r) for r in group if r["status"] in FINISHED})
    return RankingTable(title, rows, dict(failed), sensitivity(samples, rows), devices, dict(seeds))


# --- what was run ---------------------------------------------------------------------------------
def provenance(runs: list[dict]) -> list[tuple[str, str]]:
    """(field, the values the runs stored) in :data:`PROVENANCE_FIELDS` order, then any other field (a
    field only some runs stored says how many: transformers, for the runs of Hugging Face models), the
    run dates as a range, and the runs stored without provenance."""
    prov: dict[str, set] = defaultdict(set)
    count: dict[str, int] = defaultdict(int)
    for r in runs:
        for k, v in (r.get("provenance") or {}).items():
            prov[k].add(value(v))
            count[k] += 1
    with_provenance = sum(1 for r in runs if r.get("provenance"))
    titles = dict(PROVENANCE_FIELDS)
    keys = [k for k, _ in PROVENANCE_FIELDS] + sorted(k for k in prov if k not in titles and k != "date")
    rows = []
    numbers: dict[str, list[float]] = defaultdict(list)
    for r in runs:
        for k in RANGE_FIELDS:
            v = (r.get("provenance") or {}).get(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                numbers[k].append(v)
    for key in keys:
        if prov.get(key):
            some = f" ({count[key]} of {with_provenance} runs)" if count[key] < with_provenance else ""
            shown = sorted(prov[key])
            if numbers.get(key) and len(shown) > 1:
                shown = [f"{value(min(numbers[key]))} to {value(max(numbers[key]))}"]
            rows.append((titles.get(key, key), ", ".join(shown) + some))
    if prov.get("date"):
        dates = sorted(prov["date"])
        rows.append(("run dates (UTC)", dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"))
    missing = sum(1 for r in runs if not r.get("provenance"))
    if missing:
        rows.append(("runs without provenance", f"{missing} (stored by an older addnorm)"))
    return rows


def configuration(spec: dict, base: dict, runs: list[dict]) -> Configuration:
    """The base config (resolved; the spec's own base for a database that did not keep it), each
    experiment's settings and sweep with its number of runs, and the runs' provenance."""
    experiments = [
        ExperimentSettings(
            name,
            sum(1 for r in runs if any(e == name for e, _ in r["experiments"])),
            (exp or {}).get("set") or {},
            (exp or {}).get("sweep") or {},
        )
        for name, exp in (spec.get("experiments") or {}).items()
    ]
    given = set((spec.get("base") or {}).keys())
    return Configuration(base or spec.get("base") or {}, given, experiments, provenance(runs))


def not_applicable(store: Store, spec: dict) -> list[str]:
    """The plan's runs left out as not applicable, one line per variant ("experiment: label: not
    applicable (why)"), as the runner recorded them."""
    rows = store.not_applicable()
    if rows is None:  # a database written before the plan kept them: resolve the stored spec again
        rows = _legacy_not_applicable(spec)
    return list(dict.fromkeys(f"{e}: {seedless(lab)}: not applicable ({why})" for e, lab, why in rows))


def _legacy_not_applicable(spec: dict) -> list[tuple[str, str, str]]:
    from .spec import SpecError, parse_spec  # the run config: only for databases of an older addnorm

    try:
        return parse_spec(json.loads(json.dumps(spec))).not_applicable()
    except (SpecError, TypeError, ValueError):
        return []


def rule_as_test(findings) -> RuleAsTest | None:
    """The findings' rule as a t-test at the most common number of seeds among the judged findings."""
    counts = sorted(len(f.seeds) for f in findings if f.verdict != NOT_TESTED and len(f.seeds) >= 2)
    if not counts:
        return None
    seeds = max(set(counts), key=lambda c: (counts.count(c), -c))
    return RuleAsTest(seeds, *as_t_test(seeds))


def ranked_of(experiments: dict, runs: list[dict]) -> tuple[list[dict], set[str]]:
    """(the runs of the experiments marked ``rank: true``, those of them that sweep ``lr``)."""
    ranked = {n for n, e in experiments.items() if (e or {}).get("rank")}
    lr_experiments = {n for n in ranked if "lr" in ((experiments[n] or {}).get("sweep") or {})}
    return [r for r in runs if any(e in ranked for e, _ in r["experiments"])], lr_experiments


def analyse(store: Store, mix_devices: bool = False) -> StudyRecords:
    """Every record of the report from ``store``'s current plan (``mix_devices``: see :func:`ranking`)."""
    name, spec = store.study_spec() or ("study", {"experiments": {}})
    runs = store.runs()
    experiments = spec.get("experiments") or {}
    sections = []
    for exp_name, exp in experiments.items():
        exp_runs = [r for r in runs if any(e == exp_name for e, _ in r["experiments"])]
        if exp_runs:
            sections.append(experiment(store, exp_name, exp or {}, exp_runs))
    ranked_runs, lr_experiments = ranked_of(experiments, runs)
    counts: dict[str, int] = defaultdict(int)
    for r in runs:
        counts[r["status"]] += 1
    findings = compute_findings(store)
    return StudyRecords(
        name=name,
        description=" ".join(str(spec.get("description") or "").split()),
        status_counts=dict(sorted(counts.items())),
        runs=len(runs),
        planned=len({run_id for run_id, _, _ in store.planned()}) or len(runs),
        stale=len(store.stale_ids()) if store.planned() else 0,
        configuration=configuration(spec, store.base_config(), runs),
        findings=findings,
        rule=rule_as_test(findings),
        ranking=ranking(store, ranked_runs, lr_experiments, mix_devices) if ranked_runs else None,
        not_applicable=not_applicable(store, spec),
        experiments=sections,
    )
