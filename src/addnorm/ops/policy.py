"""Where a model's Add & Norm runs through the fused op, and what the op hands torch.compile.

:func:`fused_op_preferred` is the one rule that a model's fusion decision (the residual stream's
held-back adds, a Post-LN connection's add and norm) asks about the device and the dropout; the op
itself picks its backend. :func:`compile_path` is what ``addnorm.ops.add_norm`` gives Inductor while
``torch.compile`` traces it: its composite of torch ops (``"composite"``, the default) or the
registered op with the Triton kernels (``"kernel"``). Both drop the same elements (the hashed mask of
(seed, row, column)), so the choice never changes a result beyond rounding.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["COMPILE_PATHS", "compile_path", "fused_op_preferred", "set_compile_path", "using_compile_path"]

COMPILE_PATHS = ("composite", "kernel")
# Inductor's fusion of the composite with its neighbours beat the opaque op on an H100 (issue 10:
# compiled fused 0.78-0.83x of compiled unfused, 0.97x with CUDA graphs); bench_lm_step.py measures
# both paths (--compile-paths both) so a GPU run can revisit this default.
_compile_path = "composite"

# fused_op_preferred(device type, dropout) -> bool, from benchmarks/bench_host_overhead.py on the CPU
# (benchmarks/results/host_overhead_cpu.md; tiny Pre-LN LM step, dropout 0.1, one thread): the op forced
# wherever the model can fuse was 1.06x the unfused step, the unfused modules the faster; without
# dropout the op runs the unfused modules' own torch ops and saves their Python. On a GPU the op
# (issue 10: ~5% less GPU time per step; tokens/s to be confirmed by bench_lm_step.py on a GPU).
_RULE = {("cpu", True): False}


def compile_path() -> str:
    """What ``add_norm`` hands torch.compile: ``"composite"`` or ``"kernel"``."""
    return _compile_path


def set_compile_path(path: str) -> None:
    """Choose what ``add_norm`` hands torch.compile (affects graphs traced afterwards: a compiled
    model re-traces when this changes)."""
    global _compile_path
    if path not in COMPILE_PATHS:
        raise ValueError(f"path: expected one of {COMPILE_PATHS}, got {path!r}")
    _compile_path = path


@contextlib.contextmanager
def using_compile_path(path: str) -> Iterator[None]:
    """``set_compile_path(path)`` for a block, then the previous path again."""
    previous = _compile_path
    set_compile_path(path)
    try:
        yield
    finally:
        set_compile_path(previous)


def fused_op_preferred(device: torch.device, *, dropout: bool) -> bool:
    """Whether :func:`addnorm.ops.add_norm` should compute a model's add + norm on ``device`` (True) or
    the unfused modules should (False: ``nn.Dropout``, the add, the norm module), with branch dropout
    active (``dropout``: training with p > 0) or not.

    The rule, from measurements (``benchmarks/results/host_overhead_cpu.md``): the op everywhere
    except on the CPU with dropout, where the unfused modules are faster. It reads only the device
    and the call's dropout, never hooks or observers. What it means for dropout masks: on a GPU the
    fused op drops by a hash of (seed, row, column), the seed drawn from torch's generator; on the
    CPU the unfused path draws ``nn.Dropout``'s mask from torch's RNG stream, so a CPU model with
    dropout is exactly its ``fused=False`` twin. Same distribution, different elements, each
    reproducible under ``torch.manual_seed``. Without dropout (eval, p = 0) both paths compute the
    same function. Under ``torch.compile`` the op hands Inductor its composite by default
    (:func:`compile_path`)."""
    return _RULE.get((torch.device(device).type, bool(dropout)), True)
