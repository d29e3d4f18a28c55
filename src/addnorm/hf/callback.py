"""``ProbeCallback(every=N)``: per-layer statistics of a model training under ``transformers.Trainer``,
logged to whatever the Trainer reports to (``report_to``: TensorBoard, MLflow, W&B, ...).

``anhf.ProbeCallback(every=10).add_to(trainer)``. Every ``every`` optimizer steps an
:class:`addnorm.Probe` observes each micro-batch of the step (attached at ``on_step_begin``); the values
go out through the Trainer's own ``log`` at ``on_step_end``, so they carry the step number the Trainer's
own logs carry (``state.global_step`` after the step) and land in ``state.log_history`` too.

An optimizer step runs micro-batches j = 1..k (k = ``gradient_accumulation_steps``, fewer at the end of
an epoch). Let L_j be the loss the Trainer backpropagates for micro-batch j (already scaled for
accumulation: divided by k, or a token sum divided by the step's token count ``num_items_in_batch``),
L = sum_j L_j the step's loss (the accumulated ``p.grad`` is its gradient), s_ij the residual stream at
layer i's output in micro-batch j and n_j the micro-batch's token count (the elements of ``input_ids``,
or of ``inputs_embeds`` without its last dimension; where the model is called with neither, n_j = 1).
Per layer i (0 = nearest the input), as ``<prefix><metric>/layer_<i>``:

- ``stream_grad`` = sqrt(sum_j ||dL_j/ds_ij||^2) = ||dL/ds_i||, s_i the step's whole stream (every
  micro-batch's s_ij side by side): what one forward and backward of the step's whole batch under L
  gives (Xiong et al. 2020, "On Layer Normalization in the Transformer Architecture"). The last
  micro-batch alone gives about 1/sqrt(k) of it;
- ``weight_grad`` = sqrt(sum_W ||dL/dW||^2) over the layer's weight matrices W (its >= 2-D parameters):
  the accumulated gradient *before* the Trainer's clipping (``max_grad_norm``), as the Trainer's own
  ``grad_norm`` is (the sum of squares over every parameter of the model is ``grad_norm``^2), and after
  the backward's own reduction across data-parallel ranks (DDP's all-reduce);
- ``act_rms`` = sqrt(sum_j n_j rms(s_ij)^2 / sum_j n_j) = rms(s_i), the RMS of the step's whole stream.

Stream statistics are those of the micro-batches this process ran (under data parallelism each rank its
own; the Trainer reports rank 0's). When the gradients are read: transformers (5.x) calls no callback
between the last micro-batch's backward and the gradient clipping (``on_substep_end`` follows every
micro-batch but the last; ``on_pre_optimizer_step`` comes after ``clip_grad_norm_``). So the weight
gradients are read at the end of each backward pass of an observed step: a hook on the parameters'
gradient accumulation (``register_post_accumulate_grad_hook``; it only reads) queues the read on the
autograd engine, behind the backward's own end-of-pass work (DDP's gradient all-reduce), so it runs
before ``backward()`` returns to the Trainer; the last backward's read is the step's. Stream statistics
are folded at ``on_substep_end`` and ``on_pre_optimizer_step`` (clipping does not touch them). Observing
changes no result (every hook only reads). Works on untouched, fused and re-placed models and on
addnorm's own models, with activation checkpointing (under the reentrant kind, where each checkpointed
layer's backward is a nested pass, the last read still comes last; the Probe then records no stream
gradient: ``stream_grad`` is nan); tested in one process and under DDP (not under FSDP or DeepSpeed).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..probe import LayerSelector, Probe

__all__ = ["METRICS", "ProbeCallback"]

METRICS = ("stream_grad", "weight_grad", "act_rms")


def _tokens(args: tuple, kwargs: dict) -> int | None:
    """The token count of one forward of the model (n_j of the module docstring), or None."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, Tensor) and not ids.is_floating_point():
        return ids.numel()
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, Tensor) and embeds.ndim >= 1:
        return embeds[..., 0].numel()
    return None


