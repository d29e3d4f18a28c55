"""The Hugging Face architectures addnorm rewires, as data: where a model keeps its layers and final norm,
which norm fills which slot of each residual connection, how a layer calls its sublayers, and where its
residual dropout lives.

One :class:`Architecture` per family, registered under each ``config.model_type`` it covers
(:data:`ARCHITECTURES`). Everything else about a model (embeddings, masks, caches, heads, the layer loop)
stays the model's own code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

from torch import Tensor, nn

from ..extras import require
from ..registry import Registry

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Sublayer",
    "Weight",
    "architecture_of",
    "norm_options",
    "register_architecture",
    "require_transformers",
]

TRANSFORMERS_RANGE = ">=5.17,<5.24"


def require_transformers() -> ModuleType:
    """``transformers``, or a one-line error naming the extra that installs it."""
    return require("transformers", "hf", f"addnorm.hf (Hugging Face transformers{TRANSFORMERS_RANGE})")


@dataclass(frozen=True)
class Weight:
    """A weight matrix of a sublayer (path relative to the layer), or one block of it along ``dim``:
    block ``block`` of ``count`` equal blocks (GPT-2's packed query/key/value projection), or of the
    blocks whose sizes ``sizes(config)`` gives (Phi-3's query/key/value projection with fewer key/value
    heads). ``experts``: the parameter stacks one matrix per expert along dim 0 (Mixtral, Qwen2-MoE),
    each initialised as its own matrix. ``optional``: a layer may lack it (Qwen2-MoE's dense layers)."""

    path: str
    block: int | None = None
    count: int = 1
    dim: int = 0
    sizes: Callable[[object], tuple[int, ...]] | None = None
    experts: bool = False
    optional: bool = False

    def matrices(self, layer: nn.Module, config) -> list[Tensor]:
        """The matrices (views) this spec names in ``layer``: none if it is optional and absent."""
        try:
            weight = layer.get_parameter(self.path)
        except AttributeError:
            if self.optional:
                return []
            raise
        if self.block is not None:
            if self.sizes is None:
                weight = weight.chunk(self.count, self.dim)[self.block]
            else:
                weight = weight.split(list(self.sizes(config)), self.dim)[self.block]
        return list(weight.unbind(0)) if self.experts else [weight]


@dataclass(frozen=True)
class Sublayer:
    """One sublayer F of a layer and the residual connection around it.

    ``name``: the layer's attribute holding F's weights (what ``Probe`` credits to this connection);
    ``call(layer, h, **kwargs)``: F(h), given the keyword arguments the layer was called with; the
    ``*_norm`` fields: the paths (relative to the layer) of the model's own norms in each slot of the
    connection; ``silenced``: dropout modules inside F that the connection's own dropout replaces (it
    runs inside the fused op); ``init_unit`` / ``init_scaled``: the weights DeepNet-style initialisation
    gives gain 1 (queries, keys) and gain beta (values, outputs, FFN).
    """

    name: str
    call: Callable[..., Tensor]
    input_norm: str | None = None
    branch_norm: str | None = None
    output_norm: str | None = None
    silenced: tuple[str, ...] = ()
    init_unit: tuple[Weight, ...] = ()
    init_scaled: tuple[Weight, ...] = ()

    @property
    def block(self) -> str:
        """The layer attribute its connection is registered as (``Probe`` reads ``<name>_block``)."""
        return f"{self.name}_block"

    def norm_paths(self) -> dict[str, str]:
        """Slot name -> path of the model's norm in that slot."""
        slots = ("input_norm", "branch_norm", "output_norm")
        return {slot: getattr(self, slot) for slot in slots if getattr(self, slot) is not None}


@dataclass(frozen=True)
class Architecture:
    """Where one model family keeps what addnorm rewires (paths relative to ``model.base_model``).

    ``placement``: the model's own Add & Norm in addnorm's terms; ``norm``: ``"rmsnorm"`` or
    ``"layernorm"``, ``zero_centered`` for Gemma's gain 1 + w; ``layers``: the layer list; ``final_norm``:
    the norm the model applies after its last layer (None: none); ``final_norm_home``: where
    ``with_placement`` registers a final norm the model lacks (the last layer then applies it);
    ``stack``: ``"decoder"`` or ``"encoder"`` (the depth DeepNet's constants are read for);
    ``dropout``: the config attribute of the residual dropout rate; ``unsupported``: config features
    the rewired layers cannot run, as (attribute, message) pairs checked for truthiness.
    """

    name: str
    placement: str
    norm: str
    layers: str
    sublayers: tuple[Sublayer, ...]
    final_norm: str | None = None
    final_norm_home: str | None = None
    zero_centered: bool = False
    stack: str = "decoder"
    dropout: str | None = None
    unsupported: tuple[tuple[str, str], ...] = ()

    def layers_of(self, model: nn.Module) -> list[nn.Module]:
        """The model's layers, in order."""
        return list(model.base_model.get_submodule(self.layers))

    def residual_dropout(self, config) -> float:
        """The model's dropout rate on each residual branch (0 where it has none)."""
        return float(getattr(config, self.dropout)) if self.dropout else 0.0


def norm_eps(module: nn.Module) -> float:
    """A Hugging Face norm's epsilon (``variance_epsilon`` in the Llama family, ``eps`` elsewhere)."""
    eps = getattr(module, "variance_epsilon", None)
    return float(module.eps if eps is None else eps)


ARCHITECTURES: Registry[Architecture] = Registry("model type")


def register_architecture(model_types: str | tuple[str, ...], architecture: Architecture) -> Architecture:
    """Teach addnorm.hf a model family: ``architecture`` (one :class:`Architecture` record: where the
    layers and norms are, how each sublayer is called, which weights DeepNet-style initialisation
    scales) registered under each ``config.model_type`` in ``model_types``. ``fuse``,
    ``with_placement``, ``from_pretrained`` and ``Probe`` then take models of those types; no patch of
    addnorm is needed. Returns ``architecture``."""
    if not isinstance(architecture, Architecture):
        got = type(architecture).__name__
        raise TypeError(f"architecture: expected an addnorm.hf.Architecture, got {got}")
    types = (model_types,) if isinstance(model_types, str) else tuple(model_types)
    if not types or not all(isinstance(t, str) and t for t in types):
        raise ValueError(f"model_types: expected a model type name or a tuple of them, got {model_types!r}")
    for model_type in types:
        ARCHITECTURES.register(model_type, architecture)
    return architecture


# --- how each family calls its sublayers ---------------------------------------------------------------
def _self_attn(layer: nn.Module, h: Tensor, **kwargs) -> Tensor:
    """Llama-family and Gemma attention: every keyword of the layer's call goes on to it."""
    return layer.self_attn(hidden_states=h, **kwargs)[0]


def _mlp(layer: nn.Module, h: Tensor, **kwargs) -> Tensor:
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


_LLAMA_ATTN_INIT = {
    "init_unit": (Weight("self_attn.q_proj.weight"), Weight("self_attn.k_proj.weight")),
    "init_scaled": (Weight("self_attn.v_proj.weight"), Weight("self_attn.o_proj.weight")),
}
_LLAMA_MLP_INIT = {
    "init_scaled": tuple(Weight(f"mlp.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
}

_LLAMA = Architecture(
    "llama",
    placement="pre",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer("self_attn", _self_attn, input_norm="input_layernorm", **_LLAMA_ATTN_INIT),
        Sublayer("mlp", _mlp, input_norm="post_attention_layernorm", **_LLAMA_MLP_INIT),
    ),
)
_GEMMA = Architecture(
    "gemma",
    placement="sandwich",
    norm="rmsnorm",
    zero_centered=True,
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer(
            "self_attn",
            _self_attn,
            input_norm="input_layernorm",
            branch_norm="post_attention_layernorm",
            **_LLAMA_ATTN_INIT,
        ),
        Sublayer(
            "mlp",
            _mlp,
            input_norm="pre_feedforward_layernorm",
            branch_norm="post_feedforward_layernorm",
            **_LLAMA_MLP_INIT,
        ),
    ),
)
_GPT2 = Architecture(
    "gpt2",
    placement="pre",
    norm="layernorm",
    layers="h",
    final_norm="ln_f",
    dropout="resid_pdrop",
    sublayers=(
        Sublayer(
            "attn",
            _gpt2_attn,
            input_norm="ln_1",
            silenced=("attn.resid_dropout",),
            init_unit=(Weight("attn.c_attn.weight", 0, 3, dim=1), Weight("attn.c_attn.weight", 1, 3, dim=1)),
            init_scaled=(Weight("attn.c_attn.weight", 2, 3, dim=1), Weight("attn.c_proj.weight")),
        ),
        Sublayer(
            "mlp",
            _mlp,
            input_norm="ln_2",
            silenced=("mlp.dropout",),
            init_scaled=(Weight("mlp.c_fc.weight"), Weight("mlp.c_proj.weight")),
        ),
    ),
    unsupported=(("add_cross_attention", "GPT-2 cross-attention (add_cross_attention=True)"),),
)
_BERT = Architecture(
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
            init_unit=(Weight("attention.self.query.weight"), Weight("attention.self.key.weight")),
            init_scaled=(Weight("attention.self.value.weight"), Weight("attention.output.dense.weight")),
        ),
        Sublayer(
            "output",
            _bert_ffn,
            output_norm="output.LayerNorm",
            init_scaled=(Weight("intermediate.dense.weight"), Weight("output.dense.weight")),
        ),
    ),
    unsupported=(("add_cross_attention", "BERT cross-attention (add_cross_attention=True)"),),
)

