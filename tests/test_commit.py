"""The commit of the code that runs, one source of truth for a study's provenance and the benchmarks:
``$ADDNORM_COMMIT`` (``addnorm study --commit``), then the checkout's ``benchmarks/.commit`` (a copy of the
tree without ``.git``), then git; a run's provenance says which."""

from __future__ import annotations

import os
import subprocess

import pytest
from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.commit import COMMIT_ENV, checkout_root, commit_of
from addnorm.study import Store


@pytest.fixture
def no_commit_env(monkeypatch):
    monkeypatch.delenv(COMMIT_ENV, raising=False)
    monkeypatch.delenv(COMMIT_ENV + "_SOURCE", raising=False)


def test_the_commit_is_the_given_one_then_the_file_then_git(tmp_path, monkeypatch, no_commit_env):
    root = tmp_path / "tree"  # a copy of the tree without .git
    (root / "benchmarks").mkdir(parents=True)
    found = commit_of(root)
    assert found.sha is None and "no git history in this copy of the tree" in found.source
    (root / "benchmarks" / ".commit").write_text("fb82146\n")
    assert (commit_of(root).sha, commit_of(root).source) == ("fb82146", "benchmarks/.commit")
    monkeypatch.setenv(COMMIT_ENV, "abc1234")
    assert (commit_of(root).sha, commit_of(root).source) == ("abc1234", f"${COMMIT_ENV}")
    monkeypatch.setenv(COMMIT_ENV + "_SOURCE", "--commit")
    assert commit_of(root).source == "--commit"


def test_in_a_git_checkout_the_commit_is_its_head(no_commit_env):
    root = checkout_root()
    if root is None or not (root / ".git").exists() or (root / "benchmarks" / ".commit").exists():
        pytest.skip("not a git checkout without benchmarks/.commit")
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    found = commit_of()
    assert (found.sha, found.source) == (head.stdout.strip(), "git rev-parse HEAD")
    assert found.dirty in (True, False)


def test_a_study_run_records_the_commit_given_with_commit(tmp_path, no_commit_env):
    spec = tmp_path / "spec.yaml"
    spec.write_text(
        "name: c\nbase: {d_model: 16, n_heads: 2, d_ff: 32, n_layers: 2, batch_size: 4, seq_len: 16, "
        "steps: 2, eval_every: 0}\nexperiments: {main: null}\n"
    )
    out = tmp_path / "out"
    args = ["study", str(spec), "--out", str(out), "--workers", "1", "--quiet", "--commit", "fb82146"]
    result = CliRunner().invoke(app, args, env={COMMIT_ENV: None, COMMIT_ENV + "_SOURCE": None})
    assert result.exit_code == 0, result.output
    with Store(out / "study.sqlite") as store:
        (run,) = store.runs()
    assert (run["provenance"]["git_commit"], run["provenance"]["commit_source"]) == ("fb82146", "--commit")
    assert COMMIT_ENV not in os.environ  # the option set it for that invocation only
    bad = CliRunner().invoke(app, [*args[:-1], "not-a-sha"], env={COMMIT_ENV: None})
    assert (
        bad.exit_code == 2
        and "--commit: expected a git commit (4 to 40 hex digits), got 'not-a-sha'" in bad.output
    )
