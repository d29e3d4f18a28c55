"""The ``addnorm`` command line: list placements and norms, explain Add & Norm, inspect gradients by depth.

``addnorm inspect`` reproduces the observation of Xiong et al. 2020 ("On Layer Normalization in the
Transformer Architecture"): at initialisation, Post-LN's FFN weight gradients grow toward the top layers
while Pre-LN's do not.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import typer

from .cli_errors import LIBRARY_ERRORS, fail, handle_errors
from .study.cli import register as register_study_commands
from .tasks.corpus import stdlib_corpus

app = typer.Typer(
    name="addnorm",
    help="The transformer Add & Norm pattern: placements, norms, and how gradients flow through depth.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers such as 1,2,3, got {text!r}") from None
    if not values:
        raise ValueError(f"{option}: expected at least one number, got {text!r}")
    return values


def _fmt(values) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


# --- list -------------------------------------------------------------------------------------------
@app.command("list")
@handle_errors
def list_command() -> None:
    """Print every placement and norm with its formula and citation."""
    from .norms import NORMS
    from .placements import PLACEMENTS

    typer.echo("Placements (x = input, F = sublayer, N = norm, D = dropout):")
    width = max(len(name) for name in PLACEMENTS)
    for name, placement in PLACEMENTS.items():
        typer.echo(f"  {name:<{width}}  {placement.formula}")
        typer.echo(f"  {'':<{width}}  {placement.citation}")
    typer.echo("")
    typer.echo("Norms (over the last dimension):")
    width = max(len(name) for name in NORMS)
    for name, cls in NORMS.items():
        doc = (cls.__doc__ or "").strip().splitlines()
        typer.echo(f"  {name:<{width}}  {doc[0] if doc else cls.__name__}")


# --- explain ----------------------------------------------------------------------------------------
@app.command()
@handle_errors
def explain(
    x: str = typer.Option("1,2,3", "--x", help="The sublayer input x, comma-separated."),
    fx: str = typer.Option("0.5,-1,1.5", "--fx", help="The sublayer output F(x), comma-separated."),
    eps: float = typer.Option(1e-5, "--eps", help="LayerNorm's epsilon."),
) -> None:
    """Work through one Post-LN Add & Norm, y = LayerNorm(x + F(x)), step by step."""
    from .explain import explain_add_norm

    xs, fxs = _floats(x, "--x"), _floats(fx, "--fx")
    if len(xs) != len(fxs):
        raise ValueError(f"--x and --fx must have the same length, got {len(xs)} and {len(fxs)} numbers")
    s = explain_add_norm(xs, fxs, eps=eps)
    d = len(xs)
    y_mean = float(s.normalised.mean())
    y_var = float(((s.normalised - y_mean) ** 2).mean())
    lines = [
        f"Add & Norm (post): y = LayerNorm(x + F(x)), d = {d}, gamma = 1, beta = 0, eps = {eps:g}",
        f"   x                                   = {_fmt(s.x)}",
        f"   F(x)                                = {_fmt(s.fx)}",
        f"1. add:       z = x + F(x)             = {_fmt(s.z)}",
        f"2. mean:      mu = sum(z) / {d:<12} = {float(s.mean):.4f}",
        f"3. variance:  var = sum((z - mu)^2) / {d} = {float(s.var):.4f}",
        f"4. std:       sigma = sqrt(var + eps)  = {float(s.std):.4f}",
        f"5. normalise: y = (z - mu) / sigma     = {_fmt(s.normalised)}",
        f"check: mean(y) = {y_mean:.4f}, var(y) = {y_var:.4f} (var(y) = var / (var + eps))",
    ]
    typer.echo("\n".join(lines))


# --- inspect ----------------------------------------------------------------------------------------
_CORPUS_BYTES = 1 << 20


def _batch(corpus: bytes, batch: int, seq: int, seed: int):
    """A (batch, seq + 1) LongTensor of byte windows at random offsets: inputs [:, :-1], targets [:, 1:]."""
    import torch

    data = torch.frombuffer(bytearray(corpus), dtype=torch.uint8)
    if data.numel() < seq + 1:
        raise ValueError(f"--seq: the corpus has {data.numel()} bytes, fewer than seq + 1 = {seq + 1}")
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq, (batch,), generator=gen)
    return torch.stack([data[s : s + seq + 1] for s in starts.tolist()]).long()


def ffn_grad_norms_at_init(
    placement: str,
    *,
    n_layers: int = 12,
    d_model: int = 128,
    n_heads: int = 4,
    d_ff: int | None = None,
    seq: int = 64,
    batch: int = 8,
    seed: int = 0,
    repeats: int = 3,
    norm: str = "layernorm",
    init: str = "xavier",
    corpus: bytes | None = None,
) -> dict[str, list[float]]:
    """Per-layer FFN weight-gradient norms of a byte-level LanguageModel after one backward at init.

    Next-byte cross-entropy on windows of ``corpus`` (default: :func:`stdlib_corpus`); dropout 0;
    averaged over ``repeats`` seeds (fresh model and batch each). Returns ``{"w1", "w2", "ff"}`` lists
    (``ff`` = sqrt(||dW1||^2 + ||dW2||^2)), one value per layer.
    """
    import torch
    import torch.nn.functional as fn

    from .model import LanguageModel, TransformerConfig
    from .probe import Probe

    for name, value in (("layers", n_layers), ("seq", seq), ("batch", batch), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name}: expected a positive int, got {value!r}")
    corpus = stdlib_corpus(_CORPUS_BYTES) if corpus is None else corpus
    cfg = TransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_ff=4 * d_model if d_ff is None else d_ff,
        n_layers=n_layers,
        dropout=0.0,
        placement=placement,
        norm=norm,
        init=init,
        max_len=max(seq, 1),
    )
    totals = {"w1": [0.0] * n_layers, "w2": [0.0] * n_layers, "ff": [0.0] * n_layers}
    vocab = 256
    for r in range(repeats):
        torch.manual_seed(seed + r)
        model = LanguageModel(cfg, vocab)
        tokens = _batch(corpus, batch, seq, seed + r)
        with Probe(model) as probe:
            logits = model(tokens[:, :-1])
            fn.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
        for key, values in (
            ("w1", probe.weight_grad_norms("ff", "w1")),
            ("w2", probe.weight_grad_norms("ff", "w2")),
            ("ff", probe.weight_grad_norms("ff")),
        ):
            totals[key] = [t + v / repeats for t, v in zip(totals[key], values, strict=True)]
    return totals


GROWTH = 1.2  # a last/first ratio beyond this (or below 1/GROWTH) counts as a trend, not flat


def verdict(ratio: float) -> str:
    """Words for a last-layer / first-layer gradient-norm ratio."""
    if not math.isfinite(ratio):
        return "undefined (no gradient)"
    if ratio > GROWTH:
        return "grows toward the top layers"
    if ratio < 1 / GROWTH:
        return "shrinks toward the top layers"
    return "nearly flat across depth"


def _plot(results: dict[str, dict[str, list[float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FormatStrFormatter, MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, norms in results.items():
        layers = range(1, len(norms["ff"]) + 1)
        ax.plot(layers, norms["ff"], marker="o", label=name)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))
    ax.yaxis.set_minor_formatter(FormatStrFormatter("%.3g"))
    ax.set_xlabel("layer (1 = nearest the input)")
    ax.set_ylabel("FFN weight-gradient norm (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@app.command()
@handle_errors
def inspect(
    placements: str = typer.Option("post,pre,sandwich", help="Comma-separated placement names."),
    layers: int = typer.Option(12, help="Number of layers."),
    d_model: int = typer.Option(128, "--d-model", help="Model width."),
    heads: int = typer.Option(4, help="Attention heads."),
    d_ff: int | None = typer.Option(None, "--d-ff", help="FFN width (default 4 * d_model)."),
    seq: int = typer.Option(64, help="Sequence length (bytes)."),
    batch: int = typer.Option(8, help="Batch size."),
    seed: int = typer.Option(0, help="First seed; repeats use seed, seed + 1, ..."),
    repeats: int = typer.Option(3, help="Models/batches averaged per placement."),
    norm: str = typer.Option("layernorm", help="Norm name (see `addnorm list`)."),
    init: str = typer.Option("xavier", help="Initialisation: xavier, torch or gpt2."),
    corpus: Path | None = typer.Option(None, help="A text file to read as bytes (default: Python stdlib)."),
    out: Path = typer.Option(Path("addnorm-out"), help="Directory for inspect.png and inspect.json."),
    hf: str | None = typer.Option(
        None,
        "--hf",
        help="A Hugging Face model type (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt2, bert): "
        "a tiny random-weight model of it, untouched and re-placed with each placement (addnorm[hf]).",
    ),
) -> None:
    """FFN weight-gradient norm per layer at initialisation, per placement (Xiong et al. 2020)."""
    from .placements import PLACEMENTS

    names = [PLACEMENTS.resolve(p) for p in placements.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--placements: expected at least one placement name, got {placements!r}")
    names = list(dict.fromkeys(names))
    text = None
    if corpus is not None:
        try:
            text = corpus.read_bytes()
        except OSError as err:
            raise ValueError(f"--corpus: cannot read {str(corpus)!r}: {err.strerror}") from None
    if hf is not None:
        sizes = {"layers": layers, "hidden": d_model, "heads": heads, "intermediate": d_ff or 4 * d_model}
        corpus_text = stdlib_corpus(_CORPUS_BYTES) if text is None else text
        batches = [_batch(corpus_text, batch, seq, seed + r) for r in range(repeats)]
        try:
            _inspect_hf(hf, names, batches, sizes, seed, out)
        except ImportError as err:
            raise fail(err) from None
        return
    kwargs = dict(n_layers=layers, d_model=d_model, n_heads=heads, d_ff=d_ff, seq=seq, batch=batch)
    kwargs.update(seed=seed, repeats=repeats, norm=norm, init=init, corpus=text)
    results = {name: ffn_grad_norms_at_init(name, **kwargs) for name in names}
    ratios = {name: r["ff"][-1] / r["ff"][0] for name, r in results.items()}

    source = str(corpus) if corpus is not None else "Python stdlib sources"
    header = (
        f"FFN weight-gradient norm sqrt(|dW1|^2 + |dW2|^2) per layer at initialisation\n"
        f"byte-level LM on {source}: {layers} layers, d_model={d_model}, heads={heads}, "
        f"batch={batch}x{seq}, norm={norm}, init={init}, mean of {repeats} seed(s) from {seed}"
    )
    typer.echo(header)
    col = max(10, *(len(n) + 2 for n in names))
    typer.echo("layer" + "".join(f"{n:>{col}}" for n in names))
    for i in range(layers):
        typer.echo(f"{i + 1:>5}" + "".join(f"{results[n]['ff'][i]:>{col}.4g}" for n in names))
    typer.echo("")
    width = max(len(n) for n in names)
    for name in names:
        typer.echo(f"{name:<{width}}  last/first = {ratios[name]:6.2f}  -> {verdict(ratios[name])}")
    if "post" in ratios and "pre" in ratios:
        post, pre = ratios["post"], ratios["pre"]
        seen = "seen" if post > pre * GROWTH and post > 1.0 else "NOT seen"
        typer.echo(
            f"Xiong et al. 2020 (Post-LN's gradients grow toward the output, Pre-LN's do not): {seen} here "
            f"(post {post:.2f} vs pre {pre:.2f}; top-layer norm post/pre = "
            f"{results['post']['ff'][-1] / results['pre']['ff'][-1]:.2f})"
        )

    out.mkdir(parents=True, exist_ok=True)
    png, js = out / "inspect.png", out / "inspect.json"
    title = (
        f"FFN weight-gradient norm at initialisation, {layers} layers, d_model={d_model}\n"
        f"byte-level LM, norm={norm}, init={init}, mean of {repeats} seed(s)"
    )
    _plot(results, title, png)
    meta = {"layers": layers, "d_model": d_model, "heads": heads, "seq": seq, "batch": batch}
    meta.update(seed=seed, repeats=repeats, norm=norm, init=init, corpus=source)
    payload = {"config": meta, "placements": results, "last_over_first": ratios}
    js.write_text(json.dumps(payload, indent=2) + "\n")
    typer.echo(f"plot: {png}")
    typer.echo(f"data: {js}")


def _inspect_hf(model_type: str, names: list[str], batches: list, sizes: dict, seed: int, out: Path) -> None:
    """``inspect --hf``: the per-layer table and plot of :mod:`addnorm.hf.inspect`."""
    from .hf import inspect as hf_inspect
    from .hf.architectures import ARCHITECTURES

    model_type = ARCHITECTURES.resolve(model_type)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name}: expected a positive int, got {value!r}")
    placements = [hf_inspect.MODEL, *names]
    results = hf_inspect.layer_statistics(model_type, placements, batches, seed=seed, **sizes)
    shape = f"{len(batches)} x batch {batches[0].shape[0]}x{batches[0].shape[1] - 1}"
    what = f"{model_type}, {sizes['layers']} layers, hidden {sizes['hidden']}, random weights, {shape} bytes"
    typer.echo(f"Per-layer statistics at initialisation: {what}; '{hf_inspect.MODEL}' is its own Add & Norm")
    typer.echo(hf_inspect.table(results))
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / f"inspect-hf-{model_type}.png", out / f"inspect-hf-{model_type}.json"
    hf_inspect.plot(results, f"{what}: per-layer statistics at initialisation", png)
    hf_inspect.write_json(results, {"model_type": model_type, **sizes, "seed": seed}, js)
    typer.echo(f"plot: {png}")
    typer.echo(f"data: {js}")


# --- entry point ------------------------------------------------------------------------------------
def main() -> None:
    """Console-script entry: library errors from any command become one ``error:`` line, exit 2."""
    try:
        app()
    except LIBRARY_ERRORS as err:
        fail(err)
        sys.exit(2)


# --- studies: ``study``, ``report``, ``export`` -------------------------------------------------------
register_study_commands(app)


if __name__ == "__main__":
    main()
