"""The Hugging Face families addnorm ships whose layers are parallel blocks, x + F_1(N(x)) + F_2(N'(x)):
attention and MLP read the same input (through one shared norm, or one each) and their outputs join the
stream in one add, which the fused op runs with the norm that next reads the stream. One connection per
layer goes around the sum of the two (``Architecture.parallel``); each family's record is here, and adding
one touches this file only. A family whose layer is parallel or not by its config (GPT-NeoX's
``use_parallel_residual``, Falcon's ``parallel_attn`` and ``new_decoder_architecture``, StableLM's
``use_parallel_residual``) names the record of each layout (``Architecture.variant``).

Packed query/key/value projections are described by the rows each role takes (``Weight.parts``), so that
DeepNet-style inits draw each role as one matrix wherever its rows lie.
"""

from __future__ import annotations

from torch import Tensor

from .architectures import Architecture, ConfigSpec, Sizes, Sublayer, Weight
from .families import llama_sublayers, mlp, separate_qkv, weights
from .registration import register_architecture

__all__ = ["PARALLEL_FAMILIES"]


def _gptj_attn(
    layer,
    h,
    layer_past=None,
    attention_mask=None,
    position_ids=None,
    use_cache=False,
    output_attentions=False,
    **kwargs,
) -> Tensor:
    """GPT-J's and CodeGen's attention, called as their blocks call it (its residual dropout inside)."""
    out = layer.attn(
        hidden_states=h,
        layer_past=layer_past,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=use_cache,
        output_attentions=output_attentions,
    )
    return out[0]


def _falcon_attn(layer, h, alibi=None, **kwargs) -> Tensor:
    """Falcon's attention, called as its layer calls it (``output_attentions`` picks the path that
    computes the weights where the model runs SDPA)."""
    keys = (
        "attention_mask",
        "position_ids",
        "layer_past",
        "use_cache",
        "output_attentions",
        "position_embeddings",
    )
    return layer.self_attention(h, alibi=alibi, **{k: kwargs[k] for k in keys if k in kwargs})[0]


def _neox_attn(layer, h, **kwargs) -> Tensor:
    return layer.attention(h, **kwargs)[0]


def _neox_parallel_attn(layer, h, **kwargs) -> Tensor:
    return layer.post_attention_dropout(layer.attention(h, **kwargs)[0])


def _neox_parallel_mlp(layer, h, **kwargs) -> Tensor:
    return layer.post_mlp_dropout(layer.mlp(h))


def _phi_attn(layer, h, **kwargs) -> Tensor:
    return layer.resid_dropout(layer.self_attn(hidden_states=h, **kwargs)[0])


def _phi_mlp(layer, h, **kwargs) -> Tensor:
    return layer.resid_dropout(layer.mlp(h))


def _stablelm_attn(layer, h, **kwargs) -> Tensor:
    keys = ("attention_mask", "position_ids", "past_key_values", "use_cache", "position_embeddings")
    return layer.self_attn(hidden_states=h, **{k: kwargs[k] for k in keys if k in kwargs})[0]


def _stablelm_parallel_mlp(layer, h, **kwargs) -> Tensor:
    return layer.dropout(layer.mlp(h))


def _grouped(role: int, groups, per=lambda config: 1):
    """The rows of role ``role`` (0 queries, 1 keys, 2 values) in a projection packed per group as
    ``[q_1 .. q_per, k, v]``, each a head_dim block (``groups(config)`` groups of ``per(config)`` query
    heads): GPT-NeoX (one query head per group), Falcon's layouts."""

    def parts(config) -> tuple[tuple[int, int], ...]:
        n, p = groups(config), per(config)
        hd = config.hidden_size // config.num_attention_heads
        step = (p + 2) * hd
        start, size = (0, p * hd) if role == 0 else ((p + role - 1) * hd, hd)
        return tuple((g * step + start, g * step + start + size) for g in range(n))

    return parts


def _neox_qkv(role: int):
    """GPT-NeoX's query_key_value: per head, its query, key and value."""
    return _grouped(role, lambda config: config.num_attention_heads)


