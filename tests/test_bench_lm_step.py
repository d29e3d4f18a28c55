"""The LM step benchmark (``benchmarks/step/lm_step.py``) runs on tiny shapes, warms each compiled cell in a
process of its own and builds the models it says it does; its profile classification
(``benchmarks/step/removable_time.py``) counts, per step, exactly the work that fusing the connections
removes."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow  # compilers (compiled LM steps)


def test_lm_step_benchmark_runs_on_tiny_shapes(bench_module, tmp_path):
    lm = bench_module("benchmarks.step.lm_step")
    argv = ["--tiny", "--placements", "pre", "post", "--modes", "eager", "--steps", "1", "--warmup", "0"]
    lm.main([*argv, "--models", "gelu", "llama", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "lm_step_cpu.json").read_text())
    assert [(r["model"], r["placement"], r["mode"]) for r in report["rows"]] == [
        (m, p, "eager") for m in ("gelu", "llama") for p in ("pre", "post")
    ]
    for r in report["rows"]:
        # nn.TransformerEncoderLayer has no RMSNorm / SwiGLU: no such column for the Llama-style LM
        expected = {"fused=False", "default", "fused", "fused (kernel_sums)", "fused (autocast h)"}
        expected |= {"nn.TransformerEncoder"} if r["model"] == "gelu" else set()
        assert set(r["cells"]) == expected
        assert all(c["tokens_per_s"] > 0 for c in r["cells"].values())
        assert all(len(c["steps_ms"]) == 1 for c in r["cells"].values())  # every timed step kept
    md = (tmp_path / "lm_step_cpu.md").read_text()
    assert "## Targets" in md and "default / fused=False" in md and "RMSNorm + SwiGLU, d_ff 96" in md
    assert "fused / fused=False" in md and "fused (kernel_sums) / fused" in md
    assert "fused (autocast h) / fused" in md


def _backward_variant():
    from addnorm.ops import launch_config as lc

    return lc.BWD_VARIANT


def _sublayer_cast():
    from addnorm.model import stream

    return stream.AUTOCAST_SUBLAYER_INPUT


@pytest.mark.parametrize(
    "column, model, switch, candidate",
    [
        ("fused (kernel_sums)", "gelu", _backward_variant, "kernel_sums"),
        ("fused (autocast h)", "llama", _sublayer_cast, True),
    ],
)
def test_lm_step_candidate_columns_step_with_their_candidate_in_force(
    bench_module, column, model, switch, candidate
):
    """A candidate's column steps the fused model with the candidate in force (and only while it steps):
    "fused (kernel_sums)" the backward variant, "fused (autocast h)" a sublayer's input in autocast's
    dtype (``stream.AUTOCAST_SUBLAYER_INPUT``); each in eager rows only (a traced backward sums with
    torch; the other is timed eagerly only)."""
    import types

    lm = bench_module("benchmarks.step.lm_step")
    default = switch()
    cfg = lm.model_config(lm.TINY, model)
    args = types.SimpleNamespace(fp32=False)
    seen = []
    for col in ("fused", column):
        step, built = lm.prepare(cfg, "pre", "eager", col, "cpu", args)
        built.register_forward_pre_hook(lambda m, a: seen.append(switch()))
        step()
        assert switch() == default
    assert seen == [default, candidate]
    args = types.SimpleNamespace(models=[model], placements=["pre"], modes=["eager", "compile"],
                                 columns=list(lm.COLUMNS), compile_paths="default")  # fmt: skip
    rows = {mode: cols for _, _, mode, cols in lm.cells_of(args, "cpu")}
    assert column in rows["eager"] and column not in rows["compile"]


def test_lm_step_compiled_rows_take_only_the_compiled_columns_asked_for(bench_module, tmp_path):
    """--compiled-columns: the compiled rows time only those columns (each a whole-model compile; the
    fused model's other compile path with "fused"), eager rows every column; every eager row comes
    first; a compiled row without "default" is judged on what it has (fused / fused=False), not
    dropped from the targets. Compiled with aot_eager (the columns are what is checked, not Inductor's
    code: test_ops_compiled.py compiles the model with Inductor)."""
    import types

    lm = bench_module("benchmarks.step.lm_step")
    args = types.SimpleNamespace(models=["gelu", "llama"], placements=["pre"], modes=["eager", "compile"],
                                 columns=["default", "fused=False", "fused"], compile_paths="both",
                                 compiled_columns=["fused=False", "fused"])  # fmt: skip
    rows = lm.cells_of(args, "cpu")
    assert [(m, mode) for m, _, mode, _ in rows] == [
        ("gelu", "eager"), ("llama", "eager"), ("gelu", "compile"), ("llama", "compile")
    ]  # fmt: skip
    other = next(c for c in rows[2][3] if "compile path" in c)
    assert rows[0][3] == ["fused=False", "default", "fused"]
    assert rows[2][3] == ["fused=False", "fused", other]
    argv = ["--tiny", "--models", "gelu", "--placements", "pre", "--modes", "eager", "compile", "--steps",
            "1", "--warmup", "0", "--columns", "default", "fused=False", "fused", "--compiled-columns",
            "fused=False", "fused", "--compile-paths", "default", "--compile-backend", "aot_eager",
            "--out", str(tmp_path)]  # fmt: skip
    lm.main(argv)
    report = json.loads((tmp_path / "lm_step_cpu.json").read_text())
    assert report["compile_backend"] == "aot_eager"
    assert "backend aot_eager, not Inductor's times" in (tmp_path / "lm_step_cpu.md").read_text()
    assert [set(r["cells"]) for r in report["rows"]] == [
        {"default", "fused=False", "fused"},
        {"fused=False", "fused"},
    ]
    tables = bench_module("benchmarks.step.lm_step_tables")
    targets = {(t["mode"], t["target"]) for t in tables.check_targets(report)}
    assert ("compile", "fused / fused=False >= 1.0") in targets
    assert ("eager", "default / fused=False >= 0.98") in targets
    assert ("compile", "default / fused=False >= 0.98") not in targets


def test_lm_step_warm_compiles_each_compiled_cell_in_its_own_process(bench_module, monkeypatch, tmp_path):
    """--warm: one process per compiled (model, placement, mode, column) cell, at most N at a time, each
    told its cell; a worker's command line runs that cell's step (here in eager mode, so that nothing
    compiles on the CPU)."""
    import subprocess

    lm = bench_module("benchmarks.step.lm_step")
    started = []

    class Done:
        returncode = 0

        def __init__(self, argv, **kwargs):
            started.append(argv)

        def poll(self):
            return 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", Done)
    import argparse

    args = argparse.Namespace(
        tiny=True, small=False, cpu=True, fp32=False, models=["gelu", "llama"], placements=["pre"],
        modes=["eager", "compile"], columns=["default", "fused=False"], compile_paths="default", warm=3,
        warm_timeout=60.0, compile_backend="inductor",
    )  # fmt: skip
    status = lm.warm_compiles(args, "cpu")
    assert len(started) == 4 and set(status["cells"].values()) == {"ok"}
    cells = {(a[a.index("--models") + 1], a[a.index("--warm-column") + 1]) for a in started}
    assert cells == {(m, c) for m in ("gelu", "llama") for c in ("default", "fused=False")}
    assert all(a[a.index("--modes") + 1] == "compile" for a in started)
    assert all(a[a.index("--compile-backend") + 1] == "inductor" for a in started)  # the timed rows' own
    monkeypatch.undo()
    worker = [a if a != "compile" else "eager" for a in started[0][3:]]  # [python, -m, module, ...]
    lm.main([*worker, "--out", str(tmp_path)])  # runs the one cell's step, writes nothing
    assert not list(tmp_path.iterdir())


def test_lm_step_llama_model_is_rmsnorm_swiglu_without_dropout(bench_module):
    """The second model of issue 30: RMSNorm + SwiGLU, no biases, no dropout anywhere, Llama's FFN
    width (8/3 d rounded up to 256: 2816 at d_model 1024)."""
    import torch

    from addnorm.model.feedforward import FeedForward
    from addnorm.norms import RMSNorm

    lm = bench_module("benchmarks.step.lm_step")
    cfg = lm.model_config(lm.GPU, "llama")
    assert (cfg["d_ff"], cfg["dropout"], cfg["norm"], cfg["activation"]) == (2816, 0.0, "rmsnorm", "swiglu")
    model = lm.build_lm(lm.model_config(lm.TINY, "llama"), "pre", fused=False, device="cpu")
    norms = [m for m in model.modules() if isinstance(m, RMSNorm)]
    assert len(norms) == 2 * lm.TINY["n_layers"] + 1
    assert all(m.gated and m.w1.bias is None for m in model.modules() if isinstance(m, FeedForward))
    assert all(m.p == 0.0 for m in model.modules() if isinstance(m, torch.nn.Dropout))
    with pytest.raises(ValueError, match="model: expected one of gelu, llama"):
        lm.model_config(lm.TINY, "gpt")


def test_lm_step_models_are_the_same_function(bench_module):
    """The three columns train the same architecture: fused=False and the default give the same
    outputs in eval (no dropout), and the nn.TransformerEncoder LM has as many parameters."""
    import torch

    lm = bench_module("benchmarks.step.lm_step")
    outs = []
    for fused in (None, False):
        torch.manual_seed(0)
        model = lm.build_lm(lm.TINY, "pre", fused=fused, device="cpu").eval()
        outs.append(model(torch.arange(8).reshape(1, 8) % lm.TINY["vocab"]))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    theirs = lm.TorchEncoderLM(lm.TINY, "pre", "cpu")
    ours = lm.build_lm(lm.TINY, "pre", fused=None, device="cpu")
    assert sum(p.numel() for p in theirs.parameters()) == sum(p.numel() for p in ours.parameters())


def _tiny_profile(bench_module, fused, layers=2, dropout=0.1):
    import torch
    from torch.profiler import ProfilerActivity, profile

    lm, sp = bench_module("benchmarks.step.lm_step"), bench_module("benchmarks.step.removable_time")
    torch.manual_seed(0)
    cfg = {**lm.TINY, "n_layers": layers, "dropout": dropout, "seq": 16, "batch": 3}
    model = lm.build_lm(cfg, "pre", fused=fused, device="cpu")
    tokens = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"] + 1))
    step = lm.make_step(model, tokens, cfg["vocab"], fused_adamw=False)
    step()
    with (
        sp.removable_scopes(model, cfg["d_model"]),
        profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof,
    ):
        step()
    return sp, prof.events(), (cfg["batch"], cfg["seq"], cfg["d_model"])


def test_removable_time_counts_the_connections_and_nothing_else(bench_module):
    """The profiler classification on a CPU profile of an unfused Pre-LN LM with L layers finds, per
    step, exactly what the model's structure says fusion replaces: 2L + 1 norms (each connection's input
    norm and the final norm), 2L branch dropouts and 2L residual adds, each forward and backward; not
    the embedding's or the FFN's dropout, the embedding's positional add or the attention's ops; no op
    under a matmul; and at least all the time of the norm ops themselves."""
    layers = 2
    sp, events, shape = _tiny_profile(bench_module, fused=False, layers=layers)
    result = sp.classify(events, device="cpu", stream_shape=shape)
    assert result["units"] == {"norm": 2 * (2 * layers + 1), "dropout": 2 * 2 * layers, "add": 2 * 2 * layers}
    assert result["removable_ms"] > 0 and result["ms"]["other"] > 0
    classes = sp.event_classes(events, shape)
    matmul = {"aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear", "aten::baddbmm"}

    def under_matmul(e):
        while e is not None:
            if e.name in matmul:
                return True
            e = e.cpu_parent
        return False

    matmul_events = [e for e in events if under_matmul(e)]
    assert matmul_events and all(classes[id(e)] is None for e in matmul_events)
    norm_ops = {"aten::native_layer_norm", "aten::native_layer_norm_backward"}
    norm_own = sum(e.self_cpu_time_total for e in events if e.name in norm_ops) / 1e3
    assert norm_own > 0 and result["ms"]["norm"] >= norm_own


def test_removable_time_without_dropout_has_no_dropout_work(bench_module):
    """dropout 0: the branch dropout modules still run (identity), but no dropout op draws a mask."""
    sp, events, shape = _tiny_profile(bench_module, fused=False, dropout=0.0)
    classes = sp.event_classes(events, shape)  # once: it classifies the whole profile
    names = {e.name for e in events if classes[id(e)] == "dropout"}
    assert not names & {"aten::bernoulli_", "aten::native_dropout"}


def test_removable_time_on_cuda_counts_kernels_once_by_name_or_launching_op(bench_module):
    """The CUDA side on a synthetic profile: a kernel launched by a norm op or a residual add counts
    for its op, a matmul's kernel never, Inductor's and addnorm's kernels by their names whether or not
    an op launched them (each once), and the total is every kernel's time."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler_util import FunctionEvent

    sp = bench_module("benchmarks.step.removable_time")
    shape = [2, 3, 4]

    def cpu(i, name, kernels, shapes=None, start=0):
        e = FunctionEvent(i, name, thread=1, start_us=start, end_us=start + 1, input_shapes=shapes or [])
        for k, us in kernels:
            e.append_kernel(k, 0, us)
        return e

    def kernel(i, name, us):
        return FunctionEvent(i, name, thread=7, start_us=0, end_us=us, device_type=DeviceType.CUDA)

    ln = cpu(1, "aten::native_layer_norm", [("vectorized_layer_norm_kernel", 10)])
    mm = cpu(2, "aten::mm", [("sm90_xmma_gemm", 100)], start=2)
    add = cpu(3, "aten::add", [("elementwise_add", 5)], [shape, shape], start=4)
    other_add = cpu(4, "aten::add", [("elementwise_add", 6)], [shape, [4]], start=6)  # a bias, not the stream
    inductor = cpu(
        5, "triton_per_fused_add_native_layer_norm_0", [("triton_per_fused_add_native_layer_norm_0", 7)]
    )
    events = [ln, mm, add, other_add, inductor]
    events += [kernel(10, "vectorized_layer_norm_kernel", 10), kernel(11, "sm90_xmma_gemm", 100)]
    events += [kernel(12, "elementwise_add", 5), kernel(13, "elementwise_add", 6)]
    events += [
        kernel(14, "triton_per_fused_add_native_layer_norm_0", 7),
        kernel(15, "_add_norm_fwd_kernel", 3),
    ]
    result = sp.classify(events, device="cuda", stream_shape=shape)
    ms = {k: round(v * 1e3, 6) for k, v in result["ms"].items()}
    assert ms == {"norm": 17.0, "add": 5.0, "dropout": 0.0, "fused": 3.0, "other": 106.0}
    assert result["total_ms"] * 1e3 == pytest.approx(131.0) and result["removable_ms"] * 1e3 == pytest.approx(
        22.0
    )


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("triton_per_fused_add_native_dropout_native_layer_norm_0", "norm"),
        ("triton_red_fused__to_copy_add_native_layer_norm_native_layer_norm_backward_5", "norm"),
        ("triton_per_fused__to_copy_add_mean_mul_pow_rsqrt_3", "norm"),
        ("triton_poi_fused_native_dropout_2", "dropout"),
        ("triton_poi_fused_add_1", "add"),
        ("triton_poi_fused__to_copy_add_clone_4", "add"),
        ("triton_poi_fused_addmm_gelu_3", None),
        ("triton_poi_fused_gelu_native_dropout_7", None),  # the FFN's activation dropout
        ("triton_poi_fused_add_embedding_mul_native_dropout_0", None),  # the embedding's
        ("triton_tem_fused_mm_0", None),
        ("triton_poi_fused_mul_silu_8", None),
        ("sm90_xmma_gemm_bf16bf16_bf16f32", None),
        ("vectorized_layer_norm_kernel", None),  # not Inductor's: classified by its aten op instead
    ],
)
def test_inductor_kernels_are_classified_by_what_they_fuse(bench_module, name, cls):
    assert bench_module("benchmarks.step.removable_time").inductor_kernel_class(name) == cls
