"""AdamW with the usual parameter groups: no weight decay on norm gains, biases and other 1-D params."""

from __future__ import annotations

import torch
from torch import nn

from ..model.ngpt import ngpt_matrices


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Matrices (and embeddings) decay; vectors and scalars (norm gains, biases, gates, nGPT's scales) do
    not, nor do the matrices that nGPT renormalises after every step (its paper trains with none)."""
    unit = {id(w) for w, _ in ngpt_matrices(model)}
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 and id(p) not in unit else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.01) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=(0.9, 0.98), eps=1e-9)
