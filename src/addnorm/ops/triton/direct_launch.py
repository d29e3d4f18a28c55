"""Launching a JIT kernel's compiled variant directly, without ``kernel[grid](...)``'s per-call work.

Per call, ``JITFunction.run`` (Triton 3.4+) reads three knobs, looks up the current device and stream,
runs the pre-run hooks, binds and specialises every argument (a generated binder: a dict of ~35
arguments and a native call per argument), builds and looks up a cache key (``str`` of the options
dict), checks the kernel's globals, builds the launch metadata and then calls the compiled kernel's
launcher. On a CPU with the driver faked (``benchmarks/host/host_overhead.py --jit-launch``) that is
~12 us a launch, more than the rest of a small fused call. A launcher that knows its arguments' kinds
knows which of them can change the specialisation from call to call (the dtypes and 16-byte alignment
of the tensors it is given, the class of its varying integers: 1, a multiple of 16, 64-bit), keys the
compiled kernels on those, and launches the one ``run`` returned for the first such call with the
arguments ``run`` would pass it (all of the kernel's parameters, its defaults included), and the launch
hooks and their metadata only where a hook would run (:data:`SKIP_IDLE_HOOKS`: Triton 3.5+ hands every
launch an empty hook chain and builds metadata for it, two Python calls and a dictionary per launch).

Engaged only where this Triton's ``run`` launches that way (:data:`SUPPORTED`, read once from its
source), for ``JITFunction`` kernels (never the interpreter's, never a benchmark's stub) without
pre-run hooks; anything else takes ``kernel[grid](...)``.

This module imports triton at import time: import it lazily (only ``ops/triton*`` modules do).
"""

from __future__ import annotations

import inspect

from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction

try:  # Triton 3.4+ (an older one launches through kernel[grid](...): SUPPORTED is False)
    from triton import knobs
except ImportError:
    knobs = None

__all__ = ["CALL_C_LAUNCHER", "SUPPORTED", "DirectLaunch", "c_launcher", "defaults_of", "int_kind"]


def _run_launches_directly() -> bool:
    """Whether ``JITFunction.run`` launches a compiled kernel as :meth:`DirectLaunch.launch` does."""
    try:
        src = inspect.getsource(JITFunction.run)
    except (OSError, TypeError):
        return False
    return (
        knobs is not None
        and "kernel.launch_metadata(grid, stream, *bound_args.values())" in src
        and "kernel.run(grid_0, grid_1, grid_2, stream, kernel.function, kernel.packed_metadata," in src
        and "knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook, *bound_args.values())" in src
        and hasattr(knobs, "runtime")
        and hasattr(type(driver), "active")  # a property: reading it would start the driver
    )


SUPPORTED = _run_launches_directly()


try:  # Triton 3.5+: the launch-hook knobs hold a chain of hooks, empty until a profiler (Proton) adds one
    from triton.knobs import HookChain
except ImportError:  # an older Triton: a hook or None
    HookChain = None


# hand the launch no hook (and so no metadata) where the knob's hook would do nothing; False: pass the
# knobs and the metadata as JITFunction.run does (the previous launch, which the GPU suite's host-time
# step times beside this one: benchmarks/host/host_overhead.py)
SKIP_IDLE_HOOKS = True


