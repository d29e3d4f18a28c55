"""Saving and loading re-placed Hugging Face models (plain transformers refuses them by name;
addnorm.hf.from_pretrained takes every argument transformers' does, hub ids included), option errors,
a family described by a user (register_architecture) and the one placement spec both worlds read."""

from __future__ import annotations

import copy
import json
import math
import shutil

import hf_models
import pytest
import torch
from hf_models import step, tiny, tokens

import addnorm as an
import addnorm.hf as anhf
from addnorm import placement_spec
from addnorm.hf.placement import SAVED_MODEL_TYPE
from addnorm.placements import Placement

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "mixtral"])
def test_plain_transformers_refuses_a_re_placed_checkpoint_naming_addnorm(model_type, tmp_path):
    model = hf_models.trained(anhf.with_placement(tiny(model_type), "post"))
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert saved["model_type"] == SAVED_MODEL_TYPE.format(model_type)
    assert saved["addnorm"]["original_model_type"] == model_type
    with pytest.raises(ValueError) as err:
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    first = str(err.value).splitlines()[0]
    assert "addnorm" in first and "addnorm.hf.from_pretrained" in first
    with pytest.raises(ValueError, match="addnorm.hf.from_pretrained"):
        transformers.AutoConfig.from_pretrained(tmp_path)
    ids = tokens()  # addnorm loads it as what it is
    assert torch.equal(anhf.from_pretrained(tmp_path)(ids).logits, model(ids).logits)
    assert model.config.model_type == model_type  # the live model keeps its own type


def test_a_trainer_checkpoint_of_a_re_placed_model_is_refused_too(tmp_path):
    pytest.importorskip("accelerate")
    ids = tokens(batch=2, seq=8)
    model = anhf.with_placement(tiny("llama"), "deepnorm")
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, report_to=[], save_strategy="steps", save_steps=1,
        use_cpu=True, disable_tqdm=True, per_device_train_batch_size=2,
    )  # fmt: skip
    transformers.Trainer(
        model=model, args=args, train_dataset=[{"input_ids": r, "labels": r} for r in ids]
    ).train()
    checkpoint = tmp_path / "checkpoint-1"
    with pytest.raises(ValueError, match="addnorm.hf.from_pretrained"):
        transformers.AutoModelForCausalLM.from_pretrained(checkpoint)
    model.eval()
    assert torch.equal(anhf.from_pretrained(checkpoint)(ids).logits, model(ids).logits)


def test_from_pretrained_takes_transformers_arguments(tmp_path):
    ids = tokens()
    plain = tiny("llama")
    plain.save_pretrained(tmp_path / "plain")
    kw = {"dtype": "bfloat16", "attn_implementation": "eager", "output_hidden_states": True}
    ours = anhf.from_pretrained(tmp_path / "plain", **kw)  # untouched: exactly transformers' own load
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "plain", **kw)
    assert ours.dtype == theirs.dtype == torch.bfloat16
    assert ours.config._attn_implementation == "eager" and ours.config.output_hidden_states
    assert torch.equal(ours(ids).logits, theirs(ids).logits)

    placed = hf_models.trained(anhf.with_placement(tiny("llama"), "sandwich"))
    placed.save_pretrained(tmp_path / "placed")
    loaded = anhf.from_pretrained(tmp_path / "placed", **kw)
    assert loaded.dtype == torch.bfloat16 and all(p.dtype == torch.bfloat16 for p in loaded.parameters())
    assert loaded.config._attn_implementation == "eager" and loaded.config.output_hidden_states
    assert loaded.config.addnorm == placed.config.addnorm and not loaded.training
    # the oracle: the original architecture built by transformers in bfloat16, re-placed, given the weights
    config = copy.deepcopy(placed.config)
    config.output_hidden_states = True
    reference = transformers.AutoModelForCausalLM.from_config(
        config, dtype=torch.bfloat16, attn_implementation="eager"
    )
    record = {k: v for k, v in placed.config.addnorm.items() if k != "original_model_type"}
    anhf.with_placement(reference, **record, init=False).load_state_dict(placed.state_dict())
    assert torch.equal(loaded(ids).logits, reference.eval()(ids).logits)
    float32 = anhf.from_pretrained(tmp_path / "placed", dtype=torch.float32, device_map="cpu")
    assert torch.equal(float32(ids).logits, placed(ids).logits)


def _hub_cache(cache, repo: str, files_from) -> None:
    """A Hugging Face hub cache holding ``repo`` at one revision (what a download leaves)."""
    revision = "0" * 40
    root = cache / f"models--{repo.replace('/', '--')}"
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)
    shutil.copytree(files_from, root / "snapshots" / revision)


