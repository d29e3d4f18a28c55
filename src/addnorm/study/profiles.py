"""The per-layer profile rule: one value per layer from a run's stored per-layer rows.

A run stores its per-layer observations as rows ``{step, layer, sublayer, metric, param, value}`` (the
probe's rows, plus the training loop's ``update_ratio`` rows). A *profile* is one value per layer of one
metric, in one part of the layer, at one step:

- the part: ``"ffn"`` is the feed-forward sublayer, named ``ff`` in addnorm's transformer and ``mlp`` in
  Hugging Face models (:data:`FFN_SUBLAYERS`); ``"stream"`` is the layer's output (sublayer ``""``);
- the step: ``"first"`` (the first probed step, initialisation), ``"last"`` (the last probed step) or a
  step number;
- several rows of one layer (one per weight matrix) combine as ``sqrt(sum of squares)`` for
  weight-gradient norms (the norm of the matrices' gradients taken together) and as their mean for
  everything else (update-to-weight ratios of a layer's matrices; a stream statistic has one row).

The report's per-layer figures, the findings' gradient and growth measures, the trackers' per-layer
values and ``addnorm export``'s ``layer_profiles.csv`` all read profiles through :func:`layer_profile`
(or :func:`combine` for one sublayer's rows). Pure Python: no torch.
"""

from __future__ import annotations

import math
from collections import defaultdict

FFN_SUBLAYERS = ("ff", "mlp")  # addnorm's transformer, Hugging Face models
PARTS: dict[str, tuple[str, ...]] = {"ffn": FFN_SUBLAYERS, "stream": ("",)}
ROOT_SUM_SQUARES = ("weight_grad_norm",)  # metrics whose per-matrix rows combine as sqrt(sum of squares)


def combine(metric: str, values: list[float]) -> float:
    """One layer's value of ``metric`` from its rows' values: sqrt(sum of squares) for weight-gradient
    norms, the mean otherwise."""
    if metric in ROOT_SUM_SQUARES:
        return math.sqrt(sum(v * v for v in values))
    return sum(values) / len(values)


def _rows(rows: list[dict], metric: str, part: str) -> list[dict]:
    if part not in PARTS:
        raise ValueError(f"part: expected one of {', '.join(PARTS)}, got {part!r}")
    sublayers = PARTS[part]
    return [
        r for r in rows if r["metric"] == metric and r["sublayer"] in sublayers and r["value"] is not None
    ]


def profile_steps(rows: list[dict], metric: str, part: str) -> list[int]:
    """The steps at which ``rows`` hold ``metric`` in ``part``, in order."""
    return sorted({r["step"] for r in _rows(rows, metric, part)})


def layer_profile(rows: list[dict], metric: str, part: str, at: str | int = "first") -> dict[int, float]:
    """layer -> value of ``metric`` in ``part`` at step ``at`` (``"first"``, ``"last"`` or a step),
    the layer's rows combined by :func:`combine`; empty when the rows hold none."""
    chosen = _rows(rows, metric, part)
    if not chosen:
        return {}
    steps = [r["step"] for r in chosen]
    step = min(steps) if at == "first" else max(steps) if at == "last" else at
    per_layer: dict[int, list[float]] = defaultdict(list)
    for r in chosen:
        if r["step"] == step:
            per_layer[r["layer"]].append(r["value"])
    return {layer: combine(metric, values) for layer, values in sorted(per_layer.items())}


def profile_list(rows: list[dict], metric: str, part: str, at: str | int = "first") -> list[float]:
    """:func:`layer_profile` as a list in layer order (layer 0 nearest the input)."""
    return list(layer_profile(rows, metric, part, at).values())


def ffn_grad_profile(rows: list[dict]) -> list[float]:
    """Per-layer FFN weight-gradient norm sqrt(sum of squared matrix norms) at the first probed step
    (the gradient profile of Xiong et al. 2020; ``addnorm inspect`` and the findings)."""
    return profile_list(rows, "weight_grad_norm", "ffn", "first")


def all_profiles(rows: list[dict]) -> list[tuple[int, int, str, str, float]]:
    """Every profile value of a run's rows as (step, layer, part, metric, value), sorted: what
    ``addnorm export`` writes to ``layer_profiles.csv``."""
    out = []
    for metric in sorted({r["metric"] for r in rows}):
        for part in PARTS:
            for step in profile_steps(rows, metric, part):
                out += [
                    (step, layer, part, metric, v)
                    for layer, v in layer_profile(rows, metric, part, step).items()
                ]
    return sorted(out)
