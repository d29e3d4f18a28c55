"""``with_placement(model, placement)``: a Hugging Face model whose Add & Norm is any addnorm placement
around its own attention and MLP modules.

Each residual connection becomes an :class:`~addnorm.AddNorm` of the placement that owns its norms
(registered on the layer as ``<sublayer>_block``); the model's own norms leave the layers, and their
weights carry over to the new norm in the same slot where there is one of the same kind (so ``"pre"`` on
a Llama-family model keeps its function). The placement's rules come with it: its initialisation
(DeepNet's alpha and beta-scaled Xavier on values, outputs and FFN), its gates (ReZero at 0, LayerScale
by depth) and its final norm (kept, added, or replaced by the identity when the last layer's output is
already normalised). The layers run as :mod:`addnorm.hf.rewired` describes, fused by default.

The placement and its options are recorded in ``model.config.addnorm``, so ``save_pretrained`` writes
them to ``config.json`` and :func:`addnorm.hf.from_pretrained` rebuilds the same model.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..addnorm import AddNorm, check_bool, layerscale_init
from ..model.init import Depth, deepnorm_constants
from ..norms import NORMS, build_norm
from ..placements import PLACEMENTS, Placement, get_placement
from .architectures import Architecture, Sublayer, Weight, architecture_of, norm_eps, norm_options
from .fuse import unfuse
from .rewired import Rewiring, install, rewiring_of

__all__ = ["CONFIG_KEY", "supported_placements", "with_placement"]

CONFIG_KEY = "addnorm"


def _unsupported(p: Placement) -> str | None:
    """Why ``p`` cannot go around a model's own sublayers, or None."""
    if p.sublayer_norm:
        return "puts a norm inside the sublayers"
    if p.attention_norm or p.attention_connection:
        return "normalises queries/keys inside attention"
    if p.stream not in ("standard", "b2t"):
        return f"changes the residual stream across layers ({p.stream})"
    if p.norm is not None:
        return f"needs its own norm ({p.norm})"
    if p.layers is not None:
        return next((r for r in map(_unsupported, map(get_placement, p.layers[:2])) if r), None)
    return None


def supported_placements() -> list[str]:
    """The addnorm placements that :func:`with_placement` can put around a model's sublayers."""
    return [name for name, p in PLACEMENTS.items() if _unsupported(p) is None]


def _per_layer(p: Placement, n_layers: int, mix_fraction: float | None) -> list[Placement]:
    """One placement per layer: Mix-LN's ``bottom`` for the first ceil(f * L) layers, ``top`` above."""
    if p.layers is None:
        return [p] * n_layers
    bottom, top, fraction = p.layers
    fraction = fraction if mix_fraction is None else mix_fraction
    n_bottom = min(n_layers, math.ceil(fraction * n_layers - 1e-9))
    return [get_placement(bottom)] * n_bottom + [get_placement(top)] * (n_layers - n_bottom)


def _copy_norm(ours: nn.Module, theirs: nn.Module) -> None:
    with torch.no_grad():
        for name in ("weight", "bias"):
            mine, source = getattr(ours, name, None), getattr(theirs, name, None)
            if mine is not None and source is not None:
                mine.copy_(source)


def _remove(root: nn.Module, path: str, replacement: nn.Module | None = None) -> nn.Module:
    """Take the submodule at ``path`` out of ``root`` (or put ``replacement`` in its place); returns it."""
    parent_path, _, name = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    old = getattr(parent, name)
    delattr(parent, name)
    if replacement is not None:
        parent.add_module(name, replacement)
    return old


def _block(weight: torch.Tensor, spec: Weight) -> torch.Tensor:
    return weight if spec.block is None else weight.chunk(spec.count, spec.dim)[spec.block]


@torch.no_grad()
def deepnet_init(layer: nn.Module, sublayers: tuple[Sublayer, ...], beta: float) -> None:
    """DeepNet's initialisation (Wang et al. 2022) of a layer's sublayers: Xavier-normal with gain beta
    on values, attention outputs and FFN matrices, gain 1 on queries and keys."""
    for sublayer in sublayers:
        for specs, gain in ((sublayer.init_unit, 1.0), (sublayer.init_scaled, beta)):
            for spec in specs:
                nn.init.xavier_normal_(_block(layer.get_parameter(spec.path), spec), gain=gain)


def _depth(arch: Architecture, n_layers: int) -> Depth:
    return Depth("encoder", n_layers, 0) if arch.stack == "encoder" else Depth("decoder", 0, n_layers)


