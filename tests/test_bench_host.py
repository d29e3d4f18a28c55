"""The host-work benchmarks of issue 38 run end to end on the CPU: the trace reading
(``benchmarks/host/trace_analysis.py``) against a trace whose answers are known by construction, the step
trace (``benchmarks/host/step_trace.py``) and the host-work proxy (``benchmarks/host/step_host.py``) with
the op's CUDA path on a faked Triton driver
(``benchmarks/host/fake_launch.py``). The faked launches need Triton's real kernels, so those
run in a process of their own (the tests' process has the interpreter's)."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # benchmarks run end to end (callgrind, the profiler)

ROOT = Path(__file__).resolve().parents[1]
HAS_TRITON = __import__("importlib").util.find_spec("triton") is not None


def _x(name, ts, dur, cat, tid=1, pid=1):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat, "tid": tid, "pid": pid}


def test_trace_reading_finds_busy_time_gaps_launches_syncs_and_addnorm_time(bench_module):
    """A step of 1000 us: kernels at [100, 300) and [250, 400) (busy 300 us, merged), [800, 900); the
    host launches twice, synchronises once (at 500-790, inside the 400-800 gap, under an addnorm frame
    at 450-795 whose own time is 345 - 290 = 55 us); a kernel outside the step is not counted."""
    ta = bench_module("benchmarks.host.trace_analysis")
    events = [
        _x(ta.STEP_SCOPE, 0, 1000, "user_annotation"),
        _x("k1", 100, 200, "kernel", tid=7, pid=0),
        _x("k2", 250, 150, "kernel", tid=7, pid=0),
        _x("k3", 800, 100, "kernel", tid=7, pid=0),
        _x("k_outside", 1500, 50, "kernel", tid=7, pid=0),
        _x("cudaLaunchKernel", 50, 10, "cuda_runtime"),
        _x("cuLaunchKernelEx", 700, 10, "cuda_driver"),
        _x("addnorm/ops/functional.py(350): add_norm", 450, 345, "python_function"),
        _x("cudaStreamSynchronize", 500, 290, "cuda_runtime"),
        _x("torch/nn/modules/module.py(1): _call_impl", 0, 40, "python_function"),
        # the backward on its own thread: two nodes of one kind (one running a node of another kind
        # inside it, counted in it) and one of another
        _x(ta.NODE + "AddBackward0", 100, 30, "cpu_op", tid=2),
        _x(ta.NODE + "AddBackward0", 200, 50, "cpu_op", tid=2),
        _x(ta.NODE + "MulBackward0", 210, 10, "cpu_op", tid=2),
        _x(ta.NODE + "MulBackward0", 300, 20, "cpu_op", tid=2),
    ]
    (rec,) = ta.analyze({"traceEvents": events}, gaps=2)
    assert rec["nodes"] == {
        "AddBackward0": [2, pytest.approx(0.08)],
        "MulBackward0": [1, pytest.approx(0.02)],
    }
    assert rec["wall_ms"] == pytest.approx(1.0)
    assert rec["gpu_busy_ms"] == pytest.approx(0.4) and rec["gpu_busy_share"] == pytest.approx(0.4)
    (g1, g2) = rec["gaps"]
    assert (g1["ms"], g1["at_ms"]) == (pytest.approx(0.4), pytest.approx(0.4))  # 400-800
    assert g1["syncs"] == 1 and g1["launches"] == 1
    assert "add_norm > cudaStreamSynchronize" in g1["host"][0]
    assert g2["ms"] == pytest.approx(0.1)  # 0-100 or 900-1000: 100 us each
    assert rec["launches"] == 2 and rec["syncs"] == 1 and rec["sync_ms"] == pytest.approx(0.29)
    assert rec["sync_names"] == ["cudaStreamSynchronize"]
    assert rec["addnorm_ms"] == pytest.approx(0.055) and rec["python_ms"] == pytest.approx(0.095)
    kept = ta.trim({"traceEvents": events}, "run A")
    assert {e["pid"] for e in kept} == {"run A: 0", "run A: 1"}
    assert not any("module.py" in e["name"] for e in kept)  # torch's plumbing frames dropped


def test_trace_self_times_leave_record_function_scopes_out_of_the_nesting(bench_module):
    """A scope entered inside the builtin that opens it (as ``record_function`` does) and outlasting it is
    no child of that builtin: the builtin keeps its 6 us and the frame around both its 100 us less its
    two Python children (the builtin, the frame inside the scope), where the scope, counted as the
    builtin's child, made the builtin's own time negative."""
    ta = bench_module("benchmarks.host.trace_analysis")
    events = [
        _x("bench.py(1): step", 0, 100, "python_function"),
        _x("<built-in method _record_function_enter_new>", 10, 6, "python_function"),
        _x("variant: fused", 13, 80, "user_annotation"),
        _x("addnorm/ops/functional.py(350): add_norm", 20, 30, "python_function"),
    ]
    own = ta._self_times(events)
    assert own == {
        0: pytest.approx(100 - 6 - 30),
        1: pytest.approx(6),
        2: pytest.approx(80),
        3: pytest.approx(30),
    }


def _run(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.skipif(not HAS_TRITON, reason="the faked launches need triton")
def test_step_trace_runs_on_the_cpu_and_writes_its_table_and_trace(tmp_path):
    """Plain and fused HF Llama and LM steps (both LMs) traced on the CPU (the fused ones on the op's CUDA
    path, launches faked): a row per run and variant, addnorm's own Python found in the fused runs' stacks
    (far more than in the plain ones), and one trace file holding every run side by side."""
    out = _run("benchmarks.host.step_trace", "--cpu", "--runs", "hf", "lm", "lm-llama", "--steps", "1",
               "--warmup", "1", "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads((tmp_path / "step_trace_cpu.json").read_text())["rows"]
    assert [(r["run"], r["variant"]) for r in rows] == [
        ("hf", "plain"),
        ("hf", "fused"),
        ("lm", "fused=False"),
        ("lm", "fused"),
        ("lm-llama", "fused=False"),
        ("lm-llama", "fused"),
    ]
    by = {(r["run"], r["variant"]): r for r in rows}
    # the plain step's addnorm frames are the benchmark's fusion switch only
    assert by["hf", "fused"]["addnorm_ms"] > 10 * by["hf", "plain"]["addnorm_ms"]
    assert all(r["wall_ms"] > 0 and r["gpu_busy_ms"] is None for r in rows)
    # the backward by node kind (2 layers, 4 adds): the fused LM's Python node, a call per add, where
    # the unfused one runs LayerNorm's C++ node (5 norms; fused, the first input norm's only)
    fused, unfused = by["lm", "fused"]["nodes"], by["lm", "fused=False"]["nodes"]
    assert fused["TritonAddNormBackward"][0] == 2 * 2 and "TritonAddNormBackward" not in unfused
    assert (fused["NativeLayerNormBackward0"][0], unfused["NativeLayerNormBackward0"][0]) == (1, 5)
    trace = json.loads(gzip.decompress((tmp_path / "step_trace_cpu.json.gz").read_bytes()))
    labels = {str(e.get("pid")).split(":")[0] for e in trace["traceEvents"]}
    assert {"hf", "lm", "lm-llama"} <= labels
    # each run's variants in one session, in alternation: every step scope holds its variant's name
    scopes = sorted(
        (e["ts"], e["name"]) for e in trace["traceEvents"] if str(e.get("name", "")).startswith("variant: ")
    )
    assert len(scopes) == 6 * 1  # 3 runs x 2 variants x 1 step
    text = (tmp_path / "step_trace_cpu.md").read_text()
    assert "| hf | fused |" in text and "## The backward's host time by autograd node" in text
    assert "| TritonAddNormBackward |" in text


@pytest.mark.skipif(not HAS_TRITON, reason="the faked launches need triton")
def test_host_work_proxy_runs_the_gpu_path_with_its_launches_counted(tmp_path):
    """The proxy's fused steps launch the op's two kernels (forward, backward) per residual add: 4
    layers, 8 adds, each fused with the norm that next reads the stream (the last with the final
    norm; the HF model's first input norm runs unfused)."""
    out = _run("benchmarks.host.step_host", "--models", "hf", "lm-llama", "lm-gelu", "--layers", "4",
               "--reps", "2", "--warmup", "1", "--rounds", "2", "--out", str(tmp_path))  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads((tmp_path / "step_host_cpu.json").read_text())
    rows = {r["model"]: r for r in payload["results"]}
    assert rows["hf"]["triton_launches"] == rows["lm-llama"]["triton_launches"] == 2 * (2 * 4)
    for r in rows.values():
        assert r["python_calls"]["fused"] > 0 and r["cpu_ms"]["plain"] > 0
        # the floor: the fused model's calls with a do-nothing Python op in the op's place, which
        # launches nothing itself (the fused step's launches counted for it) and calls less Python
        assert r["launches"]["floor"] == r["launches"]["fused"]
        assert r["python_calls"]["floor"] < r["python_calls"]["fused"]
    # the op's backward on several programs, as at the GPU's sizes: its partial parameter gradients
    # summed after it, one aten sum per affine parameter (RMSNorm: weight; LayerNorm: weight, bias) and
    # fused add, which the floor does not launch
    for model, params in (("hf", 1), ("lm-llama", 1), ("lm-gelu", 2)):
        aten = rows[model]["aten_launches"]
        assert aten["fused"] - aten["floor"] == params * 2 * 4, (model, aten)
        # the candidate backward "kernel_sums", timed beside: the kernel adds them up, no sum launched
        assert aten["fused (kernel_sums)"] == aten["floor"], (model, aten)
    # with dropout, the seeds drawn on the host launch nothing; the previous source, timed beside, one
    # randint per fused add
    gelu = rows["lm-gelu"]["launches"]
    assert gelu["fused (randint seeds)"] - gelu["fused"] == 2 * 4
    # under autocast the candidate sublayer input (h in bfloat16) drops the linear layers' casts of the
    # 7 normed inputs the op writes (every connection's but the first; the final norm's h stays fp32),
    # forward and backward; the unfused model casts the same inputs
    for model in ("lm-gelu", "lm-llama"):
        la = rows[model]["launches"]
        assert la["fused (autocast)"] - la["fused (autocast h)"] == 2 * (2 * 4 - 1), (model, la)
        assert la["plain (autocast)"] > la["plain"] and "plain (autocast)" not in rows["hf"]["launches"]
    text = (tmp_path / "step_host_cpu.md").read_text()
    assert "| Hugging Face Llama" in text and "| randint (previous) |" in text
    assert "## The floor: a do-nothing Python op in the op's place" in text
    assert '| "kernel_sums" |' in text
    assert "## Under autocast to bfloat16" in text and "| fused (autocast h) |" in text
    # round by round: each round's paired ratio recomputed from the recorded medians and launches
    L = payload["launch_us"]
    gelu_row = rows["lm-gelu"]
    cpu, la = gelu_row["cpu_rounds_ms"], gelu_row["launches"]
    pairs = zip(cpu["plain"], cpu["fused"], strict=True)
    per = sorted((f + la["fused"] * L / 1e3) / (p + la["plain"] * L / 1e3) for p, f in pairs)
    assert len(per) == 2
    met = sum(x <= 1.0 for x in per)
    lm_lines = [li for li in text.splitlines() if li.startswith("| addnorm LM, LayerNorm")]
    work = {k: min(cpu[k]) + la[k] * L / 1e3 for k in ("plain", "fused")}  # best of rounds
    rounds_table = text.split("## Round by round")[1].split("##")[0]
    (line,) = [li for li in rounds_table.splitlines() if li.startswith("| addnorm LM, LayerNorm")]
    median = (per[0] + per[1]) / 2
    assert line == (
        f"| addnorm LM, LayerNorm + GELU, dropout 0.1 | {per[0]:.3f}x | {median:.3f}x | "
        f"{per[1]:.3f}x | {work['fused'] / work['plain']:.3f}x | {met} of 2 |"
    )
    # the main table's ratio: the median of the rounds' paired ratios, its quartiles beside it
    (main,) = [li for li in text.split("## Round by round")[0].splitlines() if li in lm_lines]
    assert f"| {median:.3f}x [" in main and f"| {'yes' if median <= 1.0 else 'NO'} |" in main
