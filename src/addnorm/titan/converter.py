"""``AddNormConverter``: torchtitan's model-config converter (``ModelConfigConverter``, the extension
point torchtitan 0.3 applies to a model's config before the model is built, as its float8 and LoRA
converters are) that gives a Llama 3 or Qwen 3 model addnorm's Add & Norm.

``convert(model_config)`` returns a new config tree (the given one is not changed) whose blocks are
:class:`~addnorm.titan.modules.ConnectedBlock` s and whose final norm is a
:class:`~addnorm.titan.modules.FinalNorm`:

- ``placement=None`` (the default): the family's own Pre-LN, fused. Every residual add runs in one
  :func:`addnorm.ops.add_norm` call with the norm that next reads the stream, across blocks into the
  final norm (2L calls for L layers); same function, same parameters, same initialisation and state
  dict as the untouched model.
- ``placement="sandwich" | "post" | "deepnorm" | "mix" | "layerscale" | "rezero" | ...``: the blocks'
  norms and adds re-placed around torchtitan's own attention and FFN (:func:`supported_placements`).
  New norms are torchtitan ``RMSNorm`` s initialised to one; gates start where the placement says
  (ReZero 0, LayerScale 0.1 / 1e-5 / 1e-6 by depth); the placement's matrix initialisation goes into the
  ``param_init`` of the Linear configs, so torchtitan's ``init_weights`` applies it, on the meta device
  or sharded: DeepNet (Wang et al. 2022): N(0, (g * sqrt(2 / (fan_in + fan_out)))^2), g = 1 on queries
  and keys and beta = (8L)^(-1/4) on values, outputs and FFN, alpha = (2L)^(1/4); B2T (Takase et al.
  2023): every matrix times L^(-1/2). The final norm stays, or becomes the identity where the last
  layer's output is normalised already (Post-LN, DeepNorm).

Named in a job's Python config as ``model_registry(flavor, converters=[AddNormConverter.Config(...)])``
or applied to a finished ``Trainer.Config`` with :func:`with_addnorm`.
"""

from ..extras import require

require("torchtitan", "torchtitan", "addnorm.titan")

import copy  # noqa: E402
import dataclasses  # noqa: E402
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from functools import partial  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.distributed.spmd_types import current_spmd_mesh, spmd_mesh_size  # noqa: E402
from torchtitan.models.common import FusedQKVLinear  # noqa: E402
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock  # noqa: E402
from torchtitan.protocols.model import ModelConfigConverter  # noqa: E402

from ..connection import check_bool  # noqa: E402
from ..placement_spec import WeightInit  # noqa: E402
from ..placements import Placement  # noqa: E402
from .families import FAMILIES, SLOT_NAMES, SUBLAYERS  # noqa: E402
from .modules import (  # noqa: E402
    AddNormLlama3Block,
    AddNormLlama3Model,
    AddNormQwen3Block,
    AddNormQwen3Model,
    FinalNorm,
    Gate,
    Wiring,
)
from .plan import LayerPlan, check_placement, plan_layers  # noqa: E402

__all__ = ["AddNormConverter", "convert", "with_addnorm"]

# the family's model config -> (its family, the converted model class, the converted block class,
# the family's block config)
_FAMILY_CLASSES = {
    Llama3Model.Config: ("llama3", AddNormLlama3Model, AddNormLlama3Block, Llama3TransformerBlock.Config),
    Qwen3Model.Config: ("qwen3", AddNormQwen3Model, AddNormQwen3Block, Qwen3TransformerBlock.Config),
}


class AddNormConverter(ModelConfigConverter):
    """addnorm's Add & Norm for torchtitan's Llama 3 and Qwen 3 (see the module docstring).

    ``AddNormConverter.Config(placement=None, mix_fraction=None, fused=True, init=True)``: ``placement``
    None keeps the family's own (Pre-LN) and fuses it; ``mix_fraction`` sets Mix-LN's share of Post-LN
    layers; ``fused=False`` runs the unfused modules (the readable reference); ``init=False`` leaves
    torchtitan's matrix initialisation as it is. The options are checked when the converter is built.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        placement: str | None = None
        mix_fraction: float | None = None
        fused: bool = True
        init: bool = True

    def __init__(self, config: Config):
        self.config = config
        _check_options(config.placement, config.mix_fraction, config.fused, config.init)

    def convert(self, model_config):
        c = self.config
        return convert(model_config, c.placement, mix_fraction=c.mix_fraction, fused=c.fused, init=c.init)


def _check_options(placement, mix_fraction, fused, init) -> Placement | None:
    check_bool("fused", fused)
    check_bool("init", init)
    p = None if placement is None else check_placement(placement)
    if mix_fraction is not None:
        if isinstance(mix_fraction, bool) or not isinstance(mix_fraction, (int, float)):
            raise ValueError(f"mix_fraction: expected a fraction in [0, 1], got {mix_fraction!r}")
        if not 0.0 <= mix_fraction <= 1.0:
            raise ValueError(f"mix_fraction: expected a fraction in [0, 1], got {mix_fraction!r}")
        if p is None or p.layers is None or not isinstance(p.layers[2], float):
            raise ValueError(
                f"mix_fraction: placement {placement!r} does not use it (only a placement whose layers "
                "split by a fraction does, such as 'mix')"
            )
    return p


def _fields(config, **changes) -> dict:
    """A config's fields as keyword arguments, with ``changes``."""
    out = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    out.update(changes)
    return out


