"""Initialisation schemes, by name (``TransformerConfig.init``), applied to freshly built layers.

Every layer is built and initialised on its own, so no two layers start with cloned weights
(``nn.TransformerEncoder`` deep-copies one layer N times).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..addnorm import AddNorm
from ..placement_spec import Depth, WeightInit, deepnorm_constants, sub_ln_gain, weight_init  # noqa: F401 (re-exported)
from ..registry import Registry
from .attention import MultiHeadAttention
from .feedforward import FeedForward
from .ngpt import sublayer_matrices, unit_

INITS: Registry = Registry("init")


@INITS.register("torch")
def init_torch(module: nn.Module, n_layers: int) -> None:
    """torch.nn's own: Xavier-uniform packed Q/K/V, zero attention biases, default Linear elsewhere."""
    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            nn.init.xavier_uniform_(m.in_proj.weight)
            for lin in (m.in_proj, m.out_proj):
                if lin.bias is not None:
                    nn.init.zeros_(lin.bias)


@INITS.register("xavier")
def init_xavier(module: nn.Module, n_layers: int) -> None:
    """Xavier-uniform on every weight matrix, zero biases (Glorot & Bengio 2010; ``nn.Transformer``)."""
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.xavier_uniform_(m.weight)
            if m.bias is not None:
                nn.init.zeros_(m.bias)


@INITS.register("gpt2")
def init_gpt2(module: nn.Module, n_layers: int) -> None:
    """GPT-2 (Radford et al. 2019): N(0, 0.02) weights, zero biases, and the projections that write into
    the residual stream (attention output, FFN W2) scaled by 1/sqrt(2 * n_layers)."""
    scaled = 0.02 / math.sqrt(2 * max(n_layers, 1))
    for m in module.modules():
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            nn.init.normal_(m.out_proj.weight, std=scaled)
        elif isinstance(m, FeedForward):
            nn.init.normal_(m.w2.weight, std=scaled)


def init_layer(module: nn.Module, scheme: str, n_layers: int) -> None:
    """Initialise one layer's sublayers in place with the named scheme."""
    INITS[scheme](module, n_layers)


# --- depth-aware constants and initialisations named by placements ---------------------------------


def _xavier_normal_rows(weight: torch.Tensor, rows: slice, gain: float) -> None:
    """Xavier-normal on a row block of a packed projection, as if it were its own matrix."""
    block = weight[rows]
    std = gain * math.sqrt(2.0 / (block.shape[0] + block.shape[1]))
    with torch.no_grad():
        block.normal_(0.0, std)


def scaled_xavier_init(
    module: nn.Module, gain: float, skip: tuple[nn.Module, ...] = (), unit: float = 1.0
) -> None:
    """Xavier-normal with ``gain`` on FFN matrices, value and output projections; gain ``unit`` (1) on
    queries and keys (the DeepNet / Magneto recipe). Sublayers in ``skip`` keep their initialisation."""
    for m in module.modules():
        if any(m is s for s in skip):
            continue
        if isinstance(m, MultiHeadAttention):
            d = m.d_model
            w = m.in_proj.weight
            _xavier_normal_rows(w, slice(0, d), unit)  # queries, keys and values, each (d, d)
            _xavier_normal_rows(w, slice(d, 2 * d), unit)
            _xavier_normal_rows(w, slice(2 * d, 3 * d), gain)
            nn.init.xavier_normal_(m.out_proj.weight, gain=gain)
        elif isinstance(m, FeedForward):
            nn.init.xavier_normal_(m.w1.weight, gain=gain)
            nn.init.xavier_normal_(m.w2.weight, gain=gain)


PLACEMENT_INITS: Registry = Registry("placement init")
"""How addnorm's own layers apply each placement's :func:`addnorm.placement_spec.weight_init` (the
gains and factors are the spec's, shared with :func:`addnorm.hf.with_placement`)."""


def _spec(name: str, depth: Depth) -> WeightInit:
    return weight_init(name, depth)


@PLACEMENT_INITS.register("deepnorm")
def _init_deepnorm(module: nn.Module, depth: Depth) -> None:
    w = _spec("deepnorm", depth)
    scaled_xavier_init(module, w.scaled, unit=w.unit)


@PLACEMENT_INITS.register("sub_ln")
def _init_sub_ln(module: nn.Module, depth: Depth) -> None:
    """Magneto's gain on every sublayer but cross-attention, which torchscale leaves unscaled (its
    decoder skips ``encoder_attn``) and builds without an inner norm."""
    cross = getattr(module, "cross_attn", None)
    w = _spec("sub_ln", depth)
    scaled_xavier_init(module, w.scaled, skip=() if cross is None else (cross,), unit=w.unit)


@PLACEMENT_INITS.register("b2t")
def _init_b2t(module: nn.Module, depth: Depth) -> None:
    """B2T's ``rescaling_init`` (Takase et al. 2023): every weight matrix of the layer (not the biases,
    not the norms) multiplied by L^(-1/2), L the depth of its stack."""
    scale = _spec("b2t", depth).factor
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                m.weight.mul_(scale)


@PLACEMENT_INITS.register("ngpt")
def _init_ngpt(module: nn.Module, depth: Depth) -> None:
    """nGPT: each matrix drawn from N(0, 1) and its d_model-sized vectors normalised to unit length
    (the authors draw N(0, 1/sqrt(d)) and normalise; only the direction remains)."""
    matrices = sublayer_matrices(module)
    with torch.no_grad():
        for weight, _ in matrices:
            weight.normal_()
    unit_(matrices)


@PLACEMENT_INITS.register("admin")
def _init_admin(module: nn.Module, depth: Depth) -> None:
    """Admin's omega is set later by a profiling pass on data (:func:`admin_init`)."""


@torch.no_grad()
def admin_init(model: nn.Module, *inputs, **kwargs) -> list[torch.Tensor]:
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
