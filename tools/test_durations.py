"""``benchmarks/results/cpu/<date>-<commit>/test_durations.md``: the two test tiers' times on a fresh
clone, per test file, from pytest's JUnit XML of each tier::

    make test     PYTEST_ARGS="-q -p no:cacheprovider --junitxml=fast.xml"
    make test-all PYTEST_ARGS="-q -p no:cacheprovider --junitxml=all.xml"
    python -m tools.test_durations --fast fast.xml 290 --all all.xml 560 --install 180 --out FOLDER \
        --order tests/file_seconds.json --import-torch 1.3

``--import-torch`` is the CPU seconds (user + system) of ``.venv/bin/python -c "import torch"`` on the
machine beside the tiers: the same code's times move with it (1.2 s on one day's 2-core machine, 3.2 s
on another's), so two records compare by it and not by their wall times alone.

The numbers after each file are the tier's wall seconds as ``time`` measured them (pytest's own
count leaves out the start-up); a file's time is the sum of its tests' times (setup, call and teardown,
so a module's shared spawn of ranks counts once, in its first test), which under two xdist workers
includes the load the other worker put beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import platform
import xml.etree.ElementTree as ET
from pathlib import Path


def per_file(junit: Path) -> tuple[dict[str, float], dict[str, int], dict[str, int]]:
    """(seconds, tests, skipped) per test file of a JUnit XML report."""
    seconds: dict[str, float] = collections.Counter()
    tests: dict[str, int] = collections.Counter()
    skipped: dict[str, int] = collections.Counter()
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("classname", "").split(".")[-1] + ".py"
        seconds[name] += float(case.get("time", 0))
        tests[name] += 1
        skipped[name] += case.find("skipped") is not None
    return dict(seconds), dict(tests), dict(skipped)


def write_order(junit: Path, path: Path) -> dict[str, float]:
    """Each test file's seconds in ``junit`` (a ``make test-all`` report), longest first, as JSON at
    ``path``: the order in which the tests hand files to their workers (``tests/order.py``)."""
    seconds = per_file(junit)[0]
    data = {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: (-kv[1], kv[0]))}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return data


def _minutes(s: float) -> str:
    return f"{int(s // 60)} min {int(round(s % 60)):02d} s"


def markdown(
    fast: Path,
    fast_wall: float,
    every: Path,
    all_wall: float,
    install: float,
    machine: str,
    import_torch: float | None = None,
) -> str:
    f_s, f_n, f_k = per_file(fast)
    a_s, a_n, a_k = per_file(every)
    speed = (
        []
        if import_torch is None
        else [
            "",
            f'Machine speed: `python -c "import torch"` took {import_torch:.2f} s of CPU beside these runs'
            " (the same code's times move with it: compare records by it).",
        ]
    )
    lines = [
        "# The test tiers on a fresh clone, per file",
        "",
        f"Machine: {machine}. `make test` (every test not marked `slow`) and `make test-all` (every test),",
        "each on a fresh clone beside `shared/`, two xdist workers of one thread (`--dist loadfile`).",
        *speed,
        "",
        "| tier | tests (skipped) | wall | tests' seconds, both workers summed |",
        "| --- | --- | --- | --- |",
        f"| install (`make install`) | | {_minutes(install)} | |",
        f"| fast: `make test` | {sum(f_n.values())} ({sum(f_k.values())}) | **{_minutes(fast_wall)}** | "
        f"{sum(f_s.values()):.0f} s |",
        f"| all: `make test-all` | {sum(a_n.values())} ({sum(a_k.values())}) | **{_minutes(all_wall)}** | "
        f"{sum(a_s.values()):.0f} s |",
        "",
        "Per file, slowest first (seconds in `make test-all`; the fast tier's where the file is in it):",
        "",
        "| file | tier | tests | all: s | fast: s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, s in sorted(a_s.items(), key=lambda kv: -kv[1]):
        tier = "fast" if name in f_s else "slow"
        fast_s = f"{f_s[name]:.1f}" if name in f_s else ""
        lines.append(f"| `tests/{name}` | {tier} | {a_n[name]} | {s:.1f} | {fast_s} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tools.test_durations", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--fast", nargs=2, metavar=("XML", "WALL_S"), required=True)
    parser.add_argument("--all", nargs=2, metavar=("XML", "WALL_S"), required=True)
    parser.add_argument("--install", type=float, required=True, metavar="WALL_S")
    parser.add_argument("--machine", default=f"{platform.processor() or platform.machine()}, Python "
                        f"{platform.python_version()}")  # fmt: skip
    parser.add_argument("--out", type=Path, required=True, help="the results folder")
    parser.add_argument(
        "--import-torch",
        type=float,
        metavar="CPU_S",
        help='CPU seconds of `python -c "import torch"` on the machine beside the tiers (its speed)',
    )
    parser.add_argument(
        "--order",
        type=Path,
        metavar="JSON",
        help="also write the all tier's seconds per file there "
        "(tests/file_seconds.json: the order the workers take the files in)",
    )
    args = parser.parse_args(argv)
    if args.import_torch is not None and not args.import_torch > 0:
        parser.error(f"--import-torch: expected a positive number of CPU seconds, got {args.import_torch}")
    if args.order is not None:
        write_order(Path(args.all[0]), args.order)
    text = markdown(
        Path(args.fast[0]),
        float(args.fast[1]),
        Path(args.all[0]),
        float(args.all[1]),
        args.install,
        args.machine,
        args.import_torch,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "test_durations.md").write_text(text)
    print(args.out / "test_durations.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
