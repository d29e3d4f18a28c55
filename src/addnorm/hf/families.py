"""The Hugging Face families addnorm ships whose layers run their sublayers one after the other, one
:class:`~addnorm.hf.architectures.Architecture` record each (parallel blocks: :mod:`.families_parallel`):
adding a family touches this file only (its record names everything fuse, re-placing, probing, tiny
models, tests and studies read).

Registered without the self-check :func:`addnorm.hf.register_architecture` runs on a user's record (that
would import ``transformers`` at ``import addnorm.hf``); ``tests/test_hf_*.py`` check each of them the same
way, on tiny random models of every type.
"""

from __future__ import annotations

from torch import Tensor, nn

from .architectures import Architecture, ConfigSpec, Sizes, Sublayer, Weight
from .registration import register_architecture

__all__ = ["FAMILIES", "llama_sublayers", "mlp", "packed_qkv", "self_attn", "separate_qkv", "weights"]


# --- how each family calls its sublayers ---------------------------------------------------------------
def self_attn(layer: nn.Module, h: Tensor, **kwargs) -> Tensor:
    """Llama-family and Gemma attention: every keyword of the layer's call goes on to it."""
    return layer.self_attn(hidden_states=h, **kwargs)[0]


def mlp(layer: nn.Module, h: Tensor, **kwargs) -> Tensor:
    return layer.mlp(h)


def _gpt2_attn(
    layer: nn.Module,
    h: Tensor,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    **kwargs,
) -> Tensor:
    return layer.attn(h, **kwargs)[0]


def _bert_attention(
    layer: nn.Module,
    h: Tensor,
    attention_mask: Tensor | None = None,
    encoder_hidden_states: Tensor | None = None,
    encoder_attention_mask: Tensor | None = None,
    past_key_values=None,
    **kwargs,
) -> Tensor:
    """BERT's self-attention and the dense projection of BertSelfOutput (whose dropout, add and LayerNorm
    are the connection's)."""
    attention = layer.attention
    context = attention.self(h, attention_mask=attention_mask, past_key_values=past_key_values, **kwargs)[0]
    return attention.output.dense(context)


def _bert_ffn(layer: nn.Module, h: Tensor, **kwargs) -> Tensor:
    """BertIntermediate and the dense projection of BertOutput (whose dropout, add and LayerNorm are the
    connection's)."""
    return layer.output.dense(layer.intermediate(h))


def _phi3_qkv(config) -> tuple[int, int, int]:
    """Phi-3's packed projection: queries of every head, then keys and values of the key/value heads."""
    head = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head
    return (config.num_attention_heads * head, kv, kv)


def _mixtral_experts(sizes: Sizes) -> dict:
    return {"num_local_experts": 4, "num_experts_per_tok": 2}  # four experts, two per token


def _qwen2_moe_experts(sizes: Sizes) -> dict:
    """Four experts, two per token, every layer sparse, and the shared expert."""
    return {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": sizes.ffn,
        "shared_expert_intermediate_size": sizes.ffn,
        "decoder_sparse_step": 1,
    }


# --- the records ---------------------------------------------------------------------------------------
def weights(*paths: str) -> tuple[Weight, ...]:
    """The weight matrices of the modules at ``paths`` (relative to a layer), one role each."""
    return tuple(Weight(f"{p}.weight") for p in paths)


def separate_qkv(prefix: str, q="q_proj", k="k_proj", v="v_proj", o="o_proj") -> dict:
    """The roles of an attention with a projection each for queries, keys, values and output, under
    ``prefix``: queries and keys ``init_unit``, values and output ``init_scaled`` (a Sublayer's keywords)."""
    return {
        "init_unit": weights(f"{prefix}.{q}", f"{prefix}.{k}"),
        "init_scaled": weights(f"{prefix}.{v}", f"{prefix}.{o}"),
    }


def packed_qkv(prefix: str, qkv: str, o: str, **block) -> dict:
    """The same roles where one projection ``qkv`` packs queries, keys and values as three blocks (a
    :class:`Weight`'s ``block`` of 3, with ``block``'s ``dim`` or ``sizes``), with the output ``o``."""
    w = f"{prefix}.{qkv}.weight"
    return {
        "init_unit": (Weight(w, 0, 3, **block), Weight(w, 1, 3, **block)),
        "init_scaled": (Weight(w, 2, 3, **block), Weight(f"{prefix}.{o}.weight")),
    }


LLAMA_ATTN_INIT = separate_qkv("self_attn")
LLAMA_MLP = weights("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def llama_sublayers(
    attention=self_attn,
    feed_forward=mlp,
    *,
    names: tuple[str, str] = ("self_attn", "mlp"),
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
    role: str = "input_norm",
    attention_init: dict | None = None,
    mlp_init: tuple[Weight, ...] = LLAMA_MLP,
    mlp_dropout: str | None = None,
    silenced: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
) -> tuple[Sublayer, Sublayer]:
    """The sublayers of a Llama-shaped layer: attention ``names[0]`` (``attention_init`` its roles, default
    separate query, key, value and output projections) called by ``attention``, then ``names[1]`` called
    by ``feed_forward`` (``mlp_init`` its scaled weights, ``mlp_dropout`` its own residual dropout's config
    attribute); ``norms`` are theirs in the slot ``role`` (``input_norm``: Pre-LN, ``branch_norm``:
    res_post; the same name twice: one norm both read); ``silenced``: the dropouts inside each that the
    connection's replaces."""
    return (
        Sublayer(
            names[0],
            attention,
            **{role: norms[0]},
            silenced=silenced[0],
            **(attention_init or LLAMA_ATTN_INIT),
        ),
        Sublayer(
            names[1],
            feed_forward,
            **{role: norms[1]},
            silenced=silenced[1],
            init_scaled=mlp_init,
            dropout=mlp_dropout,
        ),
    )


