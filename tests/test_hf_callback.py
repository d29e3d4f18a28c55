"""addnorm.hf.ProbeCallback under the real transformers.Trainer: the values TensorBoard's own event
reader reads back are those of an independent Probe of the same step, at the step numbers of the
Trainer's own logs; with gradient accumulation, clipping and micro-batches of different lengths they are
the step's values computed by hand with plain autograd on an unfused twin (a hand run that reproduces
the Trainer's own logged loss and grad_norm); and observing changes no result."""

from __future__ import annotations

import copy
import json
import math
import os
import warnings

import pytest
import torch
from hf_models import VOCAB, tiny, tokens

import addnorm as an
import addnorm.hf as anhf
from tools.procs import run_spawned

pytestmark = pytest.mark.slow  # spawned ranks (DDP)

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


def _train(model, out, callbacks=(), steps=4, probe=None, data=None, model_init=None, **options):
    ids = tokens(batch=8, seq=8)
    settings = dict(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=2,
        learning_rate=1e-2, report_to=["tensorboard"], logging_steps=1, save_strategy="no", use_cpu=True,
        disable_tqdm=True, seed=0, data_seed=0,
    )  # fmt: skip
    args = transformers.TrainingArguments(**(settings | options))
    data = [{"input_ids": r, "labels": r} for r in ids] if data is None else data
    trainer = transformers.Trainer(
        model=model,
        model_init=model_init,
        args=args,
        train_dataset=data,
        callbacks=list(callbacks),
        data_collator=_collate,
    )
    if probe is not None:
        probe.add_to(trainer)
    trainer.train()
    return trainer


def _collate(rows: list[dict]) -> dict:
    """Rows of different lengths padded on the right to the longest: attention mask 0, label -100."""
    longest = max(len(r["input_ids"]) for r in rows)
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    labels = torch.full((len(rows), longest), -100)
    for i, r in enumerate(rows):
        n = len(r["input_ids"])
        ids[i, :n], mask[i, :n], labels[i, :n] = r["input_ids"], 1, r["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def _scalars(logdir) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir)).Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_probe_callback_logs_what_a_probe_reads_to_tensorboard(model_type, tmp_path):
    """Without clipping (``max_grad_norm=0``) the gradients a Probe reads before the optimizer step are
    the ones the callback reads before clipping."""
    torch.set_num_threads(1)
    model = (
        anhf.fuse(tiny(model_type)) if model_type == "llama" else anhf.with_placement(tiny(model_type), "mix")
    )
    untouched = copy.deepcopy(model)
    oracle = _Oracle(model)
    probe = anhf.ProbeCallback(every=2)
    trainer = _train(model, tmp_path / "probed", [oracle], probe=probe, max_grad_norm=0.0)
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
    _train(untouched, tmp_path / "plain", max_grad_norm=0.0)
    for (name, a), b in zip(model.named_parameters(), untouched.parameters(), strict=True):
        assert torch.equal(a, b), name


# --- gradient accumulation and clipping: the step's values, by hand ----------------------------------

K, STEPS = 3, 2  # micro-batches per optimizer step, optimizer steps
LENGTHS = [4, 3, 12, 11, 7, 8, 5, 4, 10, 12, 6, 6]  # two rows per micro-batch: padded to 4, 12, 8, 5, 12, 6


def _rows() -> list[dict]:
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen) for n in LENGTHS]
    return [{"input_ids": r, "labels": r} for r in rows]


def _models(model_type: str):
    """(the trained model: fused or re-placed, its unfused twin for the hand run, the twin's layers)."""
    if model_type == "llama":
        model, twin = anhf.fuse(tiny("llama")), tiny("llama")
        return model, twin, twin.model.layers
    model = anhf.with_placement(tiny("gpt2"), "mix")
    twin = anhf.with_placement(tiny("gpt2"), "mix", fused=False)
    return model, twin, twin.transformer.h


