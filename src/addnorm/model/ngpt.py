"""nGPT's model-level parts (Loshchilov et al. 2024, "nGPT: Normalized Transformer with Representation
Learning on the Hypersphere"): the scaled logit head and the renormalisation of every matrix.

In nGPT every vector that lives in the embedding space R^d is a unit vector: hidden states (the
``ngpt`` placement's connections), token embeddings, output embeddings, and the d-dimensional side of
every weight matrix. The optimiser step moves them off the sphere, so after each step
:func:`ngpt_normalize_` projects them back:

| matrix | shape | unit vectors |
| --- | --- | --- |
| token embeddings | (V, d) | rows |
| logit head | (V, d) | rows |
| attention ``in_proj`` (Q, K, V packed) | (3d, d) | rows |
| attention ``out_proj`` | (d, d) | columns |
| FFN ``w1`` | (d_ff or 2 d_ff, d) | rows |
| FFN ``w2`` | (d, d_ff) | columns |

The learned scales (the eigen learning rates alpha, s_qk, s_u/s_v, s_z) are not renormalised; they are
vectors, so the training loop's optimiser groups give them no weight decay, and nGPT's matrices none
either (the paper trains with weight decay 0 and no warmup).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..placement_spec import PLACEMENT_INITS, PlacementInit, WeightInit, unit_
from .attention import MultiHeadAttention
from .embedding import _Embedding
from .feedforward import FeedForward

__all__ = ["NGPTHead", "ngpt_matrices", "ngpt_normalize_", "sublayer_matrices"]


class NGPTHead(nn.Linear):
    """nGPT's logits: z = s_z * (E x), E the (vocab, d) output embeddings (unit rows) and s_z a learned
    per-token scale initialised to 1, stored at scale 1/sqrt(d) (the parameter ``s_z`` starts at
    1/sqrt(d) and is used times sqrt(d)). Same weight layout as the ``nn.Linear`` head it replaces."""

    def __init__(self, d_model: int, vocab: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__(d_model, vocab, bias=bias, device=device, dtype=dtype)
        self.s_z_scale = d_model**-0.5
        self.s_z = nn.Parameter(torch.full((vocab,), self.s_z_scale, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        return (self.s_z / self.s_z_scale) * super().forward(x)


def sublayer_matrices(module: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """(weight, dim) of every nGPT attention and FFN matrix inside ``module``: ``dim`` is the dimension
    along which its d_model-sized vectors lie (1: rows, 0: columns)."""
    found: list[tuple[nn.Parameter, int]] = []
    for m in module.modules():
        if isinstance(m, MultiHeadAttention) and m.normalize == "ngpt":
            found += [(m.in_proj.weight, 1), (m.out_proj.weight, 0)]
        elif isinstance(m, FeedForward) and m.s_uv is not None:
            found += [(m.w1.weight, 1), (m.w2.weight, 0)]
    return found


def ngpt_matrices(model: nn.Module) -> list[tuple[nn.Parameter, int]]:
    """(weight, dim) of every matrix that nGPT keeps on the unit sphere in ``model`` (see the module
    docstring): its nGPT sublayers' matrices, its :class:`NGPTHead` heads and, when it has nGPT
    sublayers, its token embeddings. Empty for a model without nGPT layers; a weight shared by two
    modules (tied embeddings) is listed once."""
    found = sublayer_matrices(model)
    if found:
        found += [(m.weight, 1) for m in model.modules() if isinstance(m, NGPTHead)]
        found += [(m.tokens.weight, 1) for m in model.modules() if isinstance(m, _Embedding)]
    seen: set[int] = set()
    unique = []
    for weight, dim in found:
        if id(weight) not in seen:
            seen.add(id(weight))
            unique.append((weight, dim))
    return unique


def ngpt_normalize_(model: nn.Module) -> int:
    """Renormalise every nGPT matrix of ``model`` to unit vectors along its d_model side, in place (the
    authors' ``normalize_matrices``): call it after every optimiser step (the training loop does).
    Returns how many matrices it normalised; a model without nGPT layers is a ``ValueError``.

    Use in your own loop::

        loss.backward(); opt.step(); opt.zero_grad(); addnorm.ngpt_normalize_(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected an nn.Module, got {type(model).__name__}")
    matrices = ngpt_matrices(model)
    if not matrices:
        raise ValueError("model: has no nGPT layers (placement='ngpt') whose matrices to renormalise")
    unit_(matrices)
    return len(matrices)


# nGPT's init: each matrix N(0, 1), then unit vectors along its d_model side (the authors draw
# N(0, 1/sqrt(d)) and normalise; only the direction remains); after every optimiser step, back on the sphere
PLACEMENT_INITS.register("ngpt", PlacementInit(lambda depth: WeightInit("unit"), after_step=ngpt_normalize_))
