"""addnorm.hf.with_placement: a Hugging Face model with any addnorm placement around its own attention
and MLP, checked against the model itself (its own placement), a hand-written Post-LN forward, the
unfused connections, the placements' initialisation rules, and a save_pretrained / from_pretrained
round trip; trainable with a plain loop and with the Trainer."""

from __future__ import annotations

import copy
import json
import math

import hf_models
import pytest
import torch
from hf_models import LAYERS, TYPES, perturbed, step, tiny, tokens
from torch import nn

import addnorm as an
import addnorm.hf as anhf
from addnorm.model import deepnorm_constants
from addnorm.model.init import Depth


@pytest.mark.parametrize("model_type", TYPES)
def test_the_model_s_own_placement_is_the_model(model_type):
    """Llama family and GPT-2 ``pre``, Gemma ``sandwich``, BERT ``post``: the model's norms carry over to
    the same slots, so outputs and the loss are the model's (norm gradients move to the new norms)."""
    plain = tiny(model_type)
    placed = anhf.with_placement(copy.deepcopy(plain), anhf.ARCHITECTURES[model_type].placement)
    ids = tokens()
    logits, loss, grads = step(plain, ids)
    p_logits, p_loss, p_grads = step(placed, ids)
    torch.testing.assert_close(p_logits, logits)
    torch.testing.assert_close(p_loss, loss)
    for name, grad in grads.items():
        if name in p_grads:  # every weight matrix, embedding and head keeps its name and gradient
            torch.testing.assert_close(p_grads[name], grad, msg=name)
    arch = anhf.architecture_of(plain)
    prefix = f"{plain.base_model_prefix}.{arch.layers}"
    norms = [
        f"{prefix}.{i}.{path}."
        for i in range(LAYERS)
        for s in arch.sublayers
        for path in s.norm_paths().values()
    ]
    assert {n for n in grads if n not in p_grads} == {n for n in grads if n.startswith(tuple(norms))}


def _rms(x, norm):
    return nn.functional.rms_norm(x, (x.shape[-1],), norm.weight, norm.eps)


def _layer_norm(x, norm):
    return nn.functional.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)


def test_post_matches_a_hand_written_post_ln_forward():
    """Llama with ``post``: x = N(x + Attn(x)); x = N(x + MLP(x)) per layer, no final norm, written here
    with the model's own attention and MLP and the new norms' parameters."""
    model = perturbed(anhf.with_placement(tiny("llama"), "post"), 0.2, seed=2)
    ids = tokens()
    base = model.model
    x = base.embed_tokens(ids)
    positions = torch.arange(ids.shape[1])[None]
    rope = base.rotary_emb(x, positions)
    mask = hf_models.causal_mask(ids.shape[1])
    for layer in base.layers:
        a = layer.self_attn(hidden_states=x, position_embeddings=rope, attention_mask=mask)[0]
        x = _rms(x + a, layer.self_attn_block.norm)
        x = _rms(x + layer.mlp(x), layer.mlp_block.norm)
    assert isinstance(base.norm, nn.Identity)
    torch.testing.assert_close(model(ids).logits, model.lm_head(x))


def test_gpt2_post_matches_a_hand_written_post_ln_forward():
    model = anhf.with_placement(tiny("gpt2"), "post")
    ids = tokens()
    tr = model.transformer
    x = tr.wte(ids) + tr.wpe(torch.arange(ids.shape[1]))[None]
    for block in tr.h:
        x = _layer_norm(x + block.attn(x)[0], block.attn_block.norm)
        x = _layer_norm(x + block.mlp(x), block.mlp_block.norm)
    torch.testing.assert_close(model(ids).logits, model.lm_head(tr.ln_f(x)))
    assert isinstance(tr.ln_f, nn.Identity)


@pytest.fixture
def spy(monkeypatch):
    return hf_models.add_norm_calls(monkeypatch)


@pytest.mark.parametrize(
    "placement, calls",
    [
        ("pre", [True] * 4),  # every add held for the next norm, the last for the final norm
        ("post", [False] * 4),  # each add with its own norm, no final norm
        ("sandwich", [True] * 4),
        ("layerscale", [True] * 4),  # the gate runs inside the op
        ("deepnorm", [False] * 4),  # alpha inside the op
        ("mix", [False, False, True, True]),  # Post-LN layer 1, Pre-LN layer 2
        ("rezero", []),  # no norm to fuse with
        ("b2t", [False, False]),  # per layer: the first add with its norm; the last takes the layer
        # input too, and runs unfused
    ],
)
def test_fused_connections_compute_what_the_unfused_ones_do(placement, calls, spy):
    fused, unfused = hf_models.fused_and_unfused(tiny("llama"), placement)
    ids = tokens()
    expected = step(unfused, ids)
    assert spy == []
    got = step(fused, ids)
    assert spy == calls
    hf_models.assert_same_step(got, expected)


