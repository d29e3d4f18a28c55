"""What a fused or re-placed Hugging Face model returns, on every layout of every registered record: every
tensor the untouched model returns with ``output_attentions`` and ``output_hidden_states`` (the attention
weights included, which GPT-J, CodeGen and Falcon collect from their layers' returns, the others through
hooks on their attention modules), the cache, and the gradients those tensors receive."""

from __future__ import annotations

import copy

import hf_models
import pytest
import torch
from hf_models import LAYERS, tiny, tokens
from torch import Tensor

import addnorm.hf as anhf
from addnorm.hf import families, families_parallel
from addnorm.hf.architectures import resolve

LAYOUTS = hf_models.layouts()
IDS = [hf_models.layout_id(t, fields) for t, fields in LAYOUTS]

# README, "Families": float32 bit for bit, "Cohere and StableLM's parallel layers to float32 rounding",
# every returned tensor within 2^-20 of its largest value
F32_ROUNDED = {"cohere", "stablelm (parallel)"}
F32_ROUNDING = 2.0**-20


def _tensors(out) -> dict[str, Tensor]:
    """Every tensor in a transformers model output by name: the logits, each hidden state and attention
    map, each cached key and value."""
    found: dict[str, Tensor] = {}

    def walk(name: str, value) -> None:
        if isinstance(value, Tensor):
            found[name] = value
        elif isinstance(value, (tuple, list)):
            for i, v in enumerate(value):
                walk(f"{name}.{i}", v)
        elif hasattr(value, "layers"):  # a Cache: its keys and values per layer
            for i, layer in enumerate(value.layers):
                walk(f"{name}.{i}.keys", layer.keys)
                walk(f"{name}.{i}.values", layer.values)

    for key, value in out.items():
        walk(key, value)
    return found


def _returned(model, ids: Tensor) -> dict[str, Tensor]:
    """What ``model`` returns with attention weights and hidden states, and the gradient each hidden state
    and attention map receives from a fixed function of the logits (``grad:<name>``)."""
    out = model(ids, output_attentions=True, output_hidden_states=True)
    found = _tensors(out)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    kept = {n: t for n, t in found.items() if n.startswith(("hidden_states", "attentions"))}
    for t in kept.values():
        t.retain_grad()
    logits = out.logits
    (logits * torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)).sum().backward()
    found.update((f"grad:{n}", t.grad) for n, t in kept.items() if t.grad is not None)
    return {n: t.detach() for n, t in found.items()}


@pytest.mark.parametrize("attention", ["eager", "default"])
@pytest.mark.parametrize("model_type, fields", LAYOUTS, ids=IDS)
def test_fused_and_re_placed_models_return_every_tensor_the_model_returns(model_type, fields, attention):
    """The untouched model's tensors, bit for bit (Cohere and StableLM's parallel layers to float32
    rounding): from the fused model, and from the model re-placed with its own placement (the same
    function). Eager attention returns the weights; with the model's default one (SDPA) most families
    return none, and Falcon's attention takes its eager path when its layer's call asks for them."""
    sizes = {"attn_implementation": "eager"} if attention == "eager" else {}
    plain = tiny(model_type, **sizes, **fields)
    arch = anhf.architecture_of(plain)
    ids = tokens()
    expected = _returned(plain, ids)
    if attention == "eager":
        assert all(f"grad:attentions.{i}" in expected for i in range(LAYERS))
    for how, model in (
        ("fuse", anhf.fuse(copy.deepcopy(plain))),
        ("with_placement", anhf.with_placement(copy.deepcopy(plain), arch.placement)),
    ):
        got = _returned(model, ids)
        assert got.keys() == expected.keys(), how
        for name, e in expected.items():
            if arch.name in F32_ROUNDED:
                tol = F32_ROUNDING * e.abs().max().item()
                torch.testing.assert_close(got[name], e, rtol=0, atol=tol, msg=f"{how}: {name}")
            else:
                assert torch.equal(got[name], e), f"{how}: {name}"


def test_the_layouts_reach_every_shipped_record():
    """The layouts above cover every record addnorm ships, variants included, and every registered type."""
    shipped = {
        v.name
        for m in (families, families_parallel)
        for v in vars(m).values()
        if isinstance(v, anhf.Architecture)
    }
    reached = {resolve(anhf.ARCHITECTURES[t], anhf.tiny_config(t, **fields)).name for t, fields in LAYOUTS}
    assert reached == shipped
    assert {t for t, _ in LAYOUTS} == set(anhf.ARCHITECTURES)
