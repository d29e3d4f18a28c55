"""One training run: seeded data and init, AdamW with a schedule, evaluation, probing, and divergence
recorded as a result rather than raised."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..connection import AddNorm
from ..placement_spec import Lifecycle
from ..probe import Probe
from ..tasks import build_task
from .config import RunConfig
from .device import (
    PeakMemory,
    Throughput,
    autocast,
    autocast_dtype,
    device_name,
    precision_name,
    select_device,
)
from .hf_model import ADDNORM_MODEL, build_hf_model, transformers_version
from .optim import build_optimizer
from .ranks import Ranks, full
from .schedules import lr_multiplier

DONE, DIVERGED, FAILED = "done", "diverged", "failed"
SYNC_EVERY = 16  # steps between reads of the loss from a GPU (see train)


@dataclass
class RunResult:
    """What a run produced: status, final numbers, per-step metrics (step, name, value) and per-layer
    rows in the Probe's format (plus ``update_ratio`` rows), training throughput, and where and how it
    ran (``provenance``: device, precision and compile here, the rest filled in by the study's executors)."""

    status: str
    steps_done: int = 0
    wall_s: float = 0.0
    diverged_step: int | None = None
    error: str | None = None
    final: dict = field(default_factory=dict)
    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    layer_metrics: list[dict] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)
    tokens_per_s: float | None = None  # training tokens per second after the first step


ProgressCallback = Callable[[str, int, int], None]  # (phase, done, total): see train


def evaluations(cfg: RunConfig) -> int:
    """How many held-out evaluations a run that does not diverge makes: one every ``eval_every`` steps
    and after the last step (0: none of those), then the final one."""
    return (math.ceil(cfg.steps / cfg.eval_every) if cfg.eval_every else 0) + 1


def eval_batches_total(cfg: RunConfig) -> int:
    """Held-out batches over the whole run (``eval_batches`` 0 evaluates one batch)."""
    return evaluations(cfg) * max(cfg.eval_batches, 1)


@torch.no_grad()
def evaluate(
    task,
    model,
    cfg: RunConfig,
    device,
    dtype: torch.dtype | None = None,
    on_batch: Callable[[], None] | None = None,
) -> tuple[float, float]:
    """Mean held-out loss and metric over ``eval_batches`` batches from a fixed generator, under the
    run's autocast (``dtype``; default: what ``cfg.precision`` gives on ``device``). ``on_batch()`` is
    called after each batch (progress; it sees nothing of the model)."""
    device = torch.device(device)
    dtype = autocast_dtype(device, cfg.precision) if dtype is None else dtype
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    was_training = model.training
    model.eval()
    losses, metrics = [], []
    try:
        for _ in range(cfg.eval_batches or 1):
            batch = task.batch("val", cfg.batch_size, cfg.seq_len, gen, device)
            with autocast(device, dtype):
                loss, logits = task.loss(model, batch)
            losses.append(loss.item())
            metrics.append(task.metric_value(loss.item(), logits, batch))
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was_training)
    return sum(losses) / len(losses), sum(metrics) / len(metrics)


def _sublayers_by_weight(model, layer_names: list[str]) -> dict[tuple[str, str], str]:
    """(layer name, attribute) -> sublayer, for the attributes holding each connection's weights (its
    ``connection_role``, the role Probe reads)."""
    modules = dict(model.named_modules())
    found = {}
    for layer in layer_names:
        for child in modules[layer].children() if layer in modules else ():
            role = getattr(child, "connection_role", None)
            if isinstance(child, AddNorm) and role is not None:
                found.update(((layer, attribute), role.sublayer) for attribute in role.weights)
    return found


