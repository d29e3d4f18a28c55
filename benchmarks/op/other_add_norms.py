"""Other libraries' fused Add & Norm as ``benchmarks/op/add_norm.py`` times them beside the op (same call as
its implementations: ``fn(x, r, w, b, norm, prenorm, p)``): Liger-Kernel's and flash-attn's Triton kernels,
each None where the library does not import (the table then says so in one line)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

__all__ = ["flash_attn_add_norm", "liger_add_norm"]


def flash_attn_add_norm() -> Callable | None:
    """flash-attn's Triton layer norm (``layer_norm_fn``: dropout, the add, LayerNorm or RMSNorm and,
    for prenorm, s in one kernel; returns (y, s) for prenorm), or None when flash-attn does not import."""
    try:
        from flash_attn.ops.triton.layer_norm import layer_norm_fn
    except Exception:  # not installed, or built for another torch / CUDA
        return None

    def fn(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0, eps: float = 1e-5):
        rms = norm == "rmsnorm"
        return layer_norm_fn(
            x, w, None if rms else b, residual=r, eps=eps, dropout_p=p, prenorm=prenorm, is_rms_norm=rms
        )

    return fn


def liger_add_norm() -> Callable | None:
    """Liger-Kernel's LayerNorm after the add, and its fused add + RMSNorm (returns (y, s)); dropout,
    which Liger does not fuse, before them; or None when liger-kernel does not import."""
    try:
        from liger_kernel.transformers.fused_add_rms_norm import LigerFusedAddRMSNorm
        from liger_kernel.transformers.layer_norm import LigerLayerNorm
    except Exception:  # not installed, or built for another torch / Triton
        return None
    modules: dict = {}

    def fn(x, r, w, b, norm: str, prenorm: bool, p: float = 0.0, eps: float = 1e-5):
        key = (norm, x.shape[-1], x.device)
        if key not in modules:
            cls = LigerLayerNorm if norm == "layernorm" else LigerFusedAddRMSNorm
            modules[key] = cls(x.shape[-1], eps=eps).to(x.device)
        mod = modules[key]
        d = F.dropout(x, p, True) if p else x
        if norm == "layernorm":
            s = d + r
            y = torch.func.functional_call(mod, {"weight": w, "bias": b}, (s,))
        else:
            y, s = torch.func.functional_call(mod, {"weight": w}, (d, r))
        return (y, s) if prenorm else y

    return fn