class _Snapshots(transformers.TrainerCallback):
    """The model's weights as each step begins: {step: state dict}."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.states[state.global_step + 1] = copy.deepcopy(model.state_dict())


def _by_hand(twin, layers, micro_batches: list[dict], trainer) -> dict:
    """One optimizer step's values with plain autograd on the unfused twin, from each micro-batch's own
    forward and backward (float64 sums): the Trainer's loss and grad_norm, and per layer
    sqrt(sum_j ||dL_j/ds_ij||^2), the layer's weight-gradient norm after all micro-batches, and the RMS
    over every micro-batch's stream."""
    twin.train()
    twin.zero_grad(set_to_none=True)
    n_layers = len(layers)
    grad_sq, act_sq, elems = [0.0] * n_layers, [0.0] * n_layers, [0] * n_layers
    last_grad_sq = [0.0] * n_layers  # the last micro-batch's alone: what the step's value must not be

    def record(i):
        def hook(module, args, output):
            s = output[0] if isinstance(output, tuple) else output
            act_sq[i] += float(s.detach().double().square().sum())
            elems[i] += s.numel()

            def on_grad(g):
                grad_sq[i] += float(g.double().square().sum())
                last_grad_sq[i] = float(g.double().square().sum())

            s.register_hook(on_grad)

        return hook

    handles = [layer.register_forward_hook(record(i)) for i, layer in enumerate(layers)]
    # the Trainer's loss scaling: a token sum over the step's label count (labels[:, 1:] where it knows the
    # loss shifts them: not for GPT-2, whose config names no loss type), else each micro-batch's mean / K
    scaled_by_items = trainer.model_accepts_loss_kwargs
    start = 1 if trainer._loss_shifts_labels else 0
    items = sum(mb["labels"][:, start:].ne(-100).sum() for mb in micro_batches)
    loss = 0.0
    try:
        for mb in micro_batches:
            if scaled_by_items:
                step_loss = twin(**mb, num_items_in_batch=items).loss
            else:
                step_loss = twin(**mb).loss / len(micro_batches)
            step_loss.backward()
            loss += float(step_loss.detach())
    finally:
        for h in handles:
            h.remove()

    def norm(params) -> float:
        return math.sqrt(sum(float(p.grad.double().square().sum()) for p in params if p.grad is not None))

    return {
        "loss": loss,
        "grad_norm": norm(twin.parameters()),
        "stream_grad": [math.sqrt(v) for v in grad_sq],
        "weight_grad": [norm(p for p in layer.parameters() if p.ndim >= 2) for layer in layers],
        "act_rms": [math.sqrt(a / n) for a, n in zip(act_sq, elems, strict=True)],
        "last_stream_grad": [math.sqrt(v) for v in last_grad_sq],
    }


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_probe_callback_reports_the_whole_step_before_clipping(model_type, tmp_path):
    """K micro-batches of different lengths per step, ``max_grad_norm=0.01``: the logged values are the
    step's (formulas of ``addnorm.hf.callback``), the weight gradients those before clipping; the hand run
    that gives them gives the Trainer's own loss and grad_norm; and a run without the callback is
    bit-identical (losses, grad norms, weights)."""
    torch.set_num_threads(1)
    model, twin, layers = _models(model_type)
    untouched = copy.deepcopy(model)
    options = dict(
        max_steps=STEPS, gradient_accumulation_steps=K, max_grad_norm=0.01, report_to=[],
        train_sampling_strategy="sequential", data=_rows(),
    )  # fmt: skip
    snapshots = _Snapshots()
    trainer = _train(model, tmp_path / "probed", [snapshots], probe=anhf.ProbeCallback(every=1), **options)
    own = {h["step"]: h for h in trainer.state.log_history if "loss" in h and "grad_norm" in h}
    probed = {h["step"]: h for h in trainer.state.log_history if "probe/act_rms/layer_0" in h}
    assert sorted(probed) == sorted(own) == list(range(1, STEPS + 1))
    micro = [_collate(_rows()[i : i + 2]) for i in range(0, 2 * K * STEPS, 2)]
    for step in range(1, STEPS + 1):
        twin.load_state_dict(snapshots.states[step])
        hand = _by_hand(twin, layers, micro[(step - 1) * K : step * K], trainer)
        # the hand run is the Trainer's step: its own logs
        assert own[step]["loss"] == pytest.approx(hand["loss"], rel=1e-5)
        assert own[step]["grad_norm"] == pytest.approx(hand["grad_norm"], rel=1e-5)
        for metric in anhf.callback.METRICS:
            for i in range(len(layers)):
                got = probed[step][f"probe/{metric}/layer_{i}"]
                assert got == pytest.approx(hand[metric][i], rel=1e-5), (metric, i, step)
        # what the step's values are not: the clipped gradients (scaled by max_grad_norm / grad_norm, under
        # 1/10 here), the last micro-batch's stream alone
        assert own[step]["grad_norm"] > 10 * trainer.args.max_grad_norm
        for i in range(len(layers)):
            assert hand["stream_grad"][i] > 1.2 * hand["last_stream_grad"][i]
    # observing changes nothing
    plain = _train(untouched, tmp_path / "plain", **options)
    plain_own = [(h["loss"], h["grad_norm"]) for h in plain.state.log_history if "grad_norm" in h]
    assert plain_own == [(own[s]["loss"], own[s]["grad_norm"]) for s in sorted(own)]
    for (name, a), b in zip(model.named_parameters(), untouched.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_probe_callback_under_gradient_checkpointing(tmp_path):
    """Checkpointed layers recompute their forward inside the backward (reentrant: in nested backward
    passes, each with its own end): the step's weight gradients and stream RMS are those of the same run
    without checkpointing, and with transformers' default (non-reentrant) checkpointing the stream
    gradients too (under reentrant checkpointing the Probe sees no stream gradient: nan)."""
    torch.set_num_threads(1)
    options = dict(
        max_steps=STEPS, gradient_accumulation_steps=K, max_grad_norm=0.01, report_to=[],
        train_sampling_strategy="sequential", data=_rows(),
    )  # fmt: skip
    logged = {}
    for reentrant in (None, False, True):
        extra = {} if reentrant is None else {"activation_checkpointing": True}
        if reentrant is not None:
            extra["activation_checkpointing_kwargs"] = {"use_reentrant": reentrant}
        model = _models("llama")[0]
        trainer = _train(model, tmp_path / str(reentrant), probe=anhf.ProbeCallback(), **options, **extra)
        logged[reentrant] = [
            {k: v for k, v in h.items() if k.startswith("probe/")}
            for h in trainer.state.log_history
            if "probe/act_rms/layer_0" in h
        ]
    reference = logged[None]
    assert len(reference) == STEPS
    for reentrant in (False, True):
        for step, (got, expected) in enumerate(zip(logged[reentrant], reference, strict=True)):
            for tag, value in expected.items():
                if reentrant and "stream_grad" in tag:
                    assert math.isnan(got[tag])
                else:
                    assert got[tag] == pytest.approx(value, rel=1e-6), (reentrant, step, tag)


def _ddp_worker(rank: int, port: int, out: str) -> None:
    """The Trainer under DDP (2 gloo processes, 2 micro-batches a step, max_grad_norm=0.01): per step the
    logged weight_grad and, read by a Probe at on_pre_optimizer_step (clipped, all-reduced), the same
    norms with the Trainer's own grad_norm."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    model = anhf.fuse(tiny("llama"))

    class Clipped(transformers.TrainerCallback):
        def __init__(self) -> None:
            self.probe, self.seen = an.Probe(model), {}

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            self.seen[state.global_step + 1] = self.probe.weight_grad_norms(None)

    clipped = Clipped()
    data = [{"input_ids": r, "labels": r} for r in tokens(batch=16, seq=8)]
    trainer = _train(
        model, os.path.join(out, "run"), [clipped], steps=2, probe=anhf.ProbeCallback(), data=data,
        gradient_accumulation_steps=2, max_grad_norm=0.01, report_to=[], ddp_backend="gloo",
    )  # fmt: skip
    logs = trainer.state.log_history
    got = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "logged": {
            h["step"]: [h[f"probe/weight_grad/layer_{i}"] for i in range(2)]
            for h in logs
            if "probe/weight_grad/layer_0" in h
        },
        "grad_norm": {h["step"]: h["grad_norm"] for h in logs if "grad_norm" in h},
        "clipped": clipped.seen,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump(got, fh)


def test_probe_callback_reads_the_gradients_ddp_all_reduced(tmp_path):
    """Under DDP the accumulation hooks fire before the all-reduce: the read queued behind it sees the
    ranks' mean gradient, the one the Trainer clips (the clipped gradient times grad_norm / max_grad_norm,
    as ``clip_grad_norm_`` scales it), the same on both ranks; a read in the backward pass or one queued
    in it before DDP's own end-of-pass work would see each rank's own gradient."""
    run_spawned(_ddp_worker, str(tmp_path), nprocs=2)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for got in ranks:
        assert got["wrapped"] == "DistributedDataParallel"
        for step in ("1", "2"):
            grad_norm = got["grad_norm"][step]
            assert grad_norm > 10 * 0.01  # clipped: a read after clipping gives under a tenth
            unclipped = [v * (grad_norm + 1e-6) / 0.01 for v in got["clipped"][step]]
            assert got["logged"][step] == pytest.approx(unclipped, rel=1e-5), step
    assert ranks[0]["logged"] == ranks[1]["logged"]


def test_probe_callback_needs_its_trainer(tmp_path):
    model = anhf.fuse(tiny("llama"))
    with pytest.raises(RuntimeError, match=r"not added with add_to\(trainer\)"):
        _train(model, tmp_path / "a", [anhf.ProbeCallback()], steps=1, report_to=[])
    with pytest.raises(TypeError, match="trainer: expected a transformers.Trainer, got LlamaForCausalLM"):
        anhf.ProbeCallback().add_to(model)
    probe = anhf.ProbeCallback()  # listed in callbacks= and added with add_to: once
    trainer = _train(model, tmp_path / "b", [probe], steps=1, report_to=[], probe=probe)
    assert sum(cb is probe for cb in trainer.callback_handler.callbacks) == 1
    assert sum("probe/act_rms/layer_0" in h for h in trainer.state.log_history) == 1


def test_probe_callback_observes_the_model_the_trainer_trains(tmp_path):
    """With ``model_init`` the Trainer builds its model again in ``train()``, after ``add_to``: the values
    are those of the same model trained as ``model=``."""
    torch.set_num_threads(1)

    def probed(trainer) -> list[dict]:
        return [
            {k: v for k, v in h.items() if "probe/" in k} for h in trainer.state.log_history if "epoch" in h
        ]

    built = _train(
        None, tmp_path / "init", steps=2, probe=anhf.ProbeCallback(), report_to=[],
        model_init=lambda: anhf.fuse(tiny("llama")),
    )  # fmt: skip
    given = _train(
        anhf.fuse(tiny("llama")), tmp_path / "model", steps=2, probe=anhf.ProbeCallback(), report_to=[]
    )
    expected = [h for h in probed(given) if h]
    assert len(expected) == 2 and all(math.isfinite(v) for h in expected for v in h.values())
    assert [h for h in probed(built) if h] == expected


def test_probe_callback_checks_its_options():
    for kwargs, expected in (
        ({"every": 0}, "every: expected a positive int, got 0"),
        ({"every": "10"}, "every: expected a positive int, got '10'"),
        ({"metrics": ("loss",)}, "metrics: expected some of stream_grad, weight_grad, act_rms"),
    ):
        with pytest.raises(ValueError, match=expected):
            anhf.ProbeCallback(**kwargs)