def with_placement(
    model: nn.Module,
    placement: str | Placement,
    *,
    norm: str | None = None,
    eps: float | None = None,
    dropout: float | None = None,
    mix_fraction: float | None = None,
    fused: bool = True,
    init: bool = True,
) -> nn.Module:
    """Re-place ``model``'s Add & Norm in place with ``placement`` (see the module docstring); returns it.

    Args:
        placement: a name from :func:`supported_placements` (post, pre, sandwich, mix, deepnorm,
            layerscale, rezero, ...) or a :class:`~addnorm.Placement`.
        norm: the norm kind (default: the model's, Gemma's with gain 1 + w); ``eps`` its epsilon
            (default: the model's).
        dropout: residual dropout on each branch (default: the model's, 0 for the Llama family).
        mix_fraction: for ``"mix"``, the fraction of layers from the bottom that use Post-LN.
        fused: let each add run in the fused op with the norm that reads it (``False``: unfused modules).
        init: apply the placement's initialisation (DeepNet); ``False`` keeps the weights as they are.

    A fused model (:func:`addnorm.hf.fuse`) is unfused first; a model already re-placed is refused.
    Admin's omegas start at 1: run ``addnorm.admin_init(model, input_ids)`` for its profiling pass.
    """
    arch = architecture_of(model)
    p = get_placement(placement)
    why = _unsupported(p)
    if why is not None:
        raise ValueError(
            f"placement: {p.name!r} {why}, which with_placement cannot do around a model's own modules; "
            f"supported: {', '.join(supported_placements())}"
        )
    fused, init = check_bool("fused", fused), check_bool("init", init)
    if mix_fraction is not None and not 0.0 <= float(mix_fraction) <= 1.0:
        raise ValueError(f"mix_fraction: expected a fraction in [0, 1], got {mix_fraction!r}")
    if dropout is not None and not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
    rewiring = rewiring_of(model)
    if rewiring is not None and rewiring.kind != "fused":
        raise ValueError(
            f"model: {type(model).__name__} is already re-placed ({model.config.addnorm['placement']!r}); "
            "re-place the original model"
        )
    if rewiring is not None:
        unfuse(model)
    base, config = model.base_model, model.config
    layers = arch.layers_of(model)
    norm_name = NORMS.resolve(norm) if norm is not None else arch.norm
    options = norm_options(arch) if norm_name == arch.norm else {}
    first_norm = layers[0].get_submodule(next(iter(arch.sublayers[0].norm_paths().values())))
    eps = norm_eps(first_norm) if eps is None else float(eps)
    dropout = arch.residual_dropout(config) if dropout is None else float(dropout)
    placements = _per_layer(p, len(layers), mix_fraction)
    depth = _depth(arch, len(layers))
    alpha, beta = deepnorm_constants(depth)
    weight = next(layers[0].parameters())
    kw = {"device": weight.device, "dtype": weight.dtype}
    d = config.hidden_size

    connections = []
    for layer, layer_placement in zip(layers, placements, strict=True):
        blocks = []
        for sublayer in arch.sublayers:
            conn = AddNorm(
                d,
                layer_placement,
                norm_name,
                dropout,
                eps=eps,
                alpha=alpha if layer_placement.init == "deepnorm" else None,
                gate_init=layerscale_init(len(layers)) if layer_placement.gate == "layerscale" else None,
                norm_options=options,
                fused=fused,
                **kw,
            )
            for slot, path in sublayer.norm_paths().items():
                theirs = _remove(layer, path)
                if getattr(conn, slot) is not None and norm_name == arch.norm:
                    _copy_norm(getattr(conn, slot), theirs)
            conn.train(layer.training)
            layer.add_module(sublayer.block, conn)
            blocks.append(conn)
        connections.append(blocks)
        if init and layer_placement.init == "deepnorm":
            deepnet_init(layer, arch.sublayers, beta)

    final_module = applied = None
    if placements[-1].final_norm:
        final = build_norm(norm_name, d, eps=eps, **options, **kw)
        if arch.final_norm:
            theirs = _remove(base, arch.final_norm, final)
            if norm_name == arch.norm:
                _copy_norm(final, theirs)
            final_module = final
        else:
            base.get_submodule(arch.final_norm_home).add_module("norm", final)
            applied = final
    elif arch.final_norm:
        _remove(base, arch.final_norm, nn.Identity())

    record = {"placement": p.name, "norm": norm_name, "eps": eps, "dropout": dropout, "fused": fused}
    if p.layers is not None:
        record["mix_fraction"] = mix_fraction
    setattr(config, CONFIG_KEY, record)
    install(
        model,
        Rewiring("placement", arch, layers, connections, final_module=final_module),
        final_norm=final_module,
        applied_final_norm=applied,
        b2t=p.stream == "b2t",
    )
    return model
