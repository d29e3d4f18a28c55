"""addnorm inside torchtitan (``addnorm[torchtitan]``): fused and re-placed Add & Norm for torchtitan's
Llama 3 and Qwen 3, through torchtitan's own model-config converters.

- :class:`AddNormConverter` / :func:`convert`: a torchtitan model config whose blocks run every residual
  add in one fused :func:`addnorm.ops.add_norm` call with the norm that next reads the stream (same
  function, parameters and state dict), or with any placement of :func:`supported_placements` around
  torchtitan's own attention and FFN, its initialisation applied by torchtitan's ``init_weights``.
- :func:`with_addnorm`: the same for a finished ``Trainer.Config``; :mod:`addnorm.titan.config_registry`:
  ready job configs (``--module addnorm.titan --config llama3_8b`` or ``llama3_8b__sandwich``).
- :func:`on_cpu`: a model config whose attention runs on the CPU (tests, examples).

The converted model is parallelised, checkpointed and compiled by torchtitan's own functions (FSDP2,
tensor and sequence parallel through addnorm's DTensor rules, activation checkpointing,
``torch.compile``, DCP). ``import addnorm.titan`` works without torchtitan; the names below import it
when first used, and without the extra they raise :class:`addnorm.extras.MissingExtra` naming it.
"""

from __future__ import annotations

import importlib

from .families import FAMILIES, Family
from .plan import supported_placements

__all__ = [
    "FAMILIES",
    "AddNormConverter",
    "Family",
    "convert",
    "on_cpu",
    "supported_placements",
    "with_addnorm",
]

# the names that need torchtitan, and the submodule defining each
_LAZY = {
    "AddNormConverter": "converter",
    "convert": "converter",
    "with_addnorm": "converter",
    "on_cpu": "cpu",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
