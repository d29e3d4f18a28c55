"""The runnable blocks of the documentation (``README.md`` and ``docs/*.md``) and how a torchrun block
runs: the README test (``tests/test_readme.py``) runs them all, the torchrun benchmark
(``benchmarks/study/readme_torchrun.py``) runs the torchrun blocks many times.

A fenced block whose language is ``python`` (``py``) or ``bash`` (``sh``, ``shell``, ``console``),
indented or not, is a program; the line before its fence may mark it: ``<!-- test: torchrun 2 -->``
(a script under ``torchrun --nproc-per-node 2``), ``<!-- test: gpu -->`` (only where CUDA is),
``<!-- test: skip (REASON) -->`` (never run). No torch import here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ALL", "Block", "ENV", "FILES", "ROOT", "SKIP", "TORCHRUN", "blocks", "run_torchrun"]

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


def run_torchrun(
    block: Block, folder: Path, *, env: dict | None = None, timeout: float = 600, python: str = sys.executable
) -> subprocess.CompletedProcess:
    """``block`` as a user runs it: saved as ``folder/example.py`` and started with ``torchrun
    --standalone --nproc-per-node 2 example.py`` in ``folder`` (two ranks; the block's own teardown and
    the interpreter's exit included), with ``TMPDIR`` set to ``folder`` (torchrun leaves a folder in the
    temporary directory). Output captured; a run past ``timeout`` seconds raises
    ``subprocess.TimeoutExpired``."""
    (folder / "example.py").write_text(block.code)
    command = [python, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "example.py"]
    env = {**(ENV if env is None else env), "TMPDIR": str(folder)}
    return subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=timeout)