_OLMO2 = Architecture(
    "olmo2",
    placement="res_post",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer("self_attn", _self_attn, branch_norm="post_attention_layernorm", **_LLAMA_ATTN_INIT),
        Sublayer("mlp", _mlp, branch_norm="post_feedforward_layernorm", **_LLAMA_MLP_INIT),
    ),
)


def _phi3_qkv(config) -> tuple[int, int, int]:
    """Phi-3's packed projection: queries of every head, then keys and values of the key/value heads."""
    head = config.hidden_size // config.num_attention_heads
    kv = config.num_key_value_heads * head
    return (config.num_attention_heads * head, kv, kv)


_PHI3 = Architecture(
    "phi3",
    placement="pre",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    dropout="resid_pdrop",
    sublayers=(
        Sublayer(
            "self_attn",
            _self_attn,
            input_norm="input_layernorm",
            silenced=("resid_attn_dropout",),
            init_unit=tuple(Weight("self_attn.qkv_proj.weight", i, 3, sizes=_phi3_qkv) for i in (0, 1)),
            init_scaled=(
                Weight("self_attn.qkv_proj.weight", 2, 3, sizes=_phi3_qkv),
                Weight("self_attn.o_proj.weight"),
            ),
        ),
        Sublayer(
            "mlp",
            _mlp,
            input_norm="post_attention_layernorm",
            silenced=("resid_mlp_dropout",),
            init_scaled=(Weight("mlp.gate_up_proj.weight"), Weight("mlp.down_proj.weight")),
        ),
    ),
)
_MOE_EXPERTS = tuple(Weight(f"mlp.experts.{p}", experts=True) for p in ("gate_up_proj", "down_proj"))
_MIXTRAL = Architecture(
    "mixtral",
    placement="pre",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer("self_attn", _self_attn, input_norm="input_layernorm", **_LLAMA_ATTN_INIT),
        Sublayer("mlp", _mlp, input_norm="post_attention_layernorm", init_scaled=_MOE_EXPERTS),
    ),
)
_QWEN2_MOE = Architecture(
    "qwen2_moe",
    placement="pre",
    norm="rmsnorm",
    layers="layers",
    final_norm="norm",
    sublayers=(
        Sublayer("self_attn", _self_attn, input_norm="input_layernorm", **_LLAMA_ATTN_INIT),
        Sublayer(
            "mlp",
            _mlp,
            input_norm="post_attention_layernorm",
            init_scaled=tuple(
                Weight(w.path, experts=w.experts, optional=True)
                for w in (
                    *_MOE_EXPERTS,
                    *(Weight(f"mlp.shared_expert.{p}.weight") for p in ("gate_proj", "up_proj", "down_proj")),
                    *_LLAMA_MLP_INIT["init_scaled"],  # dense layers (mlp_only_layers, decoder_sparse_step)
                )
            ),
        ),
    ),
)

