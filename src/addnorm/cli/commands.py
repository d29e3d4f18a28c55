"""The ``addnorm`` command line: list placements and norms, explain Add & Norm, inspect gradients by depth.

``addnorm inspect`` reproduces the observation of Xiong et al. 2020 ("On Layer Normalization in the
Transformer Architecture"): at initialisation, Post-LN's FFN weight gradients grow toward the top layers
while Pre-LN's do not.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import typer

from .. import __version__
from .errors import LIBRARY_ERRORS, fail, handle_errors
from .lazy import LazyGroup

# Nothing above imports torch: `addnorm --help`, `--version` and `study --list/--show/--keys` answer
# without it (see cli/lazy.py); each command imports what it uses.

app = typer.Typer(
    name="addnorm",
    cls=LazyGroup,
    help="The transformer Add & Norm pattern: placements, norms, and how gradients flow through depth.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"addnorm {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """The transformer Add & Norm pattern: placements, norms, and how gradients flow through depth."""


def _floats(text: str, option: str) -> list[float]:
    try:
        values = [float(v) for v in text.replace(" ", "").split(",") if v != ""]
    except ValueError:
        raise ValueError(f"{option}: expected comma-separated numbers such as 1,2,3, got {text!r}") from None
    if not values:
        raise ValueError(f"{option}: expected at least one number, got {text!r}")
    return values


def _num(value: float, spec: str = ".4g") -> str:
    """``value`` formatted, with rounding noise and negative zero shown as 0 (never ``-0.0000``)."""
    value = float(value)
    text = format(value, spec)
    if float(text) == 0.0:  # -1e-17 rounds to "-0.0000" under .4f, and -0.0 prints "-0"
        text = format(0.0, spec)
    return text


def _fmt(values) -> str:
    scale = max((abs(float(v)) for v in values), default=0.0)
    snapped = [0.0 if abs(float(v)) <= 1e-12 * max(scale, 1.0) else float(v) for v in values]
    return "[" + ", ".join(_num(v) for v in snapped) + "]"


# --- list -------------------------------------------------------------------------------------------
_ABBREVIATIONS = ("al", "e.g", "i.e", "etc", "cf", "vs", "eq", "fig")


def first_sentence(doc: str | None) -> str:
    """The first sentence of a docstring, whatever its line breaks: up to the first period that ends a
    sentence (followed by whitespace or the end, outside parentheses, not after "et al." or "e.g."),
    or the first paragraph if no period ends one. RST literals (``x``) are shown as x."""
    paragraph = re.split(r"\n\s*\n", (doc or "").strip(), maxsplit=1)[0]
    text = " ".join(paragraph.split()).replace("``", "")
    depth = 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch != "." or depth > 0 or (i + 1 < len(text) and not text[i + 1].isspace()):
            continue
        word = re.search(r"([\w.]+)$", text[:i])
        if word and word.group(1).lower() in _ABBREVIATIONS:
            continue
        return text[: i + 1]
    return text


@app.command("list")
@handle_errors
def list_command() -> None:
    """Print every placement and norm with its formula and citation."""
    from ..norms import NORMS
    from ..placements import PLACEMENTS

    typer.echo("Placements (x = input, F = sublayer, N = norm, D = dropout):")
    width = max(len(name) for name in PLACEMENTS)
    for name, placement in PLACEMENTS.items():
        typer.echo(f"  {name:<{width}}  {placement.formula}")
        typer.echo(f"  {'':<{width}}  {placement.citation}")
    typer.echo("")
    typer.echo("Norms (over the last dimension):")
    width = max(len(name) for name in NORMS)
    for name, cls in NORMS.items():
        typer.echo(f"  {name:<{width}}  {first_sentence(cls.__doc__) or cls.__name__}")


# --- explain ----------------------------------------------------------------------------------------
@app.command()
@handle_errors
def explain(
    x: str = typer.Option("1,2,3", "--x", help="The sublayer input x, comma-separated."),
    fx: str = typer.Option("0.5,-1,1.5", "--fx", help="The sublayer output F(x), comma-separated."),
    eps: float = typer.Option(1e-5, "--eps", help="LayerNorm's epsilon."),
) -> None:
    """Work through one Post-LN Add & Norm, y = LayerNorm(x + F(x)), step by step."""
    from ..explain import explain_add_norm

    xs, fxs = _floats(x, "--x"), _floats(fx, "--fx")
    if len(xs) != len(fxs):
        raise ValueError(f"--x and --fx must have the same length, got {len(xs)} and {len(fxs)} numbers")
    s = explain_add_norm(xs, fxs, eps=eps)
    d = len(xs)
    y_mean = float(s.normalised.mean())
    y_var = float(((s.normalised - y_mean) ** 2).mean())
    steps = [
        ("", "x", _fmt(s.x)),
        ("", "F(x)", _fmt(s.fx)),
        ("1. add:", "z = x + F(x)", _fmt(s.z)),
        ("2. mean:", f"mu = sum(z) / {d}", _num(s.mean, ".4f")),
        ("3. variance:", f"var = sum((z - mu)^2) / {d}", _num(s.var, ".4f")),
        ("4. std:", "sigma = sqrt(var + eps)", _num(s.std, ".4f")),
        ("5. normalise:", "y = (z - mu) / sigma", _fmt(s.normalised)),
    ]
    w1 = max(len(a) for a, _, _ in steps)
    w2 = max(len(b) for _, b, _ in steps)
    lines = [f"Add & Norm (post): y = LayerNorm(x + F(x)), d = {d}, gamma = 1, beta = 0, eps = {eps:g}"]
    lines += [f"{a:<{w1}} {b:<{w2}} = {c}" for a, b, c in steps]
    lines.append(
        f"check: mean(y) = {_num(y_mean, '.4f')}, var(y) = {_num(y_var, '.4f')} (var(y) = var / (var + eps))"
    )
    typer.echo("\n".join(lines))


# --- inspect ----------------------------------------------------------------------------------------
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
    corpus: str | None = None,
) -> dict[str, list[float]]:
    """Per-layer FFN weight-gradient norms of a byte-level LanguageModel after one backward at init.

    The study's ``lm`` task builds the model and draws the batch (training split of ``corpus``, default
    the Python standard library) and computes the loss; dropout 0; averaged over ``repeats`` seeds
    (fresh model and batch each). Returns ``{"w1", "w2", "ff"}`` lists, one value per layer, ``ff`` =
    sqrt(||dW1||^2 + ||dW2||^2) as the study's findings compute it.
    """
    import torch

    from ..model import TransformerConfig
    from ..probe import Probe
    from ..study.findings import ffn_grad_profile
    from ..tasks import build_task

    for name, value in (("layers", n_layers), ("seq", seq), ("batch", batch), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name}: expected a positive int, got {value!r}")
    task = build_task("lm", corpus=corpus)
    cfg = TransformerConfig(
        d_model=d_model,
        n_heads=n_heads,
        d_ff=4 * d_model if d_ff is None else d_ff,
        n_layers=n_layers,
        dropout=0.0,
        placement=placement,
        norm=norm,
        init=init,
        max_len=seq,
    )
    totals = {"w1": [0.0] * n_layers, "w2": [0.0] * n_layers, "ff": [0.0] * n_layers}
    for r in range(repeats):
        torch.manual_seed(seed + r)
        model = task.build_model(cfg)
        tokens = task.batch("train", batch, seq, torch.Generator().manual_seed(seed + r))
        with Probe(model) as probe:
            loss, _ = task.loss(model, tokens)
            loss.backward()
        for key, values in (
            ("w1", probe.weight_grad_norms("ff", "w1")),
            ("w2", probe.weight_grad_norms("ff", "w2")),
            ("ff", ffn_grad_profile(probe.snapshot(0))),
        ):
            totals[key] = [t + v / repeats for t, v in zip(totals[key], values, strict=True)]
    return totals


def verdict(ratio: float) -> str:
    """Words for a last-layer / first-layer gradient-norm ratio (the study's :func:`trend`)."""
    from ..study.findings import TREND_WORDS, trend

    return TREND_WORDS[trend(ratio)]


def _plot(results: dict[str, dict[str, list[float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # headless: figures only go to files
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
    norm: str | None = typer.Option(
        None, help="Norm name (see `addnorm list`; default layernorm, with --hf the model's own)."
    ),
    init: str | None = typer.Option(
        None, help="Initialisation: xavier (default), torch or gpt2 (not with --hf: the model keeps its own)."
    ),
    corpus: Path | None = typer.Option(None, help="A text file to read as bytes (default: Python stdlib)."),
    out: Path = typer.Option(Path("addnorm-out"), help="Directory for inspect.png and inspect.json."),
    hf: str | None = typer.Option(
        None,
        "--hf",
        help="A Hugging Face model type (llama, mistral, qwen2, qwen3, gemma2, gemma3_text, gpt2, bert, "
        "olmo2, phi3, mixtral, qwen2_moe): a tiny random-weight model of it, untouched and re-placed with "
        "each placement, --norm the re-placed models' norm (addnorm[hf]).",
    ),
) -> None:
    """FFN weight-gradient norm per layer at initialisation, per placement (Xiong et al. 2020)."""
    import torch

    from ..placements import PLACEMENTS
    from ..study.findings import GROWTH
    from ..tasks import build_task

    names = [PLACEMENTS.resolve(p) for p in placements.split(",") if p.strip()]
    if not names:
        raise ValueError(f"--placements: expected at least one placement name, got {placements!r}")
    names = list(dict.fromkeys(names))
    if corpus is not None and not corpus.exists():
        raise ValueError(f"--corpus: no such file or folder {str(corpus)!r}")
    if hf is not None:
        if init is not None:
            raise ValueError(
                f"--init: {init!r} initialises addnorm's own models; with --hf the model keeps its own "
                "weights and each placement applies its own initialisation"
            )
        sizes = {"layers": layers, "hidden": d_model, "heads": heads, "intermediate": d_ff or 4 * d_model}
        task = build_task("lm", corpus=None if corpus is None else str(corpus))
        batches = []
        for r in range(repeats):  # (batch, seq + 1) byte windows, as the study's lm task draws them
            b = task.batch("train", batch, seq, torch.Generator().manual_seed(seed + r))
            batches.append(torch.cat([b.inputs, b.targets[:, -1:]], dim=1))
        try:
            _inspect_hf(hf, names, batches, sizes, seed, out, norm)
        except ImportError as err:
            raise fail(err) from None
        return
    norm, init = norm or "layernorm", init or "xavier"
    kwargs = dict(n_layers=layers, d_model=d_model, n_heads=heads, d_ff=d_ff, seq=seq, batch=batch)
    kwargs.update(
        seed=seed, repeats=repeats, norm=norm, init=init, corpus=None if corpus is None else str(corpus)
    )
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


def _inspect_hf(
    model_type: str, names: list[str], batches: list, sizes: dict, seed: int, out: Path, norm: str | None
) -> None:
    """``inspect --hf``: the per-layer table and plot of :mod:`addnorm.hf.inspect` (``norm``: the norm of
    the re-placed models; None: the model's own)."""
    from ..hf import inspect as hf_inspect
    from ..hf.architectures import ARCHITECTURES
    from ..norms import NORMS

    model_type = ARCHITECTURES.resolve(model_type)
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"--{name}: expected a positive int, got {value!r}")
    placements = [hf_inspect.MODEL, *names]
    norm = None if norm is None else NORMS.resolve(norm)
    results = hf_inspect.layer_statistics(model_type, placements, batches, seed=seed, norm=norm, **sizes)
    shape = f"{len(batches)} x batch {batches[0].shape[0]}x{batches[0].shape[1] - 1}"
    what = f"{model_type}, {sizes['layers']} layers, hidden {sizes['hidden']}, random weights, {shape} bytes"
    if norm is not None:
        what += f", re-placed with {norm}"
    typer.echo(f"Per-layer statistics at initialisation: {what}; '{hf_inspect.MODEL}' is its own Add & Norm")
    typer.echo(hf_inspect.table(results))
    out.mkdir(parents=True, exist_ok=True)
    png, js = out / f"inspect-hf-{model_type}.png", out / f"inspect-hf-{model_type}.json"
    hf_inspect.plot(results, f"{what}: per-layer statistics at initialisation", png)
    hf_inspect.write_json(results, {"model_type": model_type, **sizes, "seed": seed, "norm": norm}, js)
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


# The study commands (``study``, ``report``, ``export``, ``compare``, in addnorm.cli.study) are added by
# LazyGroup when one of them runs.

if __name__ == "__main__":
    main()
