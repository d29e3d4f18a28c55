"""The kernel benchmark script runs end to end on tiny CPU shapes, and its target checks read the rows
as the issue states them (a GPU session relies on both). The LM step benchmark and its profile:
``test_bench_lm_step.py``; the GPU suite: ``test_bench_gpu_suite.py``."""

from __future__ import annotations

import functools
import importlib.util
import json
from pathlib import Path

import pytest

from addnorm.ops.args import interpreting

pytestmark = pytest.mark.slow  # benchmarks run end to end


@pytest.fixture
def bench(bench_module):
    return bench_module("benchmarks.op.add_norm")


def test_add_norm_benchmark_runs_and_writes_its_tables(bench, tmp_path):
    argv = ["--cpu", "--hidden", "8", "32", "--elements", "64", "--reps", "2", "--warmup", "1"]
    bench.main([*argv, "--out", str(tmp_path)])
    report = json.loads((tmp_path / "add_norm_cpu.json").read_text())
    # norms x placements x dropout (0, 0.1) x hidden sizes
    assert len(report["results"]) == 2 * 2 * 2 * 2
    assert {(r["prenorm"], r["dropout"]) for r in report["results"]} == {
        (pre, p) for pre in (True, False) for p in (0.0, 0.1)
    }
    row = report["results"][0]
    assert {"addnorm_fwd", "addnorm_fwd_bwd", "eager_fwd", "eager_fwd_bwd", "copy"} <= set(row["ms"])
    # fwd+bwd bandwidth counts both phases' minimum bytes
    nbytes = 4 * row["rows"] * row["hidden"] * 4  # prenorm: x, r, y, s (fp32)
    assert row["GBps"]["addnorm_fwd_bwd"] == pytest.approx(2 * nbytes / row["ms"]["addnorm_fwd_bwd"] / 1e6)
    md = (tmp_path / "add_norm_cpu.md").read_text()
    assert "## Targets" in md and "RMSNorm forward+backward no slower than eager" in md


def test_add_norm_benchmark_sizes_its_table_to_the_budget(bench, tmp_path):
    """--budget: a table whose budget is spent lists the shapes it did not reach and is still written;
    the reps of a shape never go under --min-reps."""
    argv = ["--cpu", "--hidden", "8", "--elements", "64", "--reps", "6", "--min-reps", "3", "--warmup", "1"]
    # a budget spent before the first shape (0.001 s held only while the setup's git calls took longer:
    # the commit is read once per process since addnorm.commit)
    report = bench.main([*argv, "--norms", "rmsnorm", "--budget", "0", "--out", str(tmp_path)])
    assert report["results"] == [] and len(report["not_reached"]) == 2 * 2  # placements x dropout
    md = (tmp_path / "add_norm_cpu.md").read_text()
    assert "not reached within the budget: 4 shapes" in md
    report = bench.main(
        [*argv, "--norms", "rmsnorm", "--prenorm", "on", "--budget", "60", "--out", str(tmp_path)]
    )
    assert len(report["results"]) == 2 and report["not_reached"] == []
    assert all(3 <= r["reps"] <= 6 for r in report["results"])


def test_add_norm_warm_up_runs_every_shape_in_parallel_processes_first(bench, tmp_path):
    """--warm N: N processes, each given the same grid, run their slice of it once before the timed
    run (what fills the compile caches on a GPU; eager implementations here, so nothing compiles)."""
    argv = ["--cpu", "--impls", "addnorm", "eager", "--hidden", "8", "16", "--elements", "64", "--reps", "2"]
    report = bench.main(
        [*argv, "--norms", "rmsnorm", "--prenorm", "on", "--warm", "2", "--out", str(tmp_path)]
    )
    assert report["warm"]["processes"] == 2 and report["warm"]["status"] == {0: "ok", 1: "ok"}
    assert len(report["results"]) == 2 * 2  # dropout x hidden
    assert "Warm-up: every shape run once in 2 processes" in (tmp_path / "add_norm_cpu.md").read_text()


