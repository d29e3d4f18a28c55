"""One placement spec for both worlds: (placement, depth, options) -> what each connection of each layer is.

A :class:`~addnorm.Placement` says where the norms go; the rules that depend on where a layer sits are
here, once, and both addnorm's own layers (:mod:`addnorm.model`) and the Hugging Face rewiring
(:func:`addnorm.hf.with_placement`) read them:

- per layer: the placement each layer gets (Mix-LN's Post-LN bottom and Pre-LN top, HybridNorm*'s first
  layer), :func:`layer_placements`;
- per connection: the residual scale alpha (DeepNet: alpha = (2L)^(1/4) decoder- or encoder-only), the
  gate's starting value (ReZero 0, LayerScale 0.1 / 1e-5 / 1e-6 by depth, CaiT), the norm slots in use,
  and the placement the attention connection uses (HybridNorm), :func:`connection_spec`;
- per weight role: how the placement initialises the matrices (DeepNet: Xavier-normal, gain 1 on queries
  and keys and gain beta = (8L)^(-1/4) on values, outputs and FFN; Magneto: the same with gain
  sqrt(log 2N); B2T: every matrix times L^(-1/2)), :func:`weight_init`.

A new placement is registered once (:func:`addnorm.register_placement`, plus a :data:`WEIGHT_INITS` entry
if it brings its own initialisation) and works in both.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from .addnorm import NGPT_ALPHA_INIT, layerscale_init
from .placements import Placement, get_placement
from .registry import Registry

__all__ = [
    "WEIGHT_INITS",
    "ConnectionSpec",
    "Depth",
    "WeightInit",
    "connection_spec",
    "deepnorm_constants",
    "layer_placements",
    "sub_ln_gain",
    "weight_init",
]


@dataclass(frozen=True)
class Depth:
    """Where a layer sits: ``part`` ("encoder" or "decoder") of a model with ``n_encoder`` (N) encoder
    and ``n_decoder`` (M) decoder layers; N = 0 is decoder-only, M = 0 encoder-only."""

    part: str
    n_encoder: int
    n_decoder: int

    @property
    def architecture(self) -> str:
        if self.n_encoder and self.n_decoder:
            return "encoder_decoder"
        return "encoder" if self.n_encoder else "decoder"

    @property
    def n_layers(self) -> int:
        return self.n_encoder if self.part == "encoder" else self.n_decoder


def deepnorm_constants(depth: Depth) -> tuple[float, float]:
    """(alpha, beta) of DeepNet (Wang et al. 2022, Table 1) for N encoder and M decoder layers:
    encoder-only alpha = (2N)^(1/4), beta = (8N)^(-1/4); decoder-only alpha = (2M)^(1/4),
    beta = (8M)^(-1/4); encoder-decoder: encoder alpha = 0.81 (N^4 M)^(1/16), beta = 0.87 (N^4 M)^(-1/16),
    decoder alpha = (3M)^(1/4), beta = (12M)^(-1/4)."""
    n, m = depth.n_encoder, depth.n_decoder
    if depth.architecture == "encoder":
        return (2 * n) ** 0.25, (8 * n) ** -0.25
    if depth.architecture == "decoder":
        return (2 * m) ** 0.25, (8 * m) ** -0.25
    if depth.part == "encoder":
        return 0.81 * (n**4 * m) ** (1 / 16), 0.87 * (n**4 * m) ** (-1 / 16)
    return (3 * m) ** 0.25, (12 * m) ** -0.25


def sub_ln_gain(depth: Depth) -> float:
    """Magneto's init gain (Wang et al. 2022, Foundation Transformers): sqrt(log 2N) for encoder- or
    decoder-only; encoder-decoder: encoder sqrt(log(3M) log(2N) / 3), decoder sqrt(log 3M)."""
    n, m = depth.n_encoder, depth.n_decoder
    if depth.architecture != "encoder_decoder":
        return math.sqrt(math.log(2 * depth.n_layers))
    if depth.part == "encoder":
        return math.sqrt(math.log(3 * m) * math.log(2 * n) / 3)
    return math.sqrt(math.log(3 * m))


def layer_placements(
    placement: str | Placement, n_layers: int, mix_fraction: float | None = None
) -> list[Placement]:
    """The placement of each of ``n_layers`` layers (:meth:`Placement.layer_placements`: Mix-LN's
    ``bottom`` for the first ceil(f * L) layers, ``f`` = ``mix_fraction`` or the placement's own)."""
    return get_placement(placement).layer_placements(n_layers, mix_fraction)


@dataclass(frozen=True)
class ConnectionSpec:
    """One connection of a layer: the ``placement`` it runs (the attention connection of HybridNorm
    runs its own, with ``norm`` forced), ``alpha`` (None: the placement's), ``gate_init`` (None: no gate
    or the gate's default) and the norm slots in use."""

    placement: Placement
    alpha: float | None
    gate_init: float | None
    norm: str | None = None

    @property
    def norm_slots(self) -> tuple[str, ...]:
        return self.placement.norm_slots


def connection_spec(placement: str | Placement, depth: Depth, *, attention: bool = False) -> ConnectionSpec:
    """What one connection of a layer with (per-layer) ``placement`` at ``depth`` is: DeepNorm's alpha
    from :func:`deepnorm_constants`, LayerScale's start from :func:`addnorm.layerscale_init`, ReZero's 0,
    nGPT's 0.05; ``attention``: the attention sublayer's connection."""
    p, norm = get_placement(placement), None
    if attention and p.attention_connection is not None:
        name, norm = p.attention_connection
        p = get_placement(name)
    alpha = deepnorm_constants(depth)[0] if p.init == "deepnorm" else None
    gate_init = {
        "layerscale": layerscale_init(depth.n_layers),
        "rezero": 0.0,
        "ngpt": NGPT_ALPHA_INIT,
    }.get(p.gate)
    return ConnectionSpec(p, alpha, gate_init, norm)


@dataclass(frozen=True)
class WeightInit:
    """How a placement initialises a layer's weight matrices, by role.

    ``kind``: ``"xavier_normal"`` (Xavier-normal with gain ``unit`` on queries and keys and ``scaled`` on
    values, attention outputs and FFN matrices), ``"scale"`` (every matrix multiplied by ``factor``),
    ``"unit"`` (nGPT: N(0, 1) then unit vectors) or ``"profiled"`` (Admin: set by a pass on data)."""

    kind: str
    unit: float = 1.0
    scaled: float = 1.0
    factor: float = 1.0


WEIGHT_INITS: Registry[Callable[[Depth], WeightInit]] = Registry("placement init")
WEIGHT_INITS.register(
    "deepnorm", lambda depth: WeightInit("xavier_normal", scaled=deepnorm_constants(depth)[1])
)
WEIGHT_INITS.register("sub_ln", lambda depth: WeightInit("xavier_normal", scaled=sub_ln_gain(depth)))
WEIGHT_INITS.register("b2t", lambda depth: WeightInit("scale", factor=max(depth.n_layers, 1) ** -0.5))
WEIGHT_INITS.register("ngpt", lambda depth: WeightInit("unit"))
WEIGHT_INITS.register("admin", lambda depth: WeightInit("profiled"))


def weight_init(placement: str | Placement, depth: Depth) -> WeightInit | None:
    """How ``placement`` initialises a layer's matrices at ``depth`` (None: it keeps the model's)."""
    p = get_placement(placement)
    return None if p.init is None else WEIGHT_INITS[p.init](depth)
