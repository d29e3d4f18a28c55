"""Every Triton kernel variant the dispatcher launches compiles for sm_80 and sm_90 without spilling
registers, proven without a GPU: triton.compile for a GPUTarget builds the real cubin with the ptxas in
triton's wheel, and cuobjdump (or ptxas -v) reads its resource usage."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

# slow: compilers (Triton's real compiler, ptxas)
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed"),
]


def test_launch_configurations_cover_the_hidden_sizes_with_few_variants(bench_module):
    from addnorm.ops.launch_config import bwd_config, fwd_config

    tv = bench_module("benchmarks.kernels.triton_variants")  # a build-time tool, not the runtime package
    HIDDEN_SIZES, variants = tv.HIDDEN_SIZES, tv.variants

    for h in HIDDEN_SIZES:
        for cfg in (fwd_config(h), bwd_config(h), bwd_config(h, heavy=True)):
            assert cfg.block_n >= min(h, cfg.block_n) and (cfg.chunked or cfg.block_n >= h)
            assert cfg.block_m * cfg.block_n <= 8192 and 1 <= cfg.num_warps <= 16
    # the wide rows that spilled before (16,384 and 65,536) go in column chunks
    assert fwd_config(16384).chunked and fwd_config(65536).chunked and bwd_config(16384).chunked
    # one pass at 4096 spilled in the register-heavy backward variants (dropout or a gate): chunks
    assert bwd_config(4096, heavy=True).chunked and not bwd_config(4096).chunked and bwd_config(8192).chunked
    assert not fwd_config(8192).chunked and fwd_config(64).block_m > 1  # several rows per program
    assert all(bwd_config(h).block_m == 1 for h in HIDDEN_SIZES)  # the backward: one row per step
    vs = variants()
    launched = {(v.kernel, v.block_m, v.block_n, v.chunked, v.num_warps) for v in vs}
    for h in HIDDEN_SIZES:
        assert ("fwd", *fwd_config(h)) in launched and ("bwd", *bwd_config(h)) in launched
        assert ("bwd", *bwd_config(h, heavy=True)) in launched
    # the backward's variant "row_sums" (launch_config.BWD_VARIANTS): its slices given the pre-pass's
    # sums and its pre-pass, at every configuration they launch with, on every path
    from addnorm.ops.launch_config import bwd_sums_config

    sliced = {(v.kernel, v.block_m, v.block_n, v.chunked, v.num_warps, v.path) for v in vs if v.row_sums}
    for h in HIDDEN_SIZES:
        for heavy in (False, True):
            cfg = bwd_config(h, heavy, "row_sums")
            assert cfg.chunked == (h >= (2048 if heavy else 4096))
            for path in ("from_s", "from_y", "from_xr") if cfg.chunked else ():
                assert ("bwd", *cfg, path) in sliced and ("bwd_sums", *bwd_sums_config(h), path) in sliced
    # the candidate "kernel_sums" (its partial sums added up in the kernel) one pass and in slices
    summed = {(v.block_n, v.num_warps, v.chunked) for v in vs if v.kernel_sums}
    widest = bwd_config(1536, True, "kernel_sums")  # the widest heavy one pass: 2048 columns, 8 warps
    assert (widest.block_n, widest.num_warps, False) in summed and any(c for *_, c in summed)
    # every forward and backward path at every configuration
    assert {v.path for v in vs} == {"store_s", "no_s", "from_s", "from_y", "from_xr"}
    assert len(vs) == len(set(vs)) <= 110
    # the seed as a value (a host seed, ops/seeds.py) on every forward and backward path
    assert {v.path for v in vs if v.seed_value} == {"store_s", "no_s", "from_s", "from_y", "from_xr"}


@pytest.mark.triton
def test_every_kernel_variant_compiles_for_sm80_and_sm90_without_spills(tmp_path, bench_module):
    """Every variant's cubin for sm_80 and sm_90: no spills, at most 255 registers. A variant whose
    kernel source (with every function it calls), specialisation, target and Triton are those of a
    compile recorded in ``benchmarks/kernels/kernel_usage.json`` takes that compile's ptxas usage;
    every other one compiles here (and is recorded). One recorded variant per arch compiles again
    here and must report exactly what the record says, so a record cannot drift from ptxas."""
    tv = bench_module("benchmarks.kernels.triton_variants")
    ARCHS, compile_all, variants = tv.ARCHS, tv.compile_all, tv.variants
    record = Path(tv.__file__).with_name("kernel_usage.json")

    # under `make test`'s two xdist workers one compile process (workers x threads <= cores)
    workers = 1 if os.environ.get("PYTEST_XDIST_WORKER") else None
    vs = variants()
    results = compile_all(vs, ARCHS, workers=workers, cache_dir=str(tmp_path), usage_cache=record)
    assert {r["arch"] for r in results} == {80, 90} and len(results) == len(vs) * len(ARCHS)
    spilled = [
        (r["variant"].kernel, r["variant"].launch, r["variant"].options, r["arch"], r["spill_bytes"])
        for r in results
        if r["spill_bytes"]
    ]
    assert not spilled, spilled
    assert all(0 < r["regs"] <= 255 for r in results)
    # the record against ptxas itself: the heaviest recorded variant per arch, compiled cold
    cached = [r for r in results if r.get("cached")]
    for arch in ARCHS if cached else ():
        (again,) = compile_all(
            [max((r for r in cached if r["arch"] == arch), key=lambda r: r["regs"])["variant"]],
            [arch],
            workers=1,
            cache_dir=str(tmp_path / "again"),
        )
        was = next(r for r in cached if r["variant"] == again["variant"] and r["arch"] == arch)
        assert {k: again[k] for k in ("regs", "spill_bytes", "stack_bytes", "static_shared")} == {
            k: was[k] for k in ("regs", "spill_bytes", "stack_bytes", "static_shared")
        }, (again, was)
