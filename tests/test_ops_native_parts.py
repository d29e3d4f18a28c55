"""The native call's parts that need no C++ build (fast tier): the arguments it lays out for each
kernel, parameter by parameter against the kernels' own signatures, and the fake driver the slow tier's
byte-for-byte checks launch onto (``test_ops_native_build.py``), against the values given to it."""

from __future__ import annotations

import ctypes
import importlib.util
import os

import pytest
import torch

from addnorm.ops.native import fake_driver, launch
from addnorm.ops.native.layout import PER_PROGRAM, ROWS, SEED, TENSOR, Var

HAS_TRITON = importlib.util.find_spec("triton") is not None
FWD_TENSORS = ["X", "R", "W", "B", "G", "SEED", "Y", "S", "MEAN", "RSTD"]
BWD_TENSORS = ["DY", "DS", "SAVED", "X", "R", "W", "B", "G", "SEED", "MEAN", "RSTD", "SUMS"]
BWD_TENSORS += ["DX", "DRES", "DW_PART", "DB_PART", "DG_PART"]


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("seed_int", [False, True])
@pytest.mark.parametrize("n", [64, 40])
def test_the_launch_arguments_follow_each_kernels_parameters(seed_int, n):
    """``fwd_args`` / ``bwd_args``: one argument per kernel parameter, the native call's tensor slots
    at the kernel's pointers in the call's order (the seed a value where it is one), the rows and the
    programs' tiles per call, and the spec's sizes and constexprs where the kernel reads them."""
    from addnorm.ops.triton import kernels as k
    from addnorm.ops.triton import launchers as L
    from addnorm.ops.triton.direct_launch import defaults_of

    f32 = torch.float32
    fwd = L.fwd_spec(n, "layernorm", 1e-5, 1.0, 0.1, True, True, 0, True, f32, f32)
    args = dict(
        zip(
            k.fwd_kernel.arg_names,
            launch.fwd_args(fwd, seed_int, tuple(defaults_of(k.fwd_kernel).values())),
            strict=True,
        )
    )
    slots = [name for name, a in args.items() if isinstance(a, Var) and a.kind == TENSOR]
    assert slots == [t for t in FWD_TENSORS if not (seed_int and t == "SEED")]
    assert [args[t].slot for t in slots] == [FWD_TENSORS.index(t) for t in slots]
    assert args["SEED"] == (Var(SEED) if seed_int else Var(TENSOR, 5)) and args["n_rows"] == Var(ROWS)
    assert args["N"] == args["stride_x"] == args["stride_r"] == n and args["n_chunks"] == fwd.n_chunks

    bwd = L.bwd_spec(n, "rmsnorm", 1.0, 0.1, True, False, 0, True, 0, f32, f32, f32, True)
    got = launch.bwd_args(bwd, True, seed_int, tuple(defaults_of(k.bwd_kernel).values()))
    args = dict(zip(k.bwd_kernel.arg_names, got, strict=True))
    slots = [name for name, a in args.items() if isinstance(a, Var) and a.kind == TENSOR]
    assert slots == [t for t in BWD_TENSORS if not (seed_int and t == "SEED")]
    assert [args[t].slot for t in slots] == [BWD_TENSORS.index(t) for t in slots]
    assert args["tiles_per_program"] == Var(PER_PROGRAM) and args["n_rows"] == Var(ROWS)
    assert args["N"] == args["stride_dy"] == args["stride_ds"] == n and args["n_slices"] == bwd.n_slices


def test_the_fake_driver_records_each_launch_as_it_was_given(monkeypatch, tmp_path):
    """The fake ``libcuda`` (built here from its C source) records a ``cuLaunchKernel``'s function (and
    the kernel name it was looked up by), grid, block, shared memory, stream and each parameter's
    bytes, as the caller passed them."""
    monkeypatch.setattr(fake_driver, "_lib", None)
    monkeypatch.setenv("TRITON_LIBCUDA_PATH", os.environ.get("TRITON_LIBCUDA_PATH", ""))
    lib = fake_driver.load(str(tmp_path))
    handle = ctypes.c_uint64()
    assert lib.cuModuleGetFunction(ctypes.byref(handle), ctypes.c_void_p(1), b"add_norm_fwd") == 0
    function = handle.value
    a, b = ctypes.c_uint64(0x1234_5678_9ABC), ctypes.c_float(1e-5)
    fake_driver.set_param_sizes(function, [8, 4])
    params = (ctypes.c_void_p * 2)(ctypes.addressof(a), ctypes.addressof(b))
    fake_driver.record(True)
    before = fake_driver.launch_count()
    lib.cuLaunchKernel.argtypes = [ctypes.c_uint64] + [ctypes.c_uint] * 7 + [ctypes.c_void_p] * 3
    assert lib.cuLaunchKernel(function, 3, 2, 1, 128, 1, 1, 1024, 0x5EED, params, None) == 0
    fake_driver.record(False)
    (rec,) = fake_driver.launches()
    assert fake_driver.launch_count() == before + 1
    assert (rec.function, rec.grid, rec.block, rec.smem, rec.stream) == (
        function,
        (3, 2, 1),
        (128, 1, 1),
        1024,
        0x5EED,
    )
    assert rec.name == "add_norm_fwd" and rec.params == (bytes(a), bytes(b))
