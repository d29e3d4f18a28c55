"""``make gpu-bench``'s suite (``benchmarks/device/gpu_suite.py``): its plan fits one device call and passes
only flags its scripts take, a step past its budget leaves a line and the next one runs, tables are named by
device and bundled, and a step's trace is copied as it is."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # benchmarks run end to end


def test_gpu_suite_dry_run_plans_every_step_within_one_device_call(
    bench_module, monkeypatch, capsys, request
):
    """make gpu-bench's plan: the GPU tests, the step trace, the op table, host time, the LM steps and the
    HF step (with its GPU-bound setup), with budgets that sum, with the suite's start-up, to at most one
    8-minute device call; every flag it passes exists in its script; a dry run starts no process; --only
    keeps the steps named."""
    import subprocess

    suite = bench_module("benchmarks.device.gpu_suite")
    marked = set(_gpu_marked_files(suite.ROOT, request.session))  # pytest's own -m gpu, before processes stop

    def no_process(*args, **kwargs):
        raise AssertionError("the dry run started a process")

    monkeypatch.setattr(subprocess, "Popen", no_process)
    monkeypatch.setattr(subprocess, "run", no_process)
    assert suite.main(["--dry-run"]) == 0
    out = capsys.readouterr().out
    steps = suite.plan()
    names = [s.name for s in steps]
    assert names == ["gpu_tests", "trace", "ops", "host_overhead", "native_call", "lm_step", "hf_step"]
    assert suite.CALL_S == 480 and suite.STARTUP_S + sum(s.timeout_s for s in steps) <= suite.CALL_S
    assert all(f"[{s.name}] <= {s.timeout_s} s" in out for s in steps) and "nothing run" in out
    assert steps[0].argv[2:5] == ["pytest", "-m", "gpu"]
    # only the files with a GPU test are collected: every one of them, and none without
    files = [a for a in steps[0].argv if a.startswith("tests/")]
    own = {f"tests/{name}" for name in suite.OWN_STEP}  # the native call's grid: its own step runs it
    assert "tests/test_ops_add_norm.py" in files and set(files) == marked - own and own <= marked
    # issue 52's A/B: the native call beside today's, its check grid, the extension prebuilt meanwhile
    native = steps[names.index("native_call")].argv
    assert {"--gpu", "--check"} <= set(native) and "[native_call prebuild]" in out
    assert suite.NATIVE_PREBUILD_S < steps[0].timeout_s  # the prebuild ends within the GPU tests' step
    trace, ops, lm, hf = (steps[names.index(n)].argv for n in ("trace", "ops", "lm_step", "hf_step"))
    # the inner budget of the op table leaves its process time to start and write before its limit
    assert float(ops[ops.index("--budget") + 1]) < steps[names.index("ops")].timeout_s - 10
    assert {"gelu", "llama", "eager", "compile", "--profile", "fused"} <= set(lm)
    assert lm[lm.index("--compile-paths") + 1] == "default"  # "kernel" failed its GPU test at 81f67f7
    # two compiled columns a model, not three: the compiles ran the step past its budget at 81f67f7
    assert lm[lm.index("--compiled-columns") + 1 : lm.index("--compile-paths")] == ["fused=False", "fused"]
    # a failing GPU test's report is written as it fails, into the step's folder (bundled)
    assert steps[0].argv[steps[0].argv.index("--failures-to") + 1] == suite.OUT_TOKEN
    assert "--gpu" in hf and "--profile" in hf and "gpu-bound" in hf and "--diagnose" in hf
    assert {"hf", "lm", "lm-llama"} <= set(trace)  # both LMs: the RMSNorm one lost at 81f67f7
    root = Path(suite.ROOT)
    for s in steps[1:]:
        assert s.argv[1] == "-m" and s.argv[2].startswith("benchmarks."), s.argv  # run from the root
        source = (root / (s.argv[2].replace(".", "/") + ".py")).read_text()
        flags = [a for a in s.argv[3:] if a.startswith("--")]
        assert flags and all(f'"{f}"' in source or f == "--out" for f in flags), (s.name, flags)
        assert suite.OUT_TOKEN in s.argv  # each step writes into its own folder
    assert suite.main(["--dry-run", "--only", "ops", "hf_step"]) == 0
    out = capsys.readouterr().out
    assert "[ops]" in out and "[hf_step]" in out and "[lm_step]" not in out
    with pytest.raises(SystemExit, match="--only: expected step names"):
        suite.main(["--dry-run", "--only", "nope"])
    needs = suite.STARTUP_S + sum(s.timeout_s for s in steps)
    with pytest.raises(SystemExit, match=f"--budget: the plan needs {needs} s, more than the budget of 300"):
        suite.main(["--dry-run", "--budget", "300"])


def _gpu_marked_files(root: Path, session) -> list[str]:
    """The test files pytest itself selects with ``-m gpu`` (an oracle independent of the suite's text
    rule). From this session's own collection where it is of the whole ``tests`` folder with nothing
    deselected (``make test-all``: each xdist worker collects every test), as ``-m gpu`` selects: an item
    with a ``gpu`` marker on it, its class or its module. Otherwise (this file run alone, ``-k``, ``-m``)
    from a collection of the whole folder in a process beside; cached per session."""
    if not _GPU_FILES:
        opt = session.config.option
        whole = [Path(a).resolve() for a in session.config.args] == [root / "tests"]
        narrowing = ("markexpr", "keyword", "deselect", "lf", "failedfirst")
        narrowed = [getattr(opt, name, None) for name in narrowing]
        files = {Path(item.path).relative_to(root).as_posix() for item in session.items}
        if whole and not any(narrowed) and len(files) > 40:  # (40: no plugin narrowed it either)
            marked = (item for item in session.items if item.get_closest_marker("gpu") is not None)
            _GPU_FILES.extend(sorted({Path(item.path).relative_to(root).as_posix() for item in marked}))
        else:
            import subprocess
            import sys

            argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu"]
            argv += ["-p", "no:cacheprovider"]
            run = subprocess.run([*argv, "tests"], cwd=root, capture_output=True, text=True, timeout=300)
            assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
            lines = run.stdout.splitlines()
            _GPU_FILES.extend(sorted({line.split("::")[0] for line in lines if "::" in line}))
    return _GPU_FILES


_GPU_FILES: list[str] = []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


def test_gpu_suite_step_past_its_budget_leaves_a_line_and_the_next_step_runs(bench_module, tmp_path):
    """Fake steps on the CPU: one writes a row and sleeps past its limit (its table keeps the row and
    gains "timed out after 2 s"; the grandchild it started dies with it), one times out before writing
    (a table of one line), one needs a module that is not installed (one line, never run), one writes its
    table (copied, named by device); the summary and the bundle hold them all, and --unpack writes them."""
    import sys

    suite = bench_module("benchmarks.device.gpu_suite")
    py = sys.executable
    pid_file = tmp_path / "grandchild.pid"
    partial = (
        "import pathlib, subprocess, sys, time; out = pathlib.Path(sys.argv[1]); "
        "(out / 'slow_cuda.md').write_text('# slow\\n\\n| a |\\n| 1 |\\n'); "
        f"p = subprocess.Popen(['sleep', '60']); pathlib.Path({str(pid_file)!r}).write_text(str(p.pid)); "
        "time.sleep(60)"
    )
    quick = "import pathlib, sys; pathlib.Path(sys.argv[1], 'quick_gpu.md').write_text('# quick\\n')"
    steps = [
        suite.Step("slow", "writes a row, then hangs", [py, "-c", partial, suite.OUT_TOKEN], 2, ("slow",)),
        suite.Step("silent", "hangs", [py, "-c", "import time; time.sleep(60)"], 1, ("silent",)),
        suite.Step("extra", "needs a missing extra", [py, "-c", "0"], 5, ("extra",), ("no_such_module_x",)),
        suite.Step("quick", "writes a table", [py, "-c", quick, suite.OUT_TOKEN], 30, ("quick",)),
    ]
    report = {
        "device": "NVIDIA H100 80GB HBM3", "torch": "t", "triton": "3", "commit": "abc",
        "commit_source": "--commit", "date": "2026-01-01", "budget_s": 480, "startup_s": 1.0,
        "wheels": "none", "missing": {"liger-kernel": "not installed"},
    }  # fmt: skip
    out = tmp_path / "out"
    import time

    suite.run_suite(
        steps, out=out, slug="h100", report=report, env=dict(os.environ), budget=120, start=time.monotonic()
    )
    slow = (out / "slow_h100.md").read_text()
    assert "| 1 |" in slow and "**slow: timed out after 2 s** (the rows above are those it finished)" in slow
    assert not _alive(int(pid_file.read_text()))
    assert "**silent: timed out after 1 s** before writing a table." in (out / "silent_h100.md").read_text()
    assert "**extra: not installed: no_such_module_x**" in (out / "extra_h100.md").read_text()
    assert (out / "quick_h100.md").read_text() == "# quick\n"
    summary = (out / "gpu_suite_h100.md").read_text()
    for line in (
        "| slow | writes a row, then hangs | timed out after 2 s |",
        "| quick | writes a table | ok |",
        "| extra | needs a missing extra | not installed: no_such_module_x |",
        "- liger-kernel: not installed",
        "commit abc (--commit)",
    ):
        assert line in summary
    bundle = json.loads((out / "gpu_suite_h100.json").read_text())
    assert set(bundle["files"]) == {f"{n}_h100.md" for n in ("slow", "silent", "extra", "quick", "gpu_suite")}
    assert len(list(out.iterdir())) <= 8  # what one device call brings back
    again = tmp_path / "unpacked"
    suite.main(["--unpack", str(out / "gpu_suite_h100.json"), "--out", str(again)])
    assert (again / "slow_h100.md").read_text() == slow


def test_gpu_suite_writes_to_out_env_and_names_tables_by_device(bench_module, monkeypatch):
    suite = bench_module("benchmarks.device.gpu_suite")
    machine = bench_module("benchmarks.common.machine")
    monkeypatch.setenv("OUT", "/tmp/device-out")
    assert suite.default_out() == Path("/tmp/device-out")
    monkeypatch.delenv("OUT")
    recorded = suite.default_out("h200", "81f67f7aabbcc")
    assert recorded.parent == suite.ROOT / "benchmarks" / "results" / "h200"
    assert recorded.name.endswith("-81f67f7")  # benchmarks/results/<device>/<date>-<commit>/
    assert suite.table_name("host_overhead_cuda.json", "h200") == "host_overhead_h200.json"
    assert suite.table_name("hf_step_gpu.md", "h100") == "hf_step_h100.md"
    assert suite.table_name("lm_step_h100.md", "h100") == "lm_step_h100.md"
    slug = machine.device_slug
    assert (slug("NVIDIA H100 80GB HBM3"), slug("NVIDIA H200"), slug("NVIDIA A100-SXM4-80GB")) == (
        "h100",
        "h200",
        "a100",
    )
    assert slug("cpu") == "cpu"


def test_gpu_suite_copies_a_step_s_trace_as_it_is_and_bundles_its_tables(bench_module, tmp_path):
    """A step's Markdown goes to the output folder and into the bundle; its gzipped trace is copied byte
    for byte beside them and noted, never read as text into the bundle."""
    suite = bench_module("benchmarks.device.gpu_suite")
    scratch, out = tmp_path / "scratch", tmp_path / "out"
    scratch.mkdir()
    out.mkdir()
    (scratch / "step_trace_h200.md").write_text("# table\n")
    blob = bytes(range(256)) * 3
    (scratch / "step_trace_h200.json.gz").write_bytes(blob)
    step = suite.Step("trace", "what", [], 10, tables=("step_trace",))
    step.result = {"rc": 0}
    files, binaries = {}, {}
    suite.collect(step, scratch, out, "h200", "header", files, binaries)
    assert set(files) == {"step_trace_h200.md"} and binaries == {"step_trace_h200.json.gz": len(blob)}
    assert (out / "step_trace_h200.json.gz").read_bytes() == blob
    assert (out / "step_trace_h200.md").read_text() == "# table\n"


def test_failures_to_writes_a_failing_test_s_report_the_moment_it_fails(tmp_path):
    """``--failures-to DIR`` (tests/conftest.py, which the GPU suite's tests pass): each failing test's
    id, phase and report go to DIR/test_failures.txt and the output as it fails, before pytest's
    summary, which a step stopped at its budget never prints; passing tests write nothing."""
    import subprocess
    import sys

    tests = Path(__file__).resolve().parent
    (tmp_path / "test_probe.py").write_text(
        "def test_passes():\n    pass\n\n\ndef test_fails():\n    assert 1 + 1 == 3, 'wrong sum'\n"
    )
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "conftest"]
    argv += [str(tmp_path / "test_probe.py"), "--failures-to", str(tmp_path), "-o", "addopts="]
    env = {**os.environ, "PYTHONPATH": str(tests)}
    run = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    written = (tmp_path / "test_failures.txt").read_text()
    assert written.startswith("FAILED test_probe.py::test_fails (call)") and "wrong sum" in written
    assert "test_passes" not in written
    # printed before pytest's own summary of failures
    assert run.stdout.index("FAILED test_probe.py::test_fails (call)") < run.stdout.index("= FAILURES =")


def _report():
    return {
        "device": "NVIDIA H200", "torch": "t", "triton": "3", "commit": "abc", "commit_source": "--commit",
        "date": "2026-01-01", "budget_s": 570, "startup_s": 1.0, "wheels": "none", "missing": {},
    }  # fmt: skip


def test_gpu_suite_then_the_study_resumes_a_copy_of_its_folder_and_returns_it_as_one_tar(
    bench_module, tmp_path, monkeypatch
):
    """``--study PRESET DIR`` on the CPU with a stand-in study (``study_argv`` patched: a script that
    appends a run to the copied database and writes its report): after the steps it runs in a copy of
    DIR with the budget's time left, less the reserve, and naming the commit; the folder comes back as
    study_<preset>.tar holding the old and the new rows (no lock file); DIR itself is untouched; the
    steps' tables travel only in the bundle, so the call returns the suite's two files and the .tar."""
    import sqlite3
    import sys
    import tarfile
    import time

    suite = bench_module("benchmarks.device.gpu_suite")
    folder = tmp_path / "study_x"
    folder.mkdir()
    with sqlite3.connect(folder / "study.sqlite") as db:
        db.execute("create table runs (id text)")
        db.execute("insert into runs values ('stored')")
    (folder / ".addnorm.lock").write_text("1")
    before = (folder / "study.sqlite").read_bytes()
    seen = {}

    def fake_argv(preset, work, budget, commit):
        seen.update(preset=preset, work=work, budget=budget, commit=commit)
        script = (
            "import sqlite3, sys, pathlib; d = pathlib.Path(sys.argv[1]); "
            "c = sqlite3.connect(d / 'study.sqlite'); c.execute(\"insert into runs values ('new')\"); "
            "c.commit(); (d / 'report.html').write_text('<p>report</p>'); print('2 of 48 runs stored')"
        )
        return [sys.executable, "-c", script, str(work)]

    monkeypatch.setattr(suite, "study_argv", fake_argv)
    table = "import pathlib, sys; pathlib.Path(sys.argv[1], 'ops_cuda.md').write_text('# ops\\n')"
    steps = [
        suite.Step("ops", "writes a table", [sys.executable, "-c", table, suite.OUT_TOKEN], 30, ("ops",))
    ]
    out = tmp_path / "out"
    start = time.monotonic()
    report = suite.run_suite(
        steps, out=out, slug="h200", report=_report(), env=dict(os.environ), budget=200, start=start,
        study=("gpu-x", folder),
    )  # fmt: skip
    assert seen["preset"] == "gpu-x" and seen["commit"] == "abc" and seen["work"] != folder
    assert 200 - 60 - suite.STUDY_RESERVE_S < seen["budget"] <= 200 - suite.STUDY_RESERVE_S
    assert report["study"]["rc"] == 0 and report["study"]["tar"] == "study_gpu-x.tar"
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_suite_h200.json",
        "gpu_suite_h200.md",
        "study_gpu-x.tar",
    ]
    with tarfile.open(out / "study_gpu-x.tar") as t:
        names = t.getnames()
        t.extractall(tmp_path / "back", filter="data")
    assert "gpu-x/report.html" in names and not any(n.endswith(".lock") for n in names)
    with sqlite3.connect(tmp_path / "back" / "gpu-x" / "study.sqlite") as db:
        assert [r for (r,) in db.execute("select id from runs order by rowid")] == ["stored", "new"]
    assert (folder / "study.sqlite").read_bytes() == before
    bundle = json.loads((out / "gpu_suite_h200.json").read_text())
    assert "ops_h200.md" in bundle["files"]
    summary = (out / "gpu_suite_h200.md").read_text()
    assert "| study | `addnorm study gpu-x` from" in summary and "2 of 48 runs stored" in summary


def test_gpu_suite_skips_the_study_when_the_steps_leave_too_little_and_checks_its_arguments(
    bench_module, tmp_path, capsys
):
    """With less than STUDY_MIN_S left the study does not start (one line says why, no .tar); the plan
    with --study needs STUDY_MIN_S more of the budget than the steps (one-line error), and DIR must be a
    folder."""
    import time

    suite = bench_module("benchmarks.device.gpu_suite")
    out = tmp_path / "out"
    report = suite.run_suite(
        [], out=out, slug="h200", report=_report(), env=dict(os.environ), budget=30, start=time.monotonic(),
        study=("gpu-x", tmp_path / "none"),
    )  # fmt: skip
    assert report["study"]["skipped"].startswith("not run: ") and not list(out.glob("*.tar"))
    assert "| study |" in (out / "gpu_suite_h200.md").read_text()
    needs = suite.STARTUP_S + sum(s.timeout_s for s in suite.plan()) + suite.STUDY_MIN_S
    with pytest.raises(SystemExit, match=f"--budget: the plan needs {needs} s"):
        suite.main(["--dry-run", "--study", "gpu-literature", str(tmp_path)])
    assert suite.main(["--dry-run", "--budget", str(needs), "--study", "gpu-literature", str(tmp_path)]) == 0
    assert "[study] the budget's time left, at least 60 s" in capsys.readouterr().out
    (tmp_path / "file").write_text("x")
    with pytest.raises(SystemExit, match="--study: DIR must be a study folder"):
        suite.main(["--dry-run", "--budget", "600", "--study", "gpu-literature", str(tmp_path / "file")])
