"""``ProbeCallback(every=N)``: per-layer statistics of a model training under ``transformers.Trainer``,
logged to whatever the Trainer reports to (``report_to``: TensorBoard, MLflow, W&B, ...).

Every ``every`` optimizer steps, an :class:`addnorm.Probe` observes the step's forward and backward
(attached at ``on_step_begin``) and is read at ``on_pre_optimizer_step``, when the gradients the
optimizer is about to apply are still there (the Trainer zeroes them before ``on_step_end``, where a
gradient read gives NaN). The values go out through the Trainer's own ``log`` at ``on_step_end``, so
they carry the step number the Trainer's own logs carry (``state.global_step`` after the step) and land
in ``state.log_history`` too. Per layer i (0 = nearest the input), as ``<prefix><metric>/layer_<i>``:

- ``stream_grad``: ||dL/ds|| of the residual stream s at the layer's output (Xiong et al. 2020);
- ``weight_grad``: sqrt(sum ||grad W||^2) over the layer's weight matrices, after the Trainer's
  gradient clipping (``max_grad_norm``), i.e. the gradients the optimizer uses;
- ``act_rms``: the RMS of the stream at the layer's output.

With gradient accumulation, stream statistics are those of the step's last micro-batch; weight
gradients are the accumulated ones. Observing changes no result (the probe's hooks only read).
Works on untouched, fused and re-placed models and on addnorm's own models.
"""

from __future__ import annotations

import sys

from torch import nn

from ..probe import Probe

__all__ = ["METRICS", "ProbeCallback"]

METRICS = ("stream_grad", "weight_grad", "act_rms")


def _calling_trainer():
    """The ``transformers.Trainer`` whose training loop is running the current callback event."""
    from transformers import Trainer

    frame = sys._getframe(1)
    while frame is not None:
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer):
            return candidate
        frame = frame.f_back
    return None


class ProbeCallback:
    """A ``transformers`` Trainer callback (``Trainer(..., callbacks=[ProbeCallback(every=10)])``) that
    logs :data:`METRICS` per layer every ``every`` steps (see the module docstring).

    Args:
        every: log every ``every``-th optimizer step (steps ``every``, ``2 * every``, ...).
        metrics: a subset of :data:`METRICS`.
        prefix: the tag prefix of the logged values.
        layers: the layers to observe (:class:`addnorm.Probe`'s selector; default: the model's layers).
    """

    def __init__(
        self, every: int = 1, *, metrics: tuple[str, ...] = METRICS, prefix: str = "probe/", layers=None
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

    def __getattr__(self, name: str):
        """Every other Trainer event: nothing to do (no ``transformers`` import just to subclass)."""
        if name.startswith("on_"):
            return lambda *args, **kwargs: None
        raise AttributeError(name)

    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs) -> None:
        self.trainer = _calling_trainer()
        if self.trainer is None or model is None:
            raise RuntimeError("ProbeCallback: expected a transformers.Trainer's training loop to call it")
        self.probe = Probe(model, self.layers)

    def on_step_begin(self, args, state, control, **kwargs) -> None:
        if (state.global_step + 1) % self.every == 0 and not self._observing:
            self.probe.clear()
            self.probe.attach()
            self._observing = True

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        if not self._observing:
            return
        read = {
            "stream_grad": self.probe.stream_grad_norms,
            "weight_grad": lambda: self.probe.weight_grad_norms(None),
            "act_rms": self.probe.activation_rms,
        }
        self._pending = {
            f"{self.prefix}{metric}/layer_{i}": value
            for metric in self.metrics
            for i, value in enumerate(read[metric]())
        }
        self.probe.detach()
        self._observing = False

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self._pending is not None:
            logs, self._pending = self._pending, None
            should_log = control.should_log  # Trainer.log resets it: the Trainer's own log of this step
            self.trainer.log(logs)
            control.should_log = should_log

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.probe is not None:
            self.probe.detach()
        self._observing = False
        self.trainer = self.probe = None
