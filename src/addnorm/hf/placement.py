"""``with_placement(model, placement)``: a Hugging Face model whose Add & Norm is any addnorm placement
around its own attention and MLP modules.

Each residual connection becomes an :class:`~addnorm.AddNorm` of the placement that owns its norms
(registered on the layer as ``<sublayer>_block``); the model's own norms leave the layers, and their
weights carry over to the new norm in the same slot where there is one of the same kind (so ``"pre"`` on
a Llama-family model keeps its function). The placement's rules come with it: its initialisation
(DeepNet's alpha and beta-scaled Xavier on values, outputs and FFN), its gates (ReZero at 0, LayerScale
by depth) and its final norm (kept, added, or replaced by the identity when the last layer's output is
already normalised). The layers run as :mod:`addnorm.hf.rewired` describes, fused by default.

The per-layer placements, DeepNorm's alpha, the gates' starting values and how each weight role is
initialised come from :mod:`addnorm.placement_spec`, the same spec addnorm's own layers read.

The placement and its options are recorded in ``model.config.addnorm``, so ``save_pretrained`` writes
them to ``config.json`` and :func:`addnorm.hf.from_pretrained` rebuilds the same model. The saved
``config.json`` names the model type ``"addnorm:<type> (load with addnorm.hf.from_pretrained)"``, so
that plain ``transformers`` (``AutoModelForCausalLM.from_pretrained``) refuses it, naming addnorm and
how to load it, instead of loading the original architecture with re-initialised norms.
"""

from __future__ import annotations

import json
import numbers
from pathlib import Path

import torch
from torch import nn

from ..connection import AddNorm, check_bool
from ..norms import NORMS, build_norm
from ..placement_spec import Depth, apply_weight_init, layer_placements, layer_spec, why_not_around_sublayers
from ..placements import PLACEMENTS, Placement, get_placement
from .architectures import Architecture, architecture_of, norm_options
from .fuse import unfuse
from .rewired import Rewiring, attach, install, rewiring_of

__all__ = [
    "CONFIG_KEY",
    "ORIGINAL_TYPE",
    "SAVED_MODEL_TYPE",
    "saved_model_type",
    "supported_placements",
    "with_placement",
]

CONFIG_KEY = "addnorm"
SECOND_NORM = "second_norm"  # a parallel block's second input norm, registered on its connection
SAVED_MODEL_TYPE = "addnorm:{} (load with addnorm.hf.from_pretrained)"
# not "model_type": transformers' config loading takes a nested dict holding one for the config
ORIGINAL_TYPE = "original_model_type"


def saved_model_type(model_type: str) -> str:
    """The ``model_type`` a re-placed model's saved ``config.json`` carries (unknown to transformers)."""
    return SAVED_MODEL_TYPE.format(model_type)


def _unsupported_by(arch: Architecture, p: Placement) -> str | None:
    """Why ``p`` cannot go around the layers of ``arch``, or None."""
    if arch.parallel and any(q.stream == "b2t" for q in (p, *p.layer_kinds())):
        return "needs two connections per layer (a parallel block has one)"
    return None


