"""The record of a Hugging Face family, as data: where a model keeps its layers and final norm, which norm
fills which slot of each residual connection, how a layer calls its sublayers, where its residual
dropout lives, which weights play which role, and how a config of the family is written at given sizes.

One :class:`Architecture` per family, registered under each ``config.model_type`` it covers
(:data:`ARCHITECTURES`); the families addnorm ships are in :mod:`addnorm.hf.families` (adding one touches
that file only), a user's go through :func:`addnorm.hf.register_architecture`, which checks the record on
a tiny model first. Everything else about a model (embeddings, masks, caches, heads, the layer loop)
stays the model's own code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import NamedTuple

from torch import Tensor, nn

from ..extras import require
from ..placement_spec import RoleWeight
from ..registry import Registry

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ConfigSpec",
    "Sizes",
    "Sublayer",
    "Weight",
    "architecture_of",
    "norm_eps",
    "norm_options",
    "require_transformers",
]

TRANSFORMERS_RANGE = ">=5.17,<5.24"
SUBLAYER_KINDS = ("attention", "ffn", "cross_attention")


def require_transformers() -> ModuleType:
    """``transformers``, or a one-line error naming the extra that installs it."""
    return require("transformers", "hf", f"addnorm.hf (Hugging Face transformers{TRANSFORMERS_RANGE})")


@dataclass(frozen=True)
class Weight:
    """A weight matrix of a sublayer (path relative to the layer), or one block of it along ``dim``:
    block ``block`` of ``count`` equal blocks (GPT-2's packed query/key/value projection), or of the
    blocks whose sizes ``sizes(config)`` gives (Phi-3's query/key/value projection with fewer key/value
    heads), or the rows ``parts(config)`` gives as (start, stop) ranges along ``dim``, one matrix spread
    over them (GPT-NeoX's queries, interleaved per head with keys and values: its init reads the whole
    matrix's fans). ``experts``: the parameter stacks one matrix per expert along dim 0 (Mixtral,
    Qwen2-MoE), each initialised as its own matrix. ``optional``: a layer may lack it (Qwen2-MoE's dense
    layers)."""

    path: str
    block: int | None = None
    count: int = 1
    dim: int = 0
    sizes: Callable[[object], tuple[int, ...]] | None = None
    experts: bool = False
    optional: bool = False
    parts: Callable[[object], tuple[tuple[int, int], ...]] | None = None

    def matrices(self, layer: nn.Module, config) -> list[Tensor]:
        """The matrices (views) this spec names in ``layer``: none if it is optional and absent."""
        return [m for m, _ in self.pieces(layer, config)]

    def pieces(self, layer: nn.Module, config) -> list[tuple[Tensor, int | None]]:
        """(view, fan sum) of each piece this spec names: a matrix (fan sum None: its own shape's), or one
        of ``parts``, with the fans of the matrix they make up together."""
        try:
            weight = layer.get_parameter(self.path)
        except AttributeError:
            if self.optional:
                return []
            raise
        if self.parts is not None:
            ranges = self.parts(config)
            total = sum(stop - start for start, stop in ranges) + weight.shape[1 - self.dim]
            return [(weight.narrow(self.dim, start, stop - start), total) for start, stop in ranges]
        if self.block is not None:
            if self.sizes is None:
                weight = weight.chunk(self.count, self.dim)[self.block]
            else:
                weight = weight.split(list(self.sizes(config)), self.dim)[self.block]
        return [(m, None) for m in weight.unbind(0)] if self.experts else [(weight, None)]


@dataclass(frozen=True)
class Sublayer:
    """One sublayer F of a layer and the residual connection around it.

    ``name``: the layer's attribute holding F's weights (what ``Probe`` credits to this connection);
    ``call(layer, h, **kwargs)``: F(h), given the keyword arguments the layer was called with; it must
    return one tensor of h's shape: what the layer adds to its stream for this sublayer, before the
    residual dropout the connection applies (the model's residual multipliers included: Granite's
    ``residual_multiplier``); the ``*_norm`` fields: the paths (relative to the layer) of the model's own
    norms in each slot of the connection; ``silenced``: dropout modules inside F that the connection's
    own dropout replaces (it runs inside the fused op); ``init_unit`` / ``init_scaled``: the weights
    DeepNet-style initialisation gives gain 1 (queries, keys) and gain beta (values, outputs, FFN);
    ``kind``: ``"attention"``, ``"ffn"`` or ``"cross_attention"`` (default: attention for the first
    sublayer, FFN for the others), the role observers read; ``dropout``: the config attribute of this
    connection's residual dropout rate where it is not the record's (Falcon's sequential layers).
    """

    name: str
    call: Callable[..., Tensor]
    input_norm: str | None = None
    branch_norm: str | None = None
    output_norm: str | None = None
    silenced: tuple[str, ...] = ()
    init_unit: tuple[Weight, ...] = ()
    init_scaled: tuple[Weight, ...] = ()
    kind: str | None = None
    dropout: str | None = None

    @property
    def block(self) -> str:
        """The layer attribute its connection is registered as (the state-dict name of its tensors)."""
        return f"{self.name}_block"

    def norm_paths(self) -> dict[str, str]:
        """Slot name -> path of the model's norm in that slot."""
        slots = ("input_norm", "branch_norm", "output_norm")
        return {slot: getattr(self, slot) for slot in slots if getattr(self, slot) is not None}

    def weights(self, layer: nn.Module, config) -> list[RoleWeight]:
        """This sublayer's matrices in ``layer`` by weight role (:class:`addnorm.placement_spec.RoleWeight`):
        ``init_unit`` as ``"unit"``, ``init_scaled`` as ``"scaled"``."""
        return [
            RoleWeight(role, matrix, fan_sum=fans)
            for role, specs in (("unit", self.init_unit), ("scaled", self.init_scaled))
            for spec in specs
            for matrix, fans in spec.pieces(layer, config)
        ]


class Sizes(NamedTuple):
    """The sizes a config of a family is written at (:attr:`ConfigSpec.fields` reads them)."""

    layers: int
    hidden: int
    heads: int
    ffn: int


@dataclass(frozen=True)
class ConfigSpec:
    """How a config of the family is written at addnorm's sizes (tiny random models for tests, ``addnorm
    inspect --hf`` and benchmarks; the runs of a study's ``model: hf-<type>``), and what a fresh model of
    it is.

    ``ffn``: the field of the FFN width; ``kv_heads``: the field of the key/value heads (grouped-query
    attention: tiny models get half the heads, a study's ``kv_heads`` sets it), ``head_dim``: a field set
    to hidden // heads; ``rope``: the field of the RoPE parameters a study's ``rope_theta`` sets;
    ``dropouts``: every dropout-rate field (``dropout=`` sets them all); ``fields(sizes)``: any other
    fields at these :class:`Sizes` (experts, GPT-J's rotary dimension); ``lm``: ``"causal"`` or
    ``"masked"`` (the head of a tiny model; BERT); ``study``: a study may train it (``model:
    hf-<type>``, ``_text`` dropped); ``scaled_embeddings``: the model multiplies token embeddings by
    sqrt(hidden) (Gemma; read by the study's ``hf_init``)."""

    ffn: str = "intermediate_size"
    kv_heads: str | None = None
    head_dim: str | None = None
    rope: str | None = None
    dropouts: tuple[str, ...] = ("attention_dropout",)
    fields: Callable[[Sizes], dict] | None = None
    lm: str = "causal"
    study: bool = False
    scaled_embeddings: bool = False


@dataclass(frozen=True)
class Architecture:
    """Where one model family keeps what addnorm rewires (paths relative to ``model.base_model``).

    ``placement``: the model's own Add & Norm in addnorm's terms; ``norm``: ``"rmsnorm"`` or
    ``"layernorm"``, ``zero_centered`` for Gemma's gain 1 + w; ``norm_eps``: how to read the norms'
    epsilon (None: their ``variance_epsilon`` or ``eps`` attribute; a name: that attribute; a number:
    that value, for norms that hold none, such as OLMo 1's); a norm without ``weight`` or ``bias``
    attributes computes without them. ``layers``: the layer list; ``final_norm``: the norm the model
    applies after its last layer (None: none); ``final_norm_home``: where ``with_placement`` registers a
    final norm the model lacks (the last layer then applies it); ``stack``: ``"decoder"`` or
    ``"encoder"`` (the depth DeepNet's constants are read for); ``dropout``: the config attribute of the
    residual dropout rate; ``unsupported``: config features the rewired layers cannot run, as (attribute,
    message) pairs checked for truthiness; ``parallel``: the layer is a parallel block, x + F_1(N(x)) +
    F_2(N'(x)) (GPT-J, GPT-NeoX, Falcon, Phi, Cohere): one connection around the sum of its sublayers,
    N the first sublayer's input norm, N' the second's (the same path for one shared norm);
    ``returns_tuple``: the layer returns ``(hidden_states, attention_weights)``, the weights being the
    second output of its first sublayer's module (``Sublayer.name``), which the model collects from the
    layers' returns (GPT-J, CodeGen, Falcon; rewired, read from that module when the call asks for them
    with ``output_attentions``, else None);
    ``variant(config)``: the record for this config when it differs (GPT-NeoX without its parallel
    residual), or a one-line reason it cannot be rewired, or None; ``config``: :class:`ConfigSpec`.
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
    norm_eps: float | str | None = None
    parallel: bool = False
    returns_tuple: bool = False
    variant: Callable[[object], Architecture | str | None] | None = None
    config: ConfigSpec = field(default_factory=ConfigSpec)

    def layers_of(self, model: nn.Module) -> list[nn.Module]:
        """The model's layers, in order."""
        return list(model.base_model.get_submodule(self.layers))

    def residual_dropout(self, config, index: int = 0) -> float:
        """The model's dropout rate on the residual branch of connection ``index`` (0 where it has
        none): its sublayer's ``dropout`` attribute, or the record's."""
        name = self.connections()[index][1][0].dropout or self.dropout
        return float(getattr(config, name) or 0.0) if name else 0.0

    def kind(self, index: int) -> str:
        """What sublayer ``index`` is to observers: its ``kind``, or by position."""
        if self.parallel:
            return "parallel"
        return self.sublayers[index].kind or ("attention" if index == 0 else "ffn")

    def connections(self) -> list[tuple[str, tuple[Sublayer, ...]]]:
        """(block name, sublayers) of each connection of a layer: one per sublayer, or one named
        ``parallel_block`` around every sublayer of a parallel block."""
        if self.parallel:
            return [("parallel_block", self.sublayers)]
        return [(s.block, (s,)) for s in self.sublayers]

    def branch_norm_path(self) -> str | None:
        """A parallel block's second input norm N' (the second sublayer's, where it is not the first's)."""
        if not self.parallel or len(self.sublayers) < 2:
            return None
        first, second = self.sublayers[0].input_norm, self.sublayers[1].input_norm
        return second if second != first else None

    def eps_of(self, module: nn.Module) -> float:
        """The epsilon of the model's norm ``module`` (see ``norm_eps``)."""
        return norm_eps(module, self.norm_eps)

    def weights(self, layer: nn.Module, config) -> list[RoleWeight]:
        """Every matrix of ``layer``'s sublayers by weight role, in the order the sublayers list them."""
        return [w for sublayer in self.sublayers for w in sublayer.weights(layer, config)]


def norm_eps(module: nn.Module, how: float | str | None = None) -> float:
    """A Hugging Face norm's epsilon: ``how`` as a number, or the attribute it names, or by default
    ``variance_epsilon`` (Llama family) or ``eps``; a one-line error when the norm holds neither."""
    if isinstance(how, (int, float)) and not isinstance(how, bool):
        return float(how)
    names = (how,) if isinstance(how, str) else ("variance_epsilon", "eps")
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    raise ValueError(
        f"norm_eps: {type(module).__name__} has no epsilon attribute {' or '.join(map(repr, names))}; "
        "give the record's norm_eps as a number (the epsilon its forward uses) or the attribute's name"
    )


ARCHITECTURES: Registry[Architecture] = Registry("model type")


def norm_options(arch: Architecture) -> dict:
    """Keyword arguments that make addnorm's norm of ``arch.norm`` the family's (Gemma: gain 1 + w)."""
    return {"zero_centered": True} if arch.zero_centered else {}


def resolve(arch: Architecture, config) -> Architecture:
    """The record for ``config``: ``arch``, or what its ``variant`` gives (a reason: a one-line error)."""
    for attribute, what in arch.unsupported:
        if getattr(config, attribute, False):
            raise ValueError(f"model: {what} is not supported by addnorm.hf")
    if arch.variant is None:
        return arch
    chosen = arch.variant(config)
    if isinstance(chosen, str):
        raise ValueError(f"model: {chosen}, which addnorm.hf cannot rewire")
    return arch if chosen is None or chosen is arch else resolve(chosen, config)


def architecture_of(model: object) -> Architecture:
    """The :class:`Architecture` of a Hugging Face model (by ``model.config.model_type``, resolved for its
    config), or a one-line error listing the supported model types."""
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
    return resolve(ARCHITECTURES[model_type], model.config)
