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

SPEC_KEYS = ("name", "description", "base", "experiments")
EXPERIMENT_KEYS = ("set", "sweep", "description", "rank")


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


@dataclass
class StudySpec:
    name: str
    description: str = ""
    base: dict = field(default_factory=dict)
    experiments: dict = field(default_factory=dict)
    source: str = ""

    def expand(self) -> list[PlannedRun]:
        """Every run of every experiment, deduplicated by run id (first experiment wins)."""
        runs, seen = [], set()
        for exp_name, exp in self.experiments.items():
            for run in _expand_experiment(exp_name, exp, self.base):
                if run.run_id not in seen:
                    seen.add(run.run_id)
                    runs.append(run)
        return runs

    def memberships(self) -> dict[str, list[tuple[str, str]]]:
        """run id -> every (experiment, label) it belongs to (a run can serve several experiments)."""
        out: dict[str, list[tuple[str, str]]] = {}
        for exp_name, exp in self.experiments.items():
            for run in _expand_experiment(exp_name, exp, self.base):
                out.setdefault(run.run_id, []).append((exp_name, run.label))
        return out

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
    """Validate a loaded YAML document and build the StudySpec (every run is resolved once here)."""
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
            else:
                _check_keys({axis: None}, f"{where}.sweep")
    spec = StudySpec(name.strip(), str(data.get("description") or ""), base, experiments, source)
    spec.expand()  # resolves and validates every run now
    return spec


def _set_path(data: dict, dotted: str, value: object) -> None:
    parts = dotted.split(".")
    node = data
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    """``--set key=value``: dotted keys into the spec (``base.steps=50``); a bare run key goes to
    ``base``. Values are parsed as YAML (``true``, ``1e-3``, ``[1, 2]``)."""
    for item in overrides:
        if "=" not in item:
            raise SpecError(f"--set: expected key=value, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise SpecError(f"--set {key}: the value is not valid YAML: {err}") from None
        key = key.strip()
        if "." not in key:
            if key in SPEC_KEYS:
                data[key] = value
                continue
            key = f"base.{key}"
        _set_path(data, key, value)
    return data


def preset_names() -> list[str]:
    files = resources.files("addnorm.study").joinpath("presets")
    return sorted(p.name[: -len(".yaml")] for p in files.iterdir() if p.name.endswith(".yaml"))


def load_spec(name_or_path: str | Path | None = None, overrides: list[str] | None = None) -> StudySpec:
    """A preset by name (default ``quick``) or a YAML file by path, with ``--set`` overrides applied."""
    name_or_path = name_or_path or "quick"
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") or path.exists():
        if not path.is_file():
            raise SpecError(f"spec: no such file {str(path)!r}")
        text, source = path.read_text(), str(path)
    else:
        names = preset_names()
        if str(name_or_path) not in names:
            raise SpecError(
                f"spec: unknown preset {str(name_or_path)!r}; presets: {', '.join(names)} (or a .yaml path)"
            )
        text = resources.files("addnorm.study").joinpath("presets", f"{name_or_path}.yaml").read_text()
        source = f"preset {name_or_path}"
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark else ""
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise SpecError(f"{source}: not valid YAML{where}: {problem}") from None
    if isinstance(data, dict) and overrides:
        data = apply_overrides(data, overrides)
    return parse_spec(data, source)
