"""Hugging Face ``transformers`` models with addnorm's fused op, placements and probe (``addnorm[hf]``).

- :func:`fuse` / :func:`unfuse` / :func:`fused`: every residual add that a norm reads runs in one
  :func:`addnorm.ops.add_norm` call with it; same function, parameters and state dict.
- :func:`with_placement`: the model's Add & Norm replaced by any addnorm placement around its own
  attention and MLP; recorded in the config, reloaded by :func:`from_pretrained`.
- :class:`addnorm.Probe` observes fused, re-placed and untouched models alike; :class:`ProbeCallback`
  logs it from ``transformers.Trainer`` to whatever the Trainer reports to.

Supported model types: :data:`ARCHITECTURES` (Llama, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 text,
GPT-2, BERT, OLMo 2, Phi-3, Mixtral, Qwen2-MoE); :func:`register_architecture` adds a family from one
:class:`Architecture` record. ``transformers`` is imported only by the functions that need it.
"""

from .architectures import (
    ARCHITECTURES,
    Architecture,
    Sublayer,
    Weight,
    architecture_of,
    register_architecture,
)
from .callback import ProbeCallback
from .fuse import fuse, fused, unfuse
from .placement import supported_placements, with_placement
from .pretrained import from_pretrained
from .tiny import tiny_config, tiny_model

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ProbeCallback",
    "Sublayer",
    "Weight",
    "architecture_of",
    "from_pretrained",
    "fuse",
    "fused",
    "register_architecture",
    "supported_placements",
    "tiny_config",
    "tiny_model",
    "unfuse",
    "with_placement",
]
