"""addnorm: the transformer Add & Norm pattern — every placement, fused kernels, and a study harness."""

from .addnorm import AddNorm, SublayerConnection
from .model import (
    Decoder,
    DecoderLayer,
    Encoder,
    EncoderLayer,
    LanguageModel,
    Transformer,
    TransformerConfig,
    UnsupportedModuleError,
    admin_init,
    from_torch,
    ngpt_normalize_,
    parallelize,
    to_torch,
)
from .norms import NORMS, BatchNorm, DyT, L2Norm, LayerNorm, NoNorm, RMSNorm, ScaleNorm, build_norm
from .ops import add_norm
from .placements import PLACEMENTS, Placement, get_placement, register_placement
from .probe import Probe
from .registry import Registry, UnknownNameError

__version__ = "0.1.0"

__all__ = [
    "AddNorm",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderLayer",
    "LanguageModel",
    "Transformer",
    "TransformerConfig",
    "BatchNorm",
    "DyT",
    "L2Norm",
    "ScaleNorm",
    "LayerNorm",
    "NORMS",
    "NoNorm",
    "PLACEMENTS",
    "Probe",
    "Placement",
    "RMSNorm",
    "Registry",
    "SublayerConnection",
    "UnknownNameError",
    "UnsupportedModuleError",
    "add_norm",
    "admin_init",
    "build_norm",
    "from_torch",
    "get_placement",
    "ngpt_normalize_",
    "parallelize",
    "register_placement",
    "to_torch",
]
