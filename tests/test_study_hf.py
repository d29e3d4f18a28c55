"""Hugging Face families in the study harness: ``model: hf-llama`` trains the same model as one built and
trained by hand through plain ``transformers`` and ``with_placement``; not-applicable placements are
planned as such; the run config keeps addnorm's own model as the default with unchanged run ids."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

import transformers  # noqa: E402

from addnorm.hf import with_placement  # noqa: E402
from addnorm.study import load_spec, run_study  # noqa: E402
from addnorm.study.spec import SpecError, parse_spec  # noqa: E402
from addnorm.study.store import Store  # noqa: E402
from addnorm.tasks import build_task  # noqa: E402
from addnorm.train import RunConfig, train  # noqa: E402

SIZE = dict(d_model=32, n_heads=4, d_ff=48, n_layers=3, batch_size=4, seq_len=16, corpus_bytes=100_000)


def hand_trained_losses(placement: str, steps: int, seed: int, xavier: bool = False) -> list[float]:
    """The oracle: a LlamaConfig written out here, ``from_config`` after ``torch.manual_seed(seed)``,
    (``xavier``: Xavier-uniform on each layer's Linear weights in order, N(0, 1) embeddings, the head as
    nn.Linear initialises it), ``with_placement``, and a plain AdamW loop over the lm task's batches."""
    task = build_task("lm", corpus=None, limit=SIZE["corpus_bytes"])
    config = transformers.LlamaConfig(
        vocab_size=task.vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=16,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    if xavier:
        with torch.no_grad():
            for layer in model.model.layers:
                for m in layer.modules():
                    if isinstance(m, torch.nn.Linear):
                        torch.nn.init.xavier_uniform_(m.weight)
            torch.nn.init.normal_(model.model.embed_tokens.weight, std=1.0)
            model.lm_head.reset_parameters()
    with_placement(model, placement, fused=False)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=3e-3,
        betas=(0.9, 0.98),
        eps=1e-9,
    )
    gen = torch.Generator().manual_seed(seed)
    losses = []
    model.train()
    for _ in range(steps):
        batch = task.batch("train", 4, 16, gen)
        logits = model(input_ids=batch.inputs).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), batch.targets.reshape(-1)
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("placement, hf_init", [("sandwich", "own"), ("deepnorm", "own"), ("pre", "xavier")])
def test_hf_run_stores_the_losses_of_the_model_trained_by_hand(tmp_path, placement, hf_init):
    spec = parse_spec(
        {
            "name": "oracle",
            "base": {
                **SIZE,
                "model": "hf-llama",
                "kv_heads": 2,
                "rope_theta": 500.0,
                "lr": 3e-3,
                "steps": 5,
                "eval_every": 0,
                "precision": "fp32",
                "hf_init": hf_init,
            },
            "experiments": {"one": {"sweep": {"placement": [placement], "seed": [3]}}},
        }
    )
    run_study(spec, tmp_path, workers=1, progress=False, report=False)
    with Store(tmp_path / "study.sqlite") as store:
        (run,) = store.runs()
        stored = [v for _, v in store.metric(run["id"], "train_loss")]
    assert run["status"] == "done", run["error"]
    assert run["provenance"]["transformers"] == transformers.__version__
    expected = hand_trained_losses(placement, 5, 3, xavier=hf_init == "xavier")
    assert stored == pytest.approx(expected, rel=1e-5, abs=1e-6)


def test_fused_hf_run_matches_the_unfused_one():
    base = dict(SIZE, model="hf-qwen3", kv_heads=2, steps=3, eval_every=0, placement="pre")
    plain, fused = train(RunConfig(**base)), train(RunConfig(**base, fused=True))
    losses = lambda r: [v for _, n, v in r.metrics if n == "train_loss"]  # noqa: E731
    assert losses(fused) == pytest.approx(losses(plain), rel=1e-4)


def initial_model(family: str, hf_init: str, placement: str):
    from addnorm.train.loop import build_model

    cfg = RunConfig(
        model=family, hf_init=hf_init, placement=placement, d_model=64, n_heads=4, d_ff=128, n_layers=2
    )
    return build_model(cfg, build_task("lm", corpus=None, limit=100_000)).hf


@pytest.mark.parametrize(
    "family, placement", [("hf-llama", "pre"), ("hf-gemma2", "sandwich"), ("hf-gpt2", "pre")]
)
def test_xavier_hf_init_starts_as_addnorms_transformer(family, placement):
    model = initial_model(family, "xavier", placement)
    arch = __import__("addnorm.hf.architectures", fromlist=["x"]).architecture_of(model)
    matrices = [p for layer in arch.layers_of(model) for p in layer.parameters() if p.ndim == 2]
    assert len(matrices) >= 8
    for w in matrices:  # Xavier-uniform: variance 2 / (fan_in + fan_out)
        assert w.var().item() == pytest.approx(2.0 / sum(w.shape), rel=0.1)
        assert w.abs().max().item() <= (6.0 / sum(w.shape)) ** 0.5
    ids = torch.randint(3, 200, (4, 32))
    stream = model(input_ids=ids, output_hidden_states=True).hidden_states[0]
    embed = model.get_input_embeddings().weight
    if family == "hf-gpt2":  # tied head without a multiplier: unit-variance logits, not a unit stream
        assert embed.var().item() == pytest.approx(1 / 64, rel=0.1)
    else:  # the stream starts at unit RMS, as addnorm's scaled embeddings make it
        assert stream.pow(2).mean().sqrt().item() == pytest.approx(1.0, rel=0.1)
    if family == "hf-llama":  # an untied head as torch.nn.Linear draws it: U(-1/sqrt(d), 1/sqrt(d))
        head = model.lm_head.weight
        assert head.abs().max().item() <= 64**-0.5 and head.var().item() == pytest.approx(1 / 192, rel=0.1)


