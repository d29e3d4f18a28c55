"""The backward's parameter gradients from its programs' partial sums: each program of a backward on
several programs writes its rows' dweight / dbias / dgate as one row of fp32 partial sums, which are
added up either after the kernel by torch (:func:`param_grads`, an aten sum per parameter) or, in the
backward variant "kernel_sums" (``launch_config.BWD_VARIANTS``), inside the kernel by its last programs,
which count their arrivals in :func:`counters` (``triton.tiles.finish_col_sums``).

Plain torch, no Triton: the Triton launchers (:mod:`addnorm.ops.triton.launchers`,
:mod:`addnorm.ops.triton.tp_launchers`) share it.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["counters", "param_grads"]

_F32 = torch.float32
# the in-kernel sums' counters: one int32 buffer per (device index, stream), all zero between launches
_COUNTERS: dict[tuple[int, int], Tensor] = {}
_MIN_COUNTERS = 4096


def param_grads(
    dw: Tensor | None, db: Tensor | None, dg: Tensor | None, summed: bool, weight, bias, gate
) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """dweight, dbias, dgate from a backward kernel's buffers: per-program fp32 partial sums (programs,
    n), summed here, or (``summed``: one program, or the kernel added them up) the sums themselves; in
    the parameters' dtypes, a one-element gate's gradient summed over the columns too."""
    if not summed:
        dw = None if dw is None else dw.sum(0)
        db = None if db is None else db.sum(0)
        dg = None if dg is None else dg.sum(0)
    if dw is not None and dw.dtype is not weight.dtype:
        dw = dw.to(weight.dtype)
    if db is not None and db.dtype is not bias.dtype:
        db = db.to(bias.dtype)
    if dg is not None:
        dg = (dg.sum() if gate.numel() == 1 else dg).reshape(gate.shape).to(gate.dtype)
    return dw, db, dg


def counters(t: Tensor, size: int) -> Tensor | None:
    """At least ``size`` int32 counters, all zero, for a backward launch on ``t``'s device and that
    device's current stream (the kernel sets every counter it counted on back to zero before it
    ends: launches on one stream run one after another, so they share the buffer; another stream gets
    its own). None where there is no buffer that large yet and the stream is capturing a CUDA graph (a
    buffer made during a capture would belong to the graph's memory pool): the caller sums with torch."""
    index = t.get_device()
    cuda = index >= 0 and t.is_cuda
    key = (index, torch._C._cuda_getCurrentRawStream(index) if cuda else 0)
    buf = _COUNTERS.get(key)
    if buf is not None and buf.numel() >= size:
        return buf
    if cuda and torch.cuda.is_current_stream_capturing():
        return None
    buf = _COUNTERS[key] = torch.zeros(max(size, _MIN_COUNTERS), dtype=torch.int32, device=t.device)
    return buf


def forget_counters() -> None:
    """Drop the counter buffers (tests; a device reset)."""
    _COUNTERS.clear()