def convert(
    model_config,
    placement: str | Placement | None = None,
    *,
    mix_fraction: float | None = None,
    fused: bool = True,
    init: bool = True,
):
    """A converted copy of ``model_config`` (torchtitan's ``Llama3Model.Config`` or ``Qwen3Model.Config``):
    see the module docstring. One-line ``ValueError`` for another model, a placement its blocks cannot
    take, or options that do not fit."""
    p = _check_options(placement, mix_fraction, fused, init)
    family_name, model_cls, block_cls, block_config_cls = _family_of(model_config)
    family = FAMILIES[family_name]
    p = p or check_placement(family.placement)
    config = copy.deepcopy(model_config)
    for i, layer in enumerate(config.layers):
        if type(layer) is not block_config_cls:
            raise ValueError(
                f"model_config: layer {i} is a {type(layer).__qualname__}, not torchtitan's "
                f"{block_config_cls.__qualname__}; addnorm.titan converts {family.title}'s own blocks"
            )
    plans = plan_layers(p, len(config.layers), mix_fraction)
    layers = [
        block_cls.Config(**_fields(layer), wiring=_wiring(layer, plan, len(plans), fused))
        for layer, plan in zip(config.layers, plans, strict=True)
    ]
    if init:
        for i, (layer, plan) in enumerate(zip(layers, plans, strict=True)):
            if plan.init is not None:
                _init_matrices(layer, plan.init, i, p)
    identity = not plans[-1].placement.final_norm
    norm_fields = _fields(config.norm)
    if identity:
        norm_fields.update(elementwise_affine=False, param_init=None)
    record = {"placement": p.name, "mix_fraction": mix_fraction, "fused": fused, "init": init}
    return model_cls.Config(
        **_fields(config, layers=layers, norm=FinalNorm.Config(**norm_fields, identity=identity)),
        addnorm=record,
    )


def with_addnorm(trainer_config, placement: str | Placement | None = None, **options):
    """``trainer_config`` (a torchtitan ``Trainer.Config`` of a Llama 3 or Qwen 3 job) with its model
    converted by :func:`convert` (same options); returns it."""
    spec = trainer_config.model_spec
    spec.model = convert(spec.model, placement, **options)
    return trainer_config


def _family_of(model_config):
    entry = _FAMILY_CLASSES.get(type(model_config))
    if entry is not None:
        return entry
    if isinstance(model_config, (AddNormLlama3Model.Config, AddNormQwen3Model.Config)):
        raise ValueError("model_config: already converted by addnorm.titan; convert the family's own config")
    titles = " and ".join(
        f"{FAMILIES[name].title} ({cls.__qualname__})" for cls, (name, *_) in _FAMILY_CLASSES.items()
    )
    raise ValueError(f"model_config: addnorm.titan converts {titles}, got {type(model_config).__qualname__}")


def _wiring(layer, plan: LayerPlan, n_layers: int, fused: bool) -> Wiring:
    """The norms beyond torchtitan's input norms (clones of its ``attention_norm`` config: same eps, init
    to one) and the gates (started at the placement's value) that ``plan`` asks of one block."""
    norms, gates = {}, {}
    for sublayer, spec in zip(SUBLAYERS, plan.connections, strict=True):
        for slot in spec.norm_slots:
            if slot != "input_norm":
                norms[SLOT_NAMES[slot].format(sublayer=sublayer)] = dataclasses.replace(layer.attention_norm)
        if spec.placement.gate != "none":
            size = 1 if spec.placement.gate == "rezero" else layer.attention_norm.normalized_shape
            init = {"weight": partial(nn.init.constant_, val=float(spec.gate_init))}
            gates["gate" if plan.shared_gate else f"{sublayer}_gate"] = Gate.Config(
                size=size, param_init=init
            )
    return Wiring(placement=plan.placement.name, n_layers=n_layers, fused=fused, norms=norms, gates=gates)


