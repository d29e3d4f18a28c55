"""Study specs (YAML): a base run config, and experiments that sweep axes over it; expanded to runs.

```yaml
name: quick
description: ...
base: {task: lm, d_model: 64, n_layers: 6, steps: 300}
experiments:
  warmup:
    set: {lr: 0.003}
    sweep: {placement: [post, pre], warmup: [0, 100]}
  ablations:
    sweep:
      variant: [{label: layernorm}, {label: no residual, residual: false}]
      n_layers: [2, 6]
```
``sweep`` is a cartesian product; a ``variant`` axis takes mappings that set several keys at once (its
``label`` names it); ``rank: true`` puts an experiment's placements in the report's ranking.
Runs identical after resolution are run once (the id is the config's hash).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

import yaml

from ..train.config import RunConfig
from .keys import EXPERIMENT_KEYS, SMOKE, SPEC_KEYS, generated, markdown


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that repeats a key (YAML would keep the last silently:
    a repeated experiment name would drop the first experiment)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise SpecError(f"duplicate key {key!r} (line {mark.line + 1}, column {mark.column + 1})")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str):
    """``yaml.safe_load`` that refuses a repeated key in a mapping (a :class:`SpecError`)."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


class SpecError(ValueError):
    """A study spec that cannot be used; the message names the key and what is allowed."""


@dataclass(frozen=True)
class PlannedRun:
    experiment: str
    label: str
    config: RunConfig

    @property
    def run_id(self) -> str:
        return self.config.run_id


@dataclass(frozen=True)
class ResolvedPlan:
    """A spec expanded once: every run of every experiment resolved to its :class:`RunConfig`.

    ``runs``: the distinct applicable runs in spec order (a run that several experiments share is run
    once, under the first); ``memberships``: run id -> every (experiment, label) it belongs to;
    ``not_applicable``: (experiment, label, why) of each run left out because its placement cannot be
    applied to its model (``RunConfig.not_applicable``); ``base``: the base config with every default
    filled in (as given where it is not valid on its own). The runner, ``--dry-run`` and the store's
    plan all read this one object."""

    runs: tuple[PlannedRun, ...]
    memberships: dict[str, list[tuple[str, str]]]
    not_applicable: tuple[tuple[str, str, str], ...]
    base: dict


def resolve(experiments: dict, base: dict) -> ResolvedPlan:
    """Expand every experiment over ``base`` once (see :class:`ResolvedPlan`)."""
    runs: list[PlannedRun] = []
    members: dict[str, list[tuple[str, str]]] = {}
    left_out = []
    for exp_name, exp in experiments.items():
        for run in _expand_experiment(exp_name, exp, base):
            if run.config.not_applicable is not None:
                left_out.append((exp_name, run.label, run.config.not_applicable))
                continue
            if run.run_id not in members:
                runs.append(run)
            members.setdefault(run.run_id, []).append((exp_name, run.label))
    try:
        resolved_base = RunConfig(**base).to_dict()
    except (TypeError, ValueError):
        resolved_base = {**RunConfig.defaults(), **base}
    return ResolvedPlan(tuple(runs), members, tuple(left_out), resolved_base)


@dataclass
class StudySpec:
    """A parsed spec; ``plan`` is its expansion, made once by :func:`parse_spec`."""

    name: str
    description: str = ""
    base: dict = field(default_factory=dict)
    experiments: dict = field(default_factory=dict)
    source: str = ""
    plan: ResolvedPlan | None = field(default=None, repr=False, compare=False)

    def resolved(self) -> ResolvedPlan:
        """The plan (expanded now if this spec was built directly, not by :func:`parse_spec`)."""
        if self.plan is None:
            self.plan = resolve(self.experiments, self.base)
        return self.plan

    def expand(self) -> list[PlannedRun]:
        """Every run of every experiment, deduplicated by run id (first experiment wins)."""
        return list(self.resolved().runs)

    def memberships(self) -> dict[str, list[tuple[str, str]]]:
        """run id -> every (experiment, label) it belongs to (a run can serve several experiments)."""
        return self.resolved().memberships

    def not_applicable(self) -> list[tuple[str, str, str]]:
        """(experiment, label, why) of every run left out of the plan because its placement cannot be
        applied to its model (a Hugging Face family, see ``RunConfig.not_applicable``)."""
        return list(self.resolved().not_applicable)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "description": self.description,
            "base": self.base,
            "experiments": self.experiments,
        }


