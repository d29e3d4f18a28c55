"""The study commands registered on a Typer app: run, resume, report, export, dry run, presets, keys,
progress, findings table, and one-line errors."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from addnorm.cli.study import register
from addnorm.study import Store, load_spec, parse_spec
from addnorm.study.progress import StudyProgress
from addnorm.study.spec import spec_keys_markdown
from addnorm.train import RunConfig, RunResult

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)
DOCS = Path(__file__).resolve().parents[1] / "docs" / "study-spec.md"


def make_app() -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)

    @app.callback()
    def main() -> None:  # a callback keeps the commands as subcommands, as in the real app
        """addnorm"""

    register(app)
    return app


def write_spec(tmp_path, **sweep):
    spec = {"name": "tiny", "base": dict(TINY), "experiments": {"main": {"sweep": sweep}}}
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_register_adds_study_report_export_compare():
    names = {c.name for c in make_app().registered_commands}
    assert names == {"study", "report", "export", "compare"}


def test_study_runs_resumes_reports_exports_and_prints_findings(tmp_path):
    app, runner = make_app(), CliRunner()
    spec, out = write_spec(tmp_path, placement=["post", "pre"]), tmp_path / "out"
    args = ["study", str(spec), "--out", str(out), "--csv", "--set", "seed=5", "--workers", "1"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    assert "2 runs (0 already stored, 2 run now)" in first.output
    assert "Findings" in first.output and "┃ verdict" in first.output  # the table
    assert "not tested by this study" in first.output
    assert "Rule: a difference counts when" in first.output
    assert (out / "report.html").is_file() and (out / "csv" / "layer_metrics.csv").is_file()
    with Store(out / "study.sqlite") as store:
        runs = store.runs()
        assert {r["config"]["seed"] for r in runs} == {5}  # --set reached every run
        finished = {r["id"]: r["finished"] for r in runs}
    second = runner.invoke(app, [*args, "--quiet"])
    assert second.exit_code == 0 and "2 runs (2 already stored, 0 run now)" in second.output
    with Store(out / "study.sqlite") as store:
        assert {r["id"]: r["finished"] for r in store.runs()} == finished
    (out / "report.html").unlink()
    assert runner.invoke(app, ["report", str(out)]).exit_code == 0 and (out / "report.html").is_file()
    exported = runner.invoke(app, ["export", str(out), "--to", str(tmp_path / "x")])
    assert exported.exit_code == 0 and (tmp_path / "x" / "runs.csv").is_file()
    rows = (tmp_path / "x" / "runs.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("id,status,") and ",placement," in rows[0]


def test_dry_run_lists_runs_settings_and_cost_without_running(tmp_path):
    app, runner = make_app(), CliRunner()
    spec, out = write_spec(tmp_path, placement=["post", "Pre-LN"], lr=[0.001, 0.01]), tmp_path / "out"
    result = runner.invoke(app, ["study", str(spec), "--out", str(out), "--dry-run", "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert (
        "4 runs, 0 already stored" in result.output
        and "4 to run on 2 worker(s) x 1 torch thread(s)" in result.output
    )
    assert "estimated" in result.output and not (out / "study.sqlite").exists()
    assert '"placement": "pre"' in result.output.replace("\n", "")  # the canonical, resolved config
    for run in parse_spec(yaml.safe_load(spec.read_text())).expand():
        assert run.run_id in result.output


def test_show_keys_and_the_generated_spec_reference():
    app, runner = make_app(), CliRunner()
    shown = runner.invoke(app, ["study", "--show", "quick"])
    assert shown.exit_code == 0 and yaml.safe_load(shown.output)["name"] == "quick"
    assert load_spec("quick").expand()  # the template it printed is a valid spec
    keys = runner.invoke(app, ["study", "--keys"])
    assert keys.exit_code == 0
    for key in RunConfig.keys():
        assert re.search(rf"^{key} ", keys.output, re.M), key
    markdown = runner.invoke(app, ["study", "--keys", "--markdown"])
    assert markdown.output == spec_keys_markdown()
    assert DOCS.read_text() == spec_keys_markdown(), "docs/study-spec.md is stale: regenerate it"
    bad = runner.invoke(app, ["study", "--show", "quik"])
    assert bad.exit_code == 2 and "unknown preset 'quik'" in bad.output


def test_errors_are_one_line_with_exit_code_2(tmp_path):
    app, runner = make_app(), CliRunner()
    bad = tmp_path / "bad.yaml"
    cases = {
        "name: x\nbase: {steps: 3\n": "not valid YAML (line",
        yaml.safe_dump({"name": "x", "bse": {}, "experiments": {"a": None}}): "bse: unknown top-level key",
        yaml.safe_dump(
            {"name": "x", "base": {"lrr": 1}, "experiments": {"a": None}}
        ): "base.lrr: unknown key",
        yaml.safe_dump({"name": "x", "experiments": {"a": {"sweep": {"norm": ["lyernorm"]}}}}): (
            "norm: unknown norm 'lyernorm'; expected one of: layernorm"
        ),
        yaml.safe_dump({"name": "x", "base": {"steps": 10, "warmup": 10}, "experiments": {"a": None}}): (
            "warmup: 10 warmup steps need more than that many steps, got steps=10"
        ),
    }
    for text, expected in cases.items():
        bad.write_text(text)
        result = runner.invoke(app, ["study", str(bad)])
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    for args, expected in (
        (["study", "quik"], "unknown preset 'quik'"),
        (["study", "quick", "--set", "steps"], "--set: expected key=value"),
        (["study", "quick", "--set", "experiments.ablation.set.steps=20"], "no experiment 'ablation'"),
        (["study", "quick", "--workers", "0"], "--workers: expected a positive integer or 'auto'"),
        (["study", "quick", "--workers", "many"], "--workers: expected a positive integer or 'auto'"),
        (["study", "quick", "--threads", "0"], "--threads: expected a positive integer"),
        (["report", str(tmp_path / "nowhere")], "no study database"),
        (["export", str(tmp_path / "nowhere")], "no study database"),
    ):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert result.output.count("\n") == 1 and expected in result.output, result.output


def test_list_names_every_preset():
    result = CliRunner().invoke(make_app(), ["study", "--list"])
    assert result.exit_code == 0
    for name in ("quick", "gradient-flow", "warmup", "lr-sweep", "depth", "ablations", "dropout"):
        assert f"{name}: " in result.output


def _run():
    (run,) = parse_spec({"name": "p", "base": dict(TINY), "experiments": {"a": None}}).expand()
    return run


def _last_line(stream: io.StringIO, text: str) -> str:
    """The stream's last line once it contains ``text`` (waiting at most 30 s for the timer thread)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        lines = stream.getvalue().splitlines()
        if lines and text in lines[-1]:
            return lines[-1]
        time.sleep(0.01)
    raise AssertionError(f"no line with {text!r} in 30 s: {stream.getvalue()!r}")


