"""Probe: observes per-layer stream statistics and gradient norms without changing the model."""

from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn

import addnorm as an
import addnorm.connection as connection_module
from addnorm.ops import policy
from addnorm.probe import METRICS, Probe

VOCAB = 50


def _lm(placement: str = "pre", n_layers: int = 3, seed: int = 0) -> an.LanguageModel:
    torch.manual_seed(seed)
    cfg = an.TransformerConfig(
        d_model=16, n_heads=2, d_ff=32, n_layers=n_layers, dropout=0.0, placement=placement, init="xavier"
    )
    return an.LanguageModel(cfg, VOCAB)


def _tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(seed))


def _lm_loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _run(model, tokens, probe=None):
    model.zero_grad(set_to_none=True)
    if probe is None:
        loss = _lm_loss(model, tokens)
        loss.backward()
    else:
        with probe:
            loss = _lm_loss(model, tokens)
            loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_outputs_and_gradients_bit_identical_with_probe():
    model, tokens = _lm("post"), _tokens()
    loss0, grads0 = _run(model, tokens)
    probe = Probe(model)
    loss1, grads1 = _run(model, tokens, probe)
    assert torch.equal(loss0, loss1)
    for name in grads0:
        assert torch.equal(grads0[name], grads1[name]), name
    assert probe.snapshot()  # it did record
    # hooks are gone after the block: nothing new is recorded
    probe.clear()
    _run(model, tokens)
    assert {r["metric"] for r in probe.snapshot()} == {"weight_grad_norm", "weight_norm"}
    assert all(math.isnan(v) for v in probe.stream_grad_norms())


def test_auto_layers_and_sublayers_of_language_model():
    model = _lm("pre", n_layers=3)
    probe = Probe(model)
    assert len(probe) == 3
    assert probe.layer_names == [n for n, m in model.named_modules() if m in list(model.layers)]
    assert probe.sublayers == [["self_attn", "ff", ""]] * 3


def test_recorded_values_match_independent_computation():
    model, tokens = _lm("pre", n_layers=2), _tokens(1)
    # oracle: the same model with every add unfused, so each ff connection's output s is a tensor of its
    # own that the next norm and the next add read; capture it and its gradient with retain_grad. The
    # probed model fuses each add with the next norm, where s and N(s) leave one op.
    oracle = copy.deepcopy(model)
    for m in oracle.modules():
        if isinstance(m, an.AddNorm):
            m.fused = False
    outs = {}

    def keep(i):
        def hook(_m, _a, out):
            out.retain_grad()
            outs[i] = out

        return hook

    handles = [
        layer.ff_block.stream_out.register_forward_hook(keep(i)) for i, layer in enumerate(oracle.layers)
    ]
    _run(oracle, tokens)
    for h in handles:
        h.remove()
    probe = Probe(model)
    _run(model, tokens, probe)
    model = oracle  # the weight gradients below are the oracle's (the same up to rounding)
    rows = probe.snapshot(step=7)
    assert {r["metric"] for r in rows} == set(METRICS)
    assert all(r["step"] == 7 for r in rows)
    keys = {"step", "layer", "layer_name", "sublayer", "metric", "param", "value"}
    assert all(set(r) == keys and isinstance(r["value"], float) for r in rows)

    def get(layer, sub, metric, param=None):
        (row,) = [
            r
            for r in rows
            if (r["layer"], r["sublayer"], r["metric"], r["param"]) == (layer, sub, metric, param)
        ]
        return row["value"]

    for i, layer in enumerate(model.layers):
        out = outs[i].detach().double()
        assert get(i, "ff", "act_mean") == pytest.approx(out.mean().item(), rel=1e-5, abs=1e-6)
        assert get(i, "ff", "act_std") == pytest.approx(out.std(correction=0).item(), rel=1e-5)
        assert get(i, "ff", "act_rms") == pytest.approx(out.pow(2).mean().sqrt().item(), rel=1e-5)
        assert get(i, "ff", "grad_norm") == pytest.approx(outs[i].grad.norm().item(), rel=1e-5)
        # the layer's output is its ff connection's output
        assert get(i, "", "grad_norm") == pytest.approx(outs[i].grad.norm().item(), rel=1e-5)
        w1, w2 = layer.ff.w1.weight, layer.ff.w2.weight
        assert get(i, "ff", "weight_grad_norm", "ff.w1.weight") == pytest.approx(w1.grad.norm().item())
        assert get(i, "ff", "weight_norm", "ff.w2.weight") == pytest.approx(w2.norm().item())
        sa_params = {
            r["param"] for r in rows if (r["layer"], r["sublayer"]) == (i, "self_attn") and r["param"]
        }
        assert sa_params == {f"self_attn.{n}" for n, p in layer.self_attn.named_parameters() if p.ndim >= 2}
    combined = [
        math.hypot(la.ff.w1.weight.grad.norm().item(), la.ff.w2.weight.grad.norm().item())
        for la in model.layers
    ]
    assert probe.weight_grad_norms("ff") == pytest.approx(combined, rel=1e-5)
    one = [la.ff.w2.weight.grad.norm().item() for la in model.layers]
    assert probe.weight_grad_norms("ff", "w2") == pytest.approx(one, rel=1e-6)
    assert probe.weight_grad_norms("ff", "ff.w2.weight") == pytest.approx(one, rel=1e-6)
    every = [
        math.sqrt(sum(p.grad.norm().item() ** 2 for p in la.parameters() if p.ndim >= 2))
        for la in model.layers
    ]
    assert probe.weight_grad_norms(None) == pytest.approx(every, rel=1e-5)
    assert probe.activation_rms("ff") == pytest.approx(
        [outs[i].detach().pow(2).mean().sqrt().item() for i in range(2)], rel=1e-5
    )


