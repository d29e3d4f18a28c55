"""benchmarks/step/hf_step.py runs end to end on a tiny Llama on the CPU, and its GPU table (tokens/s and
peak memory of plain, fused and Liger) reads the rows a GPU session produces; its rows step the variants
in alternation and leave transformers as they found it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

TINY = {
    "hidden": 16,
    "layers": 2,
    "heads": 2,
    "kv_heads": 1,
    "intermediate": 32,
    "vocab": 50,
    "batch": 1,
    "seq": 8,
}


@pytest.fixture
def bench(bench_module):
    return bench_module("benchmarks.step.hf_step")


def test_cpu_benchmark_runs_and_writes_its_table(bench, tmp_path):
    argv = [
        "--setup",
        json.dumps(TINY),
        "--reps",
        "2",
        "--warmup",
        "1",
        "--rounds",
        "2",
        "--out",
        str(tmp_path),
    ]
    payload = bench.main(argv)
    (row,) = payload["results"]
    assert set(row["tokens_per_s"]) == {"plain", "fused"} and len(row["round_ms"]["fused"]) == 2
    assert row["tokens_per_s"]["fused"] == pytest.approx(8 / (row["ms"]["fused"] / 1e3))
    assert row["fused_over_plain"] == pytest.approx(row["ms"]["plain"] / row["ms"]["fused"])
    assert json.loads((tmp_path / "hf_step_cpu.json").read_text())["setups"] == {"cpu": TINY}
    md = (tmp_path / "hf_step_cpu.md").read_text()
    assert "| eager |" in md and "fused/plain by CPU time" in md and "one torch thread" in md
    assert row["fused_over_plain_cpu_time"] == pytest.approx(row["cpu_ms"]["plain"] / row["cpu_ms"]["fused"])


def test_gpu_table_has_tokens_and_peak_memory_per_variant(bench):
    rows = [
        {
            "mode": mode,
            "params": 134_105_856,
            "tokens_per_s": {"plain": 100.0, "fused": 110.0, "liger": 102.0},
            "peak_gib": {"plain": 8.8, "fused": 8.0, "liger": 8.2},
        }
        for mode in ("eager", "compile")
    ]
    md = bench.report({"134m": bench.GPU}, rows, "NVIDIA H100", gpu=True, reps=20, warmup=5, rounds=1)
    assert "| eager | 100 | 110 | 102 | 1.100x | 1.020x | 8.80 | 8.00 | 8.20 |" in md
    assert "bf16 autocast, fused AdamW" in md and "134,105,856 parameters" in md


def test_gpu_table_has_a_row_per_setup_and_the_compile_paths(bench):
    """The 134M and the GPU-bound setups side by side, named in each row; compiled rows add the fused
    model through the registered kernels, judged like the composite; eager targets 1.10x at 134M and
    1.05x where the GPU bounds the step."""
    k = bench.KERNEL_PATH
    rows = [
        {"setup": "134m", "mode": "eager", "params": 1, "tokens_per_s": {"plain": 100.0, "fused": 112.0},
         "peak_gib": {"plain": 8.0, "fused": 7.9}},
        {"setup": "gpu-bound", "mode": "eager", "params": 2, "tokens_per_s": {"plain": 100.0, "fused": 104.0},
         "peak_gib": {"plain": 8.0, "fused": 7.9}},
        {"setup": "gpu-bound", "mode": "compile", "params": 2,
         "tokens_per_s": {"plain": 100.0, "fused": 101.0, k: 99.0},
         "peak_gib": {"plain": 8.0, "fused": 7.9, k: 7.9}},
    ]  # fmt: skip
    md = bench.report(bench.SETUPS, rows, "NVIDIA H200", gpu=True, reps=5, warmup=2, rounds=1)
    assert "| 134m eager | 100 | 112 | - | 1.120x | - |" in md
    assert "| gpu-bound compile | 100 | 101 | 99 | 1.010x | 0.990x |" in md
    assert "- `gpu-bound`: Llama, hidden 2048, 4 layers" in md
    assert "| 134m eager | fused / plain >= 1.1 | 1.120 | yes |" in md
    assert "| gpu-bound eager | fused / plain >= 1.05 | 1.040 | NO |" in md
    assert f"| gpu-bound compile | {k} / plain >= 1.0 | 0.990 | NO |" in md


def test_gpu_table_states_the_targets_and_a_missing_liger(bench):
    rows = [
        {
            "mode": "eager",
            "params": 1,
            "tokens_per_s": {"plain": 100.0, "fused": 104.0},
            "peak_gib": {"plain": 8.0, "fused": 8.1},
            "missing": {"liger": "not installed"},
        }
    ]
    md = bench.report({"134m": bench.GPU}, rows, "NVIDIA H100", gpu=True, reps=20, warmup=5, rounds=1)
    assert "- eager: liger: not installed" in md
    assert "| eager | fused / plain >= 1.1 | 1.040 | NO |" in md
    assert "| eager | peak memory plain / fused >= 1.0 | 0.988 | NO |" in md


def test_cpu_profile_finds_the_llama_residual_adds_and_norms(bench, tmp_path):
    """--profile on the CPU: the plain Llama's removable time holds its 2L residual adds, forward and
    backward, and its hand-written RMSNorms (found through their modules' scopes)."""
    argv = ["--setup", json.dumps(TINY), "--reps", "1", "--warmup", "1", "--rounds", "1", "--profile"]
    payload = bench.main([*argv, "--out", str(tmp_path)])
    (row,) = payload["results"]
    plain = row["profile"]["plain"]
    assert plain["units"]["add"] == 2 * 2 * TINY["layers"]
    assert plain["ms"]["norm"] > 0 and plain["units"]["norm"] >= 2 * TINY["layers"] + 1
    assert row["realised"]["removable_ms"] == pytest.approx(plain["removable_ms"])
    assert "## What fusion can remove" in (tmp_path / "hf_step_cpu.md").read_text()


def test_diagnostic_switches_are_on_during_the_step_only(bench):
    """Each of the GPU step's diagnostic switches is in force while the step's backward runs (seen from
    a gradient hook) and undone after the step; without one, nothing changes."""
    import gc

    import torch

    from addnorm.ops import launch_config as lc

    default = lc.BWD_VARIANT
    setup = bench.Setup(**TINY)
    model = bench.build("plain", setup, torch.device("cpu"))
    tokens = bench.tokens_for(setup, torch.device("cpu"))
    seen = []
    param = next(model.parameters())
    param.register_hook(
        lambda g: seen.append((torch._C._is_multithreading_enabled(), gc.isenabled(), lc.BWD_VARIANT))
    )
    expected = {
        None: (True, True, default),
        "backward on the calling thread": (False, True, default),
        "gc off in the step": (True, False, default),
        'backward "kernel_sums"': (True, True, "kernel_sums"),
    }
    assert set(expected) - {None} == set(bench.SWITCHES)
    for switch, state in expected.items():
        seen.clear()
        step = bench.make_step(model, tokens, gpu=False, compiled=False, switch=switch)
        assert step() > 0
        assert seen == [state]
        assert torch._C._is_multithreading_enabled() and gc.isenabled() and lc.BWD_VARIANT == default


def test_gpu_table_reports_each_diagnostic_against_the_step_without_it(bench):
    rows = [
        {
            "setup": "134m", "mode": "eager", "params": 1,
            "tokens_per_s": {"plain": 180.0, "fused": 130.0}, "peak_gib": {"plain": 8.0, "fused": 7.9},
            "diagnostics": {"backward on the calling thread": {"plain": 171.0, "fused": 195.0},
                            "gc off in the step": {"plain": 180.0, "fused": 130.0}},
        },
        {"setup": "gpu-bound", "mode": "eager", "params": 2, "tokens_per_s": {"plain": 10.0, "fused": 11.0},
         "peak_gib": {"plain": 8.0, "fused": 7.9}},
    ]  # fmt: skip
    md = bench.report(bench.SETUPS, rows, "NVIDIA H200", gpu=True, reps=5, warmup=2, rounds=1)
    assert "## Diagnostics: the same step with one switch on" in md
    assert "| 134m eager | backward on the calling thread | 171 | 195 | 1.140x | 0.950x | 1.500x |" in md
    assert "| 134m eager | gc off in the step | 180 | 130 | 0.722x | 1.000x | 1.000x |" in md
    assert "gpu-bound eager | backward" not in md


def test_hf_row_interleaves_every_variant_and_switch(bench, monkeypatch):
    """``run_row`` (the GPU rows' code, run on the CPU): every variant and diagnostic switch built side
    by side and stepped in alternation (every other round the first, then the rest reversed: none right
    after itself); the pairs' ratios have one ratio per timed round; the diagnostics come from the same
    rounds."""
    import torch

    calls = []
    make_step = bench.make_step

    def recording(model, tokens, **kw):
        step = make_step(model, tokens, **kw)
        name = kw.get("variant", "plain") + (f", {kw['switch']}" if kw.get("switch") else "")

        def timed():
            calls.append(name)
            return step()

        timed.optimizer = step.optimizer
        return timed

    monkeypatch.setattr(bench, "make_step", recording)
    setup = bench.Setup(**TINY)
    tokens = bench.tokens_for(setup, torch.device("cpu"))
    reps, warmup = 3, 1
    row = bench.run_row(
        "tiny", setup, "eager", ["plain", "fused"], tokens, reps=reps, warmup=warmup, diagnose=True
    )
    names = ["plain", "fused"] + [f"{v}, {s}" for s in bench.SWITCHES for v in ("plain", "fused")]
    expected = names * warmup
    for i in range(reps):
        expected += names if i % 2 == 0 else names[:1] + names[:0:-1]
    assert calls == expected
    assert set(row["ms"]) == {"plain", "fused"} and row["paired"]["fused/plain"]["n"] == reps
    # every timed step kept, in round order: the pairs' ratios recomputed from them
    assert set(row["steps_ms"]) == set(names) and all(len(v) == reps for v in row["steps_ms"].values())
    steps = row["steps_ms"]
    ratios = sorted(p / f for p, f in zip(steps["plain"], steps["fused"], strict=True))
    assert row["paired"]["fused/plain"]["median"] == pytest.approx(ratios[len(ratios) // 2], rel=1e-3)
    assert set(row["diagnostics"]) == set(bench.SWITCHES)
    assert "peak_gib" not in row  # CPU: no allocator counters
    md = bench.report({"tiny": setup}, [row], "a CPU", gpu=False, reps=reps, warmup=warmup, rounds=1)
    pair = row["paired"]["fused/plain"]
    assert f"{pair['median']:.3f}x [{pair['q1']:.3f}-{pair['q3']:.3f}]" in md


def test_hf_targets_read_the_paired_ratio(bench):
    """A row whose medians' tokens/s say 1.20x but whose paired rounds say 1.03x is judged 1.03x."""
    row = {
        "setup": "134m", "mode": "eager", "params": 1,
        "tokens_per_s": {"plain": 100.0, "fused": 120.0, "liger": 110.0},
        "paired": {"fused/plain": {"median": 1.03, "q1": 0.9, "q3": 1.2, "n": 8},
                   "liger/plain": {"median": 1.02, "q1": 0.9, "q3": 1.1, "n": 8},
                   "fused/liger": {"median": 0.99, "q1": 0.9, "q3": 1.1, "n": 8}},
        "peak_gib": {"plain": 8.0, "fused": 7.9, "liger": 8.0},
    }  # fmt: skip
    targets = {t["target"]: t for t in bench.check_targets([row], gpu=True)}
    assert targets["fused / plain >= 1.1"]["value"] == 1.03 and not targets["fused / plain >= 1.1"]["met"]
    assert targets["fused / Liger >= 1.0"]["value"] == 0.99
    md = bench.report({"134m": bench.GPU}, [row], "NVIDIA H200", gpu=True, reps=8, warmup=2, rounds=1)
    assert "| eager | fused / plain >= 1.1 | 1.030 | NO |" in md and "1.030x [0.900-1.200]" in md
    assert "timed step by step in alternation" in md


def test_liger_variant_leaves_transformers_llama_as_it_was(bench, monkeypatch):
    """Liger's patch replaces ``modeling_llama.LlamaRMSNorm`` in transformers itself; the benchmark puts
    it back, so that a "plain" model built after the "liger" one (the next row, the variants built side
    by side) keeps transformers' own RMSNorm. Liger is faked here (it needs a GPU): its patch as
    Liger-Kernel 0.8.5 makes it, the module's class replaced and the model's norms swapped."""
    import sys
    import types

    import torch
    from transformers.models.llama import modeling_llama

    own = modeling_llama.LlamaRMSNorm

    class FakeLigerRMSNorm(own):
        pass

    def apply_liger_kernel_to_llama(*, rms_norm, model, **_):
        assert rms_norm
        modeling_llama.LlamaRMSNorm = FakeLigerRMSNorm
        modeling_llama.added_by_the_patch = True
        for m in model.modules():
            if type(m) is own:
                m.__class__ = FakeLigerRMSNorm

    fake = types.ModuleType("liger_kernel.transformers")
    fake.apply_liger_kernel_to_llama = apply_liger_kernel_to_llama
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers", fake)
    setup = bench.Setup(**TINY)
    liger = bench.build("liger", setup, torch.device("cpu"))
    plain = bench.build("plain", setup, torch.device("cpu"))
    norms = lambda m: {type(x) for x in m.modules() if "RMSNorm" in type(x).__name__}  # noqa: E731
    assert norms(liger) == {FakeLigerRMSNorm} and norms(plain) == {own}
    assert modeling_llama.LlamaRMSNorm is own and not hasattr(modeling_llama, "added_by_the_patch")