def test_add_norm_missing_extras_are_one_line_each(bench):
    """Liger and flash-attn asked for on a device where they do not import: a line each, no column."""
    impls, missing = bench.implementations(["addnorm", "eager", "liger", "flash_attn"], "cuda")
    if importlib.util.find_spec("liger_kernel") is None:
        assert "liger" not in impls and missing["liger"] == "not installed (liger-kernel)"
    if importlib.util.find_spec("flash_attn") is None:
        assert "flash_attn" not in impls and missing["flash_attn"] == "not installed (flash-attn)"
    report = {
        "machine": {"device": "NVIDIA H100", "cpu": "x", "logical_cores": 1, "torch_threads": 1, "torch": "t",
                    "python": "p", "date": "d"},
        "device": "cuda", "missing": {"liger": "not installed (liger-kernel)"}, "results": [],
    }  # fmt: skip
    md = bench.to_markdown(report)
    assert "- liger: not installed (liger-kernel)" in md and "## Targets" in md


def _row(dtype, prenorm, fwd_pct, vs_compiled, vs_liger=None):
    copy = 3000.0
    row = {
        "dtype": dtype,
        "prenorm": prenorm,
        "norm": "layernorm",
        "GBps": {"copy": copy, "addnorm_fwd": fwd_pct * copy},
        "speedup_fwd_bwd_vs_compiled": vs_compiled,
    }
    if vs_liger is not None:
        row["speedup_fwd_bwd_vs_liger"] = vs_liger
    return row


def test_gpu_targets_are_checked_on_the_rows_they_cover(bench):
    rows = [
        _row("bfloat16", True, 0.97, 1.05, 1.2),
        _row("mixed", False, 0.60, 0.90, 1.01),  # the mix: Liger's target only
        _row("float32", True, 0.50, 0.90, 0.8),  # fp32 rows are outside every target
    ]
    met = {t["target"]: t["met"] for t in bench.check_targets({"device": "cuda", "results": rows})}
    assert all(met.values()) and len(met) == 3
    rows[0]["speedup_fwd_bwd_vs_liger"] = 0.98  # slower than Liger on a bf16 row
    rows[1]["GBps"]["addnorm_fwd"] = 0.1  # the mixed row's forward is not a bf16 forward
    met = {t["target"]: t["met"] for t in bench.check_targets({"device": "cuda", "results": rows})}
    assert [k for k, v in met.items() if not v] == [
        "fwd+bwd >= Liger where it ran (bf16 and the autocast mix)"
    ]
    rows[0]["speedup_fwd_bwd_vs_compiled"] = 0.99  # slower than torch.compile at one bf16 shape
    met = {t["target"]: t["met"] for t in bench.check_targets({"device": "cuda", "results": rows})}
    assert met["bf16 fwd+bwd >= torch.compile on every shape"] is False


def _other_variant():
    """A backward variant other than the default (a candidate where one is pending), and the op
    table's column for it."""
    from addnorm.ops import launch_config as lc

    others = [v for v in (*lc.BWD_CANDIDATES, *lc.BWD_VARIANTS) if v != lc.BWD_VARIANT]
    return others[0], f"addnorm_{others[0]}"


def test_the_op_columns_are_the_default_backward_and_each_other_variant(bench):
    """The column "addnorm" times the default backward variant and every other variant has a column of
    its own (``addnorm_<variant>``, chosen with ``--impls``); a GPU run times by default the candidates
    beside the default (none once measurements have decided), never the default's own column twice."""
    from addnorm.ops import launch_config as lc

    others = [v for v in lc.BWD_VARIANTS if v != lc.BWD_VARIANT]
    assert bench.OPS == {"addnorm": lc.BWD_VARIANT} | {f"addnorm_{v}": v for v in others}
    assert set(lc.BWD_CANDIDATES) <= set(lc.BWD_VARIANTS)
    candidates = [f"addnorm_{v}" for v in lc.BWD_CANDIDATES if v != lc.BWD_VARIANT]
    assert bench.GPU_IMPLS[: 1 + len(candidates)] == ("addnorm", *candidates)
    assert not set(bench.GPU_IMPLS[1 + len(candidates) :]) & set(bench.OPS)
    assert f"addnorm_{lc.BWD_VARIANT}" not in bench.IMPLS  # the default's column would time it twice


