"""Tasks, schedules, optimiser groups and the training loop."""

import math

import pytest
import torch
from tiny_runs import TINY_SIZES

import addnorm as an
from addnorm.tasks import build_task, read_corpus
from addnorm.train import RunConfig, lr_multiplier, param_groups, train


def tiny(**kw):
    return RunConfig(**{**TINY_SIZES, "steps": 6, "eval_every": 3, "eval_batches": 1, **kw})


def test_algorithmic_targets():
    gen = torch.Generator().manual_seed(0)
    for name, fn in (
        ("copy", lambda s: s),
        ("reverse", lambda s: s.flip(1)),
        ("sort", lambda s: s.sort(1).values),
    ):
        task = build_task(name, symbols=7)
        b = task.batch("train", 5, 9, gen)
        assert torch.equal(b.targets, fn(b.src))
        assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1]) and (b.inputs[:, 0] == 1).all()
        assert b.src.min() >= 2 and b.src.max() < task.vocab == 9


def test_lm_batches_shift_by_one_and_split_is_held_out(tmp_path):
    text = bytes(range(256)) * 20
    path = tmp_path / "corpus.txt"
    path.write_bytes(text)
    task = build_task("lm", corpus=str(path))
    b = task.batch("train", 3, 10, torch.Generator().manual_seed(1))
    assert torch.equal(b.inputs[:, 1:], b.targets[:, :-1])
    assert task.splits["train"].numel() + task.splits["val"].numel() == len(text)
    with pytest.raises(ValueError, match="corpus: '/nonexistent' is neither a file nor a folder"):
        read_corpus("/nonexistent")
    assert len(read_corpus(None, limit=5000)) == 5000  # the stdlib default exists on every machine


def test_schedules_closed_forms():
    assert lr_multiplier("constant", 0, 0, 100) == 1.0
    assert lr_multiplier("constant", 4, 10, 100) == pytest.approx(0.5)
    assert lr_multiplier("linear_warmup", 9, 10, 100) == pytest.approx(1.0)
    assert lr_multiplier("linear_warmup", 55, 10, 100) == pytest.approx(0.5)
    assert lr_multiplier("cosine", 55, 10, 100) == pytest.approx(0.5)
    assert lr_multiplier("cosine", 10, 10, 100) == pytest.approx(1.0)
    w = 16  # min(s^-0.5, s w^-1.5) * sqrt(w): peaks at 1 when s = w
    assert lr_multiplier("inverse_sqrt", w - 1, w, 1000) == pytest.approx(1.0)
    assert lr_multiplier("inverse_sqrt", 63, w, 1000) == pytest.approx(math.sqrt(w) / 8)
    with pytest.raises(ValueError, match="schedule: unknown schedule 'cosin'"):
        lr_multiplier("cosin", 0, 0, 1)


def test_no_weight_decay_on_vectors():
    model = an.LanguageModel(
        an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=1, placement="pre"), 10
    )
    decay, no_decay = param_groups(model, 0.1)
    assert all(p.ndim >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.ndim < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    ln_weight = model.layers[0].ff_block.norm.weight
    assert any(p is ln_weight for p in no_decay["params"])


def test_training_is_reproducible_and_records_metrics():
    a, b = train(tiny()), train(tiny())
    losses = lambda r: [v for _, n, v in r.metrics if n == "train_loss"]  # noqa: E731
    assert a.status == "done" and losses(a) == losses(b) and len(losses(a)) == 6
    assert losses(train(tiny(seed=1))) != losses(a)
    assert {n for _, n, _ in a.metrics} >= {
        "train_loss",
        "val_loss",
        "val_bits_per_byte",
        "lr",
        "grad_norm",
        "xf_x_rms",
        "xf_f_rms",
        "xf_sum_rms",
    }
    assert a.final["val_metric"] == pytest.approx(a.final["val_loss"] / math.log(2))
    metrics = {r["metric"] for r in a.layer_metrics}
    assert {"grad_norm", "act_rms", "weight_grad_norm", "update_ratio"} <= metrics
    assert {r["step"] for r in a.layer_metrics} == {0, 5}


def test_seq2seq_task_trains():
    r = train(tiny(task="reverse", seq_len=6, steps=4))
    assert r.status == "done" and 0.0 <= r.final["val_metric"] <= 1.0 and r.final["metric"] == "accuracy"


def test_divergence_is_recorded_not_raised():
    r = train(tiny(lr=50.0, norm="none", steps=30, diverge_factor=1.5, eval_every=0))
    assert r.status == "diverged" and r.diverged_step is not None and r.diverged_step < 30
    assert r.final == {}


def test_run_config_errors_name_the_key():
    with pytest.raises(ValueError, match="n_layers: expected a positive int, got 0"):
        RunConfig(n_layers=0)
    with pytest.raises(ValueError, match="placement: unknown placement 'postt'"):
        RunConfig(placement="postt")
    with pytest.raises(ValueError, match="dropout_at: expected one of branch, after_add"):
        RunConfig(dropout_at="everywhere")
    with pytest.raises(TypeError, match="stepz: unknown run setting; expected one of: task"):
        RunConfig(stepz=3)
    assert RunConfig().run_id == RunConfig().run_id != RunConfig(seed=1).run_id
