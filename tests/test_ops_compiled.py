"""The fused op, addnorm's models and a training run under ``torch.compile`` on the CPU, against eager
(slow tier: each test compiles its graphs with Inductor). The eager checks of the same calls stay in
``test_ops_add_norm.py``, ``test_ops_fused_addnorm.py`` and ``test_train.py``."""

from __future__ import annotations

import pytest
import torch
from test_ops_add_norm import _TwoSublayers
from test_ops_fused_addnorm import _triton_model_equals_torch
from test_train import TINY, losses

import addnorm as an
from addnorm.train import RunConfig, train

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("scalar_inductor")]  # compilers (torch.compile)


def test_torch_compile_fullgraph_cpu():
    torch.manual_seed(0)
    model = _TwoSublayers(16)
    x = torch.randn(2, 3, 16)
    eager = model(x)
    eager.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(x)
    out.square().sum().backward()
    torch.testing.assert_close(out, eager, atol=1e-5, rtol=1e-5)
    for p, g in zip(model.parameters(), grads, strict=True):
        torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-5)
    # with dropout the seed is drawn inside the graph: still no graph break
    out = compiled(x, 0.1)
    assert torch.isfinite(out).all()


def test_compiled_pre_ln_model_traces_the_held_back_adds_without_graph_breaks():
    import torch._inductor.config as inductor_config

    torch.manual_seed(4)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.1, placement="pre")
    model = an.LanguageModel(cfg, vocab=40).train()
    tokens = torch.randint(0, 40, (2, 8))
    torch._dynamo.reset()
    with inductor_config.patch(fallback_random=True):  # the eager RNG stream, for a like-for-like check
        compiled = torch.compile(model, fullgraph=True)
        torch.manual_seed(5)
        out = compiled(tokens)
        out.square().mean().backward()
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad()
        torch.manual_seed(5)
        eager = model(tokens)
        eager.square().mean().backward()
    torch.testing.assert_close(out, eager, rtol=1e-4, atol=1e-5)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("placement", ["pre", "sandwich"])
def test_a_compiled_model_on_the_triton_backend_equals_the_torch_backend(placement, request):
    """The Triton-backend LanguageModel of ``test_ops_fused_addnorm.py`` gives the torch backend's
    logits and gradients eagerly and under torch.compile(fullgraph=True)."""
    _triton_model_equals_torch(placement, True, request)


def test_compile_trains_like_eager():
    """compile: true runs the unprobed training steps through torch.compile (inductor, on the CPU here):
    the same losses as eager to float rounding; probed steps run the model eagerly."""
    import torch._dynamo

    cfg = dict(TINY, n_layers=1, steps=3, eval_every=0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = train(RunConfig(**cfg, compile=True))
    counters = torch._dynamo.utils.counters
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]  # one whole graph
    eager = train(RunConfig(**cfg))
    assert compiled.provenance["compile"] is True
    torch.testing.assert_close(losses(compiled), losses(eager), atol=1e-5, rtol=1e-5)
    assert compiled.final["val_loss"] == pytest.approx(eager.final["val_loss"], abs=1e-5)
    torch._dynamo.reset()
