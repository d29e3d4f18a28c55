"""Every key a study spec may hold, without importing torch: ``addnorm study --keys`` and
``docs/study-spec.md``.

A spec's structure (:data:`STRUCTURE`: ``name``, ``description``, ``base``, ``experiments`` and an
experiment's ``set``, ``sweep``, ``variant``, ``rank``) is written here; the run keys (:data:`RUN_KEYS`,
what ``base``, ``set`` and a sweep take) are generated from :class:`~addnorm.train.RunConfig` into
``run_keys_generated.py`` (:func:`addnorm.study.spec.write_run_keys` rewrites it; a test checks it matches the
code), so listing them needs no torch. The grammar of ``--set`` (:data:`OVERRIDE_HELP`) and each key's
smoke size (:data:`SMOKE`, what ``--smoke`` shrinks) are here too, so that the command line defines its
options without importing torch.
"""

from __future__ import annotations

import json

from .run_keys_generated import RUN_KEYS

SPEC_KEYS = ("name", "description", "base", "experiments")
EXPERIMENT_KEYS = ("set", "sweep", "description", "rank")

OVERRIDE_HELP = (
    "override a setting, repeatable; values are YAML. A plain KEY=VALUE sets the key everywhere: the "
    "base, every experiment that sets it, and every sweep over it (which collapses to that value). "
    "Dotted paths reach one place and must exist: base.KEY, experiments.NAME.set.KEY, "
    "experiments.NAME.sweep.AXIS=[...]"
)

# --smoke: each setting's value at smoke size (widths tiny, a few steps, no compilation); depths,
# placements, norms, seeds, learning rates and precision keep theirs, so every run's code path is kept.
SMOKE: dict[str, object] = {
    "d_model": lambda v: 16,
    "n_heads": lambda v: 2,
    "d_ff": lambda v: 32,
    "batch_size": lambda v: 2,
    "seq_len": lambda v: 16,
    "eval_batches": lambda v: 1,
    "corpus_bytes": lambda v: min(v, 200_000) if isinstance(v, int) else v,
    "steps": lambda v: min(v, 4) if isinstance(v, int) else v,
    "warmup": lambda v: 1 if v else v,
    "eval_every": lambda v: min(v, 2) if v else v,
    "probe_every": lambda v: 2 if v else v,
    "compile": lambda v: False,
    "kv_heads": lambda v: 1 if v else v,
}
SMOKE_HELP = (
    "run the spec shrunk to a smoke size: d_model 16, 2 heads (1 key/value head), d_ff 32, batch 2, "
    "seq 16, at most 4 steps, compile off; depths, placements, seeds and precision kept (the same code "
    "path in a minute, into <name>-smoke)"
)

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
