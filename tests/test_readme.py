"""Every Python block and shell block of README.md and docs/*.md runs as written (issue 31 item 5).

Each fenced block whose language is ``python`` (``py``) or ``bash`` (``sh``, ``shell``, ``console``),
indented or not, runs on the CPU in a fresh temporary folder:

- a Python block in this process, in a namespace of its own (a block that leans on a name from
  another block fails);
- a Python block marked ``<!-- test: torchrun 2 -->`` (the line before its fence) as a script under
  ``torchrun --nproc-per-node 2``;
- a shell block through ``bash -e``, with this tree's ``addnorm`` and ``python``.

Other marks: ``<!-- test: gpu -->`` runs only where CUDA is (skipped, saying so, elsewhere);
``<!-- test: skip (REASON) -->`` never runs, and the test reports REASON. Nothing is skipped silently:
an unknown mark fails. Blocks in other languages (YAML, diagrams, text) are not programs. A block
added anywhere in these files is picked up with no change here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell"}
LANGUAGES["console"] = "shell"
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*$")
MARK = re.compile(r"^\s*<!--\s*test:\s*(?P<mark>.*?)\s*-->\s*$")
SKIP = re.compile(r"^skip \((?P<reason>.+)\)$")
ENV = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Block:
    where: str  # file:line of the opening fence
    kind: str  # python | shell
    code: str
    mark: str  # "" (run), "torchrun 2", "gpu" or "skip (reason)"


def blocks(path: Path) -> list[Block]:
    """The Python and shell blocks of a Markdown file, with the mark on the line before each."""
    lines, found, i = path.read_text().splitlines(), [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence is None:
            i += 1
            continue
        indent, start = fence["indent"], i
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        previous = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        mark = MARK.match(previous)
        kind = LANGUAGES.get(fence["lang"].lower())
        if kind is not None:
            body = "\n".join(
                line[len(indent) :] if line.startswith(indent) else line for line in lines[i + 1 : end]
            )
            where = f"{path.relative_to(ROOT)}:{start + 1}"
            found.append(Block(where, kind, textwrap.dedent(body) + "\n", mark["mark"] if mark else ""))
        i = end + 1
    return found


ALL = [b for path in FILES for b in blocks(path)]
TORCHRUN = [b for b in ALL if b.mark == "torchrun 2"]


def _ids(block: Block) -> str:
    return block.where


def test_the_readme_has_its_blocks_and_every_mark_is_known():
    """The extraction finds the README's examples (so this test cannot pass on nothing), and every
    mark is one of the four: an unknown one would skip silently."""
    readme = [b for b in ALL if b.where.startswith("README.md")]
    assert sum(b.kind == "python" for b in readme) >= 7 and any(b.kind == "shell" for b in readme)
    for block in ALL:
        assert block.mark in ("", "torchrun 2", "gpu") or SKIP.match(block.mark), (block.where, block.mark)


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


# Each rank runs the block, then leaves without the interpreter's teardown: a gloo worker thread that
# is still releasing the block's last collective when the interpreter finalizes needs the GIL there,
# and Python ends it with pthread_exit, which aborts the rank ("terminate called without an active
# exception"; torch 2.13, 5 of 40 runs of the parallelize block; see benchmarks/procs.run_spawned).
_RANK = """import os, sys
code = open(sys.argv[1]).read()
exec(compile(code, sys.argv[2], "exec"), {"__name__": "__main__"})
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""


@pytest.mark.parametrize("block", TORCHRUN, ids=_ids)
def test_torchrun_block_runs_as_written_on_two_processes(block, tmp_path):
    """The block, in a process of its own on each rank under torchrun (a failure on one rank ends the
    other: torchrun stops it), runs to its end on both ranks."""
    (tmp_path / "block.py").write_text(block.code)
    script = tmp_path / "rank.py"
    script.write_text(_RANK)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    ran = subprocess.run(
        [*command, str(script), "block.py", block.where],
        cwd=tmp_path,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, f"{block.where}: torchrun exit {ran.returncode}\n{ran.stderr[-3000:]}"


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
