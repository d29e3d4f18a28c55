"""Where the fused op was measured against the unfused ops: the recorded verdicts, one data file per
device (``measured_rows/<device>.json``, package data), that the policy (:mod:`addnorm.ops.policy`) reads.

Each :class:`Measured` row is a number a benchmark wrote into a JSON file under ``benchmarks/results``
(its :class:`Provenance`: the file, the key of the value in it as a JSON pointer, the commit and the date
it was recorded at): on one device, by its name as torch reports it (``"NVIDIA H200"``, ``"NVIDIA H100
80GB HBM3"``; ``"cpu"`` stands for any CPU), a ``scope`` (``"step"``: a model's training step, which
decides where a model fuses; ``"op"``: the op alone against the eager ops it replaces, which decides the
op's ``auto`` backend), the calls it covers (``regime``: execution mode, norm, Pre-LN or not, branch
dropout, hidden sizes from ``min_hidden``, elements per call up to ``max_numel``, and ``model``: which
models' step it timed, :data:`MODELS`) and ``ratio``, the fused time over the unfused time. A row counts
only beyond the runs' spread (:data:`SPREAD`): slower (``ratio > 1 + SPREAD``) or faster (``ratio < 1 -
SPREAD``); a tie is no row. The rows are written from a window's JSON by ``python -m
tools.measured_rows add ...`` (which refuses a tie), and a test reads every row's value again from its
file and key.

An ``"op"`` row sends the op's ``auto`` backend to its torch path, so it needs a table in which that
path (not eager PyTorch's own ops) ran faster than the kernels. None does today: the op tables time
the kernels against eager PyTorch (``F.layer_norm(x + r)``), and for a bf16 stream the op's torch path
is its fp32 composite, slower than either. The H100 row this table held (Post-LN LayerNorm from 16384
columns, 0.64x eager with an older backward) sent that shape to the composite, on every GPU: on the
H200 the "addnorm" cell there timed the composite, 2.39 ms forward against the kernels' 0.40 ms for
Pre-LN (``h200/2026-11-27-fb82146/add_norm_h200.md``; found with the kernels' compile table, which
showed no fault in them).

No Triton here, and torch only for the device's name.
"""

from __future__ import annotations

import functools
import json
from importlib import resources
from typing import NamedTuple

import torch

__all__ = [
    "MEASURED",
    "MODELS",
    "SCOPES",
    "SPREAD",
    "Measured",
    "Provenance",
    "device_name",
    "load_rows",
    "rows_for",
]

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
# the fields of a row's regime (the calls it covers), in the order Measured holds them
REGIME = ("mode", "norm", "prenorm", "dropout", "min_hidden", "max_numel", "model")


class Provenance(NamedTuple):
    """Where a row's ratio was read: ``file`` (a JSON file under ``benchmarks/results``), the value at
    JSON pointer ``key`` in it, divided by the value at ``over`` where given, inverted where ``inverse``
    (a speed-up of fused over unfused is a time ratio's inverse); ``commit`` and ``date`` of the run."""

    file: str
    key: str
    commit: str
    date: str
    over: str | None = None
    inverse: bool = False


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
    what: str
    provenance: Provenance
    model: str | None = None

    @property
    def source(self) -> str:
        """The result file the ratio was read from (relative to ``benchmarks/results``)."""
        return self.provenance.file

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

    def record(self) -> dict:
        """The row as its data file holds it (the device is the file's)."""
        return {
            "scope": self.scope,
            "regime": {name: getattr(self, name) for name in REGIME},
            "ratio": self.ratio,
            "what": self.what,
            "provenance": {k: v for k, v in self.provenance._asdict().items() if v not in (None, False)},
        }


def row_of(device: str, record: dict) -> Measured:
    """A row from its data file's ``record`` (see :meth:`Measured.record`) on ``device``; a missing or
    unknown field is a one-line error naming it."""
    regime = dict(record.get("regime", {}))
    unknown = set(regime) - set(REGIME)
    if unknown or record.get("scope") not in SCOPES:
        raise ValueError(f"measured row {record!r}: expected scope in {SCOPES} and regime keys {REGIME}")
    regime.setdefault("min_hidden", 0)
    fields = {name: regime.get(name) for name in REGIME}
    return Measured(
        device=device,
        scope=record["scope"],
        ratio=float(record["ratio"]),
        what=record["what"],
        provenance=Provenance(**record["provenance"]),
        **fields,
    )


def load_rows(folder=None) -> tuple[Measured, ...]:
    """Every row of every device's data file in ``folder`` (default: the package's
    ``measured_rows``), the files in name order, each file's rows in its order."""
    folder = resources.files(__package__).joinpath("measured_rows") if folder is None else folder
    rows: list[Measured] = []
    for path in sorted(folder.iterdir(), key=lambda p: p.name):
        if path.name.endswith(".json"):
            data = json.loads(path.read_text())
            rows.extend(row_of(data["device"], r) for r in data["rows"])
    return tuple(rows)


MEASURED = load_rows()

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
