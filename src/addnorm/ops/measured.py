"""Where the fused op was measured against the unfused ops: one table of recorded numbers, keyed on the
device that measured them, that the policy (:mod:`addnorm.ops.policy`) reads.

Each :class:`Measured` row is a line of a table under ``benchmarks/results`` (``source``, ``evidence``):
on one device, by its name as torch reports it (``"NVIDIA H200"``, ``"NVIDIA H100 80GB HBM3"``; ``"cpu"``
stands for any CPU), a ``scope`` (``"step"``: a model's training step, which decides where a model fuses;
``"op"``: the op alone against the eager ops it replaces, which decides the op's ``auto`` backend), the
calls it covers (execution mode, norm, Pre-LN or not, branch dropout, hidden sizes from ``min_hidden``,
elements per call up to ``max_numel``, and ``model``: which models' step it timed, :data:`MODELS`) and
``ratio``, the fused time over the unfused time. A row counts only beyond the runs' spread
(:data:`SPREAD`): slower (``ratio > 1 + SPREAD``) or faster (``ratio < 1 - SPREAD``); a tie is no row.
A GPU session that re-measures (``make gpu-bench``) edits the rows.

An ``"op"`` row sends the op's ``auto`` backend to its torch path, so it needs a table in which that
path (not eager PyTorch's own ops) ran faster than the kernels. None does today: the op tables time
the kernels against eager PyTorch (``F.layer_norm(x + r)``), and for a bf16 stream the op's torch path
is its fp32 composite, slower than either. The H100 row this table held (Post-LN LayerNorm from 16384
columns, 0.64x eager with an older backward) sent that shape to the composite, on every GPU: on the
H200 the "addnorm" cell there timed the composite, 2.39 ms forward against the kernels' 0.40 ms for
Pre-LN (``add_norm_h200.md``; found with the kernels' compile table, which showed no fault in them).

No Triton here, and torch only for the device's name.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

__all__ = ["MEASURED", "MODELS", "SCOPES", "SPREAD", "Measured", "device_name", "rows_for"]

SCOPES = ("step", "op")
# Whose training step a "step" row timed, since the host code around the op is theirs: "hf", a Hugging
# Face model rewired by addnorm.hf (its connections say so: AddNorm.fusion_model); "addnorm", every
# other model with AddNorm connections (addnorm's own, a user's). On the H200 at 81f67f7 the same call
# (RMSNorm, no dropout, eager, ~8M elements) ran 1.05x faster fused in the HF Llama step and 0.93x in
# addnorm's LM: the call alone does not decide.
MODELS = ("hf", "addnorm")
# identical fused=False models timed side by side differed by up to ~2% on the H100 (lm_step_cuda.md,
# gpu_h100.md) and by 2.2% on the H200 (host_overhead_h200.md): a difference within it is a tie
SPREAD = 0.02


class Measured(NamedTuple):
    """One recorded measurement of the fused op against the unfused ops, and the calls it covers (a
    field that is None covers every value; see the module docstring)."""

    device: str
    scope: str
    mode: str | None
    norm: str | None
    prenorm: bool | None
    dropout: bool | None
    min_hidden: int
    max_numel: int | None
    ratio: float
    evidence: str
    source: str
    model: str | None = None

    @property
    def slower(self) -> bool:
        """The fused op ran slower than the unfused ops beyond the spread."""
        return self.ratio > 1 + SPREAD

    @property
    def faster(self) -> bool:
        """The fused op ran faster than the unfused ops beyond the spread."""
        return self.ratio < 1 - SPREAD

    def covers(
        self, mode=None, hidden=None, numel=None, norm=None, prenorm=None, dropout=None, model=None
    ) -> bool:
        """Whether a call like this falls under the row (a field the row bounds counts only where the
        caller gives it: a row bounded in ``numel`` needs ``numel``, a LayerNorm row needs ``norm``, an
        "hf" row needs ``model``)."""
        return (
            (self.model is None or self.model == model)
            and (self.mode is None or self.mode == mode)
            and (self.norm is None or self.norm == norm)
            and (self.prenorm is None or self.prenorm is prenorm)
            and (self.dropout is None or self.dropout is dropout)
            and (not self.min_hidden or (hidden is not None and hidden >= self.min_hidden))
            and (self.max_numel is None or (numel is not None and numel <= self.max_numel))
        )


_H100, _H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
# fmt: off
MEASURED = (
    # --- training steps: where a model fuses ------------------------------------------------------
    # a tiny Pre-LN LM step on 2 CPU cores (d_model 64, dropout 0.1): the hashed NumPy mask costs more
    # than nn.Dropout; without dropout the op runs the unfused modules' own torch ops
    Measured("cpu", "step", None, None, None, True, 0, None, 1.061,
             "27781 us, 1.061x fused=False", "cpu/2026-11-23-8d56b42/host_overhead_cpu.md"),
    # the same step on the H100 (8 x 16 tokens x d_model 64 = 8192 elements a call), host-bound
    Measured(_H100, "step", "eager", None, None, None, 0, 8192, 1.278,
             "10518 us, 1.278x fused=False", "h100/2026-11-24-fcabca7/host_overhead_cuda.md"),
    # HF Llama 134M (RMSNorm, no dropout, 8 x 1024 x 768 elements a call), eager: fused 1.048x plain
    Measured(_H100, "step", "eager", None, None, False, 0, None, 1 / 1.048,
             "| eager | 122162 | 128054 |", "h100/2026-11-24-fcabca7/hf_step_gpu.md"),
    # the H200 at 81f67f7 (each a median of paired rounds, quartiles beyond the spread), eager: HF Llama
    # 134M (RMSNorm, no dropout) 1.051x plain, fused (the GPU-bound size: 1.074x); addnorm's LM with
    # RMSNorm + SwiGLU, no dropout, 0.926x fused=False. Level (no row): the LM with LayerNorm and dropout
    # 0.1 (0.999x). Not timed: compiled steps. (fb82146's rows, 0.715x-0.859x, timed older kernels.)
    Measured(_H200, "step", "eager", None, None, False, 0, None, 1 / 1.051,
             "| 134m eager | 154975 | 169825 |", "h200/2026-11-28-81f67f7/hf_step_h200.md", "hf"),
    Measured(_H200, "step", "eager", None, None, False, 0, None, 1 / 0.926,
             "| llama | pre | eager | 211,181 |", "h200/2026-11-28-81f67f7/lm_step_h200.md", "addnorm"),
    # --- the op alone: its auto backend (none: see the module docstring) ------------------------------
)
# fmt: on

# the rows by (device name, scope)
_BY_DEVICE: dict[tuple[str, str], tuple[Measured, ...]] = {}
for _m in MEASURED:
    _BY_DEVICE[_m.device, _m.scope] = (*_BY_DEVICE.get((_m.device, _m.scope), ()), _m)


def rows_for(name: str, scope: str) -> tuple[Measured, ...]:
    """The rows measured on the device called ``name`` (:func:`device_name`) in ``scope``."""
    return _BY_DEVICE.get((name, scope), ())


@functools.lru_cache(maxsize=64)
def _name_of(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _cuda_name(index: int | None) -> str:
    """The name of CUDA device ``index`` (None: the current device), looked up once per device;
    ``"cuda"`` where this torch has no CUDA device to ask (a CPU build planning for a GPU)."""
    if not torch.cuda.is_available():
        return "cuda"
    return _name_of(torch.cuda.current_device() if index is None else index)


def device_name(device: torch.device) -> str:
    """The name the rows key a device on: ``"cpu"`` for the CPU, torch's name of a CUDA device
    (``torch.cuda.get_device_name``, looked up once per device), else the device type. A constant to
    ``torch.compile`` (the graph does not depend on it at run time)."""
    if device.type == "cuda":
        return _cuda_name(device.index)
    return device.type


# What ``torch.compiler.assume_constant_result`` does, without importing torch._dynamo (and with it
# Triton) when addnorm is imported; tests/test_ops_policy.py checks the decorator still sets this mark.
device_name._dynamo_marked_constant = True  # type: ignore[attr-defined]