def _update_ratios(model, before: dict[str, torch.Tensor], layer_names: list[str], step: int) -> list[dict]:
    """||w_after - w_before|| / ||w_before|| for each weight matrix inside a probed layer, under the
    sublayer whose weights it is (its connection's role), or ``""``."""
    rows = []
    params = dict(model.named_parameters())
    sublayers = _sublayers_by_weight(model, layer_names)
    for name, old in before.items():
        layer = next((ln for ln in layer_names if name.startswith(ln + ".")), None)
        if layer is None:
            continue
        rel = name[len(layer) + 1 :]
        sublayer = sublayers.get((layer, rel.split(".")[0]), "")
        new, old = full(params[name].detach()), full(old)
        ratio = (new - old).norm().item() / max(old.norm().item(), 1e-12)
        rows.append(
            {
                "step": step,
                "layer": layer_names.index(layer),
                "layer_name": layer,
                "sublayer": sublayer,
                "metric": "update_ratio",
                "param": rel,
                "value": ratio,
            }
        )
    return rows


def _residual_picture(model, task, batch, step: int) -> list[tuple[int, str, float]]:
    """RMS of x, F(x) and x + F(x) at the FFN connection of the middle layer (the Add of Add & Norm),
    read at its ``stream_in`` and ``branch`` observation points."""
    conns = [
        m
        for m in model.modules()
        if isinstance(m, AddNorm) and m.connection_role is not None and m.connection_role.kind == "ffn"
    ]
    if not conns:
        return []
    conn = conns[len(conns) // 2]
    seen: dict[str, torch.Tensor] = {}

    def keeper(key: str):
        return lambda module, args, out: seen.setdefault(key, out)

    handles = [
        conn.stream_in.register_forward_hook(keeper("x")),
        conn.branch.register_forward_hook(keeper("f")),
    ]
    try:
        with torch.no_grad():
            task.loss(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    if "x" not in seen or "f" not in seen:
        return []
    rms = lambda t: t.float().pow(2).mean().sqrt().item()  # noqa: E731
    x, f = seen["x"], seen["f"]
    return [(step, "xf_x_rms", rms(x)), (step, "xf_f_rms", rms(f)), (step, "xf_sum_rms", rms(x + f))]


class _StepLog:
    """The per-step record of a run, read from the device every ``sync_every`` steps (reading a value
    waits for the device's queued work). A divergence found in a read is recorded at its step and the
    steps computed past it are dropped, so the result is the same for every ``sync_every``."""

    def __init__(self, result: RunResult, cfg: RunConfig, on_step: Callable[[int, float], None] | None):
        self.result, self.cfg, self.on_step = result, cfg, on_step
        self.first_loss: float | None = None
        self.pending: list[tuple[int, torch.Tensor | float, torch.Tensor, float]] = []

    def diverges(self, step: int, value: float) -> bool:
        """Whether ``value`` (the loss of ``step``) ends the run; if so it is recorded as the divergence."""
        self.first_loss = value if self.first_loss is None else self.first_loss
        if math.isfinite(value) and value <= self.cfg.diverge_factor * self.first_loss:
            return False
        self.result.status, self.result.diverged_step = DIVERGED, step
        self.result.metrics.append((step, "train_loss", value if math.isfinite(value) else float("nan")))
        return True

    def add(self, step: int, loss: torch.Tensor | float, grad_norm: torch.Tensor, lr: float) -> None:
        self.pending.append((step, loss, grad_norm.detach(), lr))

    def flush(self) -> bool:
        """Read the pending steps (one wait for the device) and record them in order; False when one of
        them diverged (the run is over)."""
        if not self.pending:
            return self.result.status == DONE
        pending, self.pending = self.pending, []
        values = torch.stack(
            [
                torch.as_tensor(x, dtype=torch.float32, device=g.device)
                for _, loss, g, _ in pending
                for x in (loss, g)
            ]
        ).tolist()
        for i, (step, loss, _, lr) in enumerate(pending):
            value = loss if isinstance(loss, float) else values[2 * i]
            if self.diverges(step, value):
                return False
            self.result.metrics += [
                (step, "train_loss", value),
                (step, "grad_norm", values[2 * i + 1]),
                (step, "lr", lr),
            ]
            self.result.steps_done = step + 1
            if self.on_step is not None:
                self.on_step(step, value)
        return True


def build_model(cfg: RunConfig, task) -> torch.nn.Module:
    """The run's model: the task's own (addnorm's transformer) or, for ``model: hf-*``, the Hugging Face
    family's causal LM re-placed by ``with_placement`` (:mod:`addnorm.train.hf_model`)."""
    if cfg.arch == ADDNORM_MODEL:
        return task.build_model(cfg.model)
    return build_hf_model(cfg, task.vocab)


def train(
    cfg: RunConfig,
    *,
    on_step: Callable[[int, float], None] | None = None,
    device: str | torch.device | None = None,
    sync_every: int | None = None,
    on_progress: ProgressCallback | None = None,
) -> RunResult:
    """Train one run to completion or divergence. Exceptions propagate (the runner records them).

    ``device``: where to train (default ``auto``: CUDA when this process sees a GPU, else the CPU).
    ``on_step(step, loss)`` is called for every completed step, in order. ``sync_every``: steps between
    reads of the loss from the device (default 1 on the CPU, :data:`SYNC_EVERY` on a GPU); probed steps
    are read at once. The result does not depend on it (see :class:`_StepLog`); ``on_step`` only comes
    later. A run with ``distributed`` set trains on this process's shard of every batch, under the
    process group its launcher started (:mod:`addnorm.train.ranks`, :mod:`addnorm.train.launch`),
    and records what one process would. With ``compile: true`` the training steps run the model
    through ``torch.compile``, except probed steps (their hooks run it uncompiled) and evaluation (a
    few forward passes would not repay compiling the evaluation graph).

    ``on_progress(phase, done, total)`` says what a long run is doing between steps: ``("build", 0,
    1)`` when it starts building its model and ``("build", 1, 1)`` when that is done; ``("eval", done,
    total)`` after each held-out batch, counted over the whole run (``total`` is
    :func:`eval_batches_total`). Like ``on_step`` it only observes.

    Args:
        cfg: the run.
        on_step: called with ``(step, loss)`` after every step.
        device: where to train (default: CUDA when there is a GPU, else the CPU).
        sync_every: steps between reads of the loss from the device.
        on_progress: called with ``(phase, done, total)`` while building and evaluating.

    Returns:
        The run's :class:`RunResult`: its status, losses, metrics and timings.
    """
    start = time.perf_counter()
    progress = on_progress or (lambda phase, done, total: None)
    progress("build", 0, 1)
    device = select_device(device)
    peak = PeakMemory(device)
    dtype = autocast_dtype(device, cfg.precision)
    sync_every = sync_every or (1 if device.type == "cpu" else SYNC_EVERY)
    torch.manual_seed(cfg.seed)
    options = (
        {"corpus": cfg.corpus, "limit": cfg.corpus_bytes} if cfg.task == "lm" else {"symbols": cfg.symbols}
    )
    task = build_task(cfg.task, **options)
    ranks = Ranks.current(cfg.distributed)
    # ``model`` is the module a rank observes and evaluates, ``trained`` the one it trains (DDP's wrapper)
    model = build_model(cfg, task).to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    # the placements' lifecycle: a pass on data before training (Admin's profiling sets omega), and
    # something after every optimiser step (nGPT puts its matrices back on the unit sphere)
    lifecycle = Lifecycle.of(model)
    if lifecycle.needs_data:
        seed = torch.Generator().manual_seed(cfg.seed + 1)
        lifecycle.prepare(
            model, *task.model_inputs(task.batch("train", cfg.batch_size, cfg.seq_len, seed, device))
        )
    progress("build", 1, 1)
    evaluated, eval_total = [0], eval_batches_total(cfg)

    def eval_batch() -> None:
        evaluated[0] += 1
        progress("eval", evaluated[0], eval_total)

    trained = ranks.wrap(model, device) if ranks else model
    forward = torch.compile(trained) if cfg.compile else trained
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay)
    result = RunResult(status=DONE)
    result.provenance = {
        "device": device_name(device),
        "precision": precision_name(dtype),
        "compile": cfg.compile,
    }
    if ranks:
        result.provenance["distributed"] = f"{ranks.strategy} x {ranks.world}"
    if cfg.arch != ADDNORM_MODEL:
        result.provenance["transformers"] = transformers_version()
    probe_steps = {0, cfg.steps - 1}
    if cfg.probe_every:
        probe_steps |= set(range(0, cfg.steps, cfg.probe_every))
    log = _StepLog(result, cfg, on_step)
    speed = Throughput(device)
    fixed_batch = task.batch(
        "val", min(cfg.batch_size, 8), cfg.seq_len, torch.Generator().manual_seed(99), device
    )
    result.metrics += _residual_picture(model, task, fixed_batch, 0)
    model.train()
    for step in range(cfg.steps):
        lr = cfg.lr * lr_multiplier(cfg.schedule, step, cfg.warmup, cfg.steps)
        for group in opt.param_groups:
            group["lr"] = lr
        batch = task.batch("train", cfg.batch_size, cfg.seq_len, gen, device)
        probing = step in probe_steps
        if ranks and not probing:  # probed steps: the whole batch on every rank (see ranks.py)
            batch = ranks.shard(batch)
        read_now = probing or sync_every == 1
        probe = Probe(model) if probing else contextlib.nullcontext()
        with probe:
            with autocast(device, dtype):
                loss, _ = task.loss(trained if probing else forward, batch)
            seen = ranks.mean(loss) if ranks and not probing else loss.detach()
            if read_now:  # a diverged step is recorded before it updates anything
                if not log.flush() or log.diverges(step, value := seen.item()):
                    break
            opt.zero_grad(set_to_none=True)
            loss.backward()
            if probing:
                rows = probe.snapshot(step)
                result.layer_metrics += rows
                layer_names = sorted(
                    {r["layer_name"] for r in rows},
                    key=lambda n: next(r["layer"] for r in rows if r["layer_name"] == n),
                )
        if cfg.grad_clip:
            grad_norm = full(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip))
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([full(p.grad.detach().norm()) for p in model.parameters() if p.grad is not None])
            )
        before = (
            {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim >= 2} if probing else None
        )
        opt.step()
        lifecycle.after_step(model)
        if probing:
            result.layer_metrics += _update_ratios(model, before, layer_names, step)
        log.add(step, value if read_now else seen, grad_norm, lr)
        speed.count(cfg.batch_size * cfg.seq_len)
        if (read_now or len(log.pending) >= sync_every) and not log.flush():
            break
        if step == 0:
            speed.resume()  # tokens/s from here on: the first step holds compilation and warm-up
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            if not log.flush():
                break
            speed.pause()
            val_loss, val_metric = evaluate(task, model, cfg, device, dtype, eval_batch)
            result.metrics += [(step, "val_loss", val_loss), (step, f"val_{task.metric}", val_metric)]
            speed.resume()
    log.flush()
    speed.pause()
    result.tokens_per_s = speed.rate
    if result.status == DONE:
        val_loss, val_metric = evaluate(task, model, cfg, device, dtype, eval_batch)
        train_tail = [v for _, n, v in result.metrics if n == "train_loss"][-10:]
        result.final = {
            "train_loss": sum(train_tail) / len(train_tail),
            "val_loss": val_loss,
            "val_metric": val_metric,
            "metric": task.metric,
        }
        result.metrics += _residual_picture(model, task, fixed_batch, result.steps_done)
    result.provenance.update(peak.record())
    result.wall_s = time.perf_counter() - start
    return result
