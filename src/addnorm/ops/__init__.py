"""Functional Add & Norm ops: the fused ``add_norm`` (Triton on CUDA, torch ops on the CPU), its
float64 reference and dropout mask, and the policy that tells models where to use it. Triton is
imported lazily, only by ``ops/triton*`` modules (and by ``library`` where CUDA is present)."""

from .args import MAX_FUSED_HIDDEN
from .functional import add_norm
from .native import call_path, set_call_path
from .policy import (
    BACKENDS,
    FusionDecision,
    compile_path,
    fused_op_preferred,
    fusion,
    fusion_decision,
    resolve_backend,
    set_compile_path,
    set_fusion,
)
from .reference import add_norm_reference, dropout_keep_mask, dropout_threshold, hash32

__all__ = [
    "BACKENDS",
    "MAX_FUSED_HIDDEN",
    "FusionDecision",
    "add_norm",
    "add_norm_reference",
    "call_path",
    "compile_path",
    "dropout_keep_mask",
    "dropout_threshold",
    "fused_op_preferred",
    "fusion",
    "fusion_decision",
    "hash32",
    "resolve_backend",
    "set_call_path",
    "set_compile_path",
    "set_fusion",
]
