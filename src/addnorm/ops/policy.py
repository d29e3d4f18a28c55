"""The fused op's policy, in one place: which backend a call runs on, the environment variables that steer
it, what the op hands torch.compile, and where a model's Add & Norm runs through the op.

:func:`resolve_backend` is the backend rule (an explicit ``backend`` wins, then ``ADDNORM_BACKEND``,
then Triton for CUDA tensors when triton imports, except for the shapes a recorded table found faster on
the eager ops; float64 and rows wider than ``MAX_FUSED_HIDDEN`` fall back to torch). ``add_norm`` caches
a plan per call signature holding what these rules decided; the cache is keyed on :data:`VERSION`, which
every change of policy (:func:`read_backend_env`, :func:`invalidate`) bumps, so no plan outlives the
policy it was made under.

:func:`fusion_decision` is the one rule that a model's fusion decision (the residual stream's
held-back adds, a Post-LN connection's add and norm) asks: fuse on a GPU only where a recorded training
step on that GPU ran faster fused, and say why (:class:`FusionDecision`); :func:`fused_op_preferred` is
its answer alone, :func:`set_fusion` (``ADDNORM_FUSION``) overrides it. The op itself picks its backend.
The recorded numbers are :data:`~addnorm.ops.measured.MEASURED`, read from one data file per device
(``ops/measured_rows/*.json``, each row with the JSON file and key it was read from), keyed on the device's
name: the steps for the model's choice, the op alone for its ``auto`` backend (:func:`eager_faster`).
:func:`compile_path` is what
``addnorm.ops.add_norm`` gives Inductor while ``torch.compile`` traces it: its composite of torch ops
(``"composite"``, the default) or the registered op with the Triton kernels (``"kernel"``). Both drop
the same elements (the hashed mask of (seed, row, column)), so the choice never changes a result beyond
rounding.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings
from contextlib import AbstractContextManager
from typing import NamedTuple

import torch
from torch.compiler import is_compiling

from .args import MAX_FUSED_HIDDEN, TRITON_DTYPES, interpreting
from .choices import one_of, scoped
from .measured import MODELS, Measured, device_name, rows_for

__all__ = [
    "BACKENDS",
    "COMPILE_PATHS",
    "FUSION_MODES",
    "VERSION",
    "FusionDecision",
    "compile_path",
    "eager_faster",
    "fused_op_preferred",
    "fusion",
    "fusion_decision",
    "invalidate",
    "is_dtensor",
    "read_backend_env",
    "resolve_backend",
    "set_compile_path",
    "set_fusion",
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


def resolve_backend(
    backend: str, device: torch.device, hidden: int, dtypes: tuple[torch.dtype, ...],
    norm: str | None = None, prenorm: bool | None = None, dropout: bool | None = None,
) -> str:  # fmt: skip
    """``"torch"`` or ``"triton"`` for a call: an explicit ``backend`` wins, then ``ADDNORM_BACKEND``
    (see :func:`read_backend_env`), then auto (triton for CUDA tensors when triton imports, except
    where :data:`MEASURED` found the eager ops faster for this ``norm``, placement (``prenorm``) and
    hidden size). Rows wider than ``MAX_FUSED_HIDDEN`` and float64 fall back to torch."""
    if backend == "auto":
        backend = _ENV_BACKEND
        if backend not in BACKENDS:
            raise ValueError(f"ADDNORM_BACKEND: expected one of {BACKENDS}, got {backend!r}")
        if backend == "auto":
            ok = device.type == "cuda" and triton_available()
            ok = ok and hidden <= MAX_FUSED_HIDDEN and all(d in TRITON_DTYPES for d in dtypes)
            ok = (
                ok
                and eager_faster(device, hidden=hidden, norm=norm, prenorm=prenorm, dropout=dropout) is None
            )
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
        from .triton.kernels import kernels_are_interpreted

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
# (benchmarks/results/h100/2026-11-24-fcabca7/gpu_h100.md, LM d_model 1024 x 12 layers, bf16): the composite
# path 1.009x the compiled unfused model at no extra memory; benchmarks/step/lm_step.py --compile-paths both
# revisits it.
_compile_path = "composite"


def eager_faster(
    device: torch.device | str, *, scope: str = "op", mode: str | None = None, hidden: int | None = None,
    numel: int | None = None, norm: str | None = None, prenorm: bool | None = None,
    dropout: bool | None = None, model: str | None = None,
) -> Measured | None:  # fmt: skip
    """The row of :data:`~addnorm.ops.measured.MEASURED` in ``scope`` measured on ``device`` (by its
    name) that found the unfused ops faster than the fused op for a call like this (in such a model,
    ``model``), or None."""
    for m in rows_for(device_name(torch.device(device)), scope):
        if m.slower and m.covers(mode, hidden, numel, norm, prenorm, dropout, model):
            return m
    return None


def compile_path() -> str:
    """What ``add_norm`` hands torch.compile: ``"composite"`` or ``"kernel"``."""
    return _compile_path


def set_compile_path(path: str) -> None:
    """Choose what ``add_norm`` hands torch.compile (affects graphs traced afterwards: a compiled
    model re-traces when this changes)."""
    global _compile_path
    _compile_path = one_of("path", path, COMPILE_PATHS)


def using_compile_path(path: str) -> AbstractContextManager[None]:
    """``set_compile_path(path)`` for a block, then the previous path again."""
    return scoped(set_compile_path, compile_path, path)


FUSION_MODES = ("measured", "always", "never")


class FusionDecision(NamedTuple):
    """Whether a model's add runs in the fused op (``fuse``), ``why`` in one sentence, and the recorded
    measurement it rests on (``row``, None where none does)."""

    fuse: bool
    why: str
    row: Measured | None = None

    def __str__(self) -> str:
        return f"{'fused' if self.fuse else 'unfused'}: {self.why}"


def _fusion_env() -> str:
    mode = os.environ.get("ADDNORM_FUSION", "measured").strip().lower() or "measured"
    return one_of("ADDNORM_FUSION", mode, FUSION_MODES)


_fusion = _fusion_env()
_decisions: dict[tuple, FusionDecision] = {}


def set_fusion(mode: str) -> None:
    """Where models fuse from now on: ``"measured"`` (the default, :func:`fusion_decision`'s rule),
    ``"always"`` (wherever a connection can: what the benchmarks time against the unfused modules) or
    ``"never"`` (the unfused modules everywhere, as ``AddNorm(fused=False)``). The environment variable
    ``ADDNORM_FUSION`` sets it at import. Affects graphs traced afterwards."""
    global _fusion
    _fusion = one_of("mode", mode, FUSION_MODES)
    _decisions.clear()


def fusion(mode: str) -> AbstractContextManager[None]:
    """``set_fusion(mode)`` for a block, then the previous mode again."""
    return scoped(set_fusion, lambda: _fusion, mode)


def fusion_decision(
    device: torch.device | str, *, dropout: bool = False, numel: int | None = None, sharded: bool = False,
    compiling: bool | None = None, model: str = "addnorm",
) -> FusionDecision:  # fmt: skip
    """Whether a model's residual add runs in :func:`addnorm.ops.add_norm` on ``device``, and why: the
    one rule :meth:`addnorm.AddNorm.add_fusion` asks (with the call's branch dropout, ``dropout``:
    training with p > 0, and its stream's element count, ``numel``), readable by a user for any call
    (``print(addnorm.ops.fusion_decision("cuda", dropout=True, numel=8 * 1024 * 1024))``), and for
    the models whose steps decide (``model``, :data:`~addnorm.ops.measured.MODELS`: ``"hf"`` for a
    Hugging Face model rewired by :mod:`addnorm.hf`, ``"addnorm"`` for any other; a connection passes
    its :attr:`addnorm.AddNorm.fusion_model`).

    - a DTensor stream (``sharded``) always fuses: the op's dropout mask is the whole tensor's on every
      shard (:mod:`addnorm.ops.sharded`), ``nn.Dropout`` on CPU DTensors draws each rank's own;
    - :func:`set_fusion` ``"always"`` / ``"never"`` (``ADDNORM_FUSION``) override the rest;
    - on a GPU the op runs its own kernels, so it fuses only where a recorded training step on *this*
      GPU (by name, not "cuda": an H100's table does not decide for an H200) ran faster fused for such
      a call (eager or compiled, ``compiling``: default whether torch.compile is tracing, dropout,
      elements per call, such models) and none ran slower; unmeasured, level or slower: the unfused
      modules;
    - on the CPU the op without dropout runs the unfused modules' own torch ops (no kernel of its own
      to be faster or slower), so it fuses unless a recorded step ran slower (with dropout: the hashed
      NumPy mask against ``nn.Dropout``).

    The rows are :data:`~addnorm.ops.measured.MEASURED` (``scope="step"``). The decision reads only the
    device, the call and the rows, never hooks or observers, and is cached per call signature."""
    if compiling is None:
        compiling = is_compiling()
    key = (device, dropout, numel, sharded, compiling, model, _fusion, VERSION)
    found = None if compiling else _decisions.get(key)
    if found is None:
        if model not in MODELS:
            raise ValueError(f"model: expected one of {MODELS}, got {model!r}")
        found = _decide(torch.device(device), bool(dropout), numel, sharded, compiling, model)
        if not compiling:
            if len(_decisions) > 4096:  # many call sizes (varying sequence lengths): start again
                _decisions.clear()
            _decisions[key] = found
    return found


def _decide(
    device: torch.device, dropout: bool, numel, sharded: bool, compiling: bool, model: str
) -> FusionDecision:
    if sharded:
        return FusionDecision(True, "a DTensor stream: the op's mask is the whole tensor's on every shard")
    if _fusion != "measured":
        return FusionDecision(_fusion == "always", f"set_fusion({_fusion!r}) (or ADDNORM_FUSION)")
    name, mode = device_name(device), "compile" if compiling else "eager"
    call = f"{model} model, {mode}, {'with' if dropout else 'without'} dropout" + (
        f", {numel} elements" if numel else ""
    )
    rows = [m for m in rows_for(name, "step") if m.covers(mode, None, numel, None, None, dropout, model)]
    slower = next((m for m in rows if m.slower), None)
    if slower is not None:
        return FusionDecision(
            False, f"{name} ran such a step {slower.ratio:.2f}x slower fused ({slower.source})", slower
        )
    if device.type != "cuda":
        return FusionDecision(True, f"on {name} the op runs torch's own ops; no recorded step ran slower")
    faster = next((m for m in rows if m.faster), None)
    if faster is not None:
        return FusionDecision(
            True, f"{name} ran such a step {1 / faster.ratio:.2f}x faster fused ({faster.source})", faster
        )
    return FusionDecision(
        False,
        f"no recorded step on {name} ran faster fused for this call ({call}); "
        "measure with benchmarks/step/lm_step.py, or set_fusion('always')",
    )


def fused_op_preferred(
    device: torch.device | str, *, dropout: bool, sharded: bool = False, numel: int | None = None,
    model: str = "addnorm",
) -> bool:  # fmt: skip
    """``fusion_decision(...).fuse``: whether a model's add runs in the fused op (see there)."""
    return fusion_decision(device, dropout=dropout, numel=numel, sharded=sharded, model=model).fuse


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``, without importing that module (if it
    is not imported, no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)
