"""A fake CUDA driver for the CPU: the tests' and the host benchmark's harness for the GPU path's launches
(nothing in the library imports it).

:func:`load` builds ``csrc/fake_cuda.c`` (a ``libcuda.so.1`` whose every call succeeds and whose
launches are recorded) and loads it before anything opens the driver; :func:`install` then makes it
Triton's active driver: Triton's real CUDA driver (its ``cuda_utils`` module compiled against the fake,
its launcher, ``CudaLauncher``, the C code that packs each launch's parameters) with the current device
0, the stream ``stream`` and an sm_90 target, so that the real ``JITFunction`` kernels compile to sm_90
cubins on the CPU (``ptxas`` ships in the triton wheel) and launch through Triton's own launcher onto the
fake. addnorm's native call (:mod:`addnorm.ops.native`) reaches the same fake through ``dlopen``, so the
two launchers' recorded launches can be compared byte for byte (:func:`launches`).

Needs the real kernels: ``TRITON_INTERPRET`` unset or 0 before triton is imported. CPU tensors stand in
for CUDA ones (the fake dereferences no pointer).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

__all__ = ["FakeLaunch", "cpu_as_cuda", "install", "launches", "load", "record", "set_param_sizes"]

_SOURCE = Path(__file__).parent / "csrc" / "fake_cuda.c"
_MAX_PARAMS, _MAX_BYTES = 48, 8
_lib: ctypes.CDLL | None = None


class _Launch(ctypes.Structure):
    _fields_ = [
        ("function", ctypes.c_uint64), ("stream", ctypes.c_uint64), ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3), ("smem", ctypes.c_uint), ("n_params", ctypes.c_int),
        ("sizes", ctypes.c_int * _MAX_PARAMS), ("bytes", (ctypes.c_ubyte * _MAX_BYTES) * _MAX_PARAMS),
        ("ex", ctypes.c_int),
    ]  # fmt: skip


class FakeLaunch(NamedTuple):
    """One recorded launch: the function (the fake's handle), its kernel's name, grid, block, shared
    memory, stream and each parameter's bytes."""

    function: int
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem: int
    stream: int
    params: tuple[bytes, ...]


def _include_dir() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "include")


