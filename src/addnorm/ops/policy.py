"""The fused op's policy, in one place: which backend a call runs on, the environment variables that
steer it, what the op hands torch.compile, and where a model's Add & Norm runs through the op.

:func:`resolve_backend` is the backend rule (an explicit ``backend`` wins, then ``ADDNORM_BACKEND``,
then Triton for CUDA tensors when triton imports; float64 and rows wider than ``MAX_FUSED_HIDDEN`` fall
back to torch). ``add_norm`` caches a plan per call signature holding what these rules decided; the
cache is keyed on :data:`VERSION`, which every change of policy (:func:`read_backend_env`,
:func:`invalidate`) bumps, so no plan outlives the policy it was made under.

:func:`fused_op_preferred` is the one rule that a model's fusion decision (the residual stream's
held-back adds, a Post-LN connection's add and norm) asks about the device and the dropout; the op
itself picks its backend. :func:`compile_path` is what ``addnorm.ops.add_norm`` gives Inductor while
``torch.compile`` traces it: its composite of torch ops (``"composite"``, the default) or the
registered op with the Triton kernels (``"kernel"``). Both drop the same elements (the hashed mask of
(seed, row, column)), so the choice never changes a result beyond rounding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator

import torch

from .args import MAX_FUSED_HIDDEN, TRITON_DTYPES, interpreting

__all__ = [
    "BACKENDS",
    "COMPILE_PATHS",
    "VERSION",
    "compile_path",
    "fused_op_preferred",
    "invalidate",
    "is_dtensor",
    "read_backend_env",
    "resolve_backend",
    "set_compile_path",
    "triton_available",
    "use_triton_op",
    "using_compile_path",
]

BACKENDS = ("auto", "torch", "triton")
# the policy's version: cached call plans are keyed on it (bumped by every change of policy)
VERSION = 0
_warned: set[str] = set()


def invalidate() -> None:
    """A new policy version: every cached call plan is rebuilt on its next call (after the backend
    environment or the kernels' launch configurations change)."""
    global VERSION
    VERSION += 1


# looked up once, at import: torch.compile cannot trace ``importlib.util.find_spec`` (a graph break in
# every fused call, measured on an H100), and triton does not come or go while a process runs
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether triton can be imported (without importing it; looked up once, at import)."""
    return _TRITON_AVAILABLE


def _env_backend() -> str:
    return os.environ.get("ADDNORM_BACKEND", "auto").strip().lower() or "auto"


_ENV_BACKEND = _env_backend()


def read_backend_env() -> str:
    """Read ``ADDNORM_BACKEND``, the backend that ``"auto"`` stands for (at import, and again only when
    this is called: no environment lookup per call), invalidate the cached plans, and return it."""
    global _ENV_BACKEND
    _ENV_BACKEND = _env_backend()
    invalidate()
    return _ENV_BACKEND


def use_triton_op() -> bool:
    """Whether the registered ops are ``torch.library.triton_op``s (CUDA and triton present: under
    torch.compile Inductor launches the kernels) or ``custom_op``s. ``ADDNORM_TRITON_OP=1``/``0``
    forces the choice (read once, when the ops are registered)."""
    forced = os.environ.get("ADDNORM_TRITON_OP", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and triton_available()
    return triton_available() and torch.cuda.is_available()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def resolve_backend(backend: str, device: torch.device, hidden: int, dtypes: tuple[torch.dtype, ...]) -> str:
    """``"torch"`` or ``"triton"`` for a call: an explicit ``backend`` wins, then ``ADDNORM_BACKEND``
    (see :func:`read_backend_env`), then auto (triton for CUDA tensors when triton imports). Rows
    wider than ``MAX_FUSED_HIDDEN`` and float64 fall back to torch."""
    if backend == "auto":
        backend = _ENV_BACKEND
        if backend not in BACKENDS:
            raise ValueError(f"ADDNORM_BACKEND: expected one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            ok = device.type == "cuda" and triton_available()
            ok = ok and hidden <= MAX_FUSED_HIDDEN and all(d in TRITON_DTYPES for d in dtypes)
            return "triton" if ok else "torch"
    if backend == "torch":
        return "torch"
    if not triton_available():
        raise RuntimeError("backend='triton': triton is not installed (pip install 'addnorm[triton]')")
    if device.type != "cuda" and not interpreting():
        raise RuntimeError(
            f"backend='triton': tensors are on {device.type}, and Triton kernels run on CUDA only, or on "
            "the CPU with TRITON_INTERPRET=1 set before triton is imported; use backend='torch' or 'auto'"
        )
    if device.type == "cpu":
        from .triton_kernels import kernels_are_interpreted

        if not kernels_are_interpreted():
            raise RuntimeError(
                "backend='triton' on CPU tensors: the kernels were compiled before TRITON_INTERPRET=1 "
                "was set; set it before importing addnorm's Triton kernels"
            )
    bad = [d for d in dtypes if d not in TRITON_DTYPES]
    if bad:
        raise TypeError(f"backend='triton': supports float32, float16 and bfloat16 tensors, got {bad[0]}")
    if hidden > MAX_FUSED_HIDDEN:
        _warn_once(
            f"add_norm: hidden size {hidden} > {MAX_FUSED_HIDDEN} exceeds the Triton kernels' widest row; "
            "using the torch path"
        )
        return "torch"
    return "triton"


COMPILE_PATHS = ("composite", "kernel")
# Inductor's fusion of the composite with its neighbours beat the opaque op on an H100 (issue 10:
# compiled fused 0.78-0.83x of compiled unfused, 0.97x with CUDA graphs). Re-measured 2026-11-24
# (benchmarks/results/gpu_h100.md, LM d_model 1024 x 12 layers, bf16): the composite path 1.009x the
# compiled unfused model at no extra memory; bench_lm_step.py --compile-paths both revisits it.
_compile_path = "composite"

# fused_op_preferred(device type, dropout) -> bool, from benchmarks/bench_host_overhead.py on the CPU
# (benchmarks/results/host_overhead_cpu.md; tiny Pre-LN LM step, dropout 0.1, one thread): the op forced
# wherever the model can fuse was 1.06x the unfused step, the unfused modules the faster; without
# dropout the op runs the unfused modules' own torch ops and saves their Python. On a GPU the op
# everywhere (benchmarks/results/gpu_h100.md, H100, 2026-11-24): LM step with dropout 0.1 eager 0.985x
# unfused (within the runs' ~2% spread), compiled 1.009x; HF Llama without dropout 1.048x; 2-7% less
# peak memory in each.
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


def fused_op_preferred(device: torch.device, *, dropout: bool, sharded: bool = False) -> bool:
    """Whether :func:`addnorm.ops.add_norm` should compute a model's add + norm on ``device`` (True) or
    the unfused modules should (False: ``nn.Dropout``, the add, the norm module), with branch dropout
    active (``dropout``: training with p > 0) or not, on a DTensor stream (``sharded``) or not.

    A DTensor stream always takes the op: its dropout mask is the whole tensor's on every shard
    (:mod:`addnorm.ops.sharded`), while ``nn.Dropout`` on a CPU DTensor draws each rank's own local
    mask (DTensor's RNG tracker is CUDA-only): shards of one tensor get the same mask, replicas
    different ones.

    The rule, from measurements (``benchmarks/results/host_overhead_cpu.md``): the op everywhere
    except on the CPU with dropout, where the unfused modules are faster. It reads only the device
    and the call's dropout, never hooks or observers. What it means for dropout masks: on a GPU the
    fused op drops by a hash of (seed, row, column), the seed drawn from torch's generator; on the
    CPU the unfused path draws ``nn.Dropout``'s mask from torch's RNG stream, so a CPU model with
    dropout is exactly its ``fused=False`` twin. Same distribution, different elements, each
    reproducible under ``torch.manual_seed``. Without dropout (eval, p = 0) both paths compute the
    same function. Under ``torch.compile`` the op hands Inductor its composite by default
    (:func:`compile_path`)."""
    return sharded or _RULE.get((torch.device(device).type, bool(dropout)), True)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``, without importing that module (if it
    is not imported, no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)
