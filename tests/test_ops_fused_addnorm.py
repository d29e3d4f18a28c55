"""AddNorm's fused path (one addnorm.ops.add_norm call) against its unfused modules: same outputs and
gradients wherever it applies, the unfused path everywhere else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import addnorm as an
import addnorm.addnorm as addnorm_module
from addnorm.placements import Placement

POST_LAYERSCALE = Placement(
    "post_layerscale", "y = N(x + diag(l) D(F(x)))", "test", output_norm=True, gate="layerscale"
)
POST_REZERO = Placement("post_rezero", "y = N(x + a D(F(x)))", "test", output_norm=True, gate="rezero")


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    original = addnorm_module.add_norm

    def spy(*args, **kwargs):
        calls.append(kwargs.get("norm"))
        return original(*args, **kwargs)

    monkeypatch.setattr(addnorm_module, "add_norm", spy)
    return calls


def _pair(d, placement, norm, **kwargs):
    torch.manual_seed(0)
    fused = an.AddNorm(d, placement, norm, fused=True, **kwargs)
    with torch.no_grad():  # non-trivial norm parameters and gates
        for p in fused.parameters():
            p.add_(0.3 * torch.randn_like(p))
    unfused = copy.deepcopy(fused)
    unfused.fused = False
    return fused, unfused


def _compare(fused, unfused, d, train, dtype=torch.float64):
    sub = nn.Sequential(nn.Linear(d, d), nn.GELU()).to(dtype)
    fused.to(dtype), unfused.to(dtype)
    fused.train(train), unfused.train(train)
    x = torch.randn(3, 5, d, dtype=dtype)
    outs, grads = [], []
    for conn in (fused, unfused):
        xi = x.clone().requires_grad_(True)
        sub.zero_grad()
        y = conn(xi, sub)
        y.pow(3).sum().backward()
        outs.append(y.detach())
        grads.append(
            [xi.grad] + [p.grad for p in conn.parameters()] + [p.grad.clone() for p in sub.parameters()]
        )
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "placement, norm, kwargs",
    [
        ("post", "layernorm", {}),
        ("post", "rmsnorm", {}),
        ("pre_post", "layernorm", {}),
        ("deepnorm", "layernorm", {"alpha": 2.5}),
        ("post", "rmsnorm", {"bias": True, "norm_options": {"zero_centered": True}}),
        ("post", "layernorm", {"norm_options": {}, "eps": 1e-3}),
        (POST_LAYERSCALE, "rmsnorm", {}),
        (POST_REZERO, "layernorm", {"gate_init": 0.5}),
    ],
    ids=lambda v: v.name if isinstance(v, Placement) else str(v),
)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout0"])
def test_fused_equals_unfused(placement, norm, kwargs, train, count_fused):
    fused, unfused = _pair(8, placement, norm, dropout=0.0, **kwargs)
    _compare(fused, unfused, 8, train)
    assert count_fused == [norm]  # the fused connection, and only it, used the op


def test_fused_without_affine_and_in_eval_with_dropout(count_fused):
    fused, unfused = _pair(8, "post", "layernorm", dropout=0.3)
    fused.output_norm.weight = None
    unfused.output_norm.weight = None
    _compare(fused, unfused, 8, train=False)
    assert len(count_fused) == 1


@pytest.mark.parametrize(
    "placement, norm, kwargs",
    [
        ("pre", "layernorm", {}),  # no output norm
        ("sandwich", "layernorm", {}),  # branch norm
        ("post", "scalenorm", {}),  # not a LayerNorm/RMSNorm
        ("post", "layernorm", {"dropout_at": "after_add"}),
        ("post", "layernorm", {"residual": False}),
        ("admin", "layernorm", {}),  # omega vector
        ("ngpt", "l2", {}),
    ],
)
def test_other_structures_stay_unfused(placement, norm, kwargs, count_fused):
    fused, unfused = _pair(8, placement, norm, **kwargs)
    _compare(fused, unfused, 8, train=False)
    assert count_fused == []


def test_hooked_norm_and_extra_residual_stay_unfused(count_fused):
    fused, _ = _pair(8, "post", "layernorm")
    seen = []
    handle = fused.output_norm.register_forward_hook(lambda m, a, o: seen.append(o.shape))
    x = torch.randn(2, 8)
    fused(x, nn.Identity())
    assert seen and count_fused == []
    handle.remove()
    fused(x, nn.Identity(), extra_residual=x)
    fused(x, nn.Identity(), return_branch=True)
    assert count_fused == []
    fused(x, nn.Identity())
    assert len(count_fused) == 1


def test_fused_dropout_trains_and_reproduces():
    fused, unfused = _pair(16, "post", "rmsnorm", dropout=0.5)
    fused.train()
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    a = fused(x, nn.Identity())
    torch.manual_seed(1)
    b = fused(x, nn.Identity())
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, fused(x, nn.Identity()))
    fused.eval(), unfused.eval()
    torch.testing.assert_close(fused(x, nn.Identity()), unfused(x, nn.Identity()))


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_models_same_with_fused_and_unfused(placement, count_fused):
    torch.manual_seed(0)
    cfg = an.TransformerConfig(
        d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0, placement=placement, norm="layernorm"
    )
    model = an.LanguageModel(cfg, vocab=50).double()
    ref = copy.deepcopy(model)
    conns = [m for m in ref.modules() if isinstance(m, an.AddNorm)]
    assert conns
    for m in conns:
        m.fused = False
    tokens = torch.randint(0, 50, (2, 7))
    for train in (False, True):
        outs = []
        for mdl in (model, ref):
            mdl.train(train)
            mdl.zero_grad()
            out = mdl(tokens)
            out.float().square().mean().backward()
            outs.append((out.detach(), [p.grad.clone() for p in mdl.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        assert count_fused  # the model's post-norm connections went through the op
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b)