def _check_keys(mapping: dict, where: str) -> None:
    allowed = RunConfig.keys()
    for key in mapping:
        if key not in allowed:
            raise SpecError(f"{where}.{key}: unknown key; allowed keys: {', '.join(allowed)}")


def _build(values: dict, where: str) -> RunConfig:
    try:
        return RunConfig(**values)
    except (ValueError, TypeError) as err:
        raise SpecError(f"{where}: {err}") from None


def _expand_experiment(name: str, exp: dict, base: dict) -> list[PlannedRun]:
    where = f"experiments.{name}"
    fixed = {**base, **(exp.get("set") or {})}
    axes = exp.get("sweep") or {}
    names = list(axes)
    runs = []
    for combo in itertools.product(*(axes[a] for a in names)) if names else [()]:
        values, label_parts = dict(fixed), []
        for axis, value in zip(names, combo, strict=True):
            if axis == "variant":
                variant = dict(value)
                label_parts.append(str(variant.pop("label")))
                values.update(variant)
            else:
                values[axis] = value
                label_parts.append(f"{axis}={value}")
        runs.append(PlannedRun(name, ", ".join(label_parts) or name, _build(values, where)))
    return runs


def parse_spec(data: object, source: str = "<spec>") -> StudySpec:
    """Validate a loaded YAML document and build the StudySpec (every run is resolved once here).

    Args:
        data: the document, a mapping with ``name``, ``base``, ``experiments`` (docs/study-spec.md).
        source: what error messages call it (a file name or a preset).

    Returns:
        The spec.

    Raises:
        SpecError: the document is not a valid spec (the message names the key and what it expects).
    """
    if not isinstance(data, dict):
        raise SpecError(
            f"{source}: expected a mapping with keys {', '.join(SPEC_KEYS)}, got {type(data).__name__}"
        )
    for key in data:
        if key not in SPEC_KEYS:
            raise SpecError(f"{key}: unknown top-level key; allowed keys: {', '.join(SPEC_KEYS)}")
    name = data.get("name")
    if not isinstance(name, str) or not name.strip():
        raise SpecError("name: expected a non-empty string naming the study")
    if "/" in name or "\\" in name or name.strip() in (".", ".."):
        raise SpecError(
            f"name: {name!r} would not name one folder under the output root; expected a plain name"
        )
    base = data.get("base") or {}
    if not isinstance(base, dict):
        raise SpecError("base: expected a mapping of run settings")
    _check_keys(base, "base")
    experiments = data.get("experiments")
    if not isinstance(experiments, dict) or not experiments:
        raise SpecError("experiments: expected a non-empty mapping of experiment name -> {set, sweep}")
    for exp_name, exp in experiments.items():
        where = f"experiments.{exp_name}"
        if exp is None:
            exp = experiments[exp_name] = {}
        if not isinstance(exp, dict):
            raise SpecError(f"{where}: expected a mapping with keys {', '.join(EXPERIMENT_KEYS)}")
        for key in exp:
            if key not in EXPERIMENT_KEYS:
                raise SpecError(f"{where}.{key}: unknown key; allowed keys: {', '.join(EXPERIMENT_KEYS)}")
        settings = exp.get("set") or {}
        if not isinstance(settings, dict):
            raise SpecError(f"{where}.set: expected a mapping of run settings")
        _check_keys(settings, f"{where}.set")
        sweep = exp.get("sweep") or {}
        if not isinstance(sweep, dict):
            raise SpecError(f"{where}.sweep: expected a mapping of axis -> list of values")
        for axis, values in sweep.items():
            if not isinstance(values, list) or not values:
                raise SpecError(f"{where}.sweep.{axis}: expected a non-empty list of values")
            if axis == "variant":
                for v in values:
                    if not isinstance(v, dict) or "label" not in v:
                        raise SpecError(f"{where}.sweep.variant: each value must be a mapping with a 'label'")
                    _check_keys({k: x for k, x in v.items() if k != "label"}, f"{where}.sweep.variant")
                labels = [str(v["label"]) for v in values]
                if len(set(labels)) < len(labels):
                    twice = next(x for x in labels if labels.count(x) > 1)
                    raise SpecError(f"{where}.sweep.variant: label {twice!r} is used twice; each must differ")
            else:
                _check_keys({axis: None}, f"{where}.sweep")
    plan = resolve(experiments, base)  # resolves and validates every run, once
    if not plan.runs and plan.not_applicable:
        raise SpecError(f"{source}: no run of this spec is applicable: {plan.not_applicable[0][2]}")
    return StudySpec(name.strip(), str(data.get("description") or ""), base, experiments, source, plan)


