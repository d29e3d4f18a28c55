"""Per-layer statistics of a tiny random-weight Hugging Face model at initialisation, untouched and under
addnorm placements: what ``addnorm inspect --hf TYPE`` prints and plots.

After one backward of the next-token loss, :class:`addnorm.Probe` reads, per layer: the norm of the
gradient of the layer's weight matrices, the norm of the gradient of the residual stream at the layer's
output, and the RMS of that stream (Xiong et al. 2020 read the first two to compare Post-LN and Pre-LN).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from ..probe import Probe
from .placement import with_placement
from .tiny import tiny_model

__all__ = ["METRICS", "MODEL", "layer_statistics", "plot", "table", "write_json"]

MODEL = "model"  # the untouched model's own Add & Norm
METRICS = {
    "weight_grad": "weight-gradient norm of the layer's matrices",
    "stream_grad": "gradient norm of the residual stream at the layer's output",
    "act_rms": "RMS of the residual stream at the layer's output",
}


def layer_statistics(
    model_type: str,
    placements: list[str],
    batches: list[torch.Tensor],
    *,
    layers: int,
    hidden: int,
    heads: int,
    intermediate: int,
    seed: int = 0,
    norm: str | None = None,
) -> dict[str, dict[str, list[float]]]:
    """``{placement: {metric: per-layer values}}`` (metrics: :data:`METRICS`), each the mean over one
    fresh model per batch (seeds ``seed``, ``seed + 1``, ...). ``placements`` may include :data:`MODEL`,
    the untouched model. ``batches``: (batch, seq + 1) token windows over a 256-symbol vocabulary; dropout
    is off. ``norm``: the norm of the re-placed models (None: the model's own)."""
    sizes = {"layers": layers, "hidden": hidden, "heads": heads, "intermediate": intermediate}
    vocab = 256
    results = {}
    for name in placements:
        totals = {metric: [0.0] * layers for metric in METRICS}
        for r, tokens in enumerate(batches):
            model = tiny_model(
                model_type, seed=seed + r, vocab=vocab, positions=tokens.shape[1], dropout=0.0, **sizes
            )
            if name != MODEL:
                with_placement(model, name, norm=norm)
            model.train()
            with Probe(model) as probe:
                logits = model(input_ids=tokens[:, :-1]).logits
                F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
            values = {
                "weight_grad": probe.weight_grad_norms(None),
                "stream_grad": probe.stream_grad_norms(),
                "act_rms": probe.activation_rms(),
            }
            for metric, per_layer in values.items():
                mean = zip(totals[metric], per_layer, strict=True)
                totals[metric] = [t + v / len(batches) for t, v in mean]
        results[name] = totals
    return results


def table(results: dict[str, dict[str, list[float]]]) -> str:
    """One block per metric: a row per layer, a column per placement."""
    names = list(results)
    col = max(12, *(len(n) + 2 for n in names))
    lines = []
    for metric, what in METRICS.items():
        lines.append(f"{metric}: {what}")
        lines.append("layer" + "".join(f"{n:>{col}}" for n in names))
        n_layers = len(next(iter(results.values()))[metric])
        for i in range(n_layers):
            lines.append(f"{i + 1:>5}" + "".join(f"{results[n][metric][i]:>{col}.4g}" for n in names))
        lines.append("")
    return "\n".join(lines).rstrip("\n")


def plot(results: dict[str, dict[str, list[float]]], title: str, path: Path) -> None:
    """The three metrics side by side, log scale, one line per placement."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4))
    for ax, (metric, what) in zip(axes, METRICS.items(), strict=True):
        for name, values in results.items():
            style = {"linestyle": "--", "marker": "s", "markersize": 8} if name == MODEL else {"marker": "o"}
            ax.plot(range(1, len(values[metric]) + 1), values[metric], label=name, **style)
        ax.set_yscale("log")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("layer (1 = nearest the input)")
        ax.set_title(what, fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(results: dict, config: dict, path: Path) -> None:
    path.write_text(json.dumps({"config": config, "metrics": METRICS, "results": results}, indent=2) + "\n")
