"""addnorm: the transformer Add & Norm pattern — every placement, fused kernels, and a study harness."""

from .addnorm import AddNorm, SublayerConnection
from .norms import NORMS, BatchNorm, LayerNorm, NoNorm, RMSNorm, build_norm
from .placements import PLACEMENTS, Placement, get_placement, register_placement
from .registry import Registry, UnknownNameError

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "BatchNorm",
    "LayerNorm",
    "NORMS",
    "NoNorm",
    "PLACEMENTS",
    "Placement",
    "RMSNorm",
    "Registry",
    "SublayerConnection",
    "UnknownNameError",
    "build_norm",
    "get_placement",
    "register_placement",
]
