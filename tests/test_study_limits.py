"""Plan-time limits: a run's memory estimate against the model's real parameter count and a real run's
measured peak memory; huge models and absurd evaluations refused in one line before anything trains."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from addnorm.placements import PLACEMENTS
from addnorm.study import limits
from addnorm.study.limits import check_eval, estimate_memory, memory_limit, parameter_count, parse_size
from addnorm.study.spec import PlannedRun, SpecError
from addnorm.tasks import build_task
from addnorm.train import RunConfig
from addnorm.train.loop import build_model

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = dict(d_model=32, n_heads=4, d_ff=64, n_layers=2)
CASES = (
    [{"placement": p} for p in PLACEMENTS]
    + [
        {"activation": "swiglu"},
        {"activation": "gelu"},
        {"qk_norm": True},
        {"positional": "learned"},
        {"norm": "rmsnorm", "placement": "sandwich"},
        {"task": "copy"},
        {"task": "reverse", "n_encoder_layers": 1, "n_decoder_layers": 3},
    ]
    + [{"model": f"hf-{f}"} for f in ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "gpt2")]
)


def cli(*args):
    from addnorm.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_parameter_count_bounds_the_built_model(case):
    """The count from sizes alone is never below ``sum(p.numel())`` of the model the run builds, and
    at most 1.5x it (tied embeddings counted twice at this tiny width; the matrices exactly)."""
    if "model" in case:
        pytest.importorskip("transformers")
    for size in (SMALL, dict(d_model=128, n_heads=8, d_ff=512, n_layers=3)):
        cfg = RunConfig(**{**size, **case})
        task = build_task(cfg.task, limit=4096) if cfg.task == "lm" else build_task(cfg.task)
        real = sum(p.numel() for p in build_model(cfg, task).parameters())
        assert real <= parameter_count(cfg) <= 1.5 * real, (size, real, parameter_count(cfg))


MEASURED = {
    "activations": dict(d_model=64, n_heads=4, d_ff=256, n_layers=6, batch_size=48, seq_len=256),
    "parameters": dict(d_model=768, n_heads=8, d_ff=3072, n_layers=2, batch_size=4, seq_len=32),
}


@pytest.mark.parametrize("which", MEASURED)
def test_the_estimate_is_above_a_real_runs_peak_memory(which, bench_module):
    """A run (two probed steps and the final evaluation) in a fresh process (the benchmark's own
    measurement: the process image's peak resident memory, not the test session's carried over by
    fork): its peak is below the estimate, and the estimate is not absurdly high (at most 2.5x)."""
    settings = {**MEASURED[which], "steps": 2, "eval_every": 0, "eval_batches": 1, "corpus_bytes": 400_000}
    got = bench_module("benchmarks.study.memory_estimate").measure(settings)
    estimate = estimate_memory(RunConfig(**settings)).total
    assert got["status"] == "done", got["error"]
    assert got["peak"] > 400 * 2**20  # the run, not the interpreter, sets the peak
    assert got["peak"] < estimate < 2.5 * got["peak"], (got["peak"], estimate)


def test_estimates_grow_with_what_a_run_keeps():
    base = RunConfig(**SMALL)
    bigger = {
        "d_model": RunConfig(**{**SMALL, "d_model": 64}),
        "n_layers": RunConfig(**{**SMALL, "n_layers": 4}),
        "batch_size": RunConfig(**{**SMALL, "batch_size": 64}),
        "attention dropout (kept weights)": RunConfig(**{**SMALL, "attention_dropout": 0.1}),
    }
    for name, cfg in bigger.items():
        assert estimate_memory(cfg).total > estimate_memory(base).total, name
    # a GPU's fused attention keeps no T x T weights, even with dropout
    dropout = bigger["attention dropout (kept weights)"]
    assert estimate_memory(dropout, cuda=True).activations == estimate_memory(base, cuda=True).activations


def test_the_limit_is_the_available_memory_shared_by_the_workers(monkeypatch):
    monkeypatch.delenv(limits.ENV, raising=False)
    monkeypatch.setattr(limits, "available_memory", lambda: 12 * 2**30)
    assert memory_limit(1, cuda=False)[0] == 12 * 2**30
    limit, words = memory_limit(4, cuda=False)
    assert limit == 3 * 2**30 and words == "3.0 GiB, each of 4 workers' share of the 12.0 GiB available"
    assert memory_limit(4, cuda=False, override="off")[0] is None
    monkeypatch.setenv(limits.ENV, "512M")
    assert memory_limit(4, cuda=False)[0] == 512 * 2**20


@pytest.mark.parametrize(
    ("text", "size"), [("8G", 8 * 2**30), ("512MiB", 512 * 2**20), ("1.5gb", 3 * 2**29), ("4096", 4096)]
)
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1G", "8X", "0"])
def test_a_bad_size_names_the_option(text):
    with pytest.raises(ValueError, match="--memory-limit: expected"):
        parse_size(text)


def test_evaluation_beyond_the_held_out_split_is_refused_at_the_bound():
    """corpus_bytes 100,000: the held-out split is 10,000 bytes; batches of 4 x 25 = 100 tokens, so
    10 passes over it are 1,000 batches: accepted; 1,001 is refused, naming the bound."""
    run = lambda n: PlannedRun(  # noqa: E731
        "main", "x", RunConfig(corpus_bytes=100_000, batch_size=4, seq_len=25, eval_batches=n)
    )
    check_eval([run(1000)])
    with pytest.raises(SpecError, match="at most 1000$") as err:
        check_eval([run(1001)])
    assert str(err.value).startswith("eval_batches: experiments.main (x) evaluates 1,001 batches")
    check_eval([PlannedRun("main", "x", RunConfig(task="copy", eval_batches=10**8))])  # no data bound


def spec_file(tmp_path, **base):
    path = tmp_path / "spec.yaml"
    spec = {
        "name": "big",
        "base": {**SMALL, "steps": 2, "eval_every": 0, **base},
        "experiments": {"main": {"set": {}}},
    }
    path.write_text(yaml.safe_dump(spec))
    return path


@pytest.mark.parametrize("dry", [True, False])
def test_a_huge_model_is_refused_in_one_line_before_the_folder_is_touched(tmp_path, dry):
    spec = spec_file(tmp_path, d_model=20000, n_heads=4)
    out = tmp_path / "out"
    result = cli("study", spec, "--out", out, *(["--dry-run"] if dry else ["--quiet"]))
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: memory: experiments.main (main; d_model=20000, ") and "GiB" in line, line
    assert "available" in line and "--memory-limit" in line
    assert not out.exists()


def test_the_limit_can_be_overridden(tmp_path):
    spec = spec_file(tmp_path)
    assert cli("study", spec, "--out", tmp_path / "o", "--dry-run", "--memory-limit", "1M").exit_code == 2
    result = cli("study", spec, "--out", tmp_path / "o", "--dry-run", "--memory-limit", "off")
    assert result.exit_code == 0 and "memory" in result.output  # the estimate's column
    result = cli("study", spec, "--out", tmp_path / "o", "--dry-run", "--memory-limit", "lots")
    assert result.exit_code == 2 and "--memory-limit: expected a size" in result.output


def test_absurd_evaluation_is_refused_by_the_cli(tmp_path):
    result = cli("study", spec_file(tmp_path, eval_batches=10**8), "--out", tmp_path / "o", "--quiet")
    assert result.exit_code == 2
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: eval_batches: experiments.main (main) evaluates 100,000,000 batches")


def test_a_run_on_several_processes_needs_a_copy_in_each():
    """On the CPU a run on 2 processes holds the model and a step in each: a limit between one and two
    estimates passes the one-process run and refuses the two-process one, naming its processes."""
    from addnorm.study.limits import check_memory

    one = RunConfig(**SMALL)
    two = RunConfig(**SMALL, distributed={"strategy": "ddp", "nproc": 2})
    between = str(int(1.5 * estimate_memory(one).total))
    check_memory([PlannedRun("main", "one", one)], workers=1, override=between)
    with pytest.raises(SpecError, match="in each of its 2 processes, more than"):
        check_memory([PlannedRun("main", "two", two)], workers=1, override=between)