def supported_placements() -> list[str]:
    """The addnorm placements that :func:`with_placement` can put around a model's sublayers."""
    return [name for name, p in PLACEMENTS.items() if why_not_around_sublayers(p) is None]


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
        model: a ``transformers`` model of a supported type (:data:`addnorm.hf.ARCHITECTURES`).
        placement: a name from :func:`supported_placements` (post, pre, sandwich, mix, deepnorm,
            layerscale, rezero, ...) or a :class:`~addnorm.Placement`.
        norm: the norm kind (default: the model's, Gemma's with gain 1 + w).
        eps: the norm's epsilon (default: the model's).
        dropout: residual dropout on each branch (default: the model's, 0 for the Llama family).
        mix_fraction: for ``"mix"``, the fraction of layers from the bottom that use Post-LN.
        fused: let each add run in the fused op with the norm that reads it (``False``: unfused modules).
        init: apply the placement's initialisation (DeepNet); ``False`` keeps the weights as they are.

    Returns:
        ``model`` itself, re-placed.

    Raises:
        ValueError: a placement the model's modules cannot take (the message lists the supported
            ones), an option out of range, or a model already re-placed.
        TypeError: a ``norm`` that is not a name.

    A fused model (:func:`addnorm.hf.fuse`) is unfused first; a model already re-placed is refused.
    Admin's omegas start at 1: run ``addnorm.admin_init(model, input_ids)`` for its profiling pass.
    """
    arch = architecture_of(model)
    p = get_placement(placement)
    why = why_not_around_sublayers(p) or _unsupported_by(arch, p)
    if why is not None:
        raise ValueError(
            f"placement: {p.name!r} {why}, which with_placement cannot do around a model's own modules; "
            f"supported: {', '.join(supported_placements())}"
        )
    fused, init = check_bool("fused", fused), check_bool("init", init)
    dropout = _number("dropout", dropout, "a probability in [0, 1)", lambda v: 0.0 <= v < 1.0)
    eps = _number("eps", eps, "a positive number", lambda v: v > 0.0)
    mix_fraction = _number("mix_fraction", mix_fraction, "a fraction in [0, 1]", lambda v: 0.0 <= v <= 1.0)
    if mix_fraction is not None and not (p.layers is not None and isinstance(p.layers[2], float)):
        raise ValueError(
            f"mix_fraction: placement {p.name!r} does not use it (only a placement whose layers split by "
            "a fraction does, such as 'mix')"
        )
    if norm is not None and not isinstance(norm, str):
        raise TypeError(f"norm: expected a norm name ({', '.join(NORMS)}), got {norm!r}")
    for option, value in (("norm", norm), ("eps", eps)):
        if value is not None and not _has_norms(p):
            raise ValueError(f"{option}: placement {p.name!r} has no norm for it to set")
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
    eps = arch.eps_of(first_norm) if eps is None else eps
    n_conns = len(arch.connections())
    dropouts = [arch.residual_dropout(config, i) if dropout is None else dropout for i in range(n_conns)]
    placements = layer_placements(p, len(layers), mix_fraction)
    depth = _depth(arch, len(layers))
    weight = next(layers[0].parameters())
    kw = {"device": weight.device, "dtype": weight.dtype}
    d = config.hidden_size
    kinds = [arch.kind(i) for i in range(len(arch.connections()))]
    second_path = arch.branch_norm_path()

    connections = []
    for layer, layer_placement in zip(layers, placements, strict=True):
        spec = layer_spec(layer_placement, depth, kinds)  # the one spec addnorm's layers read too
        blocks = []
        for i, ((block, sublayers), conn_spec) in enumerate(
            zip(arch.connections(), spec.connections, strict=True)
        ):
            conn = AddNorm(
                d,
                conn_spec.placement,
                norm_name,
                dropouts[i],
                eps=eps,
                alpha=conn_spec.alpha,
                gate_init=conn_spec.gate_init,
                norm_options=options,
                fused=fused,
                **kw,
            )
            for slot, path in sublayers[0].norm_paths().items():
                theirs = _remove(layer, path)
                if getattr(conn, slot) is not None and norm_name == arch.norm:
                    _copy_norm(getattr(conn, slot), theirs)
            if second_path is not None:  # a parallel block's second input norm: the connection's too
                theirs = _remove(layer, second_path)
                if conn.input_norm is not None:
                    conn.add_module(SECOND_NORM, build_norm(norm_name, d, eps=eps, **options, **kw))
                    if norm_name == arch.norm:
                        _copy_norm(getattr(conn, SECOND_NORM), theirs)
            attach(layer, block, conn, arch, i)
            blocks.append(conn)
        spec.share_gates(blocks)
        connections.append(blocks)
        if init and spec.init is not None:
            apply_weight_init(arch.weights(layer, config), spec.init)

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

    dropout = dropouts[0] if len(set(dropouts)) == 1 else dropout  # None: each connection the model's
    record = {"placement": p.name, "norm": norm_name, "eps": eps, "dropout": dropout, "fused": fused}
    if p.layers is not None:
        record["mix_fraction"] = mix_fraction
    record[ORIGINAL_TYPE] = config.model_type
    setattr(config, CONFIG_KEY, record)
    model.save_pretrained = SaveReplaced(model)
    seconds = [getattr(blocks[0], SECOND_NORM, None) for blocks in connections]
    install(
        model,
        Rewiring("placement", arch, layers, connections, final_module=final_module, second_norms=seconds),
        final_norm=final_module,
        applied_final_norm=applied,
        b2t=p.stream == "b2t",
    )
    return model


def _has_norms(p: Placement) -> bool:
    """Whether a model re-placed with ``p`` has any norm (ReZero has none)."""
    return any(q.norm_slots or q.final_norm for q in p.layer_kinds())


def _number(name: str, value: object, expected: str, valid) -> float | None:
    """``value`` as a float (None stays None), or a one-line error naming the option."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not valid(float(value)):
        raise ValueError(f"{name}: expected {expected}, got {value!r}")
    return float(value)


class SaveReplaced:
    """A re-placed model's ``save_pretrained`` (an instance attribute shadowing the class's, so the
    Trainer and ``push_to_hub`` call it too): the model's own, then ``config.json``'s ``model_type``
    renamed to :func:`saved_model_type`, so plain ``transformers`` refuses the checkpoint with a
    message naming addnorm and how to load it (the original type stays in ``config.addnorm``)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, save_directory, *args, **kwargs):
        result = type(self.model).save_pretrained(self.model, save_directory, *args, **kwargs)
        path = Path(save_directory) / "config.json"
        if path.is_file():
            data = json.loads(path.read_text())
            if CONFIG_KEY in data and data.get("model_type") == data[CONFIG_KEY].get(ORIGINAL_TYPE):
                data["model_type"] = saved_model_type(data["model_type"])
                path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
        return result
