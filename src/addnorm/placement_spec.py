"""One placement spec for both worlds: (placement, depth, options) -> what each layer and connection is,
how each weight role is initialised, and what a placement does before and during training.

A :class:`~addnorm.Placement` says where the norms go; the rules that depend on where a layer sits are
here, once, and both addnorm's own layers (:mod:`addnorm.model`) and the Hugging Face rewiring
(:func:`addnorm.hf.with_placement`) read them:

- per layer (:func:`layer_spec`): the placement each layer gets (Mix-LN's Post-LN bottom and Pre-LN top,
  HybridNorm*'s first layer, :func:`layer_placements`), its connections, whether they share one gate
  (ReZero: one a per layer), whether the layer input skips to the last connection (B2T), and its init;
- per connection (:func:`connection_spec`): the residual scale alpha (DeepNet: alpha = (2L)^(1/4)
  decoder- or encoder-only), the gate's starting value (ReZero 0, LayerScale 0.1 / 1e-5 / 1e-6 by depth,
  CaiT), the norm slots in use, and the placement the attention connection uses (HybridNorm);
- per weight role (:func:`weight_init`, :func:`apply_weight_init`): how the placement initialises the
  matrices (DeepNet: Xavier-normal, gain 1 on queries and keys and gain beta = (8L)^(-1/4) on values,
  outputs and FFN; Magneto: the same with gain sqrt(log 2N); B2T: every matrix times L^(-1/2); nGPT:
  unit vectors), given a layer's matrices by role (:class:`RoleWeight`): each world lists its own;
- per model (:class:`Lifecycle`): what a placement does around training, as hooks on its
  :class:`PlacementInit`: a pass on data before the first step (Admin's profiling, :func:`admin_init`),
  something after every optimiser step (nGPT's renormalisation).

A new placement is registered once (:func:`addnorm.register_placement`), plus, if it brings its own
initialisation, one :data:`PLACEMENT_INITS` entry, and works in both worlds and in the training loop.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .connection import NGPT_ALPHA_INIT, AddNorm, layerscale_init
from .placements import Placement, get_placement
from .registry import Registry

__all__ = [
    "PLACEMENT_INITS",
    "ConnectionSpec",
    "Depth",
    "LayerSpec",
    "Lifecycle",
    "PlacementInit",
    "RoleWeight",
    "WeightInit",
    "admin_init",
    "apply_weight_init",
    "connection_spec",
    "deepnorm_constants",
    "layer_placements",
    "layer_spec",
    "sub_ln_gain",
    "weight_init",
    "why_not_around_sublayers",
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


def why_not_around_sublayers(
    p: Placement, sublayers: str = "the sublayers", norm_note: str = ""
) -> str | None:
    """Why ``p`` cannot go around a model's own sublayers, kept as they are (:mod:`addnorm.hf`'s models,
    :mod:`addnorm.titan`'s blocks), as a phrase, or None: it may change nothing inside them (no norm in
    ``sublayers``, no query/key norm) and nothing of the stream between layers but B2T's layer input,
    and needs no norm of its own (``norm_note`` says what the model's norm is); a placement per layer
    (Mix-LN) is judged by its layers'."""
    if p.sublayer_norm:
        return f"puts a norm inside {sublayers}"
    if p.attention_norm or p.attention_connection:
        return "normalises queries/keys inside attention"
    if p.stream not in ("standard", "b2t"):
        return f"changes the residual stream across layers ({p.stream})"
    if p.norm is not None:
        return f"needs its own norm ({p.norm}){norm_note}"
    if p.layers is not None:
        for q in p.layer_kinds():
            why = why_not_around_sublayers(q, sublayers, norm_note)
            if why is not None:
                return why
    return None


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

    ``kind``: ``"xavier_normal"`` (Xavier-normal with gain ``unit`` on the ``"unit"`` role, queries and
    keys, and ``scaled`` on the ``"scaled"`` role, values, attention outputs and FFN matrices),
    ``"scale"`` (every matrix multiplied by ``factor``), ``"unit"`` (nGPT: N(0, 1), then unit vectors
    along each matrix's d_model side) or ``"profiled"`` (Admin: set by a pass on data, nothing at
    build time). ``cross``: whether cross-attention matrices take it too (Magneto leaves them as built)."""

    kind: str
    unit: float = 1.0
    scaled: float = 1.0
    factor: float = 1.0
    cross: bool = True

    def gain(self, role: str) -> float:
        """The Xavier gain of weight role ``role``."""
        return self.unit if role == "unit" else self.scaled


WEIGHT_ROLES = ("unit", "scaled")


@dataclass(frozen=True, eq=False)
class RoleWeight:
    """One weight matrix of a layer as the placement inits see it: ``role`` ``"unit"`` (queries, keys)
    or ``"scaled"`` (values, attention outputs, FFN), ``tensor`` the matrix (a view: one block of a
    packed projection, one expert), ``sphere_dim`` the dimension along which its d_model-sized vectors
    lie (1: rows, a matrix that reads the stream; 0: columns, one that writes it; None: not known, no
    nGPT init), ``cross``: a cross-attention matrix; ``fan_sum``: fan_in + fan_out of the matrix it is
    part of (the rows of a packed projection that make up one matrix; None: its own shape's)."""

    role: str
    tensor: Tensor
    sphere_dim: int | None = None
    cross: bool = False
    fan_sum: int | None = None


@torch.no_grad()
def apply_weight_init(weights: Sequence[RoleWeight], init: WeightInit) -> None:
    """Initialise ``weights`` (a layer's matrices by role, in the layer's order) as ``init`` says, in
    place: the one place both worlds' placement inits are drawn."""
    weights = [w for w in weights if init.cross or not w.cross]
    if init.kind == "xavier_normal":
        for w in weights:
            if w.fan_sum is None:
                nn.init.xavier_normal_(w.tensor, gain=init.gain(w.role))
            else:  # Glorot & Bengio's std of the whole matrix this part belongs to
                w.tensor.normal_(0.0, init.gain(w.role) * math.sqrt(2.0 / w.fan_sum))
    elif init.kind == "scale":
        for w in weights:
            w.tensor.mul_(init.factor)
    elif init.kind == "unit":
        if any(w.sphere_dim is None for w in weights):
            raise ValueError("init: nGPT's unit init needs each matrix's d_model side (sphere_dim)")
        drawn: list[Tensor] = []  # each matrix drawn whole, once (the blocks of a packed projection)
        for w in weights:
            base = w.tensor if w.tensor._base is None else w.tensor._base
            if not any(base is b for b in drawn):
                drawn.append(base)
                base.normal_()
        unit_([(w.tensor, w.sphere_dim) for w in weights])
    elif init.kind != "profiled":
        raise ValueError(f"init: unknown weight init kind {init.kind!r}")


@torch.no_grad()
def unit_(matrices: list[tuple[Tensor, int]]) -> None:
    """Project each (weight, dim) onto the unit sphere along ``dim``, in float32, in place."""
    for weight, dim in matrices:
        weight.copy_(F.normalize(weight.float(), dim=dim, eps=1e-12).to(weight.dtype))


@dataclass(frozen=True)
class PlacementInit:
    """A placement's own initialisation and lifecycle (``Placement.init`` names it): ``weights(depth)``,
    how it draws a layer's matrices (:class:`WeightInit`); ``prepare(model, *inputs, **kwargs)``, a pass
    on data before training (Admin's profiling); ``after_step(model)``, run after every optimiser step
    (nGPT's renormalisation). Read by addnorm's layers, :func:`addnorm.hf.with_placement` and the training
    loop (:class:`Lifecycle`) alike."""

    weights: Callable[[Depth], WeightInit]
    prepare: Callable[..., object] | None = None
    after_step: Callable[[nn.Module], object] | None = None


PLACEMENT_INITS: Registry[PlacementInit] = Registry("placement init")


def weight_init(placement: str | Placement, depth: Depth) -> WeightInit | None:
    """How ``placement`` initialises a layer's matrices at ``depth`` (None: it keeps the model's)."""
    p = get_placement(placement)
    return None if p.init is None else PLACEMENT_INITS[p.init].weights(depth)


@dataclass(frozen=True)
class LayerSpec:
    """One layer: its ``placement``, one :class:`ConnectionSpec` per sublayer (in the layer's order),
    ``shared_gate`` (its connections share the first one's gate: ReZero's one a per layer), ``b2t`` (the
    first connection keeps the layer input, the last adds it before its norm) and ``init`` (how its
    matrices start, :func:`weight_init`)."""

    placement: Placement
    connections: tuple[ConnectionSpec, ...]
    shared_gate: bool
    b2t: bool
    init: WeightInit | None

    def share_gates(self, blocks: Sequence[AddNorm]) -> None:
        """Make ``blocks`` (this layer's connections, built from :attr:`connections`) share one gate when
        the spec says so."""
        if self.shared_gate:
            for block in blocks[1:]:
                block.gate = blocks[0].gate


def layer_spec(placement: str | Placement, depth: Depth, sublayers: Sequence[str]) -> LayerSpec:
    """What one layer with (per-layer) ``placement`` at ``depth`` builds for its ``sublayers`` (their
    kinds, in order: ``"attention"``, ``"cross_attention"``, ``"ffn"``, ``"parallel"``)."""
    p = get_placement(placement)
    attention = ("attention", "cross_attention")
    conns = tuple(connection_spec(p, depth, attention=kind in attention) for kind in sublayers)
    return LayerSpec(p, conns, p.layer_gate and len(conns) > 1, p.stream == "b2t", weight_init(p, depth))


# --- Admin's profiling pass ------------------------------------------------------------------------------
@torch.no_grad()
def admin_init(model: nn.Module, *inputs, **kwargs) -> list[Tensor]:
    """Admin's profiling pass (Liu et al. 2020), as Transformer-Clinic's ``adaptive-profiling`` runs it:
    one forward pass ``model(*inputs, **kwargs)`` in training mode (dropout on, as in training), in which
    each connection i, before it runs, gets omega_i = r (one running value r per stack, starting at 1),
    and after its branch then sets r = sqrt(Var[omega_i * x_i] + Var[D(F_i(x_i))]), x_i its input and
    D(F_i) its branch as added (variances over every element). With unit-variance inputs this is
    omega_i^2 = 1 + sum_{j<i} Var[F_j]. Returns the omegas set (one per connection)."""
    conns = [m for m in model.modules() if isinstance(m, AddNorm) and m.omega is not None]
    if not conns:
        raise ValueError("model: has no Admin connections (placement='admin') to initialise")
    for c in conns:
        c.omega.fill_(1.0)
    stack_of = {}
    for stack in model.modules():
        if hasattr(stack, "layers") and isinstance(stack.layers, nn.ModuleList):
            for m in stack.modules():
                if isinstance(m, AddNorm):
                    stack_of.setdefault(id(m), id(stack))
    ratio: dict[int, float] = {}  # the running value r of each stack
    input_var: dict[int, float] = {}  # Var[omega_i * x_i] of the connection running now
    done: set[int] = set()

    def before(conn: AddNorm):
        def hook(module, args, x):
            if id(conn) not in done:
                conn.omega.fill_(ratio.get(stack_of.get(id(conn), 0), 1.0))
                input_var[id(conn)] = (x * conn.omega).float().var(unbiased=False).item()

        return hook

    def after(conn: AddNorm):
        def hook(module, args, branch):
            if id(conn) not in done and id(conn) in input_var:
                var = input_var.pop(id(conn)) + branch.float().var(unbiased=False).item()
                ratio[stack_of.get(id(conn), 0)] = math.sqrt(var)
                done.add(id(conn))

        return hook

    handles = []
    for c in conns:
        # the branch as added: after the branch dropout, or before it when dropout follows the add
        added = c.dropout if c.dropout_at == "branch" else c.branch
        handles += [c.stream_in.register_forward_hook(before(c)), added.register_forward_hook(after(c))]
    was_training = model.training
    try:
        model.train()
        model(*inputs, **kwargs)
    finally:
        model.train(was_training)
        for h in handles:
            h.remove()
    return [c.omega.detach().clone() for c in conns]


# --- the inits, by name ----------------------------------------------------------------------------------
PLACEMENT_INITS.register(
    "deepnorm", PlacementInit(lambda depth: WeightInit("xavier_normal", scaled=deepnorm_constants(depth)[1]))
)
# Magneto's gain on every sublayer but cross-attention, which torchscale leaves unscaled (its decoder
# skips ``encoder_attn``)
PLACEMENT_INITS.register(
    "sub_ln", PlacementInit(lambda depth: WeightInit("xavier_normal", scaled=sub_ln_gain(depth), cross=False))
)
# B2T's ``rescaling_init`` (Takase et al. 2023): every weight matrix of the layer times L^(-1/2)
PLACEMENT_INITS.register(
    "b2t", PlacementInit(lambda depth: WeightInit("scale", factor=max(depth.n_layers, 1) ** -0.5))
)
PLACEMENT_INITS.register("admin", PlacementInit(lambda depth: WeightInit("profiled"), prepare=admin_init))


class Lifecycle:
    """The hooks of the placements a model's connections run (:class:`PlacementInit`), in registry order:
    ``Lifecycle.of(model)``; :meth:`prepare` before training (with a batch of the model's inputs, where
    :attr:`needs_data`), :meth:`after_step` after every optimiser step. A model without such placements
    has none, and both do nothing."""

    def __init__(self, inits: Sequence[PlacementInit]) -> None:
        self.inits = tuple(inits)

    @classmethod
    def of(cls, model: nn.Module) -> Lifecycle:
        names = {m.placement.init for m in model.modules() if isinstance(m, AddNorm)}
        return cls([PLACEMENT_INITS[n] for n in PLACEMENT_INITS if n in names])

    @property
    def needs_data(self) -> bool:
        return any(i.prepare is not None for i in self.inits)

    @property
    def steps(self) -> bool:
        """Whether anything runs after an optimiser step."""
        return any(i.after_step is not None for i in self.inits)

    def prepare(self, model: nn.Module, *inputs, **kwargs) -> None:
        for init in self.inits:
            if init.prepare is not None:
                init.prepare(model, *inputs, **kwargs)

    def after_step(self, model: nn.Module) -> None:
        for init in self.inits:
            if init.after_step is not None:
                init.after_step(model)
