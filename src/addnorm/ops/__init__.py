"""Functional Add & Norm ops: the fused ``add_norm`` (Triton on CUDA, eager PyTorch on CPU) and the
float reference it is tested against. Triton is imported lazily, only by ``ops/triton*`` modules."""

from .functional import add_norm
from .library import BACKENDS, MAX_FUSED_HIDDEN, resolve_backend
from .reference import add_norm_reference, dropout_keep_mask, dropout_threshold, hash32

__all__ = [
    "BACKENDS",
    "MAX_FUSED_HIDDEN",
    "add_norm",
    "add_norm_reference",
    "dropout_keep_mask",
    "dropout_threshold",
    "hash32",
    "resolve_backend",
]
