"""Initialisation schemes, by name (``TransformerConfig.init``), applied to freshly built layers.

Every layer is built and initialised on its own, so no two layers start with cloned weights
(``nn.TransformerEncoder`` deep-copies one layer N times).
"""

from __future__ import annotations

import math

from torch import nn

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
