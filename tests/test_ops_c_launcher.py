"""The direct launch's call of a compiled kernel's C launcher (``direct_launch.CALL_C_LAUNCHER``): the
same arguments, in the same order, as Triton's ``CudaLauncher.__call__`` hands that C launcher, and
``CudaLauncher.__call__`` itself wherever the kernel needs scratch memory or GSan (or the switch is off)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("triton")

from addnorm.ops.triton import direct_launch as dl  # noqa: E402

CudaLauncher = pytest.importorskip("triton.backends.nvidia.driver").CudaLauncher


def _launcher(**fields):
    """A CudaLauncher without its compile-time __init__, its C launch a recorder."""
    calls = []
    run = CudaLauncher.__new__(CudaLauncher)
    run.__dict__.update(
        gsan_enabled=False, global_scratch_size=0, global_scratch_align=1, profile_scratch_size=0,
        profile_scratch_align=1, num_ctas=1, launch_cooperative_grid=False, launch_pdl=True,
        arg_annotations=("ann",), kernel_signature=b"sig", launch=lambda *a: calls.append(a),
    )  # fmt: skip
    run.__dict__.update(fields)
    return run, calls


def _compiled(run):
    return SimpleNamespace(run=run, function=77, packed_metadata=(4, 1, 0))


class _Kernel:
    pre_run_hooks = ()

    def __init__(self, ck):
        self.ck = ck

    def run(self, *args, grid, warmup, **options):
        return self.ck


def test_the_switch_reads_this_tritons_launcher():
    assert dl.CALL_C_LAUNCHER  # Triton 3.9's CudaLauncher.__call__ only allocates and passes on


def test_the_c_launch_gets_what_cudalauncher_call_passes(monkeypatch):
    run, calls = _launcher()
    ck = _compiled(run)
    args = (1, 2.5, None, 9)
    fake = SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 1234)
    monkeypatch.setattr(dl.driver, "_active", fake)  # the driver's active one, put back after
    run(3, 2, 1, 1234, ck.function, ck.packed_metadata, None, None, None, *args, "default")
    d = dl.DirectLaunch(("default",))
    d.launch(_Kernel(ck), "key", (3, 2), args, {})  # first: through run(), registered
    assert d.launchers[0, "key"] is not None
    d.launch(_Kernel(ck), "key", (3, 2), args, {})  # then the C launch itself
    assert len(calls) == 2 and calls[0] == calls[1]
    assert calls[1][:7] == (3, 2, 1, 1234, 77, False, True) and calls[1][-1] == (*args, "default")


@pytest.mark.parametrize(
    "fields", [{"global_scratch_size": 64}, {"profile_scratch_size": 8}, {"gsan_enabled": True}]
)
def test_a_kernel_with_scratch_or_gsan_keeps_cudalauncher_call(fields):
    run, _ = _launcher(**fields)
    assert dl.c_launcher(_compiled(run)) is None


def test_the_switch_off_keeps_cudalauncher_call(monkeypatch):
    run, _ = _launcher()
    assert dl.c_launcher(_compiled(run)) is not None
    monkeypatch.setattr(dl, "CALL_C_LAUNCHER", False)
    assert dl.c_launcher(_compiled(run)) is None
