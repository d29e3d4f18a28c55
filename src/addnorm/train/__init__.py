"""Training: run configuration, optimiser groups, learning-rate schedules, and the loop.

The names below are imported when first used (PEP 562): a rank started by torchrun runs
``addnorm.train.launch``, whose parent check must come before torch is imported (see that module).
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RunConfig": ".config",
    **dict.fromkeys(("DIVERGED", "DONE", "FAILED", "RunResult", "evaluate", "train"), ".loop"),
    **dict.fromkeys(("build_optimizer", "param_groups"), ".optim"),
    **dict.fromkeys(("SCHEDULES", "lr_multiplier"), ".schedules"),
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    """A public name (imported from its module on first use) or a submodule (``addnorm.train.loop``)."""
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
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
