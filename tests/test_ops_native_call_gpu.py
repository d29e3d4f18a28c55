"""The native call on a GPU (issue 52's device checks): y, s and every gradient against today's path
on 3 shapes x fp32/bf16 x Pre/Post-LN x dropout (``benchmarks.host.host_call.correctness``), each call
taking the C++ node. Skips without CUDA; the GPU suite runs the same grid in its ``native_call`` step
(with the per-call A/B), so its ``gpu_tests`` step leaves this file out."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_native_call_equals_todays_path():
    from addnorm.ops.native import build
    from benchmarks.host.host_call import CHECK_SHAPES, correctness

    if build.extension() is None:
        pytest.fail(f"the native extension did not build: {build.failure()}")
    rows = correctness("cuda")
    assert len(rows) == len(CHECK_SHAPES) * 8
    assert {r["node"] for r in rows} == {"CppFunction"}
    bad = [r for r in rows if r["max_abs_diff"] != 0.0]  # the same kernels, the same arguments
    assert not bad, bad
