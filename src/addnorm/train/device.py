"""Where and how a run computes: the device, the autocast precision, ``torch.compile``, tokens/s and a
GPU's peak memory.

- The device: ``"auto"`` is CUDA when this process sees a GPU (a Ray task started without GPUs sees
  none), else the CPU.
- The precision (a run setting, so part of a run's identity): ``fp32``; ``bf16``, the matmuls under
  ``torch.autocast(dtype=torch.bfloat16)`` on any device, the CPU included (how CI runs the GPU
  code path); ``auto``, bf16 on a GPU that supports it and fp32 elsewhere.
"""

from __future__ import annotations

import contextlib
import platform
import time
from functools import lru_cache
from pathlib import Path

import torch

PRECISIONS = ("auto", "fp32", "bf16")


def select_device(requested: str | torch.device | None = "auto") -> torch.device:
    """The device a run trains on: ``auto`` (or None) picks CUDA when available, else the CPU."""
    if requested is None or str(requested) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(requested)
    except (RuntimeError, TypeError):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {requested!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {requested!r} was asked for but this process sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"device: expected auto, cpu, cuda or cuda:N, got {requested!r}")
    return device


def autocast_dtype(device: torch.device, precision: str) -> torch.dtype | None:
    """The autocast dtype of ``precision`` on ``device`` (None: no autocast, everything in fp32)."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {precision!r}")
    if precision == "fp32":
        return None
    bf16_ok = device.type == "cpu" or torch.cuda.is_bf16_supported()
    if precision == "bf16" and not bf16_ok:
        raise ValueError(f"precision: bf16 was asked for but {device_name(device)} does not support it")
    if precision == "auto" and device.type != "cuda":
        return None
    return torch.bfloat16 if bf16_ok else None


def autocast(device: torch.device, dtype: torch.dtype | None):
    """``torch.autocast`` for ``dtype`` on ``device``, or a no-op context for None."""
    return torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()


def precision_name(dtype: torch.dtype | None) -> str:
    return "fp32" if dtype is None else f"{str(dtype).removeprefix('torch.')} autocast"


def device_name(device: torch.device | None = None) -> str:
    """The GPU's name for a CUDA device, the CPU model for the CPU (``None``: this process's default)."""
    device = select_device("auto") if device is None else device
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


@lru_cache(maxsize=1)
def cpu_model() -> str:
    """The CPU model name from /proc/cpuinfo (or what ``platform`` knows)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU): only for timing, never for values."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Throughput:
    """Training tokens per second of wall time, counted from the end of the first step (which holds
    compilation and the device's warm-up) and leaving out the paused intervals (evaluation)."""

    clock = staticmethod(time.perf_counter)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.tokens, self.seconds = 0, 0.0
        self._since: float | None = None

    def resume(self) -> None:
        synchronize(self.device)
        self._since = self.clock()

    def pause(self) -> None:
        if self._since is not None:
            synchronize(self.device)
            self.seconds += self.clock() - self._since
            self._since = None

    def count(self, tokens: int) -> None:
        if self._since is not None:
            self.tokens += tokens

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.tokens and self.seconds > 0 else None


class PeakMemory:
    """A run's peak memory on a GPU: the bytes torch's caching allocator reserved at most (``torch.cuda.
    max_memory_reserved``), counted from this object's creation (the peak statistics are reset then, so a
    pool worker's earlier runs do not count). The CUDA context itself is not included. On the CPU it
    records nothing (a process's peak resident memory cannot be reset per run)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)

    def record(self) -> dict:
        """``{"peak_memory": bytes}`` on a GPU (for the run's provenance), else ``{}``."""
        if self.device.type != "cuda":
            return {}
        return {"peak_memory": int(torch.cuda.max_memory_reserved(self.device))}