def load(build_dir: str | None = None) -> ctypes.CDLL:
    """Build (once per directory) and load the fake ``libcuda.so.1``, RTLD_GLOBAL, before the real one
    could be; sets ``TRITON_LIBCUDA_PATH`` to its directory (Triton links its ``cuda_utils`` there)."""
    global _lib
    if _lib is not None:
        return _lib
    out = Path(build_dir or os.path.join(tempfile.gettempdir(), f"addnorm-fake-cuda-{os.getuid()}"))
    out.mkdir(parents=True, exist_ok=True)
    so = out / "libcuda.so.1"
    if not so.exists() or so.stat().st_mtime < _SOURCE.stat().st_mtime:
        tmp = out / f"libcuda.so.1.{os.getpid()}"
        cmd = ["gcc", "-O2", "-shared", "-fPIC", f"-I{_include_dir()}", "-Wl,-soname,libcuda.so.1"]
        subprocess.run([*cmd, "-o", str(tmp), str(_SOURCE)], check=True)
        os.replace(tmp, so)
    link = out / "libcuda.so"  # what the linker's -lcuda looks for
    if not link.exists():
        link.symlink_to("libcuda.so.1")
    _lib = ctypes.CDLL(str(so), mode=ctypes.RTLD_GLOBAL)
    _lib.fake_launch.restype = ctypes.POINTER(_Launch)
    _lib.fake_function_name.restype = ctypes.c_char_p
    _lib.fake_function_name.argtypes = [ctypes.c_uint64]
    _lib.fake_launch_count.restype = ctypes.c_longlong
    _lib.fake_set_param_sizes.argtypes = [ctypes.c_uint64, ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
    assert _lib.fake_launch_struct_size() == ctypes.sizeof(_Launch)
    os.environ["TRITON_LIBCUDA_PATH"] = str(out)
    return _lib


def install(stream: int = 0x5EED) -> object:
    """Make Triton's active driver its real CUDA driver on the fake (see the module's docstring), the
    current device 0 and stream ``stream``. Returns the driver."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("fake_driver: the real kernels are needed (TRITON_INTERPRET=0 before triton)")
    load()
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.driver import CudaDriver
    from triton.runtime.driver import driver

    class FakeCudaDriver(CudaDriver):
        def __init__(self) -> None:
            super().__init__()
            self.get_current_device = lambda: 0
            self.get_current_stream = lambda device=None: stream
            self.set_current_device = lambda device: None
            self.get_device_capability = lambda device=None: (9, 0)

        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

    fake = FakeCudaDriver()
    driver.set_active(fake)
    return fake


def record(on: bool) -> None:
    """Start (forgetting what was recorded) or stop recording launches."""
    load().fake_set_recording(int(on))


def set_param_sizes(function: int, sizes: list[int]) -> None:
    """The byte size of each of ``function``'s parameters, for the recording."""
    arr = (ctypes.c_int * len(sizes))(*sizes)
    load().fake_set_param_sizes(function, len(sizes), arr)


def launch_count() -> int:
    """Launches made since the fake was loaded (recorded or not)."""
    return int(load().fake_launch_count())


def launches() -> list[FakeLaunch]:
    """The launches recorded since :func:`record` started."""
    lib = load()
    out = []
    for i in range(lib.fake_n_launches()):
        rec = lib.fake_launch(i).contents
        params = tuple(bytes(rec.bytes[j][: rec.sizes[j]]) for j in range(rec.n_params))
        out.append(
            FakeLaunch(
                rec.function,
                lib.fake_function_name(rec.function).decode(),
                tuple(rec.grid),
                tuple(rec.block),
                rec.smem,
                rec.stream,
                params,
            )  # fmt: skip
        )
    return out


class _Philox:
    """What :mod:`addnorm.ops.seeds` reads of a CUDA generator, for the CPU tensors standing in."""

    def __init__(self) -> None:
        self.seed, self.offset = 1234, 0

    def initial_seed(self) -> int:
        return self.seed

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


@contextlib.contextmanager
def cpu_as_cuda(philox=None, native_cpu: bool = True) -> Iterator[None]:
    """Inside the block ``addnorm.ops`` takes the Triton backend for CPU tensors as ``auto`` does for
    CUDA ones (the interpreter check let through), its host seeds drawn from ``philox`` (what
    :mod:`addnorm.ops.seeds` reads of a CUDA generator; default a stand-in Philox state), and with
    ``native_cpu`` the native path may take CPU tensors; plans and launch caches made inside are
    forgotten after. ``benchmarks/host/fake_launch.py`` runs its faked launches inside it too."""
    from addnorm.ops import functional, native, policy, seeds
    from addnorm.ops.triton import kernels as tk
    from addnorm.ops.triton import launchers as tl

    saved = (policy.interpreting, tk.kernels_are_interpreted, seeds.generator_for, seeds.capture_check_for)
    env = os.environ.get("ADDNORM_BACKEND")
    philox = _Philox() if philox is None else philox
    policy.interpreting = tk.kernels_are_interpreted = lambda: True
    seeds.generator_for = lambda device: philox
    seeds.capture_check_for = lambda device: lambda: False
    os.environ["ADDNORM_BACKEND"] = "triton"
    policy.read_backend_env()
    native._ALLOW_CPU = native_cpu
    functional.clear_plans()
    tl.clear_caches()
    try:
        yield
    finally:
        native._ALLOW_CPU = False
        policy.interpreting, tk.kernels_are_interpreted, seeds.generator_for, seeds.capture_check_for = saved
        if env is None:
            os.environ.pop("ADDNORM_BACKEND", None)
        else:
            os.environ["ADDNORM_BACKEND"] = env
        policy.read_backend_env()
        functional.clear_plans()
        tl.clear_caches()


if __name__ == "__main__":  # a probe: one kernel compiled for sm_90 and launched through Triton's launcher
    os.environ.setdefault("TRITON_INTERPRET", "0")
    install()
    import torch
    from triton.runtime.jit import JITFunction  # noqa: F401

    from addnorm.ops.triton import launchers as L

    sp = L.fwd_spec(
        64, "layernorm", 1e-5, 1.0, 0.0, True, True, 0, True, torch.float32, torch.float32, "none"
    )
    x = torch.randn(8, 64)
    record(True)
    sp.launch(None, x, x.clone(), torch.ones(64), torch.zeros(64), None, None)
    sp.launch(None, x, x.clone(), torch.ones(64), torch.zeros(64), None, None)
    print(launches(), file=sys.stderr)