def _falcon_qkv(role: int):
    """Falcon's query_key_value: per key/value group (new decoder architecture), per head (no
    multi-query), or every query, then one key and one value (multi-query)."""

    def parts(config) -> tuple[tuple[int, int], ...]:
        heads = config.num_attention_heads
        if config.new_decoder_architecture:
            kv = config.num_kv_heads
            return _grouped(role, lambda c: kv, lambda c: heads // kv)(config)
        if not config.multi_query:
            return _grouped(role, lambda c: heads)(config)
        return _grouped(role, lambda c: 1, lambda c: heads)(config)

    return parts


def _codegen_qkv(role: int):
    """CodeGen's qkv_proj: four model-parallel shards, each its queries, values, keys (role 0, 1, 2)."""

    def parts(config) -> tuple[tuple[int, int], ...]:
        local = config.hidden_size // 4
        return tuple((m * 3 * local + role * local, m * 3 * local + (role + 1) * local) for m in range(4))

    return parts


def _qkv(path: str, parts, out: str) -> dict:
    """init_unit (queries, keys) and init_scaled (values, then the output projection ``out``) of a
    packed projection, by ``parts(role)`` with roles 0 query, 1 key, 2 value."""
    return {
        "init_unit": (Weight(path, parts=parts(0)), Weight(path, parts=parts(1))),
        "init_scaled": (Weight(path, parts=parts(2)), *weights(out)),
    }


def _rotary(sizes: Sizes) -> dict:
    return {"rotary_dim": sizes.hidden // sizes.heads}


_PARALLEL = {"placement": "pre", "norm": "layernorm", "parallel": True}
_SHARED_NORM = ("input_layernorm", "input_layernorm")  # attention and MLP read the stream through one norm
_GPT_DROPOUTS = ("resid_pdrop", "embd_pdrop", "attn_pdrop")

GPTJ = Architecture(
    "gptj",
    **_PARALLEL,
    layers="h",
    final_norm="ln_f",
    returns_tuple=True,
    sublayers=(
        Sublayer("attn", _gptj_attn, input_norm="ln_1", **separate_qkv("attn", o="out_proj")),
        Sublayer("mlp", mlp, input_norm="ln_1", init_scaled=weights("mlp.fc_in", "mlp.fc_out")),
    ),
    config=ConfigSpec(ffn="n_inner", dropouts=_GPT_DROPOUTS, fields=_rotary),
)
# CodeGen's queries, keys and values: the codegen_qkv roles are (query, value, key) in its layout
_CODEGEN_QKV = {
    "init_unit": (
        Weight("attn.qkv_proj.weight", parts=_codegen_qkv(0)),
        Weight("attn.qkv_proj.weight", parts=_codegen_qkv(2)),
    ),
    "init_scaled": (Weight("attn.qkv_proj.weight", parts=_codegen_qkv(1)), *weights("attn.out_proj")),
}
CODEGEN = Architecture(
    "codegen",
    **_PARALLEL,
    layers="h",
    final_norm="ln_f",
    returns_tuple=True,
    sublayers=(
        Sublayer("attn", _gptj_attn, input_norm="ln_1", **_CODEGEN_QKV),
        Sublayer("mlp", mlp, input_norm="ln_1", init_scaled=weights("mlp.fc_in", "mlp.fc_out")),
    ),
    config=ConfigSpec(ffn="n_inner", dropouts=_GPT_DROPOUTS, fields=_rotary),
)
_NEOX_ATTN = _qkv("attention.query_key_value.weight", _neox_qkv, "attention.dense")
_NEOX_MLP = weights("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
_NEOX_COMMON = {"layers": "layers", "final_norm": "final_layer_norm", "norm": "layernorm"}
GPT_NEOX_SEQUENTIAL = Architecture(
    "gpt_neox (sequential)",
    placement="pre",
    **_NEOX_COMMON,
    dropout="hidden_dropout",
    sublayers=(
        Sublayer("attention", _neox_attn, input_norm="input_layernorm", **_NEOX_ATTN),
        Sublayer("mlp", mlp, input_norm="post_attention_layernorm", init_scaled=_NEOX_MLP),
    ),
    config=ConfigSpec(dropouts=("hidden_dropout", "attention_dropout")),
)
GPT_NEOX = Architecture(
    "gpt_neox",
    **{**_PARALLEL, **_NEOX_COMMON},
    sublayers=(
        Sublayer("attention", _neox_parallel_attn, input_norm="input_layernorm", **_NEOX_ATTN),
        Sublayer("mlp", _neox_parallel_mlp, input_norm="post_attention_layernorm", init_scaled=_NEOX_MLP),
    ),
    variant=lambda config: None if config.use_parallel_residual else GPT_NEOX_SEQUENTIAL,
    config=ConfigSpec(dropouts=("hidden_dropout", "attention_dropout")),
)
_FALCON_ATTN = _qkv("self_attention.query_key_value.weight", _falcon_qkv, "self_attention.dense")
_FALCON_MLP = weights("mlp.dense_h_to_4h", "mlp.dense_4h_to_h")
_FALCON_COMMON = {"layers": "h", "final_norm": "ln_f", "norm": "layernorm", "returns_tuple": True}
_FALCON_CONFIG = ConfigSpec(ffn="ffn_hidden_size", dropouts=("hidden_dropout", "attention_dropout"))


def _falcon_variant(config) -> Architecture | str | None:
    """Falcon's layer by its config: two norms (the new decoder architecture's default), one norm
    (parallel attention), or sequential attention then MLP."""
    if config.new_decoder_architecture:
        if (config.num_ln_in_parallel_attn or 2) == 2:
            return FALCON_TWO_NORMS
        if not config.parallel_attn:
            return "Falcon's new decoder architecture with one norm and parallel_attn=False"
        return None
    return None if config.parallel_attn else FALCON_SEQUENTIAL


def _falcon_parallel(name: str, attn_norm: str, mlp_norm: str, **kwargs) -> Architecture:
    """A parallel Falcon layer: attention and MLP reading the stream through ``attn_norm`` and ``mlp_norm``
    (one norm: the same name twice)."""
    return Architecture(
        name,
        **{**_PARALLEL, **_FALCON_COMMON},
        dropout="hidden_dropout",
        sublayers=(
            Sublayer("self_attention", _falcon_attn, input_norm=attn_norm, **_FALCON_ATTN),
            Sublayer("mlp", mlp, input_norm=mlp_norm, init_scaled=_FALCON_MLP),
        ),
        config=_FALCON_CONFIG,
        **kwargs,
    )


FALCON = _falcon_parallel("falcon", "input_layernorm", "input_layernorm", variant=_falcon_variant)
FALCON_TWO_NORMS = _falcon_parallel("falcon (two norms)", "ln_attn", "ln_mlp")
FALCON_SEQUENTIAL = Architecture(
    "falcon (sequential)",
    placement="pre",
    **_FALCON_COMMON,
    sublayers=(
        Sublayer(
            "self_attention",
            _falcon_attn,
            input_norm="input_layernorm",
            dropout="attention_dropout",
            **_FALCON_ATTN,
        ),
        Sublayer(
            "mlp",
            mlp,
            input_norm="post_attention_layernorm",
            dropout="hidden_dropout",
            init_scaled=_FALCON_MLP,
        ),
    ),
    config=_FALCON_CONFIG,
)
PHI = Architecture(
    "phi",
    **_PARALLEL,
    layers="layers",
    final_norm="final_layernorm",
    sublayers=(
        Sublayer(
            "self_attn",
            _phi_attn,
            input_norm="input_layernorm",
            **separate_qkv("self_attn", o="dense"),
        ),
        Sublayer("mlp", _phi_mlp, input_norm="input_layernorm", init_scaled=weights("mlp.fc1", "mlp.fc2")),
    ),
    config=ConfigSpec(
        kv_heads="num_key_value_heads", dropouts=("resid_pdrop", "embd_pdrop", "attention_dropout")
    ),
)
COHERE = Architecture(
    "cohere",
    **_PARALLEL,
    layers="layers",
    final_norm="norm",
    sublayers=llama_sublayers(norms=_SHARED_NORM),
    config=ConfigSpec(kv_heads="num_key_value_heads"),
)
STABLELM_PARALLEL = Architecture(
    "stablelm (parallel)",
    **_PARALLEL,
    layers="layers",
    final_norm="norm",
    sublayers=llama_sublayers(_stablelm_attn, _stablelm_parallel_mlp, norms=_SHARED_NORM),
    config=ConfigSpec(kv_heads="num_key_value_heads", dropouts=("hidden_dropout", "attention_dropout")),
)
STABLELM = Architecture(
    "stablelm",
    placement="pre",
    norm="layernorm",
    layers="layers",
    final_norm="norm",
    sublayers=llama_sublayers(_stablelm_attn, mlp_dropout="hidden_dropout"),
    variant=lambda config: STABLELM_PARALLEL if config.use_parallel_residual else None,
    config=ConfigSpec(kv_heads="num_key_value_heads", dropouts=("hidden_dropout", "attention_dropout")),
)


PARALLEL_FAMILIES: dict[tuple[str, ...], Architecture] = {
    ("gptj",): GPTJ,
    ("codegen",): CODEGEN,
    ("gpt_neox",): GPT_NEOX,
    ("falcon",): FALCON,
    ("phi",): PHI,
    ("cohere", "cohere2"): COHERE,
    ("stablelm",): STABLELM,
}
"""Each of these records, by the ``config.model_type`` values it covers."""

for _types, _arch in PARALLEL_FAMILIES.items():
    register_architecture(_types, _arch, check=False)
