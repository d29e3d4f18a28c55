"""addnorm.hf.ProbeCallback under the real transformers.Trainer, reporting to TensorBoard: the values
TensorBoard's own event reader reads back are those of an independent Probe of the same step, at the
step numbers of the Trainer's own logs, and observing changes no result."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hf_models import tiny, tokens

import addnorm as an
import addnorm.hf as anhf

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")


class _Oracle(transformers.TrainerCallback):
    """A Probe attached for the whole run, read by hand before each optimizer step: {step: values}."""

    def __init__(self, model) -> None:
        self.probe = an.Probe(model).attach()
        self.seen: dict[int, dict[str, list[float]]] = {}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.seen[state.global_step + 1] = {
            "stream_grad": self.probe.stream_grad_norms(),
            "weight_grad": self.probe.weight_grad_norms(None),
            "act_rms": self.probe.activation_rms(),
        }


def _train(model, out, callbacks, steps=4):
    ids = tokens(batch=8, seq=8)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=["tensorboard"], logging_steps=1, save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, data_seed=0,
    )  # fmt: skip
    data = [{"input_ids": r, "labels": r} for r in ids]
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    return trainer


def _scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir)).Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_probe_callback_logs_what_a_probe_reads_to_tensorboard(model_type, tmp_path):
    torch.set_num_threads(1)
    model = (
        anhf.fuse(tiny(model_type)) if model_type == "llama" else anhf.with_placement(tiny(model_type), "mix")
    )
    untouched = copy.deepcopy(model)
    oracle = _Oracle(model)
    trainer = _train(model, tmp_path / "probed", [anhf.ProbeCallback(every=2), oracle])
    tb = next((tmp_path / "probed").rglob("events.out.tfevents.*")).parent
    scalars = _scalars(tb)
    assert set(scalars["train/loss"]) == {1, 2, 3, 4}  # the Trainer's own logs, every step
    for metric in anhf.callback.METRICS:
        for i in range(2):
            values = scalars[f"train/probe/{metric}/layer_{i}"]
            assert set(values) == {2, 4}  # every 2 steps, at the Trainer's step numbers
            for step, value in values.items():
                expected = oracle.seen[step][metric][i]
                assert math.isfinite(value) and value > 0
                assert value == pytest.approx(expected, rel=1e-6), (metric, i, step)
    logged = [h for h in trainer.state.log_history if "probe/act_rms/layer_0" in h]
    assert [h["step"] for h in logged] == [2, 4]
    # observing changes nothing: the same run without the callbacks ends with the same weights
    _train(untouched, tmp_path / "plain", [])
    for (name, a), b in zip(model.named_parameters(), untouched.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_probe_callback_checks_its_options():
    for kwargs, expected in (
        ({"every": 0}, "every: expected a positive int, got 0"),
        ({"every": "10"}, "every: expected a positive int, got '10'"),
        ({"metrics": ("loss",)}, "metrics: expected some of stream_grad, weight_grad, act_rms"),
    ):
        with pytest.raises(ValueError, match=expected):
            anhf.ProbeCallback(**kwargs)
