"""What the native call's tests share (``test_ops_native_call.py``, fast; ``test_ops_native_build.py``,
slow): the inputs and the interpreter mark (the ``native_path`` fixture is in ``conftest.py``)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
needs_interpreter = pytest.mark.skipif(
    not (HAS_TRITON and INTERPRET), reason="needs triton under TRITON_INTERPRET=1"
)


def _inputs(rows=8, n=64, dtype=torch.float32, gate=None, bias=True):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g, dtype=dtype, requires_grad=True)
    r = torch.randn(rows, n, generator=g, dtype=dtype, requires_grad=True)
    w = torch.randn(n, generator=g, requires_grad=True)
    b = torch.randn(n, generator=g, requires_grad=True) if bias else None
    gt = {None: None, "one": torch.full((1,), 0.7), "vector": torch.rand(n, generator=g)}[gate]
    if gt is not None:
        gt.requires_grad_()
    return x, r, w, b, gt