class _AfterEachBackward:
    """Calls ``read()`` at the end of every backward pass that accumulates a gradient into one of
    ``params``, after the work that pass itself queued for its end (DDP's all-reduce of the gradients
    and its copy into ``p.grad``), before ``backward()`` returns. Hooks only read."""

    def __init__(self, params: list[nn.Parameter], read: Callable[[], None]) -> None:
        self._read = read
        self._passes: set[int] = set()
        self._handles = [p.register_post_accumulate_grad_hook(self._accumulated) for p in params]

    def _accumulated(self, param: Tensor) -> None:
        graph_task = torch._C._current_graph_task_id()
        if graph_task in self._passes:
            return
        self._passes.add(graph_task)
        engine = torch.autograd.Variable._execution_engine
        # Queued from inside the pass, the read would run before callbacks queued later in it (DDP queues
        # its finalisation when the last bucket is ready); queued again from the end-of-pass loop, which
        # runs callbacks added while it runs, it comes after all of them.
        engine.queue_callback(lambda: engine.queue_callback(self._read))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class ProbeCallback:
    """A ``transformers`` Trainer callback that logs :data:`METRICS` per layer every ``every`` optimizer
    steps (see the module docstring for what each value is)::

        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        anhf.ProbeCallback(every=10).add_to(trainer)
        trainer.train()

    ``add_to`` is needed because transformers hands callbacks the model, optimizer and data loaders but
    not the Trainer, whose ``log`` reaches ``report_to`` (transformers' own Trainer-bound callback is
    given its Trainer the same way).

    Args:
        every: log every ``every``-th optimizer step (steps ``every``, ``2 * every``, ...).
        metrics: a subset of :data:`METRICS`.
        prefix: the tag prefix of the logged values.
        layers: the layers to observe (:class:`addnorm.Probe`'s selector; default: the model's layers).
    """

    def __init__(
        self,
        every: int = 1,
        *,
        metrics: tuple[str, ...] = METRICS,
        prefix: str = "probe/",
        layers: LayerSelector = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every: expected a positive int, got {every!r}")
        metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
        unknown = [m for m in metrics if m not in METRICS]
        if unknown or not metrics:
            raise ValueError(f"metrics: expected some of {', '.join(METRICS)}, got {metrics!r}")
        if not isinstance(prefix, str):
            raise TypeError(f"prefix: expected a str, got {prefix!r}")
        self.every, self.metrics, self.prefix, self.layers = every, metrics, prefix, layers
        self.trainer = self.probe = None
        self._pending: dict[str, float] | None = None
        self._observing = False
        self._handles: list = []
        self._after_backward: _AfterEachBackward | None = None
        self._micro: list[tuple[int | None, list[float], list[float]]] = []
        self._tokens: int | None = None
        self._weight_grad: list[float] | None = None

    def add_to(self, trainer) -> ProbeCallback:
        """Add this callback to ``trainer`` (a ``transformers.Trainer``) and log through it; returns self.
        A callback already in the Trainer's list (``Trainer(callbacks=[...])``) is not added twice."""
        from transformers import Trainer

        if not isinstance(trainer, Trainer):
            raise TypeError(f"trainer: expected a transformers.Trainer, got {type(trainer).__name__}")
        if not any(cb is self for cb in trainer.callback_handler.callbacks):
            trainer.add_callback(self)
        self.trainer = trainer
        return self

    def __getattr__(self, name: str):
        """Every other Trainer event: nothing to do (no ``transformers`` import just to subclass)."""
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model: nn.Module, **kwargs) -> None:
        if self.trainer is None:
            raise RuntimeError(
                "ProbeCallback: not added with add_to(trainer): transformers gives a callback no Trainer to "
                "log through; use anhf.ProbeCallback(...).add_to(trainer)"
            )
        self.probe = Probe(model, self.layers)

    def on_step_begin(self, args, state, control, model: nn.Module, **kwargs) -> None:
        if (state.global_step + 1) % self.every != 0 or self._observing:
            return
        self.probe.clear()
        self.probe.attach()
        self._micro, self._tokens, self._weight_grad = [], None, None
        self._handles.append(model.register_forward_pre_hook(self._count_tokens, with_kwargs=True))
        if "weight_grad" in self.metrics:
            params = [p for p in model.parameters() if p.requires_grad]
            self._after_backward = _AfterEachBackward(params, self._read_weight_grads)
        self._observing = True

    def _count_tokens(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._tokens = _tokens(args, kwargs)

    def _read_weight_grads(self) -> None:
        self._weight_grad = self.probe.weight_grad_norms(None)

    def _fold_micro_batch(self) -> None:
        """Keep the micro-batch that just ran backward: (n_j, ||dL_j/ds_ij|| and rms(s_ij) per layer)."""
        self._micro.append((self._tokens, self.probe.stream_grad_norms(), self.probe.activation_rms()))
        self._tokens = None
        self.probe.clear()

    def on_substep_end(self, args, state, control, **kwargs) -> None:
        if self._observing:
            self._fold_micro_batch()

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if not self._observing:
            return
        self._fold_micro_batch()
        counts = [n for n, _, _ in self._micro]
        weights = [1] * len(counts) if None in counts else counts
        values: dict[str, list[float]] = {}
        grads = list(zip(*(g for _, g, _ in self._micro), strict=True))
        values["stream_grad"] = [math.sqrt(sum(g * g for g in per_layer)) for per_layer in grads]
        rms = list(zip(*(r for _, _, r in self._micro), strict=True))
        values["act_rms"] = [
            math.sqrt(sum(w * r * r for w, r in zip(weights, per_layer, strict=True)) / sum(weights))
            for per_layer in rms
        ]
        if "weight_grad" in self.metrics:
            if self._weight_grad is None:
                warnings.warn(
                    f"ProbeCallback: no parameter's gradient accumulated in step {state.global_step + 1}; "
                    "weight_grad not logged for it",
                    stacklevel=2,
                )
            else:
                values["weight_grad"] = self._weight_grad
        self._pending = {
            f"{self.prefix}{metric}/layer_{i}": value
            for metric in self.metrics
            for i, value in enumerate(values.get(metric, ()))
        }
        self._stop_observing()

    def _stop_observing(self) -> None:
        if self.probe is not None:
            self.probe.detach()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._after_backward is not None:
            self._after_backward.remove()
            self._after_backward = None
        self._observing = False

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._pending is not None:
            logs, self._pending = self._pending, None
            should_log = control.should_log  # Trainer.log resets it: the Trainer's own log of this step
            self.trainer.log(logs)
            control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self._stop_observing()
        self.probe = None
