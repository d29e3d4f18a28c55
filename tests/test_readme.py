"""Every Python block and shell block of README.md and docs/*.md runs as written (issue 31 item 5).

Each fenced block whose language is ``python`` (``py``) or ``bash`` (``sh``, ``shell``, ``console``),
indented or not, runs on the CPU in a fresh temporary folder:

- a Python block in this process, in a namespace of its own (a block that leans on a name from
  another block fails);
- a Python block marked ``<!-- test: torchrun 2 -->`` (the line before its fence) as a user runs it:
  saved as a script and started with ``torchrun --standalone --nproc-per-node 2``, its teardown and
  the interpreter's exit included (``tests/test_readme_torchrun.py``, in the slow tier: spawned ranks);
- a shell block through ``bash -e``, with this tree's ``addnorm`` and ``python``.

Other marks: ``<!-- test: gpu -->`` runs only where CUDA is (skipped, saying so, elsewhere);
``<!-- test: skip (REASON) -->`` never runs, and the test reports REASON. Nothing is skipped silently:
an unknown mark fails. Blocks in other languages (YAML, diagrams, text) are not programs. A block
added anywhere in these files is picked up with no change here. The blocks are found, and a torchrun
block run, by ``tools/doc_blocks.py``, which the torchrun benchmark shares.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools.doc_blocks import ALL, ENV, ROOT, SKIP, Block


def _ids(block: Block) -> str:
    return block.where


# The topic pages the front page links to (issue 51); each opens with code.
PAGES = (
    "guide.md",
    "fused-op.md",
    "huggingface.md",
    "torchtitan.md",
    "distributed.md",
    "study.md",
    "study-statistics.md",
    "cli.md",
    "performance.md",
    "placements.md",
    "architecture.md",
    "study-spec.md",
)
# A commit hash: 7 to 40 hex digits with at least one digit and one letter (so no word or plain number).
COMMIT_HASH = re.compile(r"\b(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


def test_the_readme_has_its_blocks_and_every_mark_is_known():
    """The extraction finds the README's and every page's examples (so this test cannot pass on
    nothing), and every mark is one of the four: an unknown one would skip silently."""
    readme = [b for b in ALL if b.where.startswith("README.md")]
    assert sum(b.kind == "python" for b in readme) >= 3 and any(b.kind == "shell" for b in readme)
    for page in PAGES[:9]:
        assert any(b.where.startswith(f"docs/{page}:") for b in ALL), f"docs/{page} has no runnable block"
    for block in ALL:
        assert block.mark in ("", "torchrun 2", "gpu") or SKIP.match(block.mark), (block.where, block.mark)


def test_the_readme_is_a_front_page():
    """At most 200 lines, Python within its first 60, a pip install line, a link to every topic page,
    and no commit hash or window-by-window history (that lives beside the result tables)."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines"
    first_python = next(i for i, line in enumerate(lines, 1) if line.strip() == "```python")
    assert first_python <= 60, f"the first Python block opens at line {first_python}"
    assert 'pip install "addnorm[' in text and 'pip install -e ".[dev]"' in text
    for page in PAGES:
        assert f"](docs/{page})" in text, f"README.md does not link docs/{page}"
    assert "](docs/report-quick.png)" in text
    assert not COMMIT_HASH.findall(text), COMMIT_HASH.findall(text)


def test_every_topic_page_opens_with_code():
    """A page's first thing after its title is a code block (a mark line may stand before it)."""
    for page in PAGES[:9]:
        lines = [line for line in (ROOT / "docs" / page).read_text().splitlines() if line.strip()]
        body = [line for line in lines[1:] if not line.lstrip().startswith("<!--")]
        assert lines[0].startswith("# ") and body[0].startswith("```"), f"docs/{page} does not open with code"


@pytest.mark.parametrize("block", [b for b in ALL if b.mark != "torchrun 2"], ids=_ids)
def test_block_runs_as_written(block, tmp_path, monkeypatch, registries_restored):
    if skip := SKIP.match(block.mark):
        pytest.skip(f"marked in the markdown: {skip['reason']}")
    if block.mark == "gpu" and not torch.cuda.is_available():
        pytest.skip("marked <!-- test: gpu -->: no CUDA here")
    monkeypatch.chdir(tmp_path)
    if block.kind == "shell":
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        ran = subprocess.run(
            ["bash", "-e", "-c", block.code],
            env={**ENV, "PATH": path},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert ran.returncode == 0, f"{block.where}: exit {ran.returncode}\n{ran.stderr[-2000:]}"
        return
    torch.manual_seed(0)
    exec(compile(block.code, block.where, "exec"), {"__name__": "__readme__"})  # noqa: S102


def test_make_run_passes_its_args_to_the_study():
    """``make run ARGS="--smoke"`` runs ``addnorm study --smoke`` (it ran ``addnorm --smoke``: "No such
    option"); ``make -n`` prints the commands without running them (no .venv is made)."""
    make_env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    shown = subprocess.run(  # under `make test`, the outer make's flags would print "make[1]: ..."
        ["make", "--no-print-directory", "-n", "run", "ARGS=--smoke", "VENV=/nonexistent-venv"],
        cwd=ROOT,
        env=make_env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip().splitlines()[-1] == "/nonexistent-venv/bin/addnorm study --smoke"
