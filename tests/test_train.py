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


# --- device, precision, compile, deferred reads, throughput -------------------------------------------
def test_device_selection(monkeypatch):
    from addnorm.train import device as dev

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert dev.select_device("auto") == dev.select_device(None) == torch.device("cuda")
    assert dev.select_device("cuda:1") == torch.device("cuda", 1) and dev.select_device("cpu").type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert dev.select_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="device: 'cuda' was asked for but this process sees no CUDA device"):
        dev.select_device("cuda")
    for bad in ("tpu", "meta"):
        with pytest.raises(ValueError, match="device: expected auto, cpu, cuda or cuda:N"):
            dev.select_device(bad)


def test_autocast_precision_by_device(monkeypatch):
    from addnorm.train.device import autocast_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert autocast_dtype(cpu, "fp32") is None and autocast_dtype(cpu, "auto") is None
    assert autocast_dtype(cpu, "bf16") == torch.bfloat16  # the GPU path, runnable on the CPU
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert autocast_dtype(cuda, "auto") == autocast_dtype(cuda, "bf16") == torch.bfloat16
    assert autocast_dtype(cuda, "fp32") is None
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Tesla V100")
    assert autocast_dtype(cuda, "auto") is None  # no bf16: fp32
    with pytest.raises(ValueError, match="precision: bf16 was asked for but Tesla V100 does not support it"):
        autocast_dtype(cuda, "bf16")
    for key, value, message in (
        ("precision", "fp16", "precision: expected one of auto, fp32, bf16, got 'fp16'"),
        ("compile", "yes", "compile: expected true or false, got 'yes'"),
        ("corpus_bytes", 100, "corpus_bytes: expected an integer >= 1024, got 100"),
    ):
        with pytest.raises(ValueError, match=message):
            RunConfig(**{key: value})


def test_bf16_autocast_trains_on_the_cpu():
    """precision: bf16 runs the matmuls in bfloat16 on the CPU too (CI's GPU code path): the losses move
    off the fp32 run's by bf16 rounding, not more."""
    fp32 = train(RunConfig(**TINY, steps=3, eval_every=0, precision="fp32"))
    bf16 = train(RunConfig(**TINY, steps=3, eval_every=0, precision="bf16"))
    a, b = losses(fp32), losses(bf16)
    assert bf16.status == "done" and a != b and max(abs(x - y) for x, y in zip(a, b, strict=True)) < 0.05
    assert bf16.provenance["precision"] == "bfloat16 autocast" and fp32.provenance["precision"] == "fp32"
    seen = []
    from addnorm.tasks.base import Task

    real = Task.logits
    try:
        Task.logits = lambda self, model, batch: (
            seen.append(real(self, model, batch).dtype) or real(self, model, batch)
        )
        train(RunConfig(**TINY, steps=1, eval_every=0, precision="bf16"))
    finally:
        Task.logits = real
    assert torch.bfloat16 in seen


def losses(result):
    return [v for _, n, v in result.metrics if n == "train_loss"]


@pytest.mark.parametrize("poison", [None, 4])
def test_reading_the_loss_late_gives_the_same_result(monkeypatch, poison):
    """The loss read every step or every 3 steps (a GPU's way): the same metrics, probes, evaluation and
    final numbers; a NaN found late is recorded at its own step and nothing after it is kept."""
    if poison is not None:
        from addnorm.tasks.base import Task

        real, calls = Task.loss, []

        def poisoned(self, model, batch):
            loss, logits = real(self, model, batch)
            if torch.is_grad_enabled():  # a training step
                calls.append(1)
                if len(calls) == poison:
                    loss = loss * float("nan")
            return loss, logits

        monkeypatch.setattr(Task, "loss", poisoned)
    cfg = RunConfig(**TINY, steps=9, eval_every=3, probe_every=6)
    results, steps = [], []
    for sync in (1, 3):
        seen = []
        if poison is not None:
            calls.clear()  # the same step of each run is poisoned
        results.append(train(cfg, sync_every=sync, on_step=lambda s, v, seen=seen: seen.append((s, v))))
        steps.append(seen)
    eager, late = results
    assert repr(eager.metrics) == repr(late.metrics)  # repr: a NaN equals a NaN, every float exactly
    assert eager.layer_metrics == late.layer_metrics
    assert (eager.status, eager.diverged_step, eager.steps_done, eager.final) == (
        late.status,
        late.diverged_step,
        late.steps_done,
        late.final,
    )
    assert (
        steps[0] == steps[1] == [(s, v) for s, n, v in eager.metrics if n == "train_loss"][: eager.steps_done]
    )
    if poison is not None:
        assert eager.status == "diverged" and eager.diverged_step == poison - 1


def test_throughput_counts_tokens_after_the_first_step_and_leaves_out_pauses():
    from addnorm.train.device import Throughput

    clock = iter([10.0, 12.0, 20.0, 21.0])  # resume, pause, resume, pause
    speed = Throughput(torch.device("cpu"))
    speed.clock = lambda: next(clock)
    speed.count(999)  # before the clock runs: the first step, not counted
    speed.resume()
    speed.count(100)
    speed.count(100)
    speed.pause()
    speed.resume()
    speed.count(60)
    speed.pause()
    assert speed.rate == pytest.approx(260 / 3.0)
    one = train(RunConfig(**TINY, steps=1, eval_every=0))
    many = train(RunConfig(**TINY, steps=5, eval_every=2))
    assert one.tokens_per_s is None  # nothing after the first step
    # counted over steps 1-4 only, in less time than the whole run took
    assert many.tokens_per_s > 4 * TINY["batch_size"] * TINY["seq_len"] / many.wall_s


def test_settings_added_later_keep_the_run_ids_of_stored_studies():
    """precision, compile, corpus_bytes, the Hugging Face keys (model, kv_heads, rope_theta, fused,
    hf_init) and distributed at their defaults (what every run did before they existed) are left out of
    the run id: the id is the SHA-1 of the config as it was before they were added."""
    import hashlib
    import json

    cfg = RunConfig(**TINY)
    later = (
        "precision",
        "compile",
        "corpus_bytes",
        "model",
        "kv_heads",
        "rope_theta",
        "fused",
        "hf_init",
        "distributed",
    )
    before = {k: v for k, v in cfg.to_dict().items() if k not in later}
    text = json.dumps(before, sort_keys=True, separators=(",", ":"))
    assert cfg.run_id == hashlib.sha1(text.encode()).hexdigest()[:12]
    ids = {
        RunConfig(**TINY, **{k: v}).run_id
        for k, v in (("precision", "bf16"), ("compile", True), ("corpus_bytes", 2048), ("kv_heads", 1))
    }
    assert len(ids) == 4 and cfg.run_id not in ids