def _override_everywhere(data: dict, key: str, value: object) -> None:
    """A plain ``--set key=value``: the base, every experiment's ``set``, a sweep over the key (which
    collapses to the one value) and every variant that sets it."""
    data.setdefault("base", {})
    if not isinstance(data["base"], dict):
        raise SpecError("base: expected a mapping of run settings")
    data["base"][key] = value
    for exp in (data.get("experiments") or {}).values():
        if not isinstance(exp, dict):
            continue
        if isinstance(exp.get("set"), dict) and key in exp["set"]:
            exp["set"][key] = value
        sweep = exp.get("sweep")
        if isinstance(sweep, dict):
            if key in sweep:
                sweep[key] = [value]
            for variant in sweep.get("variant") or []:
                if isinstance(variant, dict) and key in variant:
                    variant[key] = value


def _set_dotted(data: dict, dotted: str, value: object) -> None:
    """``--set a.b.c=value`` into a path that exists: ``base.KEY``, ``experiments.NAME.set.KEY``,
    ``experiments.NAME.sweep.AXIS`` or ``experiments.NAME.(description|rank)``."""
    parts = dotted.split(".")
    where = f"--set {dotted}"
    run_keys = RunConfig.keys()
    if parts[0] == "base" and len(parts) == 2:
        if parts[1] not in run_keys:
            raise SpecError(f"{where}: unknown run key {parts[1]!r}; allowed keys: {', '.join(run_keys)}")
        data.setdefault("base", {})[parts[1]] = value
        return
    if parts[0] != "experiments" or len(parts) < 3:
        raise SpecError(
            f"{where}: no such path; expected KEY, base.KEY, experiments.NAME.set.KEY or "
            "experiments.NAME.sweep.AXIS"
        )
    experiments = data.get("experiments") if isinstance(data.get("experiments"), dict) else {}
    name = parts[1]
    if name not in experiments:
        raise SpecError(
            f"{where}: no experiment {name!r} in this spec; experiments: {', '.join(experiments) or 'none'}"
        )
    exp = experiments[name] if isinstance(experiments[name], dict) else {}
    experiments[name] = exp
    field_ = parts[2]
    if field_ not in EXPERIMENT_KEYS:
        raise SpecError(
            f"{where}: {field_!r} is not an experiment key; allowed: {', '.join(EXPERIMENT_KEYS)}"
        )
    if field_ in ("description", "rank"):
        if len(parts) != 3:
            raise SpecError(f"{where}: no such path; {field_} has no sub-keys")
        exp[field_] = value
        return
    if len(parts) != 4:
        raise SpecError(f"{where}: no such path; expected experiments.{name}.{field_}.KEY")
    key = parts[3]
    if key not in run_keys and not (field_ == "sweep" and key == "variant"):
        raise SpecError(f"{where}: unknown run key {key!r}; allowed keys: {', '.join(run_keys)}")
    if not isinstance(exp.get(field_), dict):
        exp[field_] = {}
    exp[field_][key] = value