def _keep(out: torch.Tensor, outs: list) -> None:
    out.retain_grad()
    outs.append(out)


def test_torch_transformer_encoder_with_selector():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    enc = nn.TransformerEncoder(layer, num_layers=3, enable_nested_tensor=False)
    x = torch.randn(2, 5, 16)
    outs = []
    handles = [m.register_forward_hook(lambda _m, _a, o: _keep(o, outs)) for m in enc.layers]
    for probe in (Probe(enc, "layers"), Probe(enc), Probe(enc, list(enc.layers))):
        outs.clear()
        enc.zero_grad()
        with probe:
            y = enc(x)
            y.square().sum().backward()
        assert len(probe) == 3
        assert probe.sublayers == [[""]] * 3
        assert probe.layer_names == ["layers.0", "layers.1", "layers.2"]
        assert probe.stream_grad_norms() == pytest.approx([o.grad.norm().item() for o in outs], rel=1e-5)
        assert probe.activation_rms() == pytest.approx(
            [o.detach().pow(2).mean().sqrt().item() for o in outs], rel=1e-5
        )
        expected = [
            math.sqrt(sum(p.grad.norm().item() ** 2 for p in m.parameters() if p.ndim >= 2))
            for m in enc.layers
        ]
        assert probe.weight_grad_norms(None) == pytest.approx(expected, rel=1e-5)
        assert probe.weight_grad_norms("") == pytest.approx(expected, rel=1e-5)
        with pytest.raises(ValueError, match="sublayer"):
            probe.weight_grad_norms("ff")
    for h in handles:
        h.remove()


def test_callable_selector_and_decoder_layers():
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="pre")
    model = an.Transformer(cfg, src_vocab=VOCAB, tgt_vocab=VOCAB)
    probe = Probe(model)  # every module with AddNorm children: 2 encoder + 2 decoder layers
    assert len(probe) == 4
    assert probe.sublayers[2] == ["self_attn", "cross_attn", "ff", ""]
    dec = Probe(model, lambda name, m: isinstance(m, an.DecoderLayer))
    assert dec.layer_names == ["decoder.layers.0", "decoder.layers.1"]
    src, tgt = _tokens(2), _tokens(3)
    with dec:
        model(src, tgt).sum().backward()
    assert all(v > 0 for v in dec.stream_grad_norms("cross_attn"))
    assert all(v > 0 for v in dec.weight_grad_norms("cross_attn"))


