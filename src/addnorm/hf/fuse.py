"""``fuse(model)``: every residual add of a Hugging Face model that a norm reads runs in one
:func:`addnorm.ops.add_norm` call with that norm; ``unfuse(model)`` restores the model's own forward.

Each residual connection becomes an :class:`~addnorm.AddNorm` of the model's own placement (Llama family,
Phi-3, Mixtral, Qwen2-MoE, GPT-2: ``pre``; Gemma 2/3: ``sandwich``; OLMo 2: ``res_post``; BERT: ``post``)
whose norms *read* the model's norm parameters: addnorm's RMSNorm/LayerNorm (which the op computes)
holding the model's own weight and bias Parameters as plain attributes, not registered. The connections
are registered on their layer as ``<sublayer>_block`` (``self_attn_block``, ``mlp_block``), so
``model.train()``/``eval()`` reach them and :class:`addnorm.Probe` finds them, while the model's
parameters, state dict and ``save_pretrained`` output stay exactly as they were. The layers then run as
:mod:`addnorm.hf.rewired` describes: a Pre-LN model of L layers makes 2L fused calls per forward, the last
one with the final norm.

Numerics: every norm is computed as the op computes it, statistics and the weight product in float32
(float64 for float64), rounded once to the output dtype. In float32 and float64 that is the model's
function; Llama-family and Gemma RMSNorms compute in float32 even for float64 inputs, so a float64
model agrees with its fused self to float32 rounding of its norms; in bfloat16/float16 the Llama family
rounds the normalised input before its weight product, which the op does not, so results differ by
that rounding (GPT-2 and BERT: the same logits and loss, gradients differ by rounding). Residual
dropout (GPT-2, BERT, Phi-3): on the CPU in eager mode ``nn.Dropout``'s mask, the model's own for the
same seed; where the op runs it, its hashed mask (the same distribution, a different mask).

The fused model is a view of the model: its norms read the model's norm parameters each time they are
called (:func:`addnorm.norms.reading`), so fuse before or after loading, moving, converting,
``load_state_dict(assign=True)``, ``to_empty``, offloading (``device_map``) or sharding (FSDP2
``fully_shard``): the numbers are the unfused model's. Gradient checkpointing works: a checkpointed
layer fuses within itself only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from ..connection import AddNorm
from ..norms import build_norm, reading
from .architectures import Architecture, architecture_of, norm_options
from .rewired import Reads, Rewiring, attach, install, rewiring_of, uninstall

__all__ = ["fuse", "fused", "unfuse"]


def _reading(norm: nn.Module, source: nn.Module, reads: Reads, arch: Architecture) -> nn.Module:
    """``norm`` made to compute with ``source``'s parameters at each call (:func:`addnorm.norms.reading`),
    with its epsilon read as ``arch.norm_eps`` says; ``source`` noted in ``reads`` (for offload hooks)."""
    reads.sources.append(source)
    return reading(norm, source, arch.eps_of(source))


def fuse(model: nn.Module) -> nn.Module:
    """Rewire ``model`` (a supported Hugging Face model) in place so that each residual add a norm reads
    runs in one fused op with it, within layers and from layer to layer into the final norm; returns it.

    Logits, loss and gradients are the model's (see the module docstring for numerics and dropout);
    ``unfuse(model)`` or ``with fused(model):`` restores its forward.

    Args:
        model: a ``transformers`` model of a supported type (:data:`addnorm.hf.ARCHITECTURES`).

    Returns:
        ``model`` itself, rewired.

    Raises:
        ValueError: an unsupported model type (the message lists the supported ones), a model already
            rewired, or one without layers.
    """
    arch = architecture_of(model)
    if rewiring_of(model) is not None:
        raise ValueError(
            f"model: {type(model).__name__} is already rewired by addnorm.hf ({rewiring_of(model).kind}); "
            "a model from with_placement fuses its own connections (fused=True)"
        )
    base, config = model.base_model, model.config
    layers = arch.layers_of(model)
    if not layers:
        raise ValueError(f"model: {type(model).__name__} has no layers to fuse")
    options = norm_options(arch)
    connections, reads, second_norms = [], [], []
    second_path = arch.branch_norm_path()
    for layer in layers:
        blocks, layer_reads = [], Reads()
        reads.append(layer_reads)
        for i, (block, sublayers) in enumerate(arch.connections()):
            dropout = arch.residual_dropout(config, i)
            conn = AddNorm(config.hidden_size, arch.placement, arch.norm, dropout, norm_options=options)
            for slot, path in sublayers[0].norm_paths().items():
                _reading(getattr(conn, slot), layer.get_submodule(path), layer_reads, arch)
            attach(layer, block, conn, arch, i)
            blocks.append(conn)
        connections.append(blocks)
        second = None
        if second_path is not None:
            norm = build_norm(arch.norm, config.hidden_size, **options)
            second = _reading(norm, layer.get_submodule(second_path), layer_reads, arch)
        second_norms.append(second)
    final_module = base.get_submodule(arch.final_norm) if arch.final_norm else None
    final_norm = None
    if final_module is not None:
        norm = build_norm(arch.norm, config.hidden_size, **options)
        final_norm = _reading(norm, final_module, Reads(), arch)
    rewiring = Rewiring(
        "fused",
        arch,
        layers,
        connections,
        final_module=final_module,
        reads=reads,
        second_norms=second_norms,
    )
    install(model, rewiring, final_norm=final_norm)
    return model


def unfuse(model: nn.Module) -> nn.Module:
    """Undo :func:`fuse`: the model's own forwards come back and its ``<sublayer>_block`` connections go;
    returns the model."""
    rewiring = rewiring_of(model)
    if rewiring is None or rewiring.kind != "fused":
        what = "not fused" if rewiring is None else "re-placed by with_placement, not fused"
        raise ValueError(f"model: {type(model).__name__} is {what}")
    uninstall(model)
    for layer in rewiring.layers:
        for block, _ in rewiring.arch.connections():
            delattr(layer, block)
    return model


@contextmanager
def fused(model: nn.Module) -> Iterator[nn.Module]:
    """``with fused(model):`` the model runs fused inside the block and unfused after it."""
    fuse(model)
    try:
        yield model
    finally:
        unfuse(model)