def test_from_pretrained_loads_a_hub_id(tmp_path):
    ids = tokens()
    model = hf_models.trained(anhf.with_placement(tiny("qwen3"), "layerscale"))
    model.save_pretrained(tmp_path / "saved")
    plain = tiny("qwen3")
    plain.save_pretrained(tmp_path / "plain")
    _hub_cache(tmp_path / "cache", "someone/tiny-layerscale", tmp_path / "saved")
    _hub_cache(tmp_path / "cache", "someone/tiny", tmp_path / "plain")
    hub = {"cache_dir": str(tmp_path / "cache"), "local_files_only": True, "revision": "main"}
    loaded = anhf.from_pretrained("someone/tiny-layerscale", **hub)
    assert torch.equal(loaded(ids).logits, model(ids).logits)
    assert torch.equal(anhf.from_pretrained("someone/tiny", **hub)(ids).logits, plain(ids).logits)


def test_options_are_checked_by_name():
    for option, value, expected in (
        ("dropout", "high", "dropout: expected a probability in [0, 1), got 'high'"),
        ("dropout", 1.5, "dropout: expected a probability in [0, 1), got 1.5"),
        ("eps", "tiny", "eps: expected a positive number, got 'tiny'"),
        ("eps", 0.0, "eps: expected a positive number, got 0.0"),
        ("mix_fraction", "high", "mix_fraction: expected a fraction in [0, 1], got 'high'"),
        ("mix_fraction", True, "mix_fraction: expected a fraction in [0, 1], got True"),
    ):
        with pytest.raises(ValueError) as err:
            anhf.with_placement(tiny("llama"), "mix", **{option: value})
        assert str(err.value) == expected
    with pytest.raises(ValueError, match=r"^mix_fraction: placement 'pre' does not use it") as err:
        anhf.with_placement(tiny("llama"), "pre", mix_fraction=0.5)
    assert "\n" not in str(err.value)
    for option, value in (("eps", 1e-6), ("norm", "rmsnorm")):  # ReZero has no norm to set
        with pytest.raises(ValueError, match=rf"^{option}: placement 'rezero' has no norm for it to set$"):
            anhf.with_placement(tiny("llama"), "rezero", **{option: value})
    model = anhf.with_placement(tiny("llama"), "mix", mix_fraction=1, eps=1e-3, dropout=0)
    assert model.config.addnorm["mix_fraction"] == 1.0 and model.model.layers[0].mlp_block.norm.eps == 1e-3


def test_a_user_registers_a_family(registries_restored, tmp_path):
    plain = hf_models.from_config("olmo3")
    with pytest.raises(ValueError, match="unsupported model type 'olmo3'"):
        anhf.fuse(copy.deepcopy(plain))
    # OLMo 3 described by a user, from the public pieces: one record, no patch of addnorm
    olmo3 = hf_models.llama_like(
        "olmo3",
        placement="res_post",
        role="branch_norm",
        norms=("post_attention_layernorm", "post_feedforward_layernorm"),
    )
    anhf.register_architecture("olmo3", olmo3)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    logits, loss, grads = step(plain, ids)
    f_logits, f_loss, f_grads = step(fused, ids)
    assert torch.equal(f_logits, logits) and torch.equal(f_loss, loss)
    for name in grads:
        torch.testing.assert_close(f_grads[name], grads[name], msg=name)
    placed = hf_models.trained(anhf.with_placement(copy.deepcopy(plain), "pre"))
    placed.save_pretrained(tmp_path)
    assert torch.equal(anhf.from_pretrained(tmp_path)(ids).logits, placed(ids).logits)
    with pytest.raises(TypeError, match="architecture: expected an addnorm.hf.Architecture"):
        anhf.register_architecture("olmo3x", {"layers": "layers"})


