"""The commit of the code that runs: one source of truth for a study's provenance and the benchmarks'
results (``benchmarks/common/results_path.commit_info``).

A copy of the tree carried to a device may have no ``.git``, so the commit can be given. Found in this
order (:func:`commit_of`):

1. the environment variable ``ADDNORM_COMMIT`` (``addnorm study --commit SHA`` and the GPU suite's
   ``--commit`` set it for the processes they start), with ``ADDNORM_COMMIT_SOURCE`` saying where it came
   from (default ``$ADDNORM_COMMIT``);
2. the file ``benchmarks/.commit`` of the checkout (``git rev-parse HEAD > benchmarks/.commit`` before the
   tree is copied; git ignores the file, so a device call carries it explicitly);
3. ``git rev-parse HEAD`` of the checkout, with whether tracked files differ from it.

The checkout is the tree that holds this very package at ``src/addnorm``; an installed copy has none, and
only the environment variable can name its commit. Standard library only (no torch): the GPU suite's dry
run and ``addnorm study --dry-run`` read it.
"""

from __future__ import annotations

import functools
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["COMMIT_ENV", "COMMIT_FILE", "Commit", "checkout_root", "commit_of"]

COMMIT_ENV = "ADDNORM_COMMIT"
COMMIT_FILE = Path("benchmarks") / ".commit"  # relative to the checkout
_PACKAGE = Path(__file__).resolve().parent  # .../src/addnorm


@dataclass(frozen=True)
class Commit:
    """A commit (``sha``, None when none was found), where it came from (``source``: ``--commit``,
    ``benchmarks/.commit``, ``git rev-parse HEAD``, or why there is none) and whether tracked files
    differed from it (``dirty``: known from git only)."""

    sha: str | None
    source: str
    dirty: bool | None = None


def checkout_root() -> Path | None:
    """The checkout this package runs from (the folder above ``src/addnorm``), or None for an installed
    copy."""
    root = _PACKAGE.parents[1]
    return root if (root / "src" / "addnorm").resolve() == _PACKAGE else None


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(root), *args], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


@functools.lru_cache(maxsize=8)
def _git_state(root: Path) -> tuple[str | None, bool | None]:
    """(HEAD, tracked files differ from it) of the git checkout whose top level is ``root``; (None, None)
    where ``root`` is not the top of a git checkout (a copy without ``.git``, inside another repository)."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if not top or Path(top).resolve() != root.resolve():
        return None, None
    head = _git(root, "rev-parse", "HEAD")
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return head or None, (bool(status) if status is not None else None)


def commit_of(root: Path | None = None, file: Path | None = None, env: str = COMMIT_ENV) -> Commit:
    """The commit of the code in the checkout ``root`` (default :func:`checkout_root`): ``$env``, then
    ``file`` (default ``root/benchmarks/.commit``), then git (see the module docstring)."""
    given = os.environ.get(env, "").strip()
    if given:
        return Commit(given, os.environ.get(env + "_SOURCE", "").strip() or f"${env}")
    root = checkout_root() if root is None else Path(root)
    if root is None:
        return Commit(None, f"an installed copy: no ${env}")
    file = root / COMMIT_FILE if file is None else Path(file)
    if file.is_file():
        text = file.read_text().strip()
        if text:
            return Commit(text.split()[0], str(COMMIT_FILE))
    head, dirty = _git_state(root)
    if head:
        return Commit(head, "git rev-parse HEAD", dirty)
    return Commit(None, f"no ${env}, no {COMMIT_FILE}, and no git history in this copy of the tree")
