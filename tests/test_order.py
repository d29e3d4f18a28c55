"""The order the test files go to the xdist workers (``tests/order.py``) and the record it reads
(``tools/test_durations.write_order``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import order
import pytest

from tools.test_durations import main, write_order


def _junit(path, cases) -> None:
    path.write_text(
        "<testsuites><testsuite>"
        + "".join(f'<testcase classname="tests.{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
        + "</testsuite></testsuites>"
    )


def test_files_go_to_the_workers_longest_first_each_file_whole(tmp_path, monkeypatch):
    """tests/order.py: whole files, longest recorded first, an unrecorded file before all; each file's
    tests in their order; the seconds are the JUnit report's sums per file (tools/test_durations)."""
    junit = tmp_path / "all.xml"
    _junit(junit, [("test_a", "x", 1.0), ("test_b", "y", 4.0), ("test_a", "z", 2.5), ("test_c", "w", 3.5)])
    seconds = tmp_path / "file_seconds.json"
    assert write_order(junit, seconds) == {"test_b.py": 4.0, "test_c.py": 3.5, "test_a.py": 3.5}
    assert list(json.loads(seconds.read_text())) == ["test_b.py", "test_a.py", "test_c.py"]
    monkeypatch.setattr(order, "SECONDS", seconds)
    item = lambda f, n: SimpleNamespace(path=tmp_path / f, name=n)  # noqa: E731
    items = [item("test_a.py", 1), item("test_a.py", 2), item("test_new.py", 1), item("test_c.py", 1)]
    items += [item("test_c.py", 2), item("test_b.py", 1)]  # as pytest collects: a file's tests together
    order.longest_first(items)
    assert [(i.path.name, i.name) for i in items] == [
        ("test_new.py", 1), ("test_b.py", 1),
        ("test_a.py", 1), ("test_a.py", 2),  # 3.5 s as test_c: collected first, kept first
        ("test_c.py", 1), ("test_c.py", 2),
    ]  # fmt: skip


def test_the_durations_record_gives_each_tier_each_file_and_the_machine_speed(tmp_path, capsys):
    """test_durations.md: each tier's tests and wall time, every file with its tier and seconds summed
    from the JUnit reports, and the ``import torch`` CPU seconds the record's reader scales by."""
    fast, every = tmp_path / "fast.xml", tmp_path / "all.xml"
    _junit(fast, [("test_a", "x", 1.0), ("test_a", "z", 2.0)])
    _junit(every, [("test_a", "x", 1.5), ("test_a", "z", 2.0), ("test_b", "y", 7.25)])
    args = ["--fast", str(fast), "250", "--all", str(every), "601", "--install", "100"]
    args += ["--out", str(tmp_path)]
    assert main([*args, "--machine", "2-core test box", "--import-torch", "1.234"]) == 0
    text = (tmp_path / "test_durations.md").read_text()
    assert "Machine: 2-core test box." in text and '`python -c "import torch"` took 1.23 s of CPU' in text
    assert "| fast: `make test` | 2 (0) | **4 min 10 s** | 3 s |" in text
    assert "| all: `make test-all` | 3 (0) | **10 min 01 s** | 11 s |" in text
    slowest, second = "`tests/test_b.py` | slow | 1 | 7.2 |", "`tests/test_a.py` | fast | 2 | 3.5 | 3.0 |"
    assert text.index(slowest) < text.index(second)  # slowest first
    assert main(args) == 0 and "import torch" not in (tmp_path / "test_durations.md").read_text()
    with pytest.raises(SystemExit):
        main([*args, "--import-torch", "0"])
    assert "--import-torch: expected a positive number of CPU seconds, got 0.0" in capsys.readouterr().err