def test_one_spec_gives_both_worlds_their_rules(registries_restored):
    """A placement registered once (Pre-LN with DeepNet's residual scale and initialisation) gets the
    same alpha and the same weight-role gains in addnorm's own layers and in a re-placed HF model."""
    an.register_placement(
        Placement("deep_pre", "y = alpha x + F(N(x))", "test", input_norm=True, init="deepnorm")
    )
    n, d, ff = 6, 64, 256
    depth = placement_spec.Depth("decoder", 0, n)
    spec = placement_spec.connection_spec("deep_pre", depth)
    init = placement_spec.weight_init("deep_pre", depth)
    assert spec.alpha == pytest.approx((2 * n) ** 0.25) and init.scaled == pytest.approx((8 * n) ** -0.25)
    assert init.kind == "xavier_normal" and init.unit == 1.0
    torch.manual_seed(0)
    ours = an.LanguageModel(
        an.TransformerConfig(d_model=d, n_heads=4, d_ff=ff, n_layers=n, placement="deep_pre"), 50
    )
    hf = anhf.with_placement(tiny("llama", layers=n, hidden=d, intermediate=ff), "deep_pre")
    assert {c.alpha for c in ours.modules() if isinstance(c, an.AddNorm)} == {spec.alpha}
    assert {c.alpha for c in hf.modules() if isinstance(c, an.AddNorm)} == {spec.alpha}
    xavier = math.sqrt(2 / (d + ff))
    w2 = torch.cat([layer.ff.w2.weight.flatten() for layer in ours.layers])
    down = torch.cat([layer.mlp.down_proj.weight.flatten() for layer in hf.model.layers])
    assert w2.std().item() == pytest.approx(init.scaled * xavier, rel=0.05)
    assert down.std().item() == pytest.approx(init.scaled * xavier, rel=0.05)
    # LayerScale's start and Mix-LN's per-layer split: the spec's, in both worlds
    mix = placement_spec.layer_placements("mix", n, 0.5)
    assert [p.name for p in mix] == ["post"] * 3 + ["pre"] * 3
    cfg = an.TransformerConfig(d_model=d, n_heads=4, d_ff=ff, n_layers=n, placement="mix", mix_fraction=0.5)
    assert [p.name for p in an.LanguageModel(cfg, 50).stack.placements] == [p.name for p in mix]
    hf_mix = anhf.with_placement(tiny("llama", layers=n), "mix", mix_fraction=0.5)
    assert [layer.mlp_block.placement.name for layer in hf_mix.model.layers] == [p.name for p in mix]


def test_b2t_init_is_the_spec_s_in_a_re_placed_model():
    """B2T scales every weight matrix of a layer by L^(-1/2) (Takase et al. 2023), as addnorm's own layers
    do: the HF rewiring reads the same spec (it used to skip it)."""
    n = 4
    plain = tiny("llama", layers=n)
    placed = anhf.with_placement(copy.deepcopy(plain), "b2t")
    for a, b in zip(plain.model.layers, placed.model.layers, strict=True):
        for name in ("self_attn.q_proj.weight", "self_attn.o_proj.weight", "mlp.down_proj.weight"):
            torch.testing.assert_close(b.get_parameter(name), a.get_parameter(name) * n**-0.5, rtol=0, atol=0)


def _std(tensors) -> float:
    return torch.cat([t.detach().flatten() for t in tensors]).std().item()


def test_deepnet_init_reads_each_family_s_weight_roles():
    """DeepNet's init (Xavier-normal, gain beta on values, outputs and FFN, 1 on queries and keys) on the
    new families' layouts: Phi-3's packed q/k/v split by head counts (4 query heads, 2 key/value heads),
    each Mixtral expert as its own matrix (Xavier over one expert's fan-in and fan-out)."""
    n, d, ff = 4, 64, 128
    beta = placement_spec.deepnorm_constants(placement_spec.Depth("decoder", 0, n))[1]
    xavier = lambda fan_in, fan_out: math.sqrt(2 / (fan_in + fan_out))  # noqa: E731
    phi3 = anhf.with_placement(tiny("phi3", layers=n, hidden=d, intermediate=ff), "deepnorm")
    q, k, v = zip(*(l.self_attn.qkv_proj.weight.split([64, 32, 32]) for l in phi3.model.layers), strict=True)
    assert _std(q) == pytest.approx(xavier(d, 64), rel=0.05)
    assert _std(k) == pytest.approx(xavier(d, 32), rel=0.05)
    assert _std(v) == pytest.approx(beta * xavier(d, 32), rel=0.05)
    assert _std(layer.mlp.down_proj.weight for layer in phi3.model.layers) == pytest.approx(
        beta * xavier(ff, d), rel=0.05
    )
    plain = tiny("mixtral", layers=n, hidden=d, intermediate=ff)
    mixtral = anhf.with_placement(copy.deepcopy(plain), "deepnorm")
    experts = [layer.mlp.experts for layer in mixtral.model.layers]
    assert _std(e.down_proj for e in experts) == pytest.approx(beta * xavier(ff, d), rel=0.05)
    assert _std(e.gate_up_proj for e in experts) == pytest.approx(beta * xavier(d, 2 * ff), rel=0.05)
    for a, b in zip(plain.model.layers, mixtral.model.layers, strict=True):  # the router keeps its own
        assert torch.equal(a.mlp.gate.weight, b.mlp.gate.weight)
