"""The order the test files go to the xdist workers (``tests/order.py``) and the record it reads
(``tools/test_durations.write_order``)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import order

from tools.test_durations import write_order


def test_files_go_to_the_workers_longest_first_each_file_whole(tmp_path, monkeypatch):
    """tests/order.py: whole files, longest recorded first, an unrecorded file before all; each file's
    tests in their order; the seconds are the JUnit report's sums per file (tools/test_durations)."""
    junit = tmp_path / "all.xml"
    cases = [("test_a", "x", 1.0), ("test_b", "y", 4.0), ("test_a", "z", 2.5), ("test_c", "w", 3.5)]
    junit.write_text(
        "<testsuites><testsuite>"
        + "".join(f'<testcase classname="tests.{c}" name="{n}" time="{t}"/>' for c, n, t in cases)
        + "</testsuite></testsuites>"
    )
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