def test_no_grad_forward_and_repeated_steps():
    model = _lm("post", n_layers=2)
    with Probe(model) as probe:
        with torch.no_grad():
            model(_tokens()[:, :-1])
        assert all(v > 0 for v in probe.activation_rms())
        assert all(math.isnan(v) for v in probe.stream_grad_norms())
        assert not [r for r in probe.snapshot() if r["metric"] in ("grad_norm", "weight_grad_norm")]
        seen = []
        for seed in range(3):
            model.zero_grad()
            _lm_loss(model, _tokens(seed)).backward()
            seen.append(probe.stream_grad_norms("self_attn"))
        assert all(v > 0 for row in seen for v in row)
        assert seen[0] != seen[1]  # each backward overwrites with its own values
    probe.clear()
    assert {r["metric"] for r in probe.snapshot()} == {"weight_grad_norm", "weight_norm"}
    assert all(math.isnan(v) for v in probe.activation_rms())


def test_a_layer_list_elsewhere_than_model_layers_is_found():
    """Without AddNorm connections or ``model.layers``, the layers are the longest ModuleList of modules of
    one class (Hugging Face keeps them at ``transformer.h``, ``bert.encoder.layer``, ...)."""

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = nn.Linear(4, 4)

        def forward(self, x):
            return x + self.ff(x)

    model = nn.Module()
    model.heads = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    model.body = nn.Module()
    model.body.h = nn.ModuleList(Block() for _ in range(3))
    model.mixed = nn.ModuleList([Block(), nn.Linear(4, 4), Block(), Block()])  # not one class
    probe = Probe(model)
    assert probe.layer_names == ["body.h.0", "body.h.1", "body.h.2"]
    x = torch.randn(2, 4, requires_grad=True)
    with probe:
        y = x
        for block in model.body.h:
            y = block(y)
        y.square().sum().backward()
    assert probe.weight_grad_norms(None) == pytest.approx(
        [b.ff.weight.grad.norm().item() for b in model.body.h]
    )


def test_bad_arguments():
    model = _lm()
    with pytest.raises(TypeError, match="model"):
        Probe("not a model")
    with pytest.raises(ValueError, match="layers"):
        Probe(model, "no.such.path")
    with pytest.raises(ValueError, match="layers"):
        Probe(model, lambda n, m: False)
    with pytest.raises(TypeError, match="layers"):
        Probe(model, 3)
    with pytest.raises(ValueError, match="layers"):
        Probe(nn.Linear(3, 3))
    with pytest.raises(ValueError, match="param"):
        Probe(model).weight_grad_norms("ff", "w9")


def _hook_every_point(model: nn.Module) -> list:
    """Forward hooks on every connection's observation points that read (and keep) what they see, as the
    training loop's activation statistics do."""
    seen = []
    handles = [
        point.register_forward_hook(lambda _m, _a, out: seen.append(out.detach().float().square().mean()))
        for m in model.modules()
        if isinstance(m, an.AddNorm)
        for point in (m.stream_in, m.branch, m.stream_out)
    ]
    return handles


@pytest.mark.parametrize("op_preferred", [True, False], ids=["op", "unfused-modules"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("placement", ["pre", "post", "b2t", "resi_dual"])
def test_probed_and_unprobed_training_steps_are_bit_identical(placement, dtype, op_preferred, monkeypatch):
    """Dropout 0.1, fused on, training: a step under Probe (and hooks on every observation point) gives
    bit-identical logits and gradients to the same step unobserved, whichever path the op policy picks;
    the op runs exactly when the policy prefers it."""
    monkeypatch.setattr(policy, "fused_op_preferred", lambda device, **call: op_preferred)
    calls = []
    op = connection_module.add_norm
    monkeypatch.setattr(connection_module, "add_norm", lambda *a, **k: calls.append(1) or op(*a, **k))
    torch.manual_seed(0)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=3, dropout=0.1, placement=placement)
    model = an.LanguageModel(cfg, VOCAB).to(dtype).train()
    tokens = _tokens(4)

    def step(observed: bool):
        torch.manual_seed(1)
        model.zero_grad(set_to_none=True)
        handles = _hook_every_point(model) if observed else []
        with Probe(model) if observed else contextlib.nullcontext() as probe:
            logits = model(tokens[:, :-1])
            nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)).backward()
        for h in handles:
            h.remove()
        if observed:
            assert all(math.isfinite(v) for v in probe.stream_grad_norms())
        return logits.detach(), [p.grad for p in model.parameters()]

    plain, observed = step(False), step(True)
    assert torch.equal(plain[0], observed[0])
    for a, b in zip(plain[1], observed[1], strict=True):
        assert torch.equal(a, b)
    assert bool(calls) == (op_preferred and placement != "resi_dual")
