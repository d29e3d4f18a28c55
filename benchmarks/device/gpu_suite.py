"""Everything the GPU measures, in one device call of at most 8 minutes: ``make gpu-bench`` or
``PYTHONPATH=src python -m benchmarks.device.gpu_suite --out $OUT``.

Steps in order, each a child process in its own process group with its own budget (killed with its
group when it runs over; the next step still runs):

1. ``gpu_tests``: ``pytest -m gpu``, the tests that need CUDA;
2. ``trace``: where a training step's time goes (``benchmarks/host/step_trace.py``): a torch profiler
   trace of two steps each of the HF Llama plain / fused and the two LMs ``fused=False`` / fused (the RMSNorm
   one lost 0.926x at 81f67f7; the GPU-bound HF Llama's trace, which fusion speeds up, left out for time),
   read into a table (GPU busy time and share, the longest GPU idle gaps and the host frames open in
   them, launches, synchronisations, addnorm's own Python) and kept as one gzipped Chrome trace;
3. ``ops``: the op table (``benchmarks/op/add_norm.py``: bf16, LayerNorm and RMSNorm, Pre-LN and Post-LN,
   dropout 0 and 0.1, hidden 256 ... 16384; eager, torch.compile, Liger where it imports, addnorm with
   its default backward variant and, in a column of its own, each candidate (``BWD_CANDIDATES``: none
   pending since 81f67f7); fwd and fwd+bwd as % of the same run's copy bandwidth), shapes compiled first
   in parallel processes and reps sized to the step's budget;
4. ``host_overhead``: host time per call with real launches (``benchmarks/host/host_overhead.py``);
5. ``lm_step``: the two LMs (addnorm's LayerNorm + GELU with dropout 0.1, Llama-style RMSNorm + SwiGLU
   without), Pre-LN, the policy's default, ``fused=False`` and fused (the op wherever the model can),
   eager rows first, then torch.compile (``fused=False`` and fused only: each compiled column is a
   whole-model compile, and no compiled step has a policy row, so the default compiles as
   ``fused=False`` does; the fused model through the default compile path: the "kernel" path failed
   its GPU test at 81f67f7, so it is not timed until that test passes), with the profiler's removable
   time and the share the fused step realises, and in the eager rows the candidate "fused (autocast
   h)" (``benchmarks/step/lm_step.py``);
6. ``hf_step``: the Hugging Face Llama step at 134M and at a GPU-bound size, plain / ``addnorm.hf.fuse``
   / Liger, eager, with the removable time, and at 134M plain and fused also with each diagnostic
   switch (the backward on the calling thread, the garbage collector off, the backward variant
   "kernel_sums": ``benchmarks/step/hf_step.py``).

Both step benchmarks build a row's variants side by side and step them in alternation (a host-bound
step timed one variant after another moved 25% between runs on the H200), ratios the median of the
rounds' paired ratios.

**Budgets.** Each step's limit is in ``plan()``; with ``STARTUP_S`` for the suite's own start (Python,
torch, the device query, optional wheels) they sum to at most ``CALL_S`` = 480 s, and ``--dry-run``
(tested in CI) prints the plan and fails if they do not fit ``--budget``. The op table and the LM step
also get an inner budget a little under their limit, so that they finish and write on their own.

**What is written.** Every step writes into its own scratch folder; as each step ends the suite
copies its Markdown tables into ``--out`` (default ``$OUT`` when that variable is set, as on the device
machine, else ``benchmarks/results``), named by device (``add_norm_h100.md``, ``lm_step_h200.md``;
a table a step names ``_cuda`` / ``_gpu`` is renamed so), and rewrites the suite's own two files:
``gpu_suite_<device>.md`` (each step's budget, status, seconds and log tail; the GPU tests' result;
which extras were not installed) and ``gpu_suite_<device>.json`` (that summary, and every file each
step wrote, Markdown and JSON, by name); the step trace's ``step_trace_<device>.json.gz`` is copied as it
is (at most 15 MiB). Eight files in all, what a device call returns (8 files, 16 MiB each).
``--unpack gpu_suite_h100.json --out benchmarks/results`` writes the bundled files out to commit them.
A step past its budget leaves one line in its table, "timed out after N s" (under the rows it
finished, or alone); a missing extra (Liger, flash-attn, transformers, Triton) is one line, "not
installed", never a lost table. Nothing here changes a result of the library.

**The commit** each table names is the code that ran: ``--commit SHA`` (the lead's tree's HEAD, since
the device's copy of the tree may have no ``.git``), else ``benchmarks/.commit``, else ``git rev-parse
HEAD`` (``results_path.commit_info``); the suite passes it to every step and records where it came from.

It runs on a bare device image (torch and Triton preinstalled, the tree copied, ``PYTHONPATH=src``):
no virtual environment, no network. Optional wheels (Liger-Kernel, flash-attn) may travel beside the
tree in ``--wheels DIR`` (default ``benchmarks/wheels`` when it exists: git-ignored, so name it in
the device call's ``carry``; ``pip download liger-kernel==0.8.5 --no-deps -d benchmarks/wheels``):
installed with ``pip --no-index --no-deps --target`` into a scratch folder on the children's
``PYTHONPATH``.

    PYTHONPATH=src python -m benchmarks.device.gpu_suite [--dry-run] [--only ops lm_step] [--commit SHA]
        [--budget 480] [--out DIR] [--wheels DIR] [--study PRESET DIR]

**Then a study** (``--study gpu-literature benchmarks/results/h200/study-gpu-literature`` with ``--budget``
raised to what the device call allows, e.g. 570 of a 600 s call): after the steps, the study resumes
from a copy of that folder with the time left (``run_study``: not started with less than
``STUDY_MIN_S``; its own ``--budget`` what is left less ``STUDY_RESERVE_S``; ``--workers auto``
packs its runs on the GPU) and its folder comes back as one file, ``study_<preset>.tar``. The steps'
tables then travel only in the bundle, so the call returns 4 files, not 9 (the 8-file limit lost a
study's database that way at 81f67f7).
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import asdict, dataclass, field
from importlib.machinery import PathFinder
from pathlib import Path

from benchmarks.common.results_path import ROOT, commit_info, device_slug, record_dir

BENCH = ROOT / "benchmarks"

CALL_S = 480  # one device call: 8 minutes
STARTUP_S = (
    15  # the suite's own: Python and torch import, the device query, wheels, writing (5 s on the H200)
)
OUT_TOKEN = "{out}"  # replaced in a step's argv by its scratch folder
# a test or a module marked gpu: the decorator or ``pytestmark`` at the start of a line (not the words
# in a string or a comment, which made the suite collect test_bench_gpu_suite.py for nothing)
GPU_MARK = re.compile(r"^\s*(@pytest\.mark\.gpu\b|pytestmark\s*=.*\bpytest\.mark\.gpu\b)", re.M)
# --study: the study runs only if this much of the budget is left after the steps; its own --budget is
# what is left less STUDY_RESERVE_S (the study's process start, then the copy of its folder into a .tar)
STUDY_MIN_S = 60
STUDY_RESERVE_S = 15


@dataclass
class Step:
    """One child process of the suite: ``argv`` run in the repository root within ``timeout_s``; it
    writes the tables ``tables`` (stems, before the device suffix) into ``{out}``; ``needs``: modules
    without which it cannot run (a missing one is a "not installed" line instead)."""

    name: str
    what: str
    argv: list[str]
    timeout_s: int
    tables: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    result: dict = field(default_factory=dict)


def plan(py: str = sys.executable) -> list[Step]:
    """The suite's steps in order with their limits (seconds; with ``STARTUP_S`` at most ``CALL_S``).

    Sized from the H100 runs of 2026-11-24 (``gpu_h100.md``: ``pytest -m gpu`` 54 s, host time 32 s at
    15 samples, one LM's eager + compiled columns 140 s with three cold whole-model compiles, the HF
    step eager 37 s) and the CPU measurements of compile cost in ``benchmarks/op/add_norm.py`` and
    ``benchmarks/step/lm_step.py`` (cached compiles ~10x cheaper than cold): the op table's 56 shapes compile
    in 8 processes at once, then time from the caches; the LM step's four compiled cells compile in 4
    processes at once. Resized from the H200 run at 7722722 (``results/h200/2026-11-28-7722722``): the
    GPU tests (51 s of pytest) and host time ran past 65 and 25 s, the trace took 42 s of 55, the op
    table 101 s of 125; the HF step, now interleaved, times 16 steps of each variant where it timed 6.
    Resized again from the H200 run at 81f67f7 (``results/h200/2026-11-28-81f67f7``): the GPU tests ran
    past 75 s on their 22nd of 23 tests (the compile paths' two compiles come last), the op table took
    110 s of 115 with a candidate column it no longer times, the LM step ran past 135 s compiling.
    Issue 52's ``native_call`` step (30 s, not yet run on a device) took its time from the trace (-5),
    host time (-10, 6 samples), the LM step (-10) and the HF step (-5): resize from its first window."""
    # fmt: off
    return [
        Step(
            "gpu_tests", "pytest -m gpu: the tests that need CUDA",
            [py, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "--failures-to", OUT_TOKEN,
             *gpu_test_files()],
            90, needs=("pytest",),
        ),
        Step(
            "trace",
            "where the step's time goes: torch profiler trace (CPU, CUDA, Python stacks) of 2 steps each of "
            "HF Llama 134M plain/fused and the two LMs (LayerNorm + GELU with dropout, RMSNorm + SwiGLU) "
            "fused=False/fused: GPU busy, idle gaps and the host frames in them, launches, syncs, addnorm's "
            "Python",
            [py, "-m", "benchmarks.host.step_trace", "--runs", "hf", "lm", "lm-llama", "--steps", "2",
             "--warmup", "2", "--out", OUT_TOKEN],
            45, tables=("step_trace",), needs=("transformers",),
        ),
        Step(
            "ops",
            "op table: bf16, LayerNorm/RMSNorm, Pre-/Post-LN, dropout 0/0.1, hidden 256-16384; eager, "
            "torch.compile, Liger, addnorm's kernels with each backward variant (addnorm: the default; "
            "addnorm_<variant>: each candidate, none pending); fwd and fwd+bwd vs copy",
            [py, "-m", "benchmarks.op.add_norm", "--budget", "85", "--warm", "8", "--warm-timeout", "50",
             "--reps", "30", "--min-reps", "5", "--out", OUT_TOKEN],
            100, tables=("add_norm",),
        ),
        Step(
            "host_overhead", "host time per call with real launches",
            [py, "-m", "benchmarks.host.host_overhead", "--label", "gpu", "--samples", "6", "--out",
             OUT_TOKEN],
            20, tables=("host_overhead",),
        ),
        Step(
            "native_call",
            "issue 52's A/B: the native call (C++ autograd node) beside today's op, eager aten and the "
            "Python floor, per call fwd and fwd+bwd with real launches; y, s and every gradient against "
            "today's path on 3 shapes x fp32/bf16 x Pre/Post-LN x dropout (the extension and the grid's "
            "kernels prebuilt in the background during gpu_tests: NATIVE_PREBUILD)",
            [py, "-m", "benchmarks.host.host_call", "--gpu", "--check", "--rounds", "50", "--calls", "20",
             "--out", OUT_TOKEN],
            30, tables=("host_call",), needs=("triton",),
        ),
        Step(
            "lm_step",
            "LM step, Pre-LN: gelu (LayerNorm+GELU, dropout 0.1) and llama (RMSNorm+SwiGLU); default, "
            "fused=False and fused (the op wherever the model can), stepped in alternation (paired "
            "ratios); eager rows (with the candidate fused (autocast h)), then torch.compile "
            "(fused=False and fused, the default compile path); removable time",
            [py, "-m", "benchmarks.step.lm_step", "--models", "gelu", "llama", "--placements", "pre",
             "--modes", "eager", "compile", "--columns", "default", "fused=False", "fused",
             "fused (autocast h)",
             "--compiled-columns", "fused=False", "fused", "--compile-paths", "default", "--steps", "5",
             "--warmup", "2", "--profile", "--profile-steps", "2", "--warm", "8", "--warm-timeout", "60",
             "--out", OUT_TOKEN],
            125, tables=("lm_step",),
        ),
        Step(
            "hf_step", "HF Llama step, 134M and GPU-bound (hidden 2048 x 4 layers, seq 4096): plain / "
            "addnorm.hf.fuse / Liger, eager, stepped in alternation (paired ratios); removable time; at "
            "134M plain and fused also with each diagnostic switch (backward on the calling thread, gc off)",
            [py, "-m", "benchmarks.step.hf_step", "--gpu", "--setups", "134m", "gpu-bound", "--modes",
             "eager", "--reps", "16", "--warmup", "3", "--profile", "--diagnose", "--out", OUT_TOKEN],
            55, tables=("hf_step",), needs=("transformers",),
        ),
    ]
    # fmt: on


def gpu_test_files() -> list[str]:
    """The test files with a test marked ``gpu`` (relative to the repository root): ``pytest -m gpu``
    collects only those: collecting all of ``tests`` imports every test module first (15 s against 8 s
    on this project's 2-core CI machine), which the step's budget pays for."""
    tests = ROOT / "tests"
    return sorted(
        f"tests/{p.name}"
        for p in tests.glob("test_*.py")
        if GPU_MARK.search(p.read_text()) and p.name not in OWN_STEP
    )


# GPU test files a step of their own runs (not pytest -m gpu's step): the native call's grid
OWN_STEP = ("test_ops_native_call_gpu.py",)
# built in the background from the suite's start, while the GPU tests run, its own limit within theirs:
# the native call's C++ extension (a first build takes ~40 s) and the Triton kernels of its check grid
NATIVE_PREBUILD_S = 80
NATIVE_PREBUILD = (
    "from addnorm.ops.native import build; from benchmarks.host.host_call import correctness; "
    "build.extension() is not None and correctness()"
)


def prebuild_native(py: str, env: dict[str, str]):
    """Start the native call's prebuild (:data:`NATIVE_PREBUILD`) in the background, or None."""
    argv = ["timeout", str(NATIVE_PREBUILD_S), py, "-c", NATIVE_PREBUILD]
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def installed(module: str, paths: list[str] | tuple[str, ...] = ()) -> bool:
    """Whether ``module`` imports here or from one of ``paths`` (the installed wheels' folder, which the
    children find on their ``PYTHONPATH``)."""
    found = importlib.util.find_spec(module) or PathFinder.find_spec(module, list(paths))
    return found is not None


def install_wheels(wheels: Path, py: str) -> tuple[str | None, str]:
    """pip-install every wheel in ``wheels`` (no index, no dependencies) into a scratch folder; its
    path (to go on the children's PYTHONPATH, or None when there are none) and pip's log tail."""
    files = sorted(str(p) for p in wheels.glob("*.whl"))
    if not files:
        return None, "no wheels"
    target = tempfile.mkdtemp(prefix="addnorm-wheels-")
    cmd = [py, "-m", "pip", "install", "--no-index", "--no-deps", "--quiet", "--target", target, *files]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return (target if out.returncode == 0 else None), (out.stdout + out.stderr)[-2000:]


def run_step(step: Step, env: dict[str, str], limit: float, out: Path) -> dict:
    """Run one step in its own process group within ``limit`` seconds, its output folder ``out``; kill
    the group when it runs over. Its exit status, seconds and the tail of its output."""
    argv = [str(out) if a == OUT_TOKEN else a for a in step.argv]
    t0 = time.monotonic()
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        proc.wait(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        timed_out = True
    try:  # whatever the step left running in its group goes with it
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    log.seek(0)
    text = log.read()
    log.close()
    return {
        "rc": proc.returncode,
        "timed_out": timed_out,
        "limit_s": round(limit, 1),
        "seconds": round(time.monotonic() - t0, 1),
        "log_tail": text[-3000:],
        "summary": _pytest_summary(text),
    }


def _pytest_summary(text: str) -> str | None:
    found = re.findall(r"^=*\s*(\d+ (?:passed|failed|error|skipped|deselected).*?)\s*=*$", text, flags=re.M)
    return found[-1] if found else None


def table_name(file: str, slug: str) -> str:
    """A step's file named by device: ``x_cuda.md`` / ``x_gpu.md`` become ``x_<slug>.md``."""
    return re.sub(r"_(cuda|gpu)(\.\w+)$", rf"_{slug}\2", file)


def status_line(r: dict) -> str:
    """A step's (or the study's) result in a few words: skipped and why, timed out, ok, or its exit."""
    if r.get("skipped"):
        return r["skipped"]
    if r.get("timed_out"):
        return f"timed out after {r['limit_s']:.0f} s"
    return "ok" if r.get("rc") == 0 else f"exit {r.get('rc')}"


def collect(
    step: Step,
    scratch: Path,
    out: Path,
    slug: str,
    header: str,
    files: dict[str, str],
    binaries: dict[str, int],
    apart: bool = True,
) -> None:
    """Copy the step's Markdown tables into ``out`` (named by device; ``apart`` False: only in the bundle) and
    every text file it wrote into ``files``; a compressed file (a trace, ``.gz``) is copied into ``out`` as it
    is and noted in ``binaries`` (name: bytes), not bundled. A step that timed out, failed or was skipped says
    so in one line of each table it owns (under the rows it finished, or alone in a table of its own)."""
    for path in sorted(scratch.glob("*")) if scratch.is_dir() else []:
        if not path.is_file():
            continue
        name = table_name(path.name, slug)
        if path.suffix == ".gz":
            shutil.copyfile(path, out / name)
            binaries[name] = path.stat().st_size
            continue
        files[name] = path.read_text()
        if path.suffix == ".md" and apart:
            shutil.copyfile(path, out / name)
    status = status_line(step.result)
    if status == "ok":
        return
    for stem in step.tables:
        name = f"{stem}_{slug}.md"
        line = f"**{step.name}: {status}**" + (
            " (the rows above are those it finished)" if name in files else " before writing a table."
        )
        text = files.get(name) or f"# {step.what}\n\n{header}\n"
        files[name] = text.rstrip("\n") + f"\n\n{line}\n"
        if apart:
            (out / name).write_text(files[name])


def to_markdown(report: dict) -> str:
    lines = [
        "# GPU suite",
        "",
        f"Device: {report['device']}; torch {report['torch']}, Triton {report['triton']}; commit "
        f"{report['commit']} ({report['commit_source']}); {report['date']}. {report['seconds']:.0f} s of a "
        f"{report['budget_s']} s budget (start-up {report['startup_s']:.0f} s). Wheels: {report['wheels']}.",
        "",
    ]
    for name, why in report.get("missing", {}).items():
        lines.append(f"- {name}: {why}")
    for name, size in report.get("binaries", {}).items():
        lines.append(f"- {name}: {size / 2**20:.1f} MiB, beside this file (not in the .json bundle)")
    lines += ["", "| step | what | status | seconds | budget |", "| --- | --- | --- | --- | --- |"]
    for s in report["steps"]:
        r = s["result"]
        status = status_line(r) if r else "not run"
        if r.get("summary"):
            status += f" ({r['summary']})"
        lines.append(f"| {s['name']} | {s['what']} | {status} | {r.get('seconds', '-')} | {s['timeout_s']} |")
    study = report.get("study")
    if study is not None:
        status = status_line(study)
        what = f"`addnorm study {study.get('preset', '')}` from {study.get('from', '-')}, the time left"
        lines.append(
            f"| study | {what}; its folder in {study.get('tar', '-')} | {status} | "
            f"{study.get('seconds', '-')} | {study.get('budget_s', '-')} |"
        )
    lines.append("")
    for s in [*report["steps"], *([{"name": "study", "result": study}] if study else [])]:
        if s["result"].get("log_tail"):
            lines += [f"## {s['name']}", "", "```", s["result"]["log_tail"].rstrip(), "```", ""]
    return "\n".join(lines)


def run_suite(
    steps: list[Step], *, out: Path, slug: str, report: dict, env: dict[str, str], budget: float,
    start: float, study: tuple[str, Path] | None = None, paths: list[str] | tuple[str, ...] = (),
) -> dict:  # fmt: skip
    """Run ``steps`` in order within ``budget`` seconds from ``start`` (monotonic), each within its own
    limit; after each, collect its files and rewrite the suite's summary and bundle in ``out``. With
    ``study`` (preset, folder): then :func:`run_study` with what is left, and the steps' tables only in
    the bundle (the call's 8 files: the suite's 3 and the study's .tar)."""
    out.mkdir(parents=True, exist_ok=True)
    scratch_root = Path(tempfile.mkdtemp(prefix="addnorm-gpu-suite-"))
    files: dict[str, str] = {}
    report["binaries"] = binaries = {}
    deadline = start + budget
    header = (
        f"Device: {report['device']}; torch {report['torch']}, Triton {report['triton']}; commit "
        f"{report['commit']} ({report['commit_source']}); {report['date']}."
    )
    report["steps"] = [asdict(s) for s in steps]
    for i, s in enumerate(steps):
        missing = [m for m in s.needs if not installed(m, paths)]
        left = deadline - time.monotonic()
        scratch = scratch_root / s.name
        scratch.mkdir()
        if missing:
            s.result = {"skipped": f"not installed: {', '.join(missing)}"}
        elif left < 5:
            s.result = {"skipped": f"not run: the suite's budget of {budget:.0f} s was spent"}
        else:
            print(f"[{s.name}] <= {min(s.timeout_s, left):.0f} s: {s.what}", flush=True)
            s.result = run_step(s, env, min(s.timeout_s, left), scratch)
        print(f"[{s.name}] {status_line(s.result)} in {s.result.get('seconds', 0)} s", flush=True)
        collect(s, scratch, out, slug, header, files, binaries, apart=study is None)
        report["steps"][i] = asdict(s)
        _write_summary(report, files, out, slug, start)
    if study is not None:
        report["study"] = run_study(*study, out=out, env=env, deadline=deadline, commit=report["commit"])
        print(f"[study] {report['study'].get('skipped') or report['study'].get('tar')}", flush=True)
        _write_summary(report, files, out, slug, start)
    shutil.rmtree(scratch_root, ignore_errors=True)
    print(f"wrote {out}/gpu_suite_{slug}.md and .json (every file: --unpack the .json)", flush=True)
    return report


def _write_summary(report: dict, files: dict[str, str], out: Path, slug: str, start: float) -> None:
    report["seconds"] = time.monotonic() - start
    summary = to_markdown(report)
    files[f"gpu_suite_{slug}.md"] = summary
    (out / f"gpu_suite_{slug}.md").write_text(summary)
    bundle = {"summary": report, "files": files}
    (out / f"gpu_suite_{slug}.json").write_text(json.dumps(bundle, indent=1) + "\n")


def study_argv(preset: str, folder: Path, budget: int, commit: str) -> list[str]:
    """The study's command: ``preset`` resumed in ``folder`` within ``budget`` seconds, its runs packed
    on the GPU as measured (``--workers auto``), provenance naming ``commit``."""
    return [sys.executable, "-m", "addnorm", "study", preset, "--out", str(folder), "--budget", str(budget),
            "--workers", "auto", "--quiet", "--commit", commit]  # fmt: skip


def run_study(
    preset: str, folder: Path, *, out: Path, env: dict[str, str], deadline: float, commit: str
) -> dict:
    """``--study PRESET DIR``: the study ``preset`` resumed from a copy of ``DIR`` (a new folder where
    there is none) with what is left until ``deadline`` (monotonic), then the folder, database and
    report, as one file in ``out``: ``study_<preset>.tar`` (``tar -xf`` gives the folder back). Not run
    with less than ``STUDY_MIN_S`` left. Its exit status, seconds and output tail, as a step's."""
    left = deadline - time.monotonic()
    if left < STUDY_MIN_S:
        return {"skipped": f"not run: {max(left, 0):.0f} s of the budget left (needs {STUDY_MIN_S})"}
    work = Path(tempfile.mkdtemp(prefix="addnorm-gpu-study-")) / preset
    if folder.is_dir():
        shutil.copytree(folder, work, ignore=shutil.ignore_patterns("*.lock"))  # a WAL file travels
    else:
        work.mkdir()
    budget = int(left - STUDY_RESERVE_S)
    step = Step("study", f"addnorm study {preset}", study_argv(preset, work, budget, commit), budget)
    result = run_step(step, env, left - 5, work)
    tar = out / f"study_{preset}.tar"
    with tarfile.open(tar, "w") as t:
        t.add(work, arcname=preset, filter=lambda m: None if m.name.endswith(".lock") else m)
    shutil.rmtree(work.parent, ignore_errors=True)
    return {**result, "preset": preset, "from": str(folder), "budget_s": budget, "tar": tar.name}


def unpack(bundle: Path, out: Path) -> list[Path]:
    """Write every file of a suite's bundle (``gpu_suite_<device>.json``) into ``out``."""
    files = json.loads(bundle.read_text())["files"]
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in files.items():
        if Path(name).name != name:
            raise SystemExit(f"--unpack: {bundle} names a file outside the folder: {name!r}")
        (out / name).write_text(text)
        written.append(out / name)
    return written


def default_out(slug: str | None = None, commit: str | None = None) -> Path:
    """``$OUT`` when set (the device machine's), else the recorded folder of this device and commit,
    ``benchmarks/results/<device>/<date>-<commit>/`` (placeholders until the device query names them)."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return record_dir(slug or "<device>", commit or "<commit>")


def bundle_dir(bundle: Path) -> Path:
    """Where ``--unpack`` writes a bundle's files by default: the recorded folder of its device, date and
    commit (``benchmarks/results/<device>/<date>-<commit>/``)."""
    s = json.loads(bundle.read_text())["summary"]
    return record_dir(device_slug(s["device"]), s["commit"], s["date"])


def main(argv: list[str] | None = None) -> int:
    t_start = time.monotonic()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan and its budgets, run nothing")
    ap.add_argument("--budget", type=int, default=CALL_S, help=f"seconds for the whole suite ({CALL_S})")
    ap.add_argument("--only", nargs="+", default=None, help="run only these steps (by name)")
    ap.add_argument("--commit", default=None, help="the commit of the tree that runs (default: see --help)")
    ap.add_argument("--wheels", type=Path, default=BENCH / "wheels", help="optional wheels to install")
    recorded = "benchmarks/results/<device>/<date>-<commit>/"
    ap.add_argument("--out", type=Path, default=None, help=f"default: $OUT when set, else {recorded}")
    ap.add_argument("--unpack", type=Path, default=None, help="write a bundle's files into --out and stop")
    ap.add_argument(
        "--study",
        nargs=2,
        metavar=("PRESET", "DIR"),
        default=None,
        help="then resume the study PRESET from a copy of the folder DIR with the budget's time left "
        "(raise --budget for it), its folder returned as study_<PRESET>.tar",
    )
    args = ap.parse_args(argv)
    out = args.out or default_out(None, args.commit)
    if args.unpack is not None:
        for path in unpack(args.unpack, args.out or bundle_dir(args.unpack)):
            print(f"wrote {path}")
        return 0
    steps = plan()
    names = [s.name for s in steps]
    if args.only:
        unknown = sorted(set(args.only) - set(names))
        if unknown:
            raise SystemExit(f"--only: expected step names from {names}, got {unknown}")
        steps = [s for s in steps if s.name in args.only]
    total = STARTUP_S + sum(s.timeout_s for s in steps)
    for s in steps:
        print(f"[{s.name}] <= {s.timeout_s} s: {s.what}\n    {shlex.join(s.argv)}", flush=True)
    native = any(s.name == "native_call" for s in steps)
    if native:
        print(f"[native_call prebuild] in the background from the start, <= {NATIVE_PREBUILD_S} s (within "
              f"gpu_tests): {NATIVE_PREBUILD}", flush=True)  # fmt: skip
    study = None
    if args.study is not None:
        study = (args.study[0], Path(args.study[1]))
        if study[1].exists() and not study[1].is_dir():
            raise SystemExit(f"--study: DIR must be a study folder, got the file {study[1]}")
        argv_then = study_argv(
            study[0], Path("<a copy of DIR>"), args.budget - total - STUDY_RESERVE_S, "SHA"
        )
        print(f"[study] the budget's time left, at least {args.budget - total} s: {shlex.join(argv_then)}")
        total += STUDY_MIN_S
    print(f"start-up <= {STARTUP_S} s; {len(steps)} steps; {total} s of a {args.budget} s budget; out {out}")
    if total > args.budget:
        raise SystemExit(f"--budget: the plan needs {total} s, more than the budget of {args.budget} s")
    if args.dry_run:
        print("dry run: nothing run")
        return 0
    commit, source = (args.commit, "--commit") if args.commit else commit_info()
    import torch

    from benchmarks.common.machine import package_version

    if not torch.cuda.is_available():
        raise SystemExit("gpu_suite: no CUDA device (--dry-run shows the plan)")
    env = dict(os.environ, ADDNORM_COMMIT=commit, ADDNORM_COMMIT_SOURCE=source)
    paths = [str(ROOT / "src")]
    wheels = "none"
    if args.wheels.is_dir():
        target, log = install_wheels(args.wheels, sys.executable)
        wheels = f"installed from {args.wheels}" if target else f"not installed ({log.strip()[-200:]})"
        paths += [target] if target else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    device = torch.cuda.get_device_name()
    extras = {"triton": "triton", "liger-kernel": "liger_kernel", "flash-attn": "flash_attn"}
    extras |= {"transformers": "transformers", "pytest": "pytest"}
    missing = {name: "not installed" for name, mod in extras.items() if not installed(mod, paths)}
    report = {
        "device": device,
        "torch": torch.__version__,
        "triton": package_version("triton"),
        "commit": commit,
        "commit_source": source,
        "date": dt.date.today().isoformat(),
        "budget_s": args.budget,
        "startup_s": time.monotonic() - t_start,
        "wheels": wheels,
        "missing": missing,
    }
    out = args.out or default_out(device_slug(device), commit)
    if native:
        prebuild_native(sys.executable, env)
    run_suite(steps, out=out, slug=device_slug(device), report=report, env=env, budget=args.budget - 5,
              start=t_start, study=study, paths=paths)  # fmt: skip
    return 0 if all(s.result.get("rc") == 0 for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
