"""One training run: seeded data and init, AdamW with a schedule, evaluation, probing, and divergence
recorded as a result rather than raised."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..addnorm import AddNorm
from ..model import admin_init, ngpt_matrices, ngpt_normalize_
from ..probe import Probe
from ..tasks import build_task
from .config import RunConfig
from .optim import build_optimizer
from .schedules import lr_multiplier

DONE, DIVERGED, FAILED = "done", "diverged", "failed"


@dataclass
class RunResult:
    """What a run produced: status, final numbers, per-step metrics (step, name, value) and per-layer
    rows in the Probe's format (plus ``update_ratio`` rows), and where it ran (``provenance``, filled by the
    study's executors)."""

    status: str
    steps_done: int = 0
    wall_s: float = 0.0
    diverged_step: int | None = None
    error: str | None = None
    final: dict = field(default_factory=dict)
    metrics: list[tuple[int, str, float]] = field(default_factory=list)
    layer_metrics: list[dict] = field(default_factory=list)
    provenance: dict = field(default_factory=dict)


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _autocast(device: torch.device):
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(task, model, cfg: RunConfig, device) -> tuple[float, float]:
    """Mean held-out loss and metric over ``eval_batches`` batches from a fixed generator."""
    gen = torch.Generator().manual_seed(10_000 + cfg.seed)
    was_training = model.training
    model.eval()
    losses, metrics = [], []
    try:
        for _ in range(cfg.eval_batches or 1):
            batch = task.batch("val", cfg.batch_size, cfg.seq_len, gen).to(device)
            with _autocast(device):
                loss, logits = task.loss(model, batch)
            losses.append(loss.item())
            metrics.append(task.metric_value(loss.item(), logits, batch))
    finally:
        model.train(was_training)
    return sum(losses) / len(losses), sum(metrics) / len(metrics)


def _update_ratios(model, before: dict[str, torch.Tensor], layer_names: list[str], step: int) -> list[dict]:
    """||w_after - w_before|| / ||w_before|| for each weight matrix inside a probed layer."""
    rows = []
    params = dict(model.named_parameters())
    for name, old in before.items():
        layer = next((ln for ln in layer_names if name.startswith(ln + ".")), None)
        if layer is None:
            continue
        rel = name[len(layer) + 1 :]
        sub = rel.split(".")[0]
        sublayer = sub if sub in ("self_attn", "cross_attn", "ff") else ""
        ratio = (params[name].detach() - old).norm().item() / max(old.norm().item(), 1e-12)
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
    conns = [m for name, m in model.named_modules() if isinstance(m, AddNorm) and name.endswith("ff_block")]
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


def train(cfg: RunConfig, *, on_step: Callable[[int, float], None] | None = None) -> RunResult:
    """Train one run to completion or divergence. Exceptions propagate (the runner records them)."""
    start = time.perf_counter()
    device = _device()
    torch.manual_seed(cfg.seed)
    task = build_task(cfg.task, **({"corpus": cfg.corpus} if cfg.task == "lm" else {"symbols": cfg.symbols}))
    model = task.build_model(cfg.model).to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    # Admin's profiling pass sets omega from data
    if any(p.init == "admin" for p in cfg.model.placements_for(cfg.model.n_layers)):
        profile = task.batch(
            "train", cfg.batch_size, cfg.seq_len, torch.Generator().manual_seed(cfg.seed + 1)
        )
        admin_init(model, *task.model_inputs(profile.to(device)))
    opt = build_optimizer(model, cfg.lr, cfg.weight_decay)
    on_sphere = bool(ngpt_matrices(model))  # nGPT: matrices back on the unit sphere after each step
    result = RunResult(status=DONE)
    probe_steps = {0, cfg.steps - 1}
    if cfg.probe_every:
        probe_steps |= set(range(0, cfg.steps, cfg.probe_every))
    first_loss = None
    fixed_batch = task.batch(
        "val", min(cfg.batch_size, 8), cfg.seq_len, torch.Generator().manual_seed(99)
    ).to(device)
    result.metrics += _residual_picture(model, task, fixed_batch, 0)
    model.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:
            group["lr"] = cfg.lr * lr_multiplier(cfg.schedule, step, cfg.warmup, cfg.steps)
        batch = task.batch("train", cfg.batch_size, cfg.seq_len, gen).to(device)
        probing = step in probe_steps
        probe = Probe(model) if probing else contextlib.nullcontext()
        with probe:
            with _autocast(device):
                loss, _ = task.loss(model, batch)
            value = loss.item()
            first_loss = value if first_loss is None else first_loss
            if not math.isfinite(value) or value > cfg.diverge_factor * first_loss:
                result.status, result.diverged_step = DIVERGED, step
                result.metrics.append((step, "train_loss", value if math.isfinite(value) else float("nan")))
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
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        else:
            grad_norm = torch.linalg.vector_norm(
                torch.stack([p.grad.detach().norm() for p in model.parameters() if p.grad is not None])
            )
        before = (
            {n: p.detach().clone() for n, p in model.named_parameters() if p.ndim >= 2} if probing else None
        )
        opt.step()
        if on_sphere:
            ngpt_normalize_(model)
        if probing:
            result.layer_metrics += _update_ratios(model, before, layer_names, step)
        result.metrics += [
            (step, "train_loss", value),
            (step, "grad_norm", grad_norm.item()),
            (step, "lr", opt.param_groups[0]["lr"]),
        ]
        result.steps_done = step + 1
        if on_step is not None:
            on_step(step, value)
        if cfg.eval_every and ((step + 1) % cfg.eval_every == 0 or step == cfg.steps - 1):
            val_loss, val_metric = evaluate(task, model, cfg, device)
            result.metrics += [(step, "val_loss", val_loss), (step, f"val_{task.metric}", val_metric)]
    if result.status == DONE:
        val_loss, val_metric = evaluate(task, model, cfg, device)
        train_tail = [v for _, n, v in result.metrics if n == "train_loss"][-10:]
        result.final = {
            "train_loss": sum(train_tail) / len(train_tail),
            "val_loss": val_loss,
            "val_metric": val_metric,
            "metric": task.metric,
        }
        result.metrics += _residual_picture(model, task, fixed_batch, result.steps_done)
    result.wall_s = time.perf_counter() - start
    return result