def test_own_hf_init_keeps_the_familys_initialisation():
    model = initial_model("hf-llama", "own", "pre")
    for w in (model.get_input_embeddings().weight, model.model.layers[0].mlp.down_proj.weight):
        assert w.std().item() == pytest.approx(model.config.initializer_range, rel=0.1)


def test_model_key_defaults_to_addnorm_with_the_same_run_ids():
    assert RunConfig().arch == "addnorm" and RunConfig(model="addnorm").run_id == RunConfig().run_id
    assert RunConfig().run_id == "78aef321cc1e"  # the id main gave this config before the key existed
    cfg = RunConfig(model="HF-Llama", kv_heads=2)
    assert cfg.arch == "hf-llama" and cfg.to_dict()["model"] == "hf-llama"
    assert RunConfig(**cfg.to_dict()) == cfg and cfg.run_id != RunConfig(kv_heads=2).run_id
    # hf_init: own, the default, keeps the ids HF runs had before the key; addnorm's model ignores it
    sandwich = RunConfig(model="hf-llama", kv_heads=2, placement="sandwich")
    assert sandwich.run_id == "b6d8fd7a259e"  # the id main gave this config before hf_init existed
    xavier = RunConfig(model="hf-llama", kv_heads=2, placement="sandwich", hf_init="Xavier")
    assert xavier.hf_init == "xavier" and xavier.run_id != sandwich.run_id
    assert RunConfig(hf_init="xavier") == RunConfig() and RunConfig(hf_init="xavier").hf_init == "own"


@pytest.mark.parametrize(
    "values, message",
    [
        ({"model": "hf-nope"}, "model: expected addnorm or one of hf-llama"),
        ({"model": "hf-llama", "task": "copy"}, "model: hf-llama is a causal language model"),
        ({"model": "hf-llama", "kv_heads": -1}, "kv_heads: expected a non-negative integer"),
        ({"model": "hf-llama", "rope_theta": 0}, "rope_theta: expected a positive number"),
        ({"model": "hf-llama", "fused": "yes"}, "fused: expected true or false"),
        ({"model": "hf-llama", "hf_init": "normal"}, "hf_init: unknown hf_init 'normal'; expected one of"),
        ({"hf_init": "normal"}, "hf_init: unknown hf_init"),
    ],
)
def test_bad_hf_settings_are_one_line_errors(values, message):
    with pytest.raises(ValueError, match=message):
        RunConfig(**values)


def test_kv_heads_must_divide_heads():
    r = RunConfig(**SIZE, model="hf-llama", kv_heads=3, steps=1, eval_every=0)
    with pytest.raises(ValueError, match="kv_heads: 3 does not divide n_heads=4"):
        train(r)


def test_placements_with_placement_refuses_are_planned_not_applicable(tmp_path):
    spec = parse_spec(
        {
            "name": "na",
            "base": {**SIZE, "model": "hf-gpt2", "steps": 2, "eval_every": 0},
            "experiments": {"p": {"rank": True, "sweep": {"placement": ["pre", "ngpt", "sub_ln"]}}},
        }
    )
    assert [r.label for r in spec.expand()] == ["placement=pre"]
    assert [(e, label) for e, label, _ in spec.not_applicable()] == [
        ("p", "placement=ngpt"),
        ("p", "placement=sub_ln"),
    ]
    assert "sub_ln puts a norm inside the sublayers" in spec.not_applicable()[1][2]
    run_study(spec, tmp_path, workers=1, progress=False)
    page = (tmp_path / "report.html").read_text()
    assert "not applicable" in page and "sub_ln puts a norm inside the sublayers" in page


def test_a_spec_of_only_not_applicable_runs_is_refused():
    with pytest.raises(SpecError, match="no run of this spec is applicable"):
        parse_spec(
            {
                "name": "x",
                "base": {"model": "hf-llama"},
                "experiments": {"p": {"sweep": {"placement": ["ngpt"]}}},
            }
        )


def test_llama_preset_plans_both_architectures_at_smoke_size():
    spec = load_spec("llama", smoke=True)
    archs = {r.config.arch for r in spec.expand()}
    assert archs == {"addnorm", "hf-llama"}
    assert {r.config.seed for r in spec.expand()} == {0, 1, 2}
    assert all(r.config.kv_heads in (0, 1) for r in spec.expand())


@pytest.mark.parametrize(
    "family", ["hf-llama", "hf-mistral", "hf-qwen2", "hf-qwen3", "hf-gemma2", "hf-gemma3", "hf-gpt2"]
)
def test_every_family_trains_re_placed_with_its_sizes(family):
    cfg = RunConfig(**SIZE, model=family, kv_heads=2, placement="sandwich", steps=2, eval_every=0)
    result = train(cfg)
    assert result.status == "done", result.error
    layers = {r["layer"] for r in result.layer_metrics if r["metric"] == "act_rms"}
    assert layers == {0, 1, 2}  # the probe sees the family's layers through the re-placed connections
    from addnorm.tasks import build_task as task_of
    from addnorm.train.loop import build_model

    model = build_model(cfg, task_of("lm", corpus=None, limit=SIZE["corpus_bytes"]))
    config = model.hf.config
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (32, 3, 4)
    assert config.addnorm["placement"] == "sandwich"
    if family != "hf-gpt2":
        assert (config.num_key_value_heads, config.intermediate_size) == (2, 48)


def test_planning_an_hf_study_does_not_import_transformers():
    import subprocess
    import sys

    code = (
        "import sys; from addnorm.study import load_spec; load_spec('llama').expand(); "
        "assert 'transformers' not in sys.modules, 'transformers imported at planning time'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