def distributed_override(nproc: int | None, strategy: str | None) -> str:
    """``--nproc N [--strategy S]`` as the ``--set`` override ``distributed={strategy: S, nproc: N}``
    (validated with the runs: ``distributed.nproc``/``distributed.strategy`` errors name the key)."""
    if nproc is None:
        raise SpecError("--strategy: only with --nproc N (the processes each run trains on)")
    return f"distributed={{strategy: {strategy or 'ddp'}, nproc: {nproc}}}"


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply ``--set`` overrides to a loaded spec (see :data:`.keys.OVERRIDE_HELP`)."""
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"--set: expected key=value, got {item!r}")
        key, text = item.split("=", 1)
        key = key.strip()
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise SpecError(f"--set {key}: the value is not valid YAML: {err}") from None
        if "." in key:
            _set_dotted(data, key, value)
        elif key in ("name", "description"):
            data[key] = value
        elif key in RunConfig.keys():
            _override_everywhere(data, key, value)
        else:
            raise SpecError(
                f"--set {key}: unknown key; expected a run key ({', '.join(RunConfig.keys())}), "
                "name, description, or a dotted path"
            )
    return data


def smoke_spec(data: dict) -> dict:
    """``data`` (a loaded spec) with every run setting at smoke size (:data:`.keys.SMOKE`) wherever it is
    given (base, ``set``, sweeps, variants) and in the base where it is not; named ``<name>-smoke``."""
    shrink = lambda key, value: SMOKE[key](value) if key in SMOKE else value  # noqa: E731
    data = dict(data)
    if isinstance(data.get("name"), str):
        data["name"] = data["name"].strip() + "-smoke"
    defaults = RunConfig.defaults()
    base = dict(data.get("base") or {}) if isinstance(data.get("base"), dict) else data.get("base")
    if isinstance(base, dict):
        base = {k: shrink(k, v) for k, v in base.items()}
        for key in SMOKE:
            base.setdefault(key, shrink(key, defaults[key]))
        data["base"] = base
    experiments = {}
    for name, exp in (
        (data.get("experiments") or {}).items() if isinstance(data.get("experiments"), dict) else ()
    ):
        if isinstance(exp, dict):
            exp = dict(exp)
            if isinstance(exp.get("set"), dict):
                exp["set"] = {k: shrink(k, v) for k, v in exp["set"].items()}
            if isinstance(exp.get("sweep"), dict):
                sweep = {}
                for axis, values in exp["sweep"].items():
                    if not isinstance(values, list):
                        sweep[axis] = values
                    elif axis == "variant":
                        sweep[axis] = [
                            {k: (x if k == "label" else shrink(k, x)) for k, x in v.items()}
                            if isinstance(v, dict)
                            else v
                            for v in values
                        ]
                    else:
                        sweep[axis] = list(dict.fromkeys(shrink(axis, v) for v in values))
                exp["sweep"] = sweep
        experiments[name] = exp
    if experiments:
        data["experiments"] = experiments
    return data


def preset_names() -> list[str]:
    files = resources.files("addnorm.study").joinpath("presets")
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def preset_text(name: str) -> str:
    """A preset's YAML as shipped (``addnorm study --show NAME``: a template for a spec of one's own)."""
    names = preset_names()
    if name not in names:
        raise SpecError(f"spec: unknown preset {name!r}; presets: {', '.join(names)}")
    return resources.files("addnorm.study").joinpath("presets", f"{name}.yaml").read_text()


def spec_keys() -> list[tuple[str, str, str]]:
    """(key, default as YAML, description) for every key a spec's ``base``, ``set`` or ``sweep`` takes,
    generated from :class:`RunConfig` and :class:`~addnorm.model.TransformerConfig`."""
    defaults, help_ = RunConfig.defaults(), RunConfig.help()
    rows = []
    for key in RunConfig.keys():
        default = yaml.safe_dump(defaults[key], default_flow_style=True).strip().removesuffix("...").strip()
        rows.append((key, default, help_[key]))
    return rows


def write_run_keys() -> Path:
    """Regenerate ``study/run_keys_generated.py`` (generated code: the run keys that ``study --keys``
    lists without torch) from :func:`spec_keys`; returns its path."""
    path = Path(__file__).with_name("run_keys_generated.py")
    path.write_text(generated(spec_keys()))
    return path


def spec_keys_markdown() -> str:
    """The spec reference (``docs/study-spec.md``): the spec's structure and every run key."""
    return markdown()


def load_spec(
    name_or_path: str | Path | None = None, overrides: list[str] | None = None, smoke: bool = False
) -> StudySpec:
    """A preset by name (default ``quick``) or a YAML file by path, with ``--set`` overrides applied.

    Args:
        name_or_path: a preset name (:func:`preset_names`) or a ``.yaml`` path; None: ``quick``.
        overrides: ``KEY=VALUE`` settings, as ``addnorm study --set`` takes them.
        smoke: shrink the spec to a smoke size (:func:`smoke_spec`).

    Returns:
        The spec.

    Raises:
        SpecError: no such preset or file, YAML that does not parse, or an invalid spec.
    """
    name_or_path = name_or_path or "quick"
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpecError(f"spec: no such file {str(path)!r}")
        text, source = path.read_text(), str(path)
    else:
        if str(name_or_path) not in preset_names():
            raise SpecError(
                f"spec: unknown preset {str(name_or_path)!r}; presets: {', '.join(preset_names())} "
                "(or a .yaml path)"
            )
        text, source = preset_text(str(name_or_path)), f"preset {name_or_path}"
    try:
        data = load_yaml(text)
    except SpecError as err:
        raise SpecError(f"{source}: {err}") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None
    if isinstance(data, dict) and overrides:
        data = apply_overrides(data, overrides)
    if isinstance(data, dict) and smoke:
        data, source = smoke_spec(data), f"{source} at smoke size"
    return parse_spec(data, source)
