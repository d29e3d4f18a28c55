"""Hugging Face ``transformers`` models with addnorm's fused op, placements and probe (``addnorm[hf]``).

- :func:`fuse` / :func:`unfuse` / :func:`fused`: every residual add that a norm reads runs in one
  :func:`addnorm.ops.add_norm` call with it; same function, parameters and state dict.
- :func:`with_placement`: the model's Add & Norm replaced by any addnorm placement around its own
  attention and MLP; recorded in the config, reloaded by :func:`from_pretrained`.
- :class:`addnorm.Probe` observes fused, re-placed and untouched models alike; :class:`ProbeCallback`
  logs it from ``transformers.Trainer`` to whatever the Trainer reports to.

Supported model types: :data:`ARCHITECTURES` (the records of :mod:`addnorm.hf.families`);
:func:`register_architecture` adds a family from one :class:`Architecture` record, checked on a tiny
random model first, and :func:`unregister_architecture` takes it back. ``transformers`` is imported only
by the functions that need it.
"""

from .architectures import ARCHITECTURES, Architecture, ConfigSpec, Sublayer, Weight, architecture_of
from .callback import ProbeCallback
from .families import FAMILIES
from .families_parallel import PARALLEL_FAMILIES
from .fuse import fuse, fused, unfuse
from .placement import supported_placements, with_placement
from .pretrained import from_pretrained
from .registration import register_architecture, unregister_architecture
from .tiny import tiny_config, tiny_model

__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "ConfigSpec",
    "FAMILIES",
    "PARALLEL_FAMILIES",
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
    "unregister_architecture",
    "with_placement",
]
