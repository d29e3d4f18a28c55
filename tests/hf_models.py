"""Shared helpers of the Hugging Face tests: tiny random models of every supported type, with norm
weights and biases moved off their initial values so that a norm in the wrong place shows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")  # the hf extra; a test module importing this one skips without it

TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt2", "bert"]
TYPES += ["olmo2", "phi3", "mixtral", "qwen2_moe"]  # OLMo 2 (res_post), Phi-3 and the MoE families
VOCAB, LAYERS = 100, 2


def perturbed(model: nn.Module, scale: float = 0.3) -> nn.Module:
    """Add noise to every 1-D parameter (norm gains, biases), in place."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tiny(model_type: str, *, dropout: bool = False, **sizes) -> nn.Module:
    """A tiny model of ``model_type`` in eval mode, every dropout off unless ``dropout``."""
    from addnorm.hf import tiny_model

    if not dropout:
        sizes.setdefault("dropout", 0.0)
    sizes.setdefault("vocab", VOCAB)
    sizes.setdefault("layers", LAYERS)
    return perturbed(tiny_model(model_type, **sizes)).eval()


def tokens(batch: int = 2, seq: int = 7, seed: int = 0) -> torch.Tensor:
    """Token ids that avoid the special ids 0, 1, 2."""
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, ids: torch.Tensor):
    """One forward and backward with the LM loss: (logits, loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads
