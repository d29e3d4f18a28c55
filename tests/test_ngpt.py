"""nGPT (Loshchilov et al. 2024) against a float64 oracle written from the paper's equations (and the
authors' NVIDIA/ngpt model.py where the code is what was run), with weights copied from our model."""

import math

import pytest
import torch
import torch.nn.functional as F

import addnorm as an
from addnorm.model import ngpt_matrices
from addnorm.train.optim import param_groups

D, H, DFF, V = 16, 4, 24, 20


def cfg(**kw):
    base = dict(
        d_model=D,
        n_heads=H,
        d_ff=DFF,
        n_layers=2,
        dropout=0.0,
        placement="ngpt",
        activation="swiglu",
        bias=False,
        positional="none",
    )
    base.update(kw)
    return an.TransformerConfig(**base)


def unit(x):
    return x / x.norm(dim=-1, keepdim=True)  # the paper's Norm (no eps)


def randomise_scales(model):
    """Non-trivial eigen learning rates (some negative: the code uses |alpha|) and scaling vectors."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("gate", "s_qk", "s_uv", "s_z")):
                p.mul_(torch.empty_like(p).uniform_(-2.0, 2.0))


def oracle_block(h, layer):
    """One nGPT block (paper, Section 2; authors' Block.forward), float64, causal, from copied weights."""
    b, t, d = h.shape
    dk = d // H
    w = layer.self_attn.in_proj.weight
    wq, wk, wv = w[:d], w[d : 2 * d], w[2 * d :]
    wo = layer.self_attn.out_proj.weight
    s_qk = (layer.self_attn.s_qk * math.sqrt(d)).view(H, 1, dk)  # stored at 1/sqrt(d), init 1

    def heads(z):
        return z.view(b, t, H, dk).transpose(1, 2)

    q, k, v = heads(h @ wq.T), heads(h @ wk.T), heads(h @ wv.T)
    q, k = s_qk * unit(q), s_qk * unit(k)
    scores = q @ k.transpose(-1, -2) * math.sqrt(dk)  # sqrt(d_k), not 1/sqrt(d_k)
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    h_a = (torch.softmax(scores, -1) @ v).transpose(1, 2).reshape(b, t, d) @ wo.T
    alpha_a = (layer.self_attn_block.gate * 0.05 * math.sqrt(d)).abs()  # stored at 1/sqrt(d), init 0.05
    h = unit(unit(h) + alpha_a * (unit(h_a) - unit(h)))

    # SwiGLU: u * SiLU(v); our w1 holds the SiLU'd half (v) first, then u
    w1, w2 = layer.ff.w1.weight, layer.ff.w2.weight
    s_uv = layer.ff.s_uv
    v_ = (s_uv[:DFF] * math.sqrt(d)) * (h @ w1[:DFF].T)
    u_ = (s_uv[DFF:] * math.sqrt(d)) * (h @ w1[DFF:].T)
    h_m = (u_ * F.silu(v_)) @ w2.T
    alpha_m = (layer.ff_block.gate * 0.05 * math.sqrt(d)).abs()
    return unit(unit(h) + alpha_m * (unit(h_m) - unit(h)))


def test_ngpt_block_equals_the_papers_equations():
    layer = an.EncoderLayer(cfg()).double().eval()
    randomise_scales(layer)
    assert (layer.self_attn_block.gate < 0).any()  # |alpha| matters
    x = unit(torch.randn(2, 6, D, dtype=torch.float64))
    torch.testing.assert_close(layer(x, is_causal=True), oracle_block(x, layer))


def test_ngpt_language_model_equals_the_oracle_with_scaled_logits_and_no_final_norm():
    lm = an.LanguageModel(cfg(n_layers=3), V).double().eval()
    randomise_scales(lm)
    assert lm.norm is None and isinstance(lm.head, an.model.NGPTHead)
    tokens = torch.randint(0, V, (2, 7))
    h = lm.embed.tokens.weight[tokens]  # the raw embedding row: unit norm, no scale, no positions
    torch.testing.assert_close(h.norm(dim=-1), torch.ones(2, 7, dtype=torch.float64))
    for layer in lm.layers:
        h = oracle_block(h, layer)
    s_z = lm.head.s_z * math.sqrt(D)  # stored at 1/sqrt(d), init 1
    torch.testing.assert_close(lm(tokens), s_z * (h @ lm.head.weight.T))


def test_scaling_vectors_start_at_their_paper_values():
    lm = an.LanguageModel(cfg(), V)
    layer = lm.layers[0]
    torch.testing.assert_close(layer.self_attn_block.gate_value, torch.full((D,), 0.05))
    torch.testing.assert_close(layer.self_attn.s_qk, torch.full((D,), D**-0.5))  # used: 1
    torch.testing.assert_close(layer.ff.s_uv, torch.ones(2 * DFF))  # used: sqrt(d)
    torch.testing.assert_close(lm.head.s_z, torch.full((V,), D**-0.5))  # used: 1


def _assert_on_sphere(model):
    for weight, dim in ngpt_matrices(model):
        norms = weight.detach().norm(dim=dim)
        torch.testing.assert_close(norms, torch.ones_like(norms))


def test_ngpt_normalize_puts_every_matrix_back_on_the_sphere():
    lm = an.LanguageModel(cfg(n_layers=2), V)
    layer = lm.layers[0]
    # the d-sized side of each matrix (authors' normalize_matrices): rows, or columns for outputs
    expected = {
        id(lm.embed.tokens.weight): 1,
        id(lm.head.weight): 1,
        id(layer.self_attn.in_proj.weight): 1,
        id(layer.self_attn.out_proj.weight): 0,
        id(layer.ff.w1.weight): 1,
        id(layer.ff.w2.weight): 0,
    }
    found = {id(w): dim for w, dim in ngpt_matrices(lm)}
    assert len(found) == 2 + 4 * 2 and expected.items() <= found.items()
    _assert_on_sphere(lm)  # at construction
    scales = {n: p.detach().clone() for n, p in lm.named_parameters() if p.ndim == 1}
    opt = torch.optim.AdamW(lm.parameters(), lr=0.1)
    lm(torch.randint(0, V, (2, 5))).logsumexp(-1).mean().backward()
    opt.step()
    assert abs(layer.ff.w2.weight.norm(dim=0)[0].item() - 1) > 1e-3  # the step left the sphere
    moved = {n: p.detach().clone() for n, p in lm.named_parameters() if p.ndim == 1}
    assert an.ngpt_normalize_(lm) == 10
    _assert_on_sphere(lm)
    for n, p in lm.named_parameters():  # the scaling vectors are left alone
        if p.ndim == 1:
            torch.testing.assert_close(p.detach(), moved[n])
    assert any(not torch.equal(scales[n], moved[n]) for n in scales)
    with pytest.raises(ValueError, match="no nGPT layers"):
        an.ngpt_normalize_(an.LanguageModel(cfg(placement="pre"), V))


def test_hidden_states_stay_on_the_sphere():
    lm = an.LanguageModel(cfg(n_layers=3, positional="sinusoidal", dropout=0.1), V)
    outs = []
    for layer in lm.layers:
        for block in layer.blocks():
            block.stream_out.register_forward_hook(lambda m, i, o: outs.append(o))
    lm(torch.randint(0, V, (2, 7)))
    assert len(outs) == 6
    for o in outs:
        torch.testing.assert_close(o.norm(dim=-1), torch.ones(2, 7))


def test_no_weight_decay_on_ngpt_parameters():
    lm = an.LanguageModel(cfg(), V)
    decay, no_decay = param_groups(lm, 0.1)
    assert decay["params"] == [] and decay["weight_decay"] == 0.1
    assert {id(p) for p in no_decay["params"]} == {id(p) for p in lm.parameters()}
    pre = an.LanguageModel(cfg(placement="pre"), V)
    assert len(param_groups(pre, 0.1)[0]["params"]) > 0  # other models' matrices still decay


def test_short_lm_run_trains_without_warmup_and_stays_on_the_sphere(monkeypatch):
    """The training loop renormalises after each step. nGPT's parametrisation makes the step size of
    every unit vector and scale grow with sqrt(d) for a given lr, so the paper's lr 3e-3 at d = 1024 is
    3e-3 * sqrt(1024 / 32) = 0.017 at d = 32: 40 steps of byte-level LM there, no warmup."""
    from addnorm.train import loop
    from addnorm.train.config import RunConfig

    built = []
    real = loop.build_task

    def spy(*args, **kwargs):
        task = real(*args, **kwargs)
        make = task.build_model
        task.build_model = lambda c: built.append(make(c)) or built[-1]
        return task

    monkeypatch.setattr(loop, "build_task", spy)
    run = RunConfig(
        task="lm",
        placement="ngpt",
        activation="swiglu",
        d_model=32,
        n_heads=4,
        d_ff=64,
        n_layers=2,
        steps=40,
        batch_size=8,
        seq_len=32,
        lr=3e-3 * math.sqrt(1024 / 32),
        warmup=0,
        eval_every=0,
        eval_batches=1,
    )
    result = loop.train(run)
    assert result.status == "done"
    losses = [v for _, n, v in result.metrics if n == "train_loss"]
    assert losses[0] > 5.0 and sum(losses[-5:]) / 5 < 3.5  # from ln 256 = 5.5 nats (measured: 2.8)
    _assert_on_sphere(built[0])
