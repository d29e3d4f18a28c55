"""Transformer layers, stacks and models built from AddNorm connections."""

from ..placement_spec import Depth, deepnorm_constants, sub_ln_gain
from .attention import MultiHeadAttention, causal_mask
from .config import TransformerConfig
from .embedding import PositionalEncoding
from .feedforward import FeedForward
from .init import INITS, PLACEMENT_INITS, admin_init
from .interop import UnsupportedModuleError, from_torch, to_torch
from .layers import DecoderLayer, EncoderLayer
from .models import EncoderDecoder, LanguageModel, Transformer, reset_buffers
from .ngpt import NGPTHead, ngpt_matrices, ngpt_normalize_
from .parallel import parallelizable_placements, parallelize
from .stacks import Decoder, Encoder

__all__ = [
    "INITS",
    "PLACEMENT_INITS",
    "Depth",
    "admin_init",
    "deepnorm_constants",
    "sub_ln_gain",
    "Decoder",
    "DecoderLayer",
    "Encoder",
    "EncoderDecoder",
    "EncoderLayer",
    "FeedForward",
    "LanguageModel",
    "MultiHeadAttention",
    "PositionalEncoding",
    "Transformer",
    "TransformerConfig",
    "UnsupportedModuleError",
    "NGPTHead",
    "causal_mask",
    "ngpt_matrices",
    "ngpt_normalize_",
    "parallelize",
    "parallelizable_placements",
    "reset_buffers",
    "from_torch",
    "to_torch",
]