def test_the_op_columns_time_the_kernels_on_a_gpu(bench, monkeypatch):
    """On CUDA both op columns call the Triton backend, not the policy's choice: with "auto" the H200
    table's Post-LN LayerNorm rows at hidden 16384 timed the torch path (a policy row keyed on "cuda"
    sends them there), fp32 casts and a hashed mask in torch ops, as the op's kernels."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs triton")
    import torch

    backends = []
    monkeypatch.setattr(bench, "add_norm", lambda *args, **kw: backends.append(kw["backend"]))
    impls, missing = bench.implementations(list(bench.OPS), "cuda")
    x = torch.zeros(2, 8)
    for fn in impls.values():
        fn(x, x, x[0], x[0], "layernorm", False)
    assert backends == ["triton"] * len(bench.OPS) and not missing


def test_gpu_targets_are_judged_for_each_backward_variant_timed(bench):
    """With the op's column of the other backward variant in the rows, its own torch.compile and Liger
    targets join the default's, each judged on its own speeds and named by its variant."""
    other, column = _other_variant()
    rows = [_row("bfloat16", True, 0.97, 1.05, 1.2), _row("mixed", False, 0.6, 0.9, 1.01)]
    for r, (vs_compiled, vs_liger) in zip(rows, ((0.97, 1.3), (1.5, 1.02)), strict=True):
        r[bench.speed_key(column, "compiled")] = vs_compiled
        r[bench.speed_key(column, "liger")] = vs_liger
    targets = {t["target"]: t for t in bench.check_targets({"device": "cuda", "results": rows})}
    new = targets[f"bf16 fwd+bwd >= torch.compile on every shape ({other})"]
    assert new["rows"] == 1 and new["worst"] == "0.97x" and new["met"] is False
    assert targets[f"fwd+bwd >= Liger where it ran (bf16 and the autocast mix) ({other})"]["met"] is True
    assert targets["bf16 fwd+bwd >= torch.compile on every shape"]["met"] is True and len(targets) == 5


def test_a_table_recorded_under_another_default_renders_its_variant_column(bench):
    """The H200 table at 7722722 was recorded while "slices" was the default, its other column
    ``addnorm_row_sums``: it renders from its JSON byte for byte whatever the default is now, that
    column's speeds and targets included."""
    recorded = Path(__file__).resolve().parents[1] / "benchmarks/results/h200/2026-11-28-7722722"
    report = json.loads((recorded / "add_norm_h200.json").read_text())
    md = bench.to_markdown(report)
    assert md == (recorded / "add_norm_h200.md").read_text()
    assert "| addnorm_row_sums speed vs compiled |" in md
    assert "| bf16 fwd+bwd >= torch.compile on every shape (row_sums) | 56 |" in md


def test_add_norm_times_each_backward_variant_in_one_run(bench, tmp_path, monkeypatch):
    """The op's default backward and the other variant in one run, in columns of their own: each
    column's backward launches run with its own variant selected (the other one selected around that
    column's calls only), the row-sums pre-pass runs exactly where "row_sums" is selected, the default
    is selected again after the run, and the table has both columns."""
    if importlib.util.find_spec("triton") is None or not interpreting():
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    from addnorm.ops import launch_config as lc
    from addnorm.ops.triton import launchers as triton_launch

    default = lc.BWD_VARIANT
    other, column = _other_variant()
    timing, launched = [None], []  # the timer running; (timer, variant selected, pre-pass sums given)
    real_interleaved, kernel = bench.interleaved, triton_launch.bwd_kernel

    def named(key, fn):
        def run():
            timing[0] = key
            try:
                return fn()
            finally:
                timing[0] = None

        return run

    def interleaved(timers, *args, **kwargs):
        return real_interleaved({k: named(k, f) for k, f in timers.items()}, *args, **kwargs)

    class Spy:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                launched.append((timing[0], lc.BWD_VARIANT, args[11] is not None))  # args[11]: SUMS
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(bench, "interleaved", interleaved)
    monkeypatch.setattr(triton_launch, "bwd_kernel", Spy())
    argv = ["--cpu", "--impls", "addnorm", column, "--hidden", "2048", "--elements", "4096"]
    argv += ["--norms", "rmsnorm", "--prenorm", "on", "--dropout", "0.1", "--reps", "2", "--warmup", "1"]
    report = bench.main([*argv, "--out", str(tmp_path)])
    (row,) = report["results"]
    assert {"addnorm_fwd_bwd", f"{column}_fwd_bwd"} <= set(row["ms"])
    assert row[bench.speed_key("addnorm", column)] > 0
    by_timer = {}
    for key, variant, sums in launched:
        by_timer.setdefault(key, set()).add(variant)
        assert sums == (variant != "slices"), (key, variant)  # hidden 2048 with dropout: it engages
    assert by_timer == {"addnorm_fwd_bwd": {default}, f"{column}_fwd_bwd": {other}}
    assert lc.BWD_VARIANT == default
    assert report["bwd_variants"] == {"addnorm": default, column: other}
    md = (tmp_path / "add_norm_cpu.md").read_text()
    assert f"{column} fwd+bwd ms" in md and f'addnorm: the default backward variant "{default}"' in md


