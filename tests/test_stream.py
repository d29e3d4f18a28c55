"""model/stream.py used from outside addnorm's own layers: a Llama-style model written with plain torch
modules gets its adds fused through Stream and Connection, and Probe finds its observation points."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import addnorm as an
import addnorm.connection as connection_module
from addnorm.connection import ConnectionRole
from addnorm.model.stream import Connection, Stream

D, LAYERS, EPS = 16, 3, 1e-6


class ForeignBlock(nn.Module):
    """A Llama-style Pre-LN decoder block written without addnorm (attention stands in as a Linear)."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(D, eps=EPS)
        self.attn = nn.Linear(D, D)
        self.post_attention_layernorm = nn.RMSNorm(D, eps=EPS)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.SiLU(), nn.Linear(2 * D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class ForeignModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(ForeignBlock() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D, eps=EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def _sharing(norm: nn.RMSNorm) -> an.RMSNorm:
    """addnorm's RMSNorm (which the op computes) on the foreign norm's own weight Parameter."""
    ours = an.RMSNorm(D, eps=norm.eps)
    ours.weight = norm.weight
    return ours


def _fuse(model: ForeignModel) -> None:
    """What an integration does: one Pre-LN AddNorm per residual connection, its input norm sharing the
    model's weights, registered on the layer with its role (the sublayer it wraps) so that Probe finds it
    and credits it the sublayer's weights; and a forward that passes one Stream through every connection
    and ends with the final norm."""
    for layer in model.layers:
        for sub, kind, norm in (
            ("attn", "attention", layer.input_layernorm),
            ("mlp", "ffn", layer.post_attention_layernorm),
        ):
            conn = an.AddNorm(D, "pre", "rmsnorm")
            conn.norm = _sharing(norm)
            conn.connection_role = ConnectionRole(sub, kind)
            setattr(layer, f"{sub}_block", conn)
    final = _sharing(model.norm)
    steps = [(Connection(layer.attn_block), Connection(layer.mlp_block), layer) for layer in model.layers]

    def forward(x: torch.Tensor) -> torch.Tensor:
        stream = Stream(x)
        for attn, mlp, layer in steps:
            stream = attn(stream, layer.attn)
            stream = mlp(stream, layer.mlp)
        return stream.output(final)

    model.forward = forward


@pytest.fixture
def models():
    torch.manual_seed(0)
    plain = ForeignModel().double()
    with torch.no_grad():
        for p in plain.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    fused = copy.deepcopy(plain)
    _fuse(fused)
    return plain, fused


def _step(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    y = model(x)
    y.square().mean().backward()
    return y.detach(), {n: p.grad for n, p in model.named_parameters() if "_block" not in n}


def test_a_foreign_pre_ln_model_fuses_every_add_and_keeps_its_function(models, monkeypatch):
    calls = []
    op = connection_module.add_norm
    monkeypatch.setattr(
        connection_module, "add_norm", lambda *a, **k: calls.append(k["prenorm"]) or op(*a, **k)
    )
    plain, fused = models
    x = torch.randn(2, 5, D, dtype=torch.float64)
    y_plain, g_plain = _step(plain, x)
    y_fused, g_fused = _step(fused, x)
    assert calls == [True] * (2 * LAYERS)  # every add met the next norm (the last: the final norm)
    torch.testing.assert_close(y_fused, y_plain)
    assert g_fused.keys() == g_plain.keys()  # the model's own parameters, norms included, get gradients
    for name in g_plain:
        torch.testing.assert_close(g_fused[name], g_plain[name], msg=name)


def test_probe_finds_the_foreign_model_s_observation_points(models):
    plain, fused = models
    x = torch.randn(2, 5, D, dtype=torch.float64)
    # oracle: the plain model's stream after each block, with its gradient
    outs = []

    def keep(_module, _args, out):
        out.retain_grad()
        outs.append(out)

    handles = [layer.register_forward_hook(keep) for layer in plain.layers]
    _step(plain, x)
    for h in handles:
        h.remove()
    with an.Probe(fused, "layers") as probe:
        _step(fused, x)
    assert probe.sublayers == [["attn", "mlp", ""]] * LAYERS
    assert probe.stream_grad_norms() == pytest.approx([o.grad.norm().item() for o in outs], rel=1e-9)
    assert probe.activation_rms() == pytest.approx([o.detach().square().mean().sqrt().item() for o in outs])
    assert probe.weight_grad_norms("mlp", "0") == pytest.approx(
        [layer.mlp[0].weight.grad.norm().item() for layer in plain.layers], rel=1e-9
    )
