"""Initialisation schemes, by name (``TransformerConfig.init``), applied to freshly built layers, and
the weight roles of addnorm's own layers, through which a placement's own initialisation
(:data:`addnorm.placement_spec.PLACEMENT_INITS`, the one registry both worlds read) reaches them.

Every layer is built and initialised on its own, so no two layers start with cloned weights
(``nn.TransformerEncoder`` deep-copies one layer N times).
"""

from __future__ import annotations

import math

from torch import nn

from ..placement_spec import (  # noqa: F401 (re-exported)
    PLACEMENT_INITS,
    Depth,
    RoleWeight,
    WeightInit,
    admin_init,
    apply_weight_init,
    deepnorm_constants,
    sub_ln_gain,
    weight_init,
)
from ..registry import Registry
from .attention import MultiHeadAttention
from .feedforward import FeedForward

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


# --- a placement's own initialisation, through the layer's weight roles --------------------------------


def layer_weights(module: nn.Module) -> list[RoleWeight]:
    """The matrices of ``module``'s attention and FFN sublayers by weight role, in module order: per
    attention, its packed projection's query, key and value blocks (each (d, d), initialised as its own
    matrix) and its output projection; per FFN, W1 and W2. Cross-attention's are marked ``cross``."""
    cross_attn = getattr(module, "cross_attn", None)
    cross = set() if cross_attn is None else {id(m) for m in cross_attn.modules()}
    found: list[RoleWeight] = []
    for m in module.modules():
        if isinstance(m, MultiHeadAttention):
            d, w, is_cross = m.d_model, m.in_proj.weight, id(m) in cross
            found += [
                RoleWeight("unit", w[:d], 1, is_cross),
                RoleWeight("unit", w[d : 2 * d], 1, is_cross),
                RoleWeight("scaled", w[2 * d :], 1, is_cross),
                RoleWeight("scaled", m.out_proj.weight, 0, is_cross),
            ]
        elif isinstance(m, FeedForward):
            found += [RoleWeight("scaled", m.w1.weight, 1), RoleWeight("scaled", m.w2.weight, 0)]
    return found


def init_placement(module: nn.Module, init: WeightInit | None) -> None:
    """A placement's own initialisation (:func:`addnorm.placement_spec.weight_init`) of one of addnorm's
    layers, through its weight roles (:func:`layer_weights`); None: nothing."""
    if init is not None:
        apply_weight_init(layer_weights(module), init)