def test_placement_rules_come_with_the_placement():
    n = 4
    layers = lambda m: m.model.layers  # noqa: E731
    ids = tokens()
    # ReZero: every layer starts as the identity and there is no final norm
    model = anhf.with_placement(tiny("llama", layers=n), "rezero")
    assert isinstance(model.model.norm, nn.Identity)
    torch.testing.assert_close(model(ids).logits, model.lm_head(model.model.embed_tokens(ids)))
    # LayerScale: CaiT's 0.1 up to 18 layers; Mix-LN: Post-LN for the first ceil(0.25 * 4) = 1 layer
    model = anhf.with_placement(tiny("llama", layers=n), "layerscale")
    gates = [block.gate for layer in layers(model) for block in (layer.self_attn_block, layer.mlp_block)]
    assert len(gates) == 2 * n and all(torch.equal(g, torch.full((32,), 0.1)) for g in gates)
    model = anhf.with_placement(tiny("llama", layers=n), "mix")
    assert [l.self_attn_block.placement.name for l in layers(model)] == ["post", "pre", "pre", "pre"]
    model = anhf.with_placement(tiny("llama", layers=n), "mix", mix_fraction=0.5)
    assert [l.mlp_block.placement.name for l in layers(model)] == ["post", "post", "pre", "pre"]
    assert model.config.addnorm["mix_fraction"] == 0.5
    # DeepNorm: alpha = (2N)^(1/4), values/outputs/FFN Xavier-normal with gain beta = (8N)^(-1/4)
    alpha, beta = deepnorm_constants(Depth("decoder", 0, n))
    model = anhf.with_placement(tiny("llama", layers=n, hidden=64, intermediate=256), "deepnorm")
    assert layers(model)[0].mlp_block.alpha == pytest.approx(alpha) == pytest.approx((2 * n) ** 0.25)
    down = torch.cat([l.mlp.down_proj.weight.flatten() for l in layers(model)])
    assert down.std().item() == pytest.approx(beta * math.sqrt(2 / (64 + 256)), rel=0.05)
    q = torch.cat([l.self_attn.q_proj.weight.flatten() for l in layers(model)])
    assert q.std().item() == pytest.approx(math.sqrt(2 / (64 + 64)), rel=0.05)
    # BERT is an encoder: DeepNet's encoder-only constants, and Pre-LN gets a final norm it lacked
    bert = anhf.with_placement(tiny("bert", layers=n), "pre")
    assert type(bert.bert.encoder.norm) is an.LayerNorm
    enc_alpha = (
        anhf.with_placement(tiny("bert", layers=n), "deepnorm").bert.encoder.layer[0].output_block.alpha
    )
    assert enc_alpha == pytest.approx(deepnorm_constants(Depth("encoder", n, 0))[0])


def test_bert_pre_ln_applies_its_final_norm_in_the_last_layer():
    model = anhf.with_placement(tiny("bert"), "pre", fused=False)
    ids = tokens()
    enc = model.bert.encoder
    x = model.bert.embeddings(input_ids=ids)
    for layer in enc.layer:
        x = x + layer.attention.output.dense(layer.attention.self(layer.attention_block.norm(x))[0])
        x = x + layer.output.dense(layer.intermediate(layer.output_block.norm(x)))
    expected = enc.norm(x)
    torch.testing.assert_close(model.bert(ids).last_hidden_state, expected)


@pytest.mark.parametrize("model_type", TYPES)
def test_save_pretrained_and_from_pretrained_round_trip(model_type, tmp_path):
    placement = "layerscale" if anhf.ARCHITECTURES[model_type].placement == "pre" else "pre"
    # one SGD step, so that loading cannot pass on freshly initialised weights
    model = hf_models.trained(anhf.with_placement(tiny(model_type), placement))
    ids = tokens()
    model.save_pretrained(tmp_path)
    record = json.loads((tmp_path / "config.json").read_text())["addnorm"]
    assert record["placement"] == placement and record["fused"] is True
    loaded = anhf.from_pretrained(tmp_path)
    assert type(loaded) is type(model) and not loaded.training
    assert loaded.config.addnorm == model.config.addnorm
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert loaded.state_dict().keys() == model.state_dict().keys()


def test_from_pretrained_loads_an_untouched_model_through_transformers(tmp_path):
    model = tiny("qwen3")
    model.save_pretrained(tmp_path)
    ids = tokens()
    torch.testing.assert_close(anhf.from_pretrained(tmp_path)(ids).logits, model(ids).logits)


def test_generate_on_a_re_placed_model():
    fused, unfused = hf_models.fused_and_unfused(tiny("llama"), "sandwich")
    hf_models.assert_generates_the_same(fused, unfused, seq=4, new=5)


def test_a_re_placed_model_trains_with_a_plain_loop_and_the_trainer(tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    ids = tokens(batch=4, seq=8)
    data = [{"input_ids": row, "labels": row} for row in ids]
    model = anhf.with_placement(tiny("llama"), "post").train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(5):
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert losses[-1] < losses[0]
    model = anhf.with_placement(tiny("gpt2"), "mix")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=3,
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        disable_tqdm=True,
    )
    result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert any("_block" in n for n in moved) and any("attn.c_attn" in n for n in moved)


def test_bad_placements_and_models_get_one_line_errors():
    for name in ("sub_ln", "ngpt", "resi_dual", "hybridnorm"):
        with pytest.raises(ValueError, match=rf"placement: '{name}'.*supported: post, pre, sandwich") as err:
            anhf.with_placement(tiny("llama"), name)
        assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="unknown placement 'prenorm'"):
        anhf.with_placement(tiny("llama"), "prenorm")
    model = anhf.with_placement(tiny("llama"), "post")
    with pytest.raises(ValueError, match="already re-placed"):
        anhf.with_placement(model, "pre")
    with pytest.raises(ValueError, match="not fused"):
        anhf.unfuse(model)
    with pytest.raises(TypeError, match="fused: expected True or False"):
        anhf.with_placement(tiny("llama"), "pre", fused="yes")
    fused = anhf.fuse(tiny("llama"))  # a fused model is unfused, then re-placed
    anhf.with_placement(fused, "post")
    assert fused.config.addnorm["placement"] == "post"
