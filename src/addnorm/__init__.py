"""addnorm: the transformer Add & Norm pattern — every placement, fused kernels, and a study harness.

The names below are imported when first used (PEP 562), so ``import addnorm`` costs nothing and the
command line answers ``--help``, ``--version`` and ``study --list`` without importing torch;
``addnorm.AddNorm``, ``from addnorm import LanguageModel`` and ``addnorm.model`` work as before.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# public name -> the submodule that defines it
_EXPORTS = {
    **dict.fromkeys(("AddNorm", "SublayerConnection"), ".addnorm"),
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
    "add_norm": ".ops",
    **dict.fromkeys(("PLACEMENTS", "Placement", "get_placement", "register_placement"), ".placements"),
    "Probe": ".probe",
    **dict.fromkeys(("Registry", "UnknownNameError"), ".registry"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (``addnorm.model``)."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):
        try:
            return importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise  # the submodule exists; something it imports does not
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
