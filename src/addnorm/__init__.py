"""addnorm: the transformer Add & Norm pattern — every placement, fused kernels, and a study harness.

The names below are imported when first used (PEP 562), so ``import addnorm`` costs nothing and the
command line answers ``--help``, ``--version`` and ``study --list`` without importing torch;
``addnorm.AddNorm``, ``from addnorm import LanguageModel`` and ``addnorm.model`` work as before.
"""

from __future__ import annotations

from . import gloo_exit  # noqa: F401  (arms its wait at exit: docs/gloo-exit-abort.md)
from ._lazy import lazy_exports

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("AddNorm", "ConnectionRole", "SublayerConnection"), ".connection"),
    **dict.fromkeys(
        (
            "Decoder",
            "DecoderLayer",
            "Encoder",
            "EncoderLayer",
            "LanguageModel",
            "Transformer",
            "TransformerConfig",
            "UnsupportedModuleError",
            "admin_init",
            "from_torch",
            "ngpt_normalize_",
            "parallelize",
            "to_torch",
        ),
        ".model",
    ),
    **dict.fromkeys(
        ("NORMS", "BatchNorm", "DyT", "L2Norm", "LayerNorm", "NoNorm", "RMSNorm", "ScaleNorm", "build_norm"),
        ".norms",
    ),
    **dict.fromkeys(("add_norm", "fusion_decision", "set_fusion"), ".ops"),
    **dict.fromkeys(("PLACEMENTS", "Placement", "get_placement", "register_placement"), ".placements"),
    "Probe": ".probe",
    **dict.fromkeys(("Registry", "UnknownNameError"), ".registry"),
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
