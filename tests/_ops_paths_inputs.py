"""The shared helpers of the fused op's path tests (``test_ops_paths*.py``): the op's random inputs, and
the Triton skip mark and device of the op's tests (``_add_norm_cases``, one definition)."""

from __future__ import annotations

import torch
from _add_norm_cases import (  # sets TRITON_INTERPRET=1 without CUDA, before the kernels are imported
    DEVICE,
    HAS_TRITON,
    _triton_ready,
    needs_triton,
)

__all__ = ["DEVICE", "HAS_TRITON", "_inputs", "_triton_ready", "needs_triton"]


def _inputs(rows, hidden, dtype=torch.float32, gate=False, seed=0, device=DEVICE):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g, dtype=torch.float64).to(dtype).to(device)
    r = (2 * torch.randn(rows, hidden, generator=g, dtype=torch.float64) + 1).to(dtype).to(device)
    w = (1 + 0.3 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(dtype).to(device)
    b = (0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(dtype).to(device)
    gt = (
        (0.5 + 0.1 * torch.randn(hidden, generator=g, dtype=torch.float64)).to(dtype).to(device)
        if gate
        else None
    )
    return x, r, w, b, gt
