"""Every key a study spec may hold, without importing torch: ``addnorm study --keys`` and
``docs/study-spec.md``.

A spec's structure (:data:`STRUCTURE`: ``name``, ``description``, ``base``, ``experiments`` and an
experiment's ``set``, ``sweep``, ``variant``, ``rank``) is written here; the run keys (:data:`RUN_KEYS`,
what ``base``, ``set`` and a sweep take) are generated from :class:`~addnorm.train.RunConfig` into
``run_keys_generated.py`` (:func:`addnorm.study.spec.write_run_keys` rewrites it; a test checks it matches the
code), so listing them needs no torch.
"""

from __future__ import annotations

import json

from .run_keys_generated import RUN_KEYS

SPEC_KEYS = ("name", "description", "base", "experiments")
EXPERIMENT_KEYS = ("set", "sweep", "description", "rank")
# (key, where it goes, what it means)
STRUCTURE: tuple[tuple[str, str, str], ...] = (
    ("name", "top level", "the study's name (required): its folder under --out and the report's title"),
    (
        "description",
        "top level, an experiment",
        "what the study or the experiment measures, shown in the report",
    ),
    ("base", "top level", "the run settings every run starts from (the run keys below; the rest default)"),
    ("experiments", "top level", "experiment name -> {set, sweep, rank, description} (required, not empty)"),
    ("set", "an experiment", "this experiment's fixed run settings, over the base"),
    ("sweep", "an experiment", "run key -> list of values; the runs are the cartesian product of the axes"),
    (
        "variant",
        "a sweep axis",
        "a list of mappings that set several run keys at once, each named by its label: "
        "[{label: no residual, residual: false}, ...]",
    ),
    ("rank", "an experiment", "true: rank this experiment's placements in the report (default false)"),
)
INTRO = """# Study spec keys

Generated from `RunConfig` and `TransformerConfig` by `addnorm study --keys --markdown`; the
tests check that this file matches the code. A spec is YAML:

```yaml
name: my-study
description: what it measures
base: {n_layers: 6, steps: 300}        # every run starts from these
experiments:
  warmup:
    description: shown in the report
    set: {lr: 0.003}                    # this experiment's fixed settings
    sweep: {placement: [post, pre], warmup: [0, 100], seed: [0, 1, 2]}   # cartesian product
  ablations:
    sweep:
      variant:                          # several keys at once, named by label
        - {label: layernorm}
        - {label: no residual, residual: false}
    rank: false                         # true: rank this experiment's placements in the report
```

Names are canonicalised before a run's id is computed (`Post-LN` is `post`), so an alias never
splits a run. `addnorm study --set KEY=VALUE` sets a key everywhere (see `addnorm study --help`).
"""


def cell(text: str) -> str:
    """``text`` as one Markdown table cell: a ``|`` escaped (it would end the cell), newlines joined."""
    return " ".join(str(text).split()).replace("|", "\\|")


def markdown() -> str:
    """The spec reference (``docs/study-spec.md``): the structure keys, then every run key."""
    lines = [INTRO, "## Structure", "", "| key | where | meaning |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {cell(w)} | {cell(m)} |" for k, w, m in STRUCTURE]
    lines += [
        "",
        "## Run keys (`base`, `set`, `sweep`)",
        "",
        "| key | default | meaning |",
        "| --- | --- | --- |",
    ]
    lines += [f"| `{k}` | `{cell(d)}` | {cell(h)} |" for k, d, h in RUN_KEYS]
    return "\n".join(lines) + "\n"


def text() -> str:
    """Every key in plain text (``addnorm study --keys``): the run keys with their defaults, then the
    structure keys."""
    width = max(len(k) for k, _, _ in (*RUN_KEYS, *STRUCTURE))
    lines = [f"{key:<{width}}  {help_} (default {default})" for key, default, help_ in RUN_KEYS]
    lines += ["", "spec structure:"]
    lines += [f"{key:<{width}}  {meaning} ({where})" for key, where, meaning in STRUCTURE]
    return "\n".join(lines) + "\n"


def generated(rows: list[tuple[str, str, str]]) -> str:
    """The source of ``run_keys_generated.py`` for ``rows`` (key, default as YAML, description)."""
    quote = lambda s: json.dumps(s, ensure_ascii=False)  # noqa: E731 - as ruff format writes a string
    body = "".join("    (\n" + "".join(f"        {quote(x)},\n" for x in row) + "    ),\n" for row in rows)
    return (
        '"""The run keys (key, default as YAML, meaning), generated from RunConfig by\n'
        'addnorm.study.spec.write_run_keys(). Do not edit; a test checks that it matches the code."""\n\n'
        "# ruff: noqa: E501\n"
        f"RUN_KEYS: tuple[tuple[str, str, str], ...] = (\n{body})\n"
    )
