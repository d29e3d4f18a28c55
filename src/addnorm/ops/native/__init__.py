"""The native call path (opt-in): the fused op's eager CUDA call as a C++ autograd node.

Today's eager call (:class:`~addnorm.ops.triton.eager.TritonAddNorm`) is a Python
``autograd.Function`` whose forward and backward launch the Triton kernels through Python; its host
cost per call exceeds the aten ops it replaces (issue 52: 1.45-1.48x eager ``x + r`` then
``F.layer_norm``, forward and backward, on one CPU core). The native call replaces that Function, per
eager launch, with a C++ ``torch::autograd::Function`` (``csrc/native_call.cpp``, also the
``TORCH_LIBRARY`` op ``torch.ops.addnorm_native.add_norm``) whose forward and backward allocate the
outputs and launch the kernels Triton compiled for the call's signature with ``cuLaunchKernel``
(the driver opened with ``dlopen``), on the current stream: the function handle, block, shared memory
and parameter layout taken from the compiled kernels the direct launch holds
(:mod:`~addnorm.ops.native.launch`, :mod:`~addnorm.ops.native.layout`). The same formula and
gradients as today's path, launch for launch.

Switch: ``ADDNORM_NATIVE_CALL=1`` (read at import) or :func:`set_call_path` (``"native"`` /
``"python"``, the default; cached plans are rebuilt). The extension is built on the first CUDA call
that takes the native path (``torch.utils.cpp_extension``, cached; :mod:`~addnorm.ops.native.build`);
a build or load failure warns once and every call takes today's path. CPU tensors never take it (a
CPU-only install never builds). A launch the native node cannot do is refused in one line
(:func:`refusals`) and that call takes today's path: a Triton whose launches are not direct
(``direct_launch.SUPPORTED``), and per specialisation a kernel that needs launch attributes or scratch
memory. Inside the node, a call whose kernel is not registered yet (its first call, an unaligned or
strided tensor, no rows) or whose backward has a pre-pass (rows in column slices) launches through
today's launchers.

Under ``torch.compile`` (plans made while tracing have no eager launches), ``torch.func`` transforms,
dispatch modes and DTensors the call never reaches the node.
"""

from __future__ import annotations

import os
import warnings

from .. import policy

__all__ = ["CALL_PATHS", "attach", "call_path", "refusals", "set_call_path"]

CALL_PATHS = ("python", "native")
_path = "native" if os.environ.get("ADDNORM_NATIVE_CALL", "") == "1" else "python"
_ALLOW_CPU = False  # tests: CPU tensors take the native path too (the fake driver, the CPU kernel)
_warned = False
_refusals: dict[str, int] = {}


def call_path() -> str:
    """The eager Triton call's path: ``"python"`` (today's) or ``"native"``."""
    return _path


def set_call_path(path: str) -> str:
    """Choose the eager Triton call's path for later calls and return the previous one.

    Args:
        path: ``"native"`` (the C++ autograd node, where it builds and takes the call) or
            ``"python"`` (today's ``autograd.Function``).

    Returns:
        The previous path.
    """
    global _path
    if path not in CALL_PATHS:
        raise ValueError(f"set_call_path: expected one of {CALL_PATHS}, got {path!r}")
    previous, _path = _path, path
    if previous != path:
        policy.invalidate()  # plans hold their launches' apply
    return previous


def refusals() -> dict[str, int]:
    """The reasons calls were routed to today's path, and how many launches each (a copy)."""
    return dict(_refusals)


def _refuse(reason: str) -> None:
    _refusals[reason] = _refusals.get(reason, 0) + 1


def refusal(plan) -> str | None:
    """Why ``plan``'s eager launches cannot take the native call (one line), or None."""
    from ..triton import direct_launch

    if not direct_launch.SUPPORTED:
        return "this Triton's JITFunction.run does not launch as the direct launch does"
    return None


def attach(plan, launches: list) -> None:
    """Give ``plan``'s eager launches the native call as their ``apply`` where the path is native and
    it builds (else they keep today's, after one warning for a failed build)."""
    global _warned
    if _path != "native" or (plan.device.type != "cuda" and not _ALLOW_CPU):
        return
    reason = refusal(plan)
    if reason is not None:
        _refuse(reason)
        return
    from . import build

    ext = build.extension()
    if ext is None:
        _refuse(f"the extension did not build: {build.failure()}")
        if not _warned:
            _warned = True
            warnings.warn(
                f"addnorm: the native call path did not build or load ({build.failure()}); "
                "every call takes today's path",
                RuntimeWarning,
                stacklevel=3,
            )
        return
    from .launch import NativeLaunch

    for launch in launches:
        launch.native = NativeLaunch(ext, launch, plan.device)
        launch.apply = launch.native.call
