"""torchtitan job configs with addnorm's Add & Norm, for torchtitan's command line::

    torchrun --nproc_per_node 8 -m torchtitan.train --module addnorm.titan --config llama3_8b
    torchrun --nproc_per_node 8 -m torchtitan.train --module addnorm.titan --config llama3_8b__sandwich

``--config <name>`` is any config function of torchtitan's Llama 3 or Qwen 3 registry
(``torchtitan.models.llama3.config_registry.llama3_8b``, ``qwen3_0_6b``, ``llama3_debugmodel``, ...): that
job with its model converted by :func:`addnorm.titan.with_addnorm`, fused in the family's own placement;
``<name>__<placement>`` re-places it (``llama3_debugmodel__deepnorm``). Every other option stays
torchtitan's (``--training.steps 100``, ``--parallelism.tensor_parallel_degree 2``, ...). An unknown name
or a placement the family cannot take fails when the config is made, with one line.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from .families import FAMILIES

SEPARATOR = "__"


def _registry(family: str):
    return importlib.import_module(f"{FAMILIES[family].package}.config_registry")


def _base(name: str) -> tuple[Callable, str | None] | None:
    """(torchtitan's config function, the placement or None) that ``name`` stands for, or None."""
    base, _, placement = name.partition(SEPARATOR)
    family = next((f for f in FAMILIES if base.startswith(f"{f}_")), None)
    if family is None:
        return None
    fn = getattr(_registry(family), base, None)
    if not callable(fn) or base.startswith("_"):
        return None
    return fn, placement or None


def __getattr__(name: str) -> Callable:
    found = None if name.startswith("_") else _base(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    fn, placement = found

    def config():
        from .converter import with_addnorm

        return with_addnorm(fn(), placement)

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's {fn.__name__} with addnorm's Add & Norm ({placement or 'fused'})."
    return config


def __dir__() -> list[str]:
    names = []
    for family in FAMILIES:
        registry = _registry(family)
        names += [n for n in dir(registry) if n.startswith(f"{family}_") and callable(getattr(registry, n))]
    return sorted(names)
