"""The GPU path's launches on a machine without a GPU: Triton's driver faked, its compiler replaced by a
kernel whose launch does no work (it counts), and addnorm's op told that the
Triton backend may run on CPU tensors. What remains is the Python and the autograd of the GPU path
exactly as it runs on CUDA: the real ``JITFunction`` kernels, their binder and kernel cache on a first
call, then :mod:`addnorm.ops.triton.direct_launch`'s direct launch of the "compiled" kernel.

The benchmarks use it to count and time host work (``benchmarks/host/host_overhead.py --jit-launch``,
``benchmarks/host/step_host.py``, ``benchmarks/host/step_trace.py`` on the CPU); nothing in the library knows
it. It needs the real kernels, so Triton must not run in its interpreter: ``TRITON_INTERPRET`` unset or ``0``
before triton is imported (:func:`require_jit`).

    with faked_launches() as launches:
        step()
    launches.count   # kernels launched in the block
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

__all__ = ["Launches", "faked_launches", "require_jit"]


def require_jit() -> None:
    """Set ``TRITON_INTERPRET=0`` (before triton is imported), or fail if triton is already imported in
    the interpreter's mode."""
    import sys

    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError(
            "fake_launch: triton was imported with TRITON_INTERPRET=1; the real kernels are needed"
        )
    os.environ["TRITON_INTERPRET"] = "0"


class Launches:
    """What the faked kernels were asked to do: ``count`` launches."""

    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


_active: list[Launches] = []  # the innermost faked_launches block's counter


class _NoOpCompiled:
    """A compiled kernel whose launch does nothing but count in the active block's :class:`Launches`
    (Triton keeps compiled kernels across blocks)."""

    function, packed_metadata = 0, ()

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, *args):
        _active[-1].count += 1


class FakePhilox:
    """What :mod:`addnorm.ops.seeds` reads of a CUDA generator (its seed and Philox offset), for the CPU
    tensors that stand in for CUDA ones: the host seeds' Python runs as it does on a GPU."""

    __slots__ = ("offset", "seed")

    def __init__(self, seed: int = 0, offset: int = 0) -> None:
        self.seed, self.offset = seed, offset

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        if offset % 4:  # as CUDA's generator refuses it
            raise ValueError(f"offset: expected a multiple of 4 (Philox's), got {offset}")
        self.offset = offset


@contextlib.contextmanager
def faked_launches() -> Iterator[Launches]:
    """Inside the block: Triton's active driver is a fake one (device 0, stream 0, an sm_90 target),
    every JIT kernel "compiles" to :class:`_NoOpCompiled`, and ``addnorm.ops`` takes the Triton backend
    for CPU tensors as its ``auto`` backend does for CUDA ones (``ADDNORM_BACKEND=triton``, and the
    interpreter check let through), its dropout seeds drawn on the host from a :class:`FakePhilox`.
    Yields the :class:`Launches` counter. Plans and launch caches made inside are forgotten after."""
    require_jit()
    from triton.backends.compiler import GPUTarget
    from triton.runtime.driver import driver
    from triton.runtime.jit import JITFunction

    from addnorm.ops.native.fake_driver import cpu_as_cuda

    launches = Launches()

    class FakeDriver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device):
            return 0

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    def compile_nothing(self, key, signature, device, constexprs, options, attrs, warmup):
        ck = self.device_caches[device][0][key] = _NoOpCompiled()
        return ck

    driver.set_active(FakeDriver())
    real_compile, JITFunction._do_compile = JITFunction._do_compile, compile_nothing
    _active.append(launches)
    try:
        # the backend, the host seeds (from a FakePhilox) and the plans as the native call's tests set
        # them, the native path left off
        with cpu_as_cuda(FakePhilox(), native_cpu=False):
            yield launches
    finally:
        _active.pop()
        JITFunction._do_compile = real_compile
        with contextlib.suppress(RuntimeError):  # without a GPU there is no driver to go back to
            driver.reset_active()
