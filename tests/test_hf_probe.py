"""addnorm.Probe on Hugging Face models, untouched, fused and re-placed: it finds their layers, reports
the same per-layer stream gradient norms, activation RMS and weight-gradient norms for the same function,
and observing changes no output or gradient bit."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import LAYERS, TYPES, step, tiny, tokens

import addnorm as an
import addnorm.hf as anhf

LAYER_LISTS = {"gpt2": "transformer.h", "bert": "bert.encoder.layer"}


def _variants(model_type, **options):
    plain = tiny(model_type, **options)
    fused = anhf.fuse(copy.deepcopy(plain))
    placed = anhf.with_placement(copy.deepcopy(plain), anhf.ARCHITECTURES[model_type].placement)
    return {"untouched": plain, "fused": fused, "re-placed": placed}


@pytest.mark.parametrize("model_type", TYPES)
def test_probe_reads_the_same_stream_on_untouched_fused_and_re_placed_models(model_type):
    ids = tokens()
    seen = {}
    for name, model in _variants(model_type).items():
        with an.Probe(model) as probe:
            step(model, ids)
        prefix = LAYER_LISTS.get(model_type, "model.layers")
        assert probe.layer_names == [f"{prefix}.{i}" for i in range(LAYERS)], name
        seen[name] = (probe.stream_grad_norms(), probe.activation_rms(), probe.weight_grad_norms(None))
        assert all(v > 0 for values in seen[name] for v in values), name
    for name in ("fused", "re-placed"):
        for got, expected in zip(seen[name], seen["untouched"], strict=True):
            assert got == pytest.approx(expected, rel=1e-5), name
    # the oracle for the untouched model: each layer's output and its gradient, kept by hand
    model = _variants(model_type)["untouched"]
    layers = model.base_model.get_submodule(anhf.architecture_of(model).layers)
    outs = []

    def keep(_module, _args, out):
        out.retain_grad()
        outs.append(out)

    handles = [layer.register_forward_hook(keep) for layer in layers]
    step(model, ids)
    for h in handles:
        h.remove()
    assert seen["untouched"][0] == pytest.approx([o.grad.norm().item() for o in outs], rel=1e-6)
    assert seen["fused"][1] == pytest.approx(
        [o.detach().square().mean().sqrt().item() for o in outs], rel=1e-5
    )


@pytest.mark.parametrize("model_type", TYPES)
def test_probing_changes_no_output_or_gradient(model_type):
    ids = tokens()
    for name, model in _variants(model_type, dropout=True).items():
        model.train()  # GPT-2's and BERT's dropouts on: neither the op's seeds nor torch's masks move
        twin = copy.deepcopy(model)
        torch.manual_seed(3)
        logits, loss, grads = step(model, ids)
        torch.manual_seed(3)
        with an.Probe(twin) as probe:
            p_logits, p_loss, p_grads = step(twin, ids)
        assert len(probe.snapshot()) > 0
        assert torch.equal(p_logits, logits) and torch.equal(p_loss, loss), name
        assert p_grads.keys() == grads.keys()
        assert all(torch.equal(p_grads[n], grads[n]) for n in grads), name


def test_probe_names_the_sublayers_of_rewired_layers():
    ids = tokens()
    model = anhf.fuse(tiny("llama"))
    with an.Probe(model) as probe:
        step(model, ids)
    assert probe.sublayers == [["self_attn", "mlp", ""]] * LAYERS
    expected = [layer.mlp.down_proj.weight.grad.norm().item() for layer in model.model.layers]
    assert probe.weight_grad_norms("mlp", "down_proj") == pytest.approx(expected)
    bert = anhf.with_placement(tiny("bert"), "sandwich")
    with an.Probe(bert) as probe:
        step(bert, ids)
    assert probe.sublayers == [["attention", "output", ""]] * LAYERS
    assert all(v > 0 for v in probe.stream_grad_norms("attention"))
