"""Position-wise feed-forward networks: ReLU/GELU (Vaswani et al. 2017) and SwiGLU (Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..registry import Registry

ACTIVATIONS: Registry = Registry("activation")
ACTIVATIONS.register("relu", F.relu)
ACTIVATIONS.register("gelu", F.gelu)
GATED_ACTIVATIONS = ("swiglu",)


class FeedForward(nn.Module):
    """FFN(x) = W2 D(act(W1 x + b1)) + b2; for ``swiglu``: W2 D(silu(W1a x) * W1b x) with W1 = [W1a; W1b].

    ``inner_norm`` (Sub-LN) normalises the hidden activations after the activation dropout and before
    W2: W2 N(D(act(W1 x))), as torchscale's ``FeedForwardNetwork``.
    ``scale_hidden`` (nGPT, Loshchilov et al. 2024) multiplies W1 x by a learned per-unit vector before
    the activation: s_u and s_v of the paper, one entry per row of W1, initialised to 1 and used times
    sqrt(d_model) (the parameter ``s_uv`` starts at 1; nGPT's code scales both SwiGLU halves).
    ``w1`` is (d_ff, d) — (2 d_ff, d) for SwiGLU — and ``w2`` is (d, d_ff), as ``linear1``/``linear2``
    of ``nn.TransformerEncoderLayer``.
    """

    # x is read by ``w1`` only: under autocast a connection may hand it over in autocast's dtype
    # (addnorm.model.stream.sublayer_dtype)
    autocast_input = True

    def __init__(
        self,
        d_model: int,
        d_ff: int,
        activation: str = "relu",
        dropout: float = 0.0,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        inner_norm: nn.Module | None = None,
        scale_hidden: bool = False,
    ) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.activation = activation
        self.gated = activation in GATED_ACTIVATIONS
        self._act = None if self.gated else ACTIVATIONS[activation]
        self.w1 = nn.Linear(d_model, (2 if self.gated else 1) * d_ff, bias=bias, **kw)
        self.w2 = nn.Linear(d_ff, d_model, bias=bias, **kw)
        self.dropout = nn.Dropout(dropout)
        self.inner_norm = inner_norm  # Sub-LN: a norm on the hidden activations before W2
        self.s_uv: nn.Parameter | None = None
        if scale_hidden:  # nGPT's s_u, s_v: stored at 1, used times sqrt(d_model)
            self.s_uv_factor = d_model**0.5
            self.s_uv = nn.Parameter(torch.ones(self.w1.out_features, **kw))

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.w1(x)
        if self.s_uv is not None:
            hidden = (self.s_uv * self.s_uv_factor) * hidden
        if self.gated:
            gate, value = hidden.chunk(2, dim=-1)
            hidden = F.silu(gate) * value
        else:
            hidden = self._act(hidden)
        hidden = self.dropout(hidden)
        if self.inner_norm is not None:
            hidden = self.inner_norm(hidden)
        return self.w2(hidden)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}"