def _launcher_calls_c_directly() -> bool:
    """Whether this Triton's ``CudaLauncher.__call__`` only allocates scratch memory (none where the
    kernel asks for none) and then calls its C launcher ``self.launch`` with its own fields, as
    :func:`c_launcher` passes them."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher

        src = inspect.getsource(CudaLauncher.__call__)
    except (ImportError, OSError, TypeError):
        return False
    return (
        "self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,"
        in src
        and "kernel_metadata, launch_metadata, launch_enter_hook, launch_exit_hook, global_scratch," in src
        and "profile_scratch, self.arg_annotations, self.kernel_signature, kernel_args)" in src
        and "if size > 0:" in src
    )


# call a compiled CUDA kernel's C launcher itself where its ``CudaLauncher.__call__`` would only pass
# its fields on (no scratch memory, no GSan): that frame, its two closures and its allocator checks
# cost ~1 us a launch on the 2-core CPU. False: every launch through ``CudaLauncher.__call__`` (the
# previous launch; a hypothesis until the GPU suite's host step times both)
CALL_C_LAUNCHER = _launcher_calls_c_directly()


def c_launcher(ck) -> tuple | None:
    """``ck``'s C launch and its constant arguments where :data:`CALL_C_LAUNCHER` applies to it: (the
    C launcher, cooperative grid, PDL, argument annotations, kernel signature); else None."""
    run = ck.run
    if (
        not CALL_C_LAUNCHER
        or type(run).__name__ != "CudaLauncher"
        or type(run).__module__ != "triton.backends.nvidia.driver"
        or getattr(run, "gsan_enabled", True)
        or getattr(run, "global_scratch_size", 1) != 0
        or getattr(run, "profile_scratch_size", 1) != 0
    ):
        return None
    return run.launch, run.launch_cooperative_grid, run.launch_pdl, run.arg_annotations, run.kernel_signature


def defaults_of(kernel) -> dict:
    """A JIT kernel's trailing parameters that have a default: name -> default, in order."""
    params = inspect.signature(kernel.fn).parameters.values()
    return {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}


def int_kind(v: int) -> int:
    """What Triton's specialisation of an integer argument depends on: 1 (a constant), a multiple of 16,
    64-bit."""
    return (v == 1) | ((v & 15 == 0) << 1) | ((v >> 31 != 0) << 2)


class DirectLaunch:
    """One launch spec's compiled kernels, keyed by (device, the call's specialisation facts), each the
    kernel ``JITFunction.run`` launched for the first call with that key. ``launch(kernel, key, grid,
    args, options)`` launches ``kernel`` on ``grid`` (one or two dimensions) with the positional
    ``args`` (every parameter without a default, in order) and the launch ``options``; ``defaults``
    (:func:`defaults_of` the kernel's values) follow ``args`` in the direct launch, as ``run`` binds them."""

    __slots__ = ("compiled", "defaults", "launchers")

    def __init__(self, defaults: tuple) -> None:
        self.compiled: dict = {}
        self.defaults = defaults  # the kernel's trailing parameters' defaults, which run() passes too
        self.launchers: dict = {}  # (device, key) -> the kernel's C launch (:func:`c_launcher`), or None

    def launch(self, kernel, key, grid: tuple, args: tuple, options: dict) -> None:
        active = driver.active
        device = active.get_current_device()
        ck = self.compiled.get((device, key))
        if ck is None:  # the normal launch (compiling on a first call), which returns the kernel it ran
            ck = kernel.run(*args, grid=grid, warmup=False, **options)
            if (
                ck is not None
                and not kernel.pre_run_hooks
                and hasattr(ck, "function")
                and hasattr(ck, "packed_metadata")
                and len(self.compiled) < 64
            ):
                self.compiled[device, key] = ck
                self.launchers[device, key] = c_launcher(ck)
            return
        stream = active.get_current_stream(device)
        full = (*args, *self.defaults)
        runtime = knobs.runtime
        enter, exit_ = runtime.launch_enter_hook, runtime.launch_exit_hook
        if SKIP_IDLE_HOOKS:  # an empty chain would be called to do nothing: no hook (inline: a hot path)
            if type(enter) is HookChain and not enter.calls:
                enter = None
            if type(exit_) is HookChain and not exit_.calls:
                exit_ = None
        # the metadata is only ever handed to the hooks: made only where one runs
        meta = None if enter is None and exit_ is None else ck.launch_metadata(grid, stream, *full)
        gy = grid[1] if len(grid) > 1 else 1
        c = self.launchers.get((device, key)) if CALL_C_LAUNCHER else None
        if c is not None:  # CudaLauncher.__call__'s work without its frame (nothing to allocate)
            launch, coop, pdl, ann, sig = c
            launch(
                grid[0], gy, 1, stream, ck.function, coop, pdl, ck.packed_metadata, meta, enter, exit_, None,
                None, ann, sig, full,
            )  # fmt: skip
        else:
            ck.run(grid[0], gy, 1, stream, ck.function, ck.packed_metadata, meta, enter, exit_, *full)
