"""The shared helpers of the fused op's path tests (``test_ops_paths*.py``): the op's random inputs and
the skip mark for the Triton kernels."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

HAS_TRITON = importlib.util.find_spec("triton") is not None
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _triton_ready() -> bool:
    if not HAS_TRITON:
        return False
    if torch.cuda.is_available():
        return True
    from addnorm.ops.triton_kernels import kernels_are_interpreted

    return kernels_are_interpreted()


needs_triton = pytest.mark.skipif(
    not _triton_ready(), reason="triton kernels need CUDA or TRITON_INTERPRET=1"
)


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