def test_host_overhead_benchmark_runs_and_files_runs_by_label(bench_module, tmp_path):
    hb = bench_module("benchmarks.host.host_overhead")
    argv = ["--cpu", "--calls", "2", "--samples", "1", "--steps", "1", "--out", str(tmp_path)]
    hb.main([*argv, "--label", "before"])
    hb.main([*argv, "--label", "after"])
    report = json.loads((tmp_path / "host_overhead_cpu.json").read_text())
    assert list(report["runs"]) == ["before", "after"]
    run = report["runs"]["after"]
    cases = {r["case"] for r in run["ops"]}
    assert {"layernorm fwd", "layernorm fwd+bwd", "rmsnorm fwd+bwd", "layernorm dropout 0.1 fwd"} <= cases
    for r in run["ops"]:
        assert r["ratio"] == pytest.approx(r["fused_us"] / r["eager_us"])
        assert r["target"] == (2.0 if "dropout" in r["case"] else 1.2)
    assert {"default_us", "unfused_us", "forced_us", "ratio"} <= set(run["lm_step"])
    md = (tmp_path / "host_overhead_cpu.md").read_text()
    assert "## before" in md and "## after" in md and "LM step" in md


@pytest.mark.skipif(
    importlib.util.find_spec("triton") is None or not interpreting(),
    reason="needs triton and TRITON_INTERPRET=1 (the kernels built for the interpreter)",
)
def test_host_overhead_stub_launch_times_the_triton_path_without_running_a_kernel(bench_module, tmp_path):
    """--stub-launch: backend='triton' on CPU tensors with both launches stubbed; every case of the
    issue's table, the issue-21 targets; the stub is the benchmark's, and the library gets its kernels
    back afterwards."""
    from addnorm.ops.triton import launchers as k

    kernels = k.fwd_kernel, k.bwd_kernel
    hb = bench_module("benchmarks.host.host_overhead")
    argv = ["--stub-launch", "--calls", "2", "--samples", "1"]
    hb.main([*argv, "--no-record", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # --no-record (CI) writes nothing
    hb.main([*argv, "--breakdown", "--out", str(tmp_path)])
    assert (k.fwd_kernel, k.bwd_kernel) == kernels
    run = json.loads((tmp_path / "host_overhead_stub_cpu.json").read_text())["runs"]["after"]
    assert "lm_step" not in run
    # --breakdown: each case's forward peeled into the same five layers
    layers = {(r["case"], r["stage"]) for r in run["breakdown"] if r["us"] > 0}
    assert len(layers) == 2 * 5 and {c for c, _ in layers} == {"layernorm", "layernorm prenorm"}
    targets = {r["case"]: r["target"] for r in run["ops"]}
    assert targets == {
        "layernorm fwd": 1.5, "layernorm fwd+bwd": 1.2, "layernorm prenorm fwd": 1.5,
        "layernorm prenorm fwd+bwd": 1.2, "rmsnorm prenorm fwd": 1.5, "rmsnorm prenorm fwd+bwd": 1.2,
        "layernorm dropout 0.1 fwd": 2.0, "layernorm dropout 0.1 fwd+bwd": 1.5, "floor fwd": 1.5,
        "floor fwd+bwd": 1.2,
    }  # fmt: skip
    md = (tmp_path / "host_overhead_stub_cpu.md").read_text()
    assert "launches stubbed" in md and "Where the forward's time goes" in md


def test_stubbed_launches_run_no_kernel_and_the_path_still_returns_its_outputs(bench_module):
    """Under the stub the Triton path allocates and returns outputs of the right shapes and dtypes
    (their values are whatever torch.empty held) and its backward returns gradients for every leaf."""
    if importlib.util.find_spec("triton") is None or not interpreting():
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    import torch

    from addnorm.ops import add_norm

    hb = bench_module("benchmarks.host.host_overhead")
    x, r = (torch.randn(2, 3, 16, requires_grad=True) for _ in range(2))
    w, b = torch.ones(16, requires_grad=True), torch.zeros(16, requires_grad=True)
    with hb.stubbed_launches():
        y, s = add_norm(x, r, w, b, prenorm=True, backend="triton")
        grads = torch.autograd.grad([y, s], [x, r, w, b], [torch.ones_like(y), torch.ones_like(s)])
    assert y.shape == s.shape == x.shape and y.dtype == s.dtype == torch.float32
    assert [g.shape for g in grads] == [x.shape, r.shape, w.shape, b.shape]


def test_commit_is_the_given_one_then_the_file_then_git(bench_module, monkeypatch, tmp_path):
    rp = bench_module("benchmarks.common.results_path")
    monkeypatch.setattr(rp, "COMMIT_FILE", tmp_path / ".commit")
    monkeypatch.setenv("ADDNORM_COMMIT", "abc1234")
    monkeypatch.setenv("ADDNORM_COMMIT_SOURCE", "--commit")
    assert rp.commit_info() == ("abc1234", "--commit")
    monkeypatch.delenv("ADDNORM_COMMIT")
    (tmp_path / ".commit").write_text("def5678\n")
    assert rp.commit_info() == ("def5678", "benchmarks/.commit")
    (tmp_path / ".commit").unlink()
    commit, source = rp.commit_info()
    assert source == "git rev-parse HEAD" or commit == "unknown"
    monkeypatch.setattr(rp, "ROOT", tmp_path)  # a copy of the tree without .git
    assert rp.commit_info()[0] == "unknown"


def test_results_go_to_scratch_unless_recorded(bench_module, tmp_path, monkeypatch):
    import argparse
    import datetime as dt

    rp = bench_module("benchmarks.common.results_path")
    monkeypatch.setenv("ADDNORM_COMMIT", "564f000abcdef")
    monkeypatch.setenv("ADDNORM_COMMIT_SOURCE", "--commit")
    today = dt.date.today().isoformat()
    recorded = rp.RESULTS / rp.machine_slug() / f"{today}-564f000"  # <device>/<date>-<commit>/
    ap = argparse.ArgumentParser()
    rp.add_out_argument(ap)
    assert ap.parse_args([]).out == rp.SCRATCH and not ap.parse_args([]).record
    assert ap.parse_args(["--record"]).out == recorded == rp.record_dir()
    assert ap.parse_args(["--record", "--out", str(tmp_path)]).out == tmp_path
    assert ap.parse_args(["--out", str(tmp_path), "--record"]).out == tmp_path
    assert rp.SCRATCH.relative_to(rp.RESULTS) == Path("scratch")
    ignored = (Path(rp.ROOT) / ".gitignore").read_text().splitlines()
    assert "/benchmarks/results/scratch/" in ignored
    plain = argparse.ArgumentParser()
    rp.add_record_argument(plain)
    assert (
        rp.out_dir(plain.parse_args([])) == rp.SCRATCH
        and rp.out_dir(plain.parse_args(["--record"])) == recorded
    )
    assert rp.window_name("564f000abcde+dirty", "2026-12-01") == "2026-12-01-564f000-dirty"
    assert rp.window_name("unknown", "2026-12-01") == "2026-12-01-unknown"
    assert rp.record_dir("h200", "7722722", "2026-11-28") == rp.RESULTS / "h200" / "2026-11-28-7722722"


def test_every_benchmark_that_writes_results_defaults_to_scratch(bench_module):
    """Issue 31: no benchmark overwrites benchmarks/results/ unless --record: each takes its folder
    from results_path (no script names the results folder itself; the fault trials' too)."""
    root = Path(bench_module("benchmarks.common.results_path").ROOT)
    scripts = sorted([*(root / "benchmarks").rglob("*.py"), root / "tools" / "fault_trials.py"])
    assert len(scripts) > 30
    for path in scripts:
        source = path.read_text()
        if (
            "write_results(" not in source
            and "write_text(" not in source
            or path.name in ("machine.py", "gpu_suite.py", "results_path.py")
        ):
            continue
        assert '/ "results"' not in source, path.name


def test_report_screenshot_cuts_the_report_to_its_title_and_one_section(bench_module):
    cut = bench_module("tools.report_screenshot").section_page
    report = (
        "<html><head><style>x</style></head><body><h1>t</h1><p>intro</p>"
        "<h2 id='findings'>F</h2>f<h2 id='ranking'>R</h2><table>r</table><h2 id='depth'>D</h2>d</body></html>"
    )
    assert cut(report, "ranking") == (
        "<html><head><style>x</style></head><body><h1>t</h1><p>intro</p>"
        "<h2 id='ranking'>R</h2><table>r</table></body></html>"
    )
    assert cut(report, "depth").endswith("<h2 id='depth'>D</h2>d</body></html>")
    with pytest.raises(ValueError, match="section: the report has no section 'nope'"):
        cut(report, "nope")


def test_host_overhead_lists_each_previous_variant_beside_the_default(bench_module):
    """A GPU run's rows carry the previous variants' times (idle launch hooks passed, the launcher
    called, randint seeds for the dropout case): the table lists each under its own heading, against
    the default's time."""
    hb = bench_module("benchmarks.host.host_overhead")
    machine = {"device": "NVIDIA H200", "cpu": "x", "logical_cores": 16, "torch_threads": 1, "torch": "2",
               "python": "3", "date": "2026-11-28"}  # fmt: skip
    row = {"clock": "wall", "eager_us": 10.0, "ratio": 1.2, "target": 1.5, "met": True}
    ops = [
        {**row, "case": "layernorm fwd+bwd", "fused_us": 12.0, "fused_idle_hooks_passed_us": 13.0,
         "fused_launcher_call_us": 12.5},
        {**row, "case": "layernorm dropout 0.1 fwd+bwd", "fused_us": 14.0, "fused_idle_hooks_passed_us": 15.0,
         "fused_launcher_call_us": 14.5, "fused_randint_seeds_us": 19.5},
    ]  # fmt: skip
    md = hb.to_markdown({"runs": {"gpu": {"machine": machine, "rows": 8, "hidden": 64, "ops": ops}}})
    hooks, launcher, seeds = (md.index(hb.PREVIOUS_VARIANTS[k]) for k in hb.PREVIOUS_VARIANTS)
    assert "- layernorm fwd+bwd: 13.0 us against 12.0 us" in md[hooks:launcher]
    assert "- layernorm fwd+bwd: 12.5 us against 12.0 us" in md[launcher:seeds]
    assert "- layernorm dropout 0.1 fwd+bwd: 19.5 us against 14.0 us" in md[seeds:]
    assert "- layernorm fwd+bwd" not in md[seeds:]


@pytest.mark.triton
def test_launch_config_sweep_runs_each_candidate_rule_and_restores_the_library_s(bench_module, tmp_path):
    """benchmarks/op/sweep_launch_config.py (a GPU tool; here on the CPU interpreter, --device cpu): every
    case times every candidate rule, each installed while its calls run (the launch specs asked it), and the
    library's own rules are back afterwards."""
    if importlib.util.find_spec("triton") is None or not interpreting():
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    from addnorm.ops import launch_config

    sweep = bench_module("benchmarks.op.sweep_launch_config")
    asked = []

    def recording(key, fn):
        @functools.lru_cache  # as the library's rules are (a cache cleared when a rule is installed)
        def rule(*args):
            asked.append(key)
            return fn(*args)

        return rule

    sweep.CANDIDATES = {key: recording(key, fn) for key, fn in sweep.CANDIDATES.items()}
    rows = sweep.main(["--device", "cpu", "--hidden", "64", "--elements", "128", "--reps", "1",
                       "--out", str(tmp_path)])  # fmt: skip
    assert len(rows) == 4 * len(sweep.CANDIDATES)
    assert set(asked) == set(sweep.CANDIDATES)  # each rule was what a launch spec asked
    assert {(r["phase"], r["rule"]) for r in rows} == set(sweep.CANDIDATES)
    assert all(r["ms"] > 0 for r in rows)
    assert launch_config.fwd_config is sweep.ORIGINAL["fwd"]
    assert launch_config.bwd_config is sweep.ORIGINAL["bwd"]
    assert json.loads((tmp_path / "launch_config_sweep.json").read_text()) == rows
