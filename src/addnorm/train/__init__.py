"""Training: run configuration, optimiser groups, learning-rate schedules, and the loop.

The names below are imported when first used (PEP 562): a rank started by torchrun runs
``addnorm.train.launch``, whose parent check must come before torch is imported (see that module).
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "RunConfig": ".config",
    **dict.fromkeys(("DIVERGED", "DONE", "FAILED", "RunResult", "evaluate", "train"), ".loop"),
    **dict.fromkeys(("build_optimizer", "param_groups"), ".optim"),
    **dict.fromkeys(("SCHEDULES", "lr_multiplier"), ".schedules"),
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