def test_progress_prints_plain_lines_when_not_a_terminal(monkeypatch):
    """Not a TTY: while a run is in flight, a line every PLAIN_EVERY seconds on what it does (building
    its model, its step, its held-out batch), and one per finished run."""
    monkeypatch.setattr(StudyProgress, "PLAIN_EVERY", 0.05)
    stream = io.StringIO()
    run = _run()
    bar = StudyProgress(total=2, done=0, todo=[run], stream=stream)
    bar.progress(run, "build", 0, 1)
    assert _last_line(stream, "building").startswith("[0/2] a: a | building the model, 0s | ETA ~")
    bar.step(run, 0, 5.5)
    bar.step(run, 1, 5.0)
    assert _last_line(stream, "step 2/3").startswith("[0/2] a: a | step 2/3 loss 5.000, ")
    bar.progress(run, "eval", 3, 8)
    assert _last_line(stream, "evaluating").startswith("[0/2] a: a | evaluating 3/8, ")
    monkeypatch.setattr(StudyProgress, "PLAIN_EVERY", 3600.0)  # no timer lines from here on
    bar.finished(run, RunResult("done", final={"val_loss": 4.0}, wall_s=1.0))
    bar.close()
    text = stream.getvalue()
    assert "\r" not in text and "\x1b" not in text
    assert text.splitlines()[-1].startswith("[1/2] a: a -> done val loss 4.000 (1s) | ETA")


def test_the_eta_counts_evaluation_batches():
    """A run of 3 steps and 4 held-out evaluations of 6 batches (each a third of a step): after its
    3 steps the run is 3 / (3 + 8) done; after every batch too, it is done."""
    (run,) = parse_spec(
        {
            "name": "p",
            "base": {**TINY, "steps": 3, "eval_every": 1, "eval_batches": 6},
            "experiments": {"a": None},
        }
    ).expand()
    bar = StudyProgress(total=1, done=0, todo=[run], stream=io.StringIO(), enabled=False)
    cost = bar.cost[run.run_id]
    for step in range(3):
        bar.step(run, step, 1.0)
    assert bar._partial() == pytest.approx(cost * 3 / 11)
    bar.progress(run, "eval", 24, 24)
    assert bar._partial() == pytest.approx(cost)
    bar.close()


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_on_a_narrow_terminal_fits_its_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    stream = FakeTerminal()
    run = _run()
    long = type(run)(run.experiment, "variant=" + "a very long label " * 8, run.config)
    bar = StudyProgress(total=1, done=0, todo=[long], stream=stream)
    for step in range(3):
        bar.step(long, step, 5.0 - step)
    bar.finished(long, RunResult("done", final={"val_loss": 4.0}, wall_s=1.0))
    bar.close()
    visible = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", stream.getvalue())
    lines = [ln for chunk in visible.split("\r") for ln in chunk.split("\n") if ln.strip()]
    assert lines and max(len(ln) for ln in lines) <= 80, max(lines, key=len)
    assert any("-> done val loss 4.000" in ln for ln in lines)
