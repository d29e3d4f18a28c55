"""Tiny random-weight Hugging Face models of each supported type, built from a config (nothing is
downloaded): for tests, ``addnorm inspect --hf``, the benchmarks and the check of a registered record.

The config is written from the family's record (:class:`~addnorm.hf.architectures.ConfigSpec`): no list
of families here."""

from __future__ import annotations

import inspect

from torch import nn

from .architectures import ARCHITECTURES, Architecture, Sizes, require_transformers

__all__ = ["config_fields", "tiny_config", "tiny_model"]


def config_fields(
    arch: Architecture,
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 100,
    intermediate: int | None = None,
    positions: int = 128,
    dropout: float | None = None,
) -> dict:
    """The config fields of a model of family ``arch`` at these sizes (see :func:`tiny_config`)."""
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden: {hidden} is not divisible by heads={heads}")
    spec = arch.config
    ffn = 2 * hidden if intermediate is None else intermediate
    fields = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": positions,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
        spec.ffn: ffn,
    }
    if spec.kv_heads:
        fields[spec.kv_heads] = max(1, heads // 2)
    if spec.head_dim:
        fields[spec.head_dim] = hidden // heads
    if spec.fields is not None:
        fields.update(spec.fields(Sizes(layers, hidden, heads, ffn)))
    if dropout is not None:
        fields.update(dict.fromkeys(spec.dropouts, float(dropout)))
    return fields


_SIZES = tuple(inspect.signature(config_fields).parameters)[1:]  # the keywords after arch


def tiny_config(model_type: str, **fields):
    """A ``transformers`` config of ``model_type`` with the sizes :func:`config_fields` takes (``layers``,
    ``hidden``, ``heads``, ``vocab``, ``intermediate``, ``positions``, ``dropout``, with its defaults:
    ``intermediate`` 2 * hidden; where the family has key/value heads, half the heads; ``dropout`` sets
    every dropout rate of the family, default its own); any other keyword sets that config field."""
    transformers = require_transformers()
    model_type = ARCHITECTURES.resolve(model_type) if isinstance(model_type, str) else model_type
    sizes = {name: fields.pop(name) for name in _SIZES if name in fields}
    config = config_fields(ARCHITECTURES[model_type], **sizes)
    config.update(fields)
    return transformers.AutoConfig.for_model(model_type, **config)


def model_from_config(config, arch: Architecture, *, causal: bool | None = None) -> nn.Module:
    """A random-weight model of ``config``: a causal LM, or for a masked-LM family (BERT) a masked LM
    unless ``causal``."""
    transformers = require_transformers()
    if arch.config.lm == "masked" and not causal:
        return transformers.AutoModelForMaskedLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)


def tiny_model(model_type: str, *, seed: int = 0, causal: bool | None = None, **sizes) -> nn.Module:
    """A random-weight model from :func:`tiny_config` (``torch.manual_seed(seed)`` first): a causal LM,
    or for BERT a masked LM (``causal=True``: BERT as a decoder, BertLMHeadModel, which can generate)."""
    import torch

    arch = ARCHITECTURES[model_type]
    if arch.config.lm == "masked" and causal:
        sizes.setdefault("is_decoder", True)
    config = tiny_config(model_type, **sizes)
    torch.manual_seed(seed)
    return model_from_config(config, arch, causal=causal)
