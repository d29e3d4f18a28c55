"""``tools/census.py``: a command's process tree and each process's own CPU time, read from ``/proc``,
against what the processes measure of themselves (``time.process_time``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tools import census
from tools.procs import alive

CHILD = """
import sys, time
t = time.process_time()
while time.process_time() - t < 0.5:
    pass
open(sys.argv[1], "w").write(repr(time.process_time()))
time.sleep(1.0)  # read once more after the last of its CPU, even on a loaded machine
"""
PARENT = """
import subprocess, sys, time
subprocess.run([sys.executable, "-c", {child!r}, {path!r}], check=True)
time.sleep(0.3)
sys.exit(3)
"""


def test_each_process_of_the_tree_with_its_own_cpu_time_and_the_command_s_exit_code(tmp_path):
    outsider = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])  # not descended
    try:
        path = str(tmp_path / "child_cpu")
        code = census.main(
            ["--out", str(tmp_path), "--", sys.executable, "-c", PARENT.format(child=CHILD, path=path)]
        )
    finally:
        outsider.kill()
        outsider.wait()
    assert code == 3
    rows = json.loads((tmp_path / "processes.json").read_text())
    assert outsider.pid not in {r["pid"] for r in rows}
    (parent,) = [r for r in rows if "subprocess.run" in r["cmdline"]]
    (child,) = [r for r in rows if "process_time() - t" in r["cmdline"] and r is not parent]
    assert child["ppid"] == parent["pid"]
    own = float((tmp_path / "child_cpu").read_text())
    assert child["cpu"] == pytest.approx(own, abs=0.05)  # clock ticks of 10 ms, one read's worth
    assert parent["cpu"] < own  # the parent waited: its CPU is its own start-up, not the child's
    md = (tmp_path / "census.md").read_text()
    assert f"{len(rows)} processes" in md and "| other python | 2 |" in md
    # a command of several lines (python -c) is one row of the table
    assert len([line for line in md.splitlines() if line.startswith("| ") and "`" in line]) == len(rows)
    record = json.loads((tmp_path / "census.json").read_text())
    assert record["processes"] == len(rows) and record["cpu"] == pytest.approx(
        sum(r["cpu"] for r in rows), abs=0.01
    )
    assert record["kinds"] == [{"kind": "other python", "processes": 2, "cpu": pytest.approx(record["cpu"])}]


@pytest.mark.parametrize(
    ("cmdline", "expected"),
    [
        ("/v/bin/python -u -c import sys;exec(eval(sys.stdin.readline()))", "pytest-xdist worker"),
        ("/v/bin/python -m pytest --collect-only -q -m gpu tests", "pytest"),
        ("/v/bin/python -m addnorm.cli study /tmp/pytest-of-root/x/spec.yaml --out o", "study CLI"),
        ("/v/bin/python -m torch.distributed.run --nproc-per-node=2 -m addnorm.train.launch d", "torchrun l"),
        ("/v/bin/python -u -m addnorm.train.launch /tmp/pytest-of-root/addnorm-ranks-x", "torchrun rank"),
        ("/v/bin/python -B -c from multiprocessing.spawn import spawn_main; spawn_main(3)", "study proc"),
        ("/usr/lib/gcc/x86_64-linux-gnu/12/cc1plus -quiet x.cpp", "C++ compiler"),
        ("/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet --port 1", "Ray"),
        ("/usr/bin/make test-all", "other"),
    ],
)
def test_a_process_s_kind_is_the_first_whose_piece_its_command_line_holds(cmdline, expected):
    assert census.kind(cmdline).startswith(expected)


@pytest.mark.parametrize(
    ("argv", "message"),
    [(["--out", "o"], "cmd: expected"), (["--out", "o", "--every", "0", "--", "true"], "--every")],
)
def test_bad_arguments_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit):
        census.main(argv)
    assert message in capsys.readouterr().err


def test_a_census_that_fails_takes_its_command_with_it(tmp_path, monkeypatch):
    pid_file = tmp_path / "pid"
    real = census.stats

    def failing():  # a failure of the census's own, once the command runs
        if pid_file.exists() and pid_file.read_text():
            raise RuntimeError("the census failed")
        return real()

    monkeypatch.setattr(census, "stats", failing)
    code = f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)"
    with pytest.raises(RuntimeError, match="the census failed"):
        census.watch([sys.executable, "-c", code], every=0.05)
    assert not alive(int(pid_file.read_text()))  # terminated and reaped, not left running
