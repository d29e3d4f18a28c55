"""Tiny random-weight Hugging Face models of each supported type, built from a config (nothing is
downloaded): for tests, ``addnorm inspect --hf`` and the benchmarks."""

from __future__ import annotations

from torch import nn

from .architectures import ARCHITECTURES, require_transformers

__all__ = ["tiny_config", "tiny_model"]

_LLAMA_FAMILY = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "phi3", "mixtral", "qwen2_moe"
)  # fmt: skip
_DROPOUTS = {
    "gpt2": ("resid_pdrop", "embd_pdrop", "attn_pdrop"),
    "bert": ("hidden_dropout_prob", "attention_probs_dropout_prob"),
    "phi3": ("resid_pdrop", "embd_pdrop", "attention_dropout"),
}
_EXPERTS = {  # four experts, two per token; Qwen2-MoE also has its shared expert
    "mixtral": lambda ffn: {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": lambda ffn: {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": ffn,
        "shared_expert_intermediate_size": ffn,
        "decoder_sparse_step": 1,
    },
}


def tiny_config(
    model_type: str,
    *,
    layers: int = 2,
    hidden: int = 32,
    heads: int = 4,
    vocab: int = 100,
    intermediate: int | None = None,
    positions: int = 128,
    dropout: float | None = None,
    **overrides,
):
    """A ``transformers`` config of ``model_type`` with these sizes (``intermediate`` defaults to
    2 * hidden; Llama-family key/value heads are half the heads); ``dropout`` sets every dropout rate of
    the family (default: its own); ``overrides`` set any other field."""
    transformers = require_transformers()
    model_type = ARCHITECTURES.resolve(model_type) if isinstance(model_type, str) else model_type
    for name, value in (("layers", layers), ("hidden", hidden), ("heads", heads), ("vocab", vocab)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if hidden % heads:
        raise ValueError(f"hidden: {hidden} is not divisible by heads={heads}")
    fields = {
        "vocab_size": vocab,
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "max_position_embeddings": positions,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    ffn = 2 * hidden if intermediate is None else intermediate
    if model_type == "gpt2":
        fields["n_inner"] = ffn
    else:
        fields["intermediate_size"] = ffn
    if model_type in _LLAMA_FAMILY:
        fields.update(num_key_value_heads=max(1, heads // 2), head_dim=hidden // heads)
    if model_type in _EXPERTS:
        fields.update(_EXPERTS[model_type](ffn))
    if dropout is not None:
        fields.update(dict.fromkeys(_DROPOUTS.get(model_type, ("attention_dropout",)), float(dropout)))
    fields.update(overrides)
    return transformers.AutoConfig.for_model(model_type, **fields)


def tiny_model(model_type: str, *, seed: int = 0, causal: bool | None = None, **sizes) -> nn.Module:
    """A random-weight model from :func:`tiny_config` (``torch.manual_seed(seed)`` first): a causal LM,
    or for BERT a masked LM (``causal=True``: BERT as a decoder, BertLMHeadModel, which can generate)."""
    import torch

    transformers = require_transformers()
    if model_type == "bert" and causal:
        sizes.setdefault("is_decoder", True)
    config = tiny_config(model_type, **sizes)
    torch.manual_seed(seed)
    if config.model_type == "bert" and not causal:
        return transformers.AutoModelForMaskedLM.from_config(config)
    return transformers.AutoModelForCausalLM.from_config(config)