for _types, _arch in (
    (("llama", "mistral", "qwen2", "qwen3"), _LLAMA),
    (("gemma2", "gemma3_text"), _GEMMA),
    (("gpt2",), _GPT2),
    (("bert",), _BERT),
    (("olmo2",), _OLMO2),
    (("phi3",), _PHI3),
    (("mixtral",), _MIXTRAL),
    (("qwen2_moe",), _QWEN2_MOE),
):
    register_architecture(_types, _arch)


def norm_options(arch: Architecture) -> dict:
    """Keyword arguments that make addnorm's norm of ``arch.norm`` the family's (Gemma: gain 1 + w)."""
    return {"zero_centered": True} if arch.zero_centered else {}


def architecture_of(model: object) -> Architecture:
    """The :class:`Architecture` of a Hugging Face model (by ``model.config.model_type``), or a one-line
    error listing the supported model types."""
    if not isinstance(model, nn.Module) or not hasattr(model, "config") or not hasattr(model, "base_model"):
        raise TypeError(
            f"model: expected a Hugging Face transformers PreTrainedModel, got {type(model).__name__}"
        )
    model_type = getattr(model.config, "model_type", None)
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        raise ValueError(
            f"model: unsupported model type {model_type!r} ({type(model).__name__}); supported model types: "
            f"{', '.join(ARCHITECTURES)}"
        )
    arch = ARCHITECTURES[model_type]
    for attribute, what in arch.unsupported:
        if getattr(model.config, attribute, False):
            raise ValueError(f"model: {what} is not supported by addnorm.hf")
    return arch
