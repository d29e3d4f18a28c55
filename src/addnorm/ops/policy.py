"""The fused op's policy, in one place: which backend a call runs on, the environment variables that steer
it, what the op hands torch.compile, and where a model's Add & Norm runs through the op.

:func:`resolve_backend` is the backend rule (an explicit ``backend`` wins, then ``ADDNORM_BACKEND``,
then Triton for CUDA tensors when triton imports, except for the shapes a recorded table found faster on
the eager ops; float64 and rows wider than ``MAX_FUSED_HIDDEN`` fall back to torch). ``add_norm`` caches
a plan per call signature holding what these rules decided; the cache is keyed on :data:`VERSION`, which
every change of policy (:func:`read_backend_env`, :func:`invalidate`) bumps, so no plan outlives the
policy it was made under.

:func:`fused_op_preferred` is the one rule that a model's fusion decision (the residual stream's
held-back adds, a Post-LN connection's add and norm) asks about the device and the dropout; the op itself
picks its backend. Where the fused op is slower than the eager ops is one data table, :data:`MEASURED`:
each row a case a recorded table under ``benchmarks/results`` shows (the device it was measured on, the
number, the file), read by :func:`eager_faster` for the model's choice, the op's ``auto`` backend and
(:func:`eager_faster_at_size`) a model's calls of a given size. :func:`compile_path` is what
``addnorm.ops.add_norm`` gives Inductor while ``torch.compile`` traces it: its composite of torch ops
(``"composite"``, the default) or the registered op with the Triton kernels (``"kernel"``). Both drop
the same elements (the hashed mask of (seed, row, column)), so the choice never changes a result beyond
rounding.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import warnings
from collections.abc import Iterator
from typing import NamedTuple

import torch

from .args import MAX_FUSED_HIDDEN, TRITON_DTYPES, interpreting

__all__ = [
    "BACKENDS",
    "COMPILE_PATHS",
    "MEASURED",
    "VERSION",
    "Measured",
    "compile_path",
    "eager_faster",
    "eager_faster_at_size",
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


def resolve_backend(
    backend: str, device: torch.device, hidden: int, dtypes: tuple[torch.dtype, ...],
    norm: str | None = None, prenorm: bool | None = None,
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
            ok = ok and not eager_faster(device.type, hidden=hidden, norm=norm, prenorm=prenorm)
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


class Measured(NamedTuple):
    """A recorded case where the eager ops ran faster than the fused op, and the rule it gives: on
    ``device_type``, a call matching every field that is not None (the norm, Pre-LN or not, branch
    dropout active or not, the hidden size from ``min_hidden``, at most ``max_numel`` elements per
    call) is left to the eager ops. ``ratio`` is the fused time over the eager time measured on
    ``device``; ``evidence`` is the line of ``benchmarks/results/<source>`` that gives it."""

    device_type: str
    device: str
    norm: str | None
    prenorm: bool | None
    dropout: bool | None
    min_hidden: int
    max_numel: int | None
    ratio: float
    evidence: str
    source: str


# The cases the recorded tables show the op slower than eager by more than the runs' spread (SPREAD:
# identical fused=False models timed side by side differed by up to ~2% on the H100, lm_step_cuda.md,
# gpu_h100.md; so the d_model-1024 LM's 0.985x in eager mode is a tie, and the op stays there for its
# 2-7% less peak memory). A GPU session that re-measures (make gpu-bench) edits these rows.
SPREAD = 0.02
MEASURED = (
    # a tiny Pre-LN LM step on 2 CPU cores (d_model 64, dropout 0.1): the hashed NumPy mask costs more
    # than nn.Dropout; without dropout the op runs the unfused modules' own torch ops
    Measured("cpu", "CPU AMD EPYC, 2 logical cores", None, None, True, 0, None, 1.061,
             "27781 us, 1.061x fused=False", "host_overhead_cpu.md"),
    # the same step on the H100 (8 x 16 tokens x d_model 64 = 8192 elements a call), host-bound: a
    # fused call cost 2.0-3.0x eager's host time at 8 x 64 (issue 30 item 4 works on that)
    Measured("cuda", "NVIDIA H100 80GB HBM3", None, None, None, 0, 8192, 1.278,
             "10518 us, 1.278x fused=False", "host_overhead_cuda.md"),
    # the op alone, bf16, 2**27 elements: Post-LN LayerNorm at hidden 16384, fwd+bwd 0.64x eager's speed
    # (1.15x at 4096) with the column-chunked backward of commit fcabca7, since replaced by the sliced
    # one (launch_config): to be re-measured
    Measured("cuda", "NVIDIA H100 80GB HBM3", "layernorm", False, None, 16384, None, 1 / 0.64,
             "layernorm post bfloat16 h=16384", "gpu_suite_nvidia_h100_80gb_hbm3.md"),
)  # fmt: skip


def eager_faster(
    device_type: str, *, hidden: int | None = None, numel: int | None = None, norm: str | None = None,
    prenorm: bool | None = None, dropout: bool | None = None,
) -> bool:  # fmt: skip
    """Whether a row of :data:`MEASURED` says the eager ops are faster than the fused op for a call
    like this on ``device_type`` (a row's field counts only where the caller gives it: a row bounded
    in ``numel`` needs ``numel``, a LayerNorm row needs ``norm``)."""
    return any(
        _covers(m, hidden, numel, norm, prenorm, dropout) for m in _MEASURED_BY_DEVICE.get(device_type, ())
    )


def eager_faster_at_size(device_type: str, numel: int, dropout: bool) -> bool:
    """:func:`eager_faster` over the rows bounded in the call's size only (elements a call): what a
    model asks per call beside :func:`fused_op_preferred`, which covers the rows without a bound."""
    rows = _MEASURED_BY_DEVICE.get(device_type, ())
    return any(m.max_numel is not None and _covers(m, None, numel, None, None, dropout) for m in rows)


def _covers(m: Measured, hidden, numel, norm, prenorm, dropout) -> bool:
    return (
        (m.norm is None or m.norm == norm)
        and (m.prenorm is None or m.prenorm is prenorm)
        and (m.dropout is None or m.dropout is dropout)
        and (not m.min_hidden or (hidden is not None and hidden >= m.min_hidden))
        and (m.max_numel is None or (numel is not None and numel <= m.max_numel))
    )


_MEASURED_BY_DEVICE: dict[str, tuple[Measured, ...]] = {}
for _m in MEASURED:
    _MEASURED_BY_DEVICE[_m.device_type] = (*_MEASURED_BY_DEVICE.get(_m.device_type, ()), _m)
# fused_op_preferred's answer per (device type, dropout), from the rows that need nothing else
_PREFERRED = {(t, d): not eager_faster(t, dropout=d) for t in ("cpu", "cuda") for d in (False, True)}


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

    The rule is :data:`MEASURED`'s, the recorded cases where the eager ops were faster
    (:func:`eager_faster`): here the op everywhere except on the CPU with dropout
    (``benchmarks/results/host_overhead_cpu.md``); a row bounded in the call's size (the H100's tiny
    calls) is asked by ``AddNorm.add_fusion`` with the stream's element count, and the op's own
    ``auto`` backend asks the rows bounded in the hidden size (:func:`resolve_backend`). It reads only
    the device and the call's dropout, never hooks or observers. What it means for dropout masks: on a GPU the
    fused op drops by a hash of (seed, row, column), the seed drawn from torch's generator; on the
    CPU the unfused path draws ``nn.Dropout``'s mask from torch's RNG stream, so a CPU model with
    dropout is exactly its ``fused=False`` twin. Same distribution, different elements, each
    reproducible under ``torch.manual_seed``. Without dropout (eval, p = 0) both paths compute the
    same function. Under ``torch.compile`` the op hands Inductor its composite by default
    (:func:`compile_path`)."""
    return sharded or _PREFERRED.get((torch.device(device).type, bool(dropout)), True)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor``, without importing that module (if it
    is not imported, no DTensor exists)."""
    mod = sys.modules.get("torch.distributed.tensor")
    return mod is not None and isinstance(t, mod.DTensor)
