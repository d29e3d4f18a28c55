"""Parallel blocks, x + F_1(N(x)) + F_2(N'(x)) (GPT-J, CodeGen, GPT-NeoX, Falcon, Phi-1/2, Cohere, Cohere 2,
StableLM with its parallel residual), and the sequential layouts the same families take by config: the
fused model is the untouched transformers model (logits, loss, every gradient, generated tokens, the
residual dropout's mask on the CPU), each parallel layer's add is one add_norm call with the norm that next
reads the stream, a re-placed model runs the placement's formula around the sum of its branches, and
saves and reloads."""

from __future__ import annotations

import copy

import hf_models
import pytest
import torch
from hf_models import LAYERS, perturbed, step, tiny, tokens

import addnorm as an
import addnorm.hf as anhf

# (model type, config fields, the record the config resolves to, parallel)
CASES = [
    ("gptj", {}, "gptj", True),
    ("codegen", {}, "codegen", True),
    ("gpt_neox", {}, "gpt_neox", True),  # two norms: input_layernorm, post_attention_layernorm
    ("gpt_neox", {"use_parallel_residual": False}, "gpt_neox (sequential)", False),
    ("falcon", {}, "falcon", True),  # multi-query, one shared norm
    ("falcon", {"multi_query": False}, "falcon", True),
    ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2}, "falcon (two norms)", True),
    ("falcon", {"parallel_attn": False}, "falcon (sequential)", False),
    ("phi", {}, "phi", True),
    ("cohere", {}, "cohere", True),
    ("cohere2", {}, "cohere", True),
    ("stablelm", {}, "stablelm", False),
    ("stablelm", {"use_parallel_residual": True}, "stablelm (parallel)", True),
]
IDS = [f"{t}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for t, kw, _, _ in CASES]


@pytest.fixture
def spy(monkeypatch):
    return hf_models.add_norm_calls(monkeypatch)


@pytest.mark.parametrize("model_type, fields, record, parallel", CASES, ids=IDS)
def test_the_fused_model_is_the_model(model_type, fields, record, parallel, spy):
    """Logits, loss and every gradient are the model's (Cohere and StableLM's parallel layer add x + a + m
    in another order than x + (a + m): float32 rounding); a parallel layer's add is one add_norm call
    with the next layer's input norm (the last one's with the final norm), a sequential layer's two."""
    plain = tiny(model_type, **fields)
    fused = anhf.fuse(copy.deepcopy(plain))
    assert anhf.architecture_of(plain).name == record
    ids = tokens()
    expected = step(plain, ids)
    assert spy == []
    got = step(fused, ids)
    assert spy == [True] * (LAYERS if parallel else 2 * LAYERS)
    exact = model_type not in ("cohere", "cohere2") and record != "stablelm (parallel)"
    tol = {"rtol": 0, "atol": 0} if exact else {}
    hf_models.assert_same_step(got, expected, **tol)
    assert list(fused.state_dict()) == list(plain.state_dict())


@pytest.mark.parametrize("model_type, fields, record, parallel", CASES, ids=IDS)
def test_generate_gives_the_same_tokens(model_type, fields, record, parallel):
    plain = tiny(model_type, **fields)
    fused = anhf.fuse(copy.deepcopy(plain))
    hf_models.assert_generates_the_same(fused, plain)


_DROPOUT = {
    "falcon": {"hidden_dropout": 0.2},  # on the sum of the branches: the connection's dropout
    "phi": {"resid_pdrop": 0.2},  # on each branch: the branches' calls apply the layer's own
    "gpt_neox": {"hidden_dropout": 0.2},  # on each branch, by post_attention_dropout / post_mlp_dropout
    "gptj": {"resid_pdrop": 0.2},  # inside the attention and MLP modules
}


@pytest.mark.parametrize("model_type", list(_DROPOUT))
def test_on_the_cpu_residual_dropout_is_the_model_s_mask(model_type):
    """Train mode, residual dropout on, the same torch seed: bit for bit the model's step, and dropout
    did drop."""
    plain = tiny(model_type, dropout=True, **_DROPOUT[model_type])
    hf_models.assert_dropout_is_the_model_s(plain, anhf.fuse(copy.deepcopy(plain)))


def test_a_re_placed_parallel_block_runs_the_placement_around_the_sum_of_its_branches():
    """Post-LN on GPT-NeoX (two norms in the model): x = N(x + Attn(x) + MLP(x)) per layer, written here
    with the model's own modules and the new norm; no final norm."""
    model = perturbed(anhf.with_placement(tiny("gpt_neox"), "post"), 0.2, seed=2)
    ids = tokens()
    base = model.gpt_neox
    x = base.embed_in(ids)
    rope = base.rotary_emb(x, torch.arange(ids.shape[1])[None])
    mask = hf_models.causal_mask(ids.shape[1])
    for layer in base.layers:
        a = layer.attention(x, attention_mask=mask, position_embeddings=rope)[0]
        norm = layer.parallel_block.norm
        x = torch.nn.functional.layer_norm(
            x + a + layer.mlp(x), (x.shape[-1],), norm.weight, norm.bias, norm.eps
        )
    assert isinstance(base.final_layer_norm, torch.nn.Identity)
    assert not hasattr(layer, "input_layernorm") and not hasattr(layer.parallel_block, "second_norm")
    torch.testing.assert_close(model(ids).logits, model.lm_head(x))


@pytest.mark.parametrize(
    "model_type, fields",
    [("gpt_neox", {}), ("falcon", {"new_decoder_architecture": True, "num_kv_heads": 2})],
)
def test_pre_keeps_a_two_norm_block_s_second_norm_and_the_model_s_function(model_type, fields, tmp_path):
    plain = tiny(model_type, **fields)
    placed = anhf.with_placement(copy.deepcopy(plain), "pre")
    ids = tokens()
    torch.testing.assert_close(placed(ids).logits, plain(ids).logits, rtol=0, atol=0)
    second = anhf.architecture_of(plain).branch_norm_path()
    for original, layer in zip(
        anhf.architecture_of(plain).layers_of(plain),
        placed.base_model.layers if model_type == "gpt_neox" else placed.transformer.h,
        strict=True,
    ):
        torch.testing.assert_close(
            layer.parallel_block.second_norm.weight, original.get_submodule(second).weight
        )
    hf_models.trained(placed).save_pretrained(tmp_path)
    assert torch.equal(anhf.from_pretrained(tmp_path)(ids).logits, placed(ids).logits)


@pytest.mark.parametrize("placement", ["post", "sandwich", "deepnorm", "rezero", "layerscale", "mix"])
def test_fused_connections_around_parallel_blocks_compute_what_the_unfused_ones_do(placement):
    fused, unfused = hf_models.fused_and_unfused(tiny("falcon"), placement)
    ids = tokens()
    expected = step(unfused, ids)
    hf_models.assert_same_step(step(fused, ids), expected)


def test_b2t_is_refused_for_parallel_blocks_in_one_line():
    with pytest.raises(
        ValueError, match=r"^placement: 'b2t' needs two connections per layer .*supported: "
    ) as err:
        anhf.with_placement(tiny("gptj"), "b2t")
    assert "\n" not in str(err.value)
    anhf.with_placement(tiny("falcon", parallel_attn=False), "b2t")  # a sequential Falcon takes it


def test_deepnet_init_finds_each_role_in_packed_projections():
    """DeepNet's init on GPT-NeoX's query_key_value, packed per head as (q, k, v): the queries and keys
    (gain 1) and the values (gain beta) are each Xavier-normal over the whole matrix they make up."""
    import math

    n, d = 4, 64
    beta = an.model.deepnorm_constants(an.model.Depth("decoder", 0, n))[1]
    model = anhf.with_placement(tiny("gpt_neox", layers=n, hidden=d, heads=4), "deepnorm")
    hd = d // 4
    packed = torch.stack([layer.attention.query_key_value.weight for layer in model.gpt_neox.layers])
    per_head = packed.view(n, 4, 3, hd, d)
    xavier = math.sqrt(2 / (d + d))
    assert per_head[:, :, 0].std().item() == pytest.approx(xavier, rel=0.05)  # queries
    assert per_head[:, :, 1].std().item() == pytest.approx(xavier, rel=0.05)  # keys
    assert per_head[:, :, 2].std().item() == pytest.approx(beta * xavier, rel=0.05)  # values


def test_probe_sees_one_connection_per_parallel_layer_owning_both_branches():
    model = anhf.fuse(tiny("phi"))
    ids = tokens()
    with an.Probe(model) as probe:
        model(input_ids=ids, labels=ids).loss.backward()
    assert probe.sublayers == [["parallel", ""]] * LAYERS
    for layer, got in zip(model.model.layers, probe.weight_grad_norms("parallel"), strict=True):
        grads = [p.grad for m in (layer.self_attn, layer.mlp) for p in m.parameters() if p.ndim >= 2]
        assert got == pytest.approx(torch.sqrt(sum(g.square().sum() for g in grads)).item(), rel=1e-6)
    assert all(v > 0 for v in probe.stream_grad_norms())


@pytest.mark.parametrize("model_type, fields, record, parallel", CASES, ids=IDS)
def test_own_placement_is_the_model_and_a_re_placed_model_reloads(
    model_type, fields, record, parallel, tmp_path
):
    """``with_placement`` with the family's own placement (``pre``) is the model; a LayerScale model,
    trained one step, saves and loads back to the same logits."""
    plain = tiny(model_type, **fields)
    ids = tokens()
    own = anhf.with_placement(copy.deepcopy(plain), "pre")
    torch.testing.assert_close(own(ids).logits, plain(ids).logits)
    model = hf_models.trained(anhf.with_placement(copy.deepcopy(plain), "layerscale"))
    model.save_pretrained(tmp_path)
    loaded = anhf.from_pretrained(tmp_path)
    assert loaded.config.addnorm == model.config.addnorm
    assert torch.equal(loaded(ids).logits, model(ids).logits)