# --- a placement's matrix initialisation, as param_init of torchtitan's Linear configs ------------------


def _init_matrices(layer, init: WeightInit, index: int, p: Placement) -> None:
    """Put ``init`` (:func:`addnorm.placement_spec.weight_init`) into the ``param_init`` of the block's
    matrices: queries and keys are the ``unit`` role, values, attention output and FFN the ``scaled`` one."""
    attention, ffn = layer.attention, layer.feed_forward
    if layer.moe is not None or ffn is None:
        raise ValueError(
            f"placement: {p.name!r} initialises each weight role, which addnorm.titan does for dense "
            f"blocks only; layer {index} is a mixture of experts"
        )
    ffn_linears = [ffn.w1, ffn.w2, ffn.w3]
    if init.kind == "scale":
        for linear in [*_qkv_linears(attention.qkv_linear), attention.wo, *ffn_linears]:
            linear.param_init = _scaled(linear.param_init, init.factor)
        return
    if init.kind != "xavier_normal":
        raise ValueError(
            f"placement: {p.name!r} initialisation {init.kind!r} is not supported by addnorm.titan"
        )
    qkv = attention.qkv_linear
    if not isinstance(qkv, FusedQKVLinear.Config):
        raise ValueError(
            f"placement: {p.name!r} initialises keys and values differently, which torchtitan's shared "
            "wk/wv config cannot express; build the model with fuse_qkv=True"
        )
    dim, hd = qkv.wqkv.in_features, qkv.head_dim
    q_rows, kv_rows = qkv.n_heads * hd, qkv.n_kv_heads * hd
    stds = (_xavier_std(dim, q_rows, init.unit), _xavier_std(dim, kv_rows, init.unit))
    stds += (_xavier_std(dim, kv_rows, init.scaled),)
    qkv.wqkv.param_init = {
        "weight": _fused_qkv_normal(qkv.n_heads, qkv.n_kv_heads, hd, stds),
        "bias": nn.init.zeros_,
    }
    for linear in [attention.wo, *ffn_linears]:
        std = _xavier_std(linear.in_features, linear.out_features, init.scaled)
        linear.param_init = {"weight": partial(nn.init.normal_, mean=0.0, std=std), "bias": nn.init.zeros_}


def _qkv_linears(qkv) -> list:
    return [qkv.wqkv] if isinstance(qkv, FusedQKVLinear.Config) else [qkv.wq, qkv.wkv]


def _xavier_std(fan_in: int, fan_out: int, gain: float) -> float:
    """Xavier-normal's std, gain * sqrt(2 / (fan_in + fan_out)), from the whole matrix's sizes (a shard
    must not change it)."""
    return gain * math.sqrt(2.0 / (fan_in + fan_out))


def _scaled(param_init: dict | None, factor: float) -> dict:
    """``param_init`` with every weight multiplied by ``factor`` after its own init."""
    if not param_init or "weight" not in param_init:
        raise ValueError("model_config: a Linear without a weight param_init cannot be scaled")

    def init(t, base=param_init["weight"]):
        base(t)
        with torch.no_grad():
            t.mul_(factor)

    return {**param_init, "weight": init}


def _fused_qkv_normal(n_heads: int, n_kv_heads: int, head_dim: int, stds: tuple[float, float, float]):
    """The init of torchtitan's fused ``wqkv`` (rows laid out as n_kv_heads groups of [q heads, k, v])
    with N(0, std^2) for the query, key and value rows: each drawn in the stock q/k/v shapes (replicated
    where ``wqkv`` is a sharded DTensor, so the values do not depend on the sharding), laid out, then
    copied into this rank's part, as torchtitan's own fused init does."""
    per_kv = n_heads // n_kv_heads

    def init(t):
        tail = t.shape[1:]
        q, k, v = (
            t.new_empty(rows, *tail).normal_(0.0, std)
            for rows, std in zip(
                (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim), stds, strict=True
            )
        )
        fused = torch.cat(
            [
                q.view(n_kv_heads, per_kv, head_dim, *tail),
                k.view(n_kv_heads, 1, head_dim, *tail),
                v.view(n_kv_heads, 1, head_dim, *tail),
            ],
            dim=1,
        ).view(-1, *tail)
        with torch.no_grad():
            if not isinstance(t, DTensor) and (tp := spmd_mesh_size("tp")) > 1:
                fused = fused.chunk(tp, dim=0)[current_spmd_mesh().get_local_rank("tp")]
            t.copy_(fused)

    return init
