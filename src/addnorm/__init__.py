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
    from_torch,
)
from .norms import NORMS, BatchNorm, LayerNorm, NoNorm, RMSNorm, build_norm
from .placements import PLACEMENTS, Placement, get_placement, register_placement
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
    "LayerNorm",
    "NORMS",
    "NoNorm",
    "PLACEMENTS",
    "Placement",
    "RMSNorm",
    "Registry",
    "SublayerConnection",
    "UnknownNameError",
    "UnsupportedModuleError",
    "build_norm",
    "from_torch",
    "get_placement",
    "register_placement",
]
