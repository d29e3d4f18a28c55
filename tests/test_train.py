"""The training loop: update ratios, probing schedule, clipping, divergence threshold, schedules."""

from __future__ import annotations

import math

import pytest
import torch

from addnorm.train import SCHEDULES, RunConfig, lr_multiplier, train

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, batch_size=4, seq_len=16, eval_batches=1)


def ratios(result, step):
    return [r["value"] for r in result.layer_metrics if r["metric"] == "update_ratio" and r["step"] == step]


def test_update_to_weight_ratio_follows_the_learning_rate():
    small = train(RunConfig(**TINY, steps=2, lr=1e-9, weight_decay=0.0, eval_every=0))
    large = train(RunConfig(**TINY, steps=2, lr=1e-2, weight_decay=0.0, eval_every=0))
    assert ratios(small, 0) and max(ratios(small, 0)) < 1e-6
    # Adam's first step moves every weight by about lr: ||dW|| / ||W|| = lr * sqrt(n) / ||W||
    assert 1e-4 < min(ratios(large, 0)) and max(ratios(large, 0)) < 1.0
    subs = {r["sublayer"] for r in large.layer_metrics if r["metric"] == "update_ratio"}
    assert {"self_attn", "ff"} <= subs


def test_probing_every_k_steps_and_at_the_last():
    r = train(RunConfig(**TINY, steps=7, probe_every=3, eval_every=0))
    assert {row["step"] for row in r.layer_metrics} == {0, 3, 6}
    assert {row["layer"] for row in r.layer_metrics} == {0, 1}


def test_evaluation_and_clipping_are_recorded():
    r = train(RunConfig(**TINY, steps=4, eval_every=2, grad_clip=0.5))
    names = [(s, n) for s, n, _ in r.metrics if n in ("val_loss", "val_bits_per_byte")]
    assert names == [(1, "val_loss"), (1, "val_bits_per_byte"), (3, "val_loss"), (3, "val_bits_per_byte")]
    assert r.status == "done" and all(
        v > 0 for _, n, v in r.metrics if n == "grad_norm"
    )  # the norm before clipping is what is logged


def test_divergence_threshold_and_nan_are_recorded_with_the_step(monkeypatch):
    with pytest.raises(ValueError, match="diverge_factor: expected a number above 1"):
        RunConfig(diverge_factor=0.5)
    from addnorm.tasks.base import Task

    real = Task.loss
    calls = []

    def poisoned(self, model, batch):  # the third training loss is NaN
        loss, logits = real(self, model, batch)
        if torch.is_grad_enabled():  # a training step, not evaluation or the x / F(x) picture
            calls.append(1)
        return (loss * float("nan") if len(calls) == 3 else loss), logits

    monkeypatch.setattr(Task, "loss", poisoned)
    r = train(RunConfig(**TINY, steps=5, eval_every=0))
    assert r.status == "diverged" and r.diverged_step == 2 and r.steps_done == 2 and r.final == {}
    assert math.isnan([v for s, n, v in r.metrics if n == "train_loss"][-1])


def test_schedules_registry():
    assert {"constant", "linear_warmup", "cosine", "inverse_sqrt"} <= set(SCHEDULES)
    for name in SCHEDULES:
        values = [lr_multiplier(name, s, 10, 100) for s in range(100)]
        assert all(0 <= v <= 1 + 1e-12 for v in values) and max(values) == pytest.approx(1.0)
        assert values[0] == pytest.approx(0.1)  # every schedule warms up linearly over 10 steps
    assert lr_multiplier("cosine", 99, 10, 100) < 0.01
    assert math.isclose(lr_multiplier("inverse_sqrt", 39, 10, 100), math.sqrt(10 / 40))
