"""The README's and docs' blocks marked ``<!-- test: torchrun 2 -->`` run as a user runs them, on two
processes (the rest of the blocks: ``tests/test_readme.py``). Slow tier: each block starts torchrun
and two ranks that import torch."""

from __future__ import annotations

import pytest

from tools.doc_blocks import TORCHRUN, Block, run_torchrun

pytestmark = pytest.mark.slow  # spawned ranks


def _ids(block: Block) -> str:
    return block.where


def test_the_docs_have_torchrun_blocks():
    """The extraction finds the marked blocks (so the test below cannot pass on nothing)."""
    assert TORCHRUN and all(b.kind == "python" for b in TORCHRUN)


@pytest.mark.parametrize("block", TORCHRUN, ids=_ids)
def test_torchrun_block_runs_as_written_on_two_processes(block, tmp_path):
    """The block as a user runs it (saved as a script, ``torchrun --standalone --nproc-per-node 2``,
    its own teardown and the interpreter's exit included; a failure on one rank ends the other:
    torchrun stops it) runs to its end on both ranks. The exit used to abort now and then (issue 41,
    docs/gloo-exit-abort.md); ``benchmarks/study/readme_torchrun.py`` runs these blocks 50 times under
    load."""
    ran = run_torchrun(block, tmp_path)
    assert ran.returncode == 0, f"{block.where}: torchrun exit {ran.returncode}\n{ran.stderr[-3000:]}"