_GQA = {"kv_heads": "num_key_value_heads", "head_dim": "head_dim"}
_LLAMA_CONFIG = ConfigSpec(**_GQA, rope="rope_parameters", study=True)
_PRE_LLAMA = {"placement": "pre", "norm": "rmsnorm", "layers": "layers", "final_norm": "norm"}

LLAMA = Architecture(
    "llama",
    **_PRE_LLAMA,
    sublayers=llama_sublayers(),
    config=_LLAMA_CONFIG,
)
GEMMA = Architecture(
    "gemma",
    placement="sandwich",
    norm="rmsnorm",
    zero_centered=True,
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer(
            "self_attn",
            self_attn,
            input_norm="input_layernorm",
            branch_norm="post_attention_layernorm",
            **LLAMA_ATTN_INIT,
        ),
        Sublayer(
            "mlp",
            mlp,
            input_norm="pre_feedforward_layernorm",
            branch_norm="post_feedforward_layernorm",
            init_scaled=LLAMA_MLP,
        ),
    ),
    config=ConfigSpec(**_GQA, rope="rope_parameters", study=True, scaled_embeddings=True),
)
GPT2 = Architecture(
    "gpt2",
    placement="pre",
    norm="layernorm",
    layers="h",
    final_norm="ln_f",
    dropout="resid_pdrop",
    sublayers=llama_sublayers(
        _gpt2_attn,
        names=("attn", "mlp"),
        norms=("ln_1", "ln_2"),
        attention_init=packed_qkv("attn", "c_attn", "c_proj", dim=1),
        mlp_init=weights("mlp.c_fc", "mlp.c_proj"),
        silenced=(("attn.resid_dropout",), ("mlp.dropout",)),
    ),
    unsupported=(("add_cross_attention", "GPT-2 cross-attention (add_cross_attention=True)"),),
    config=ConfigSpec(ffn="n_inner", dropouts=("resid_pdrop", "embd_pdrop", "attn_pdrop"), study=True),
)
BERT = Architecture(
    "bert",
    placement="post",
    norm="layernorm",
    layers="encoder.layer",
    final_norm_home="encoder",
    stack="encoder",
    dropout="hidden_dropout_prob",
    sublayers=(
        Sublayer(
            "attention",
            _bert_attention,
            output_norm="attention.output.LayerNorm",
            **separate_qkv("attention", "self.query", "self.key", "self.value", "output.dense"),
        ),
        Sublayer(
            "output",
            _bert_ffn,
            output_norm="output.LayerNorm",
            init_scaled=weights("intermediate.dense", "output.dense"),
        ),
    ),
    unsupported=(("add_cross_attention", "BERT cross-attention (add_cross_attention=True)"),),
    config=ConfigSpec(dropouts=("hidden_dropout_prob", "attention_probs_dropout_prob"), lm="masked"),
)
OLMO2 = Architecture(
    "olmo2",
    placement="res_post",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    sublayers=llama_sublayers(
        norms=("post_attention_layernorm", "post_feedforward_layernorm"), role="branch_norm"
    ),
    config=ConfigSpec(**_GQA),
)
PHI3 = Architecture(
    "phi3",
    **_PRE_LLAMA,
    dropout="resid_pdrop",
    sublayers=llama_sublayers(
        attention_init=packed_qkv("self_attn", "qkv_proj", "o_proj", sizes=_phi3_qkv),
        mlp_init=weights("mlp.gate_up_proj", "mlp.down_proj"),
        silenced=(("resid_attn_dropout",), ("resid_mlp_dropout",)),
    ),
    config=ConfigSpec(**_GQA, dropouts=("resid_pdrop", "embd_pdrop", "attention_dropout")),
)
_MOE_EXPERTS = tuple(Weight(f"mlp.experts.{p}", experts=True) for p in ("gate_up_proj", "down_proj"))
MIXTRAL = Architecture(
    "mixtral",
    **_PRE_LLAMA,
    sublayers=llama_sublayers(mlp_init=_MOE_EXPERTS),
    config=ConfigSpec(**_GQA, fields=_mixtral_experts),
)
QWEN2_MOE = Architecture(
    "qwen2_moe",
    **_PRE_LLAMA,
    sublayers=llama_sublayers(
        mlp_init=tuple(
            Weight(w.path, experts=w.experts, optional=True)
            for w in (
                *_MOE_EXPERTS,
                *(Weight(f"mlp.shared_expert.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
                *LLAMA_MLP,  # dense layers (mlp_only_layers, decoder_sparse_step)
            )
        )
    ),
    config=ConfigSpec(**_GQA, fields=_qwen2_moe_experts),
)

FAMILIES: dict[tuple[str, ...], Architecture] = {
    ("llama", "mistral", "qwen2", "qwen3"): LLAMA,
    ("gemma2", "gemma3_text"): GEMMA,
    ("gpt2",): GPT2,
    ("bert",): BERT,
    ("olmo2",): OLMO2,
    ("phi3",): PHI3,
    ("mixtral",): MIXTRAL,
    ("qwen2_moe",): QWEN2_MOE,
}
"""Each of these records, by the ``config.model_type`` values it covers."""

for _types, _arch in FAMILIES.items():
    register_architecture(_types, _arch, check=False)
