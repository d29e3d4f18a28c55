"""The fusion rule's measured rows (``src/addnorm/ops/measured_rows/<device>.json``), written from a
window's benchmark JSON and checked against it.

A row's ratio is a value a benchmark wrote (its provenance: the JSON file under
``benchmarks/results``, a JSON pointer ``key`` into it, optionally divided by the value at ``over``,
optionally inverted), so this tool reads the number where the benchmark put it and never retypes it::

    python -m tools.measured_rows check                 # every row's ratio equals its file's value
    python -m tools.measured_rows add h200 \\
        --json h200/2026-11-28-81f67f7/hf_step_h200.json \\
        --key /results/0/paired/fused~1plain/median --inverse \\
        --scope step --mode eager --dropout false --model hf \\
        --what "HF Llama 134M (RMSNorm, no dropout), eager: fused 1.051x plain (paired median)"

``add`` takes the device's name, the commit and the date from the JSON's ``machine`` record where it
has one, else from its window folder (``<date>-<commit>``), and refuses a ratio within the spread
(:data:`addnorm.ops.measured.SPREAD`: a tie is no row).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
ROWS = ROOT / "src" / "addnorm" / "ops" / "measured_rows"
WINDOW = re.compile(r"^(\d{4}-\d{2}-\d{2})-([0-9a-f]{7,40})(?:-dirty)?$")


def pointer(data, key: str):
    """The value at JSON pointer ``key`` (RFC 6901) in ``data``; a missing step is a one-line error."""
    if not key.startswith("/"):
        raise ValueError(f"key: expected a JSON pointer starting with '/', got {key!r}")
    value = data
    for part in key[1:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        try:
            value = value[int(part)] if isinstance(value, list) else value[part]
        except (KeyError, IndexError, ValueError, TypeError):
            raise ValueError(f"key {key!r}: no {part!r} at that step") from None
    return value


def value_of(provenance, results: Path | None = None) -> float:
    """The ratio that ``provenance`` (an :class:`addnorm.ops.measured.Provenance`) points at."""
    data = json.loads(((results or RESULTS) / provenance.file).read_text())
    value = float(pointer(data, provenance.key))
    if provenance.over:
        value /= float(pointer(data, provenance.over))
    return 1 / value if provenance.inverse else value


def _machine(data) -> dict:
    """The first ``machine`` record (a dict) in a benchmark's JSON, else {}."""
    if isinstance(data, dict):
        if isinstance(data.get("machine"), dict):
            return data["machine"]
        for v in data.values():
            if found := _machine(v):
                return found
    return {}


def provenance_of(file: str, key: str, over: str | None, inverse: bool, results: Path | None = None) -> dict:
    """A row's provenance: the file, keys and how they combine, and the run's commit and date (the
    JSON's machine record, else the window folder's name)."""
    machine = _machine(json.loads(((results or RESULTS) / file).read_text()))
    commit, date = machine.get("commit"), machine.get("date")
    if not (commit and date):
        m = WINDOW.match(Path(file).parent.name)
        if m is None:
            raise ValueError(f"--json {file}: no commit and date in it or in its folder's name")
        date, commit = date or m[1], commit or m[2]
    out = {"file": file, "key": key, "commit": str(commit), "date": str(date)}
    if over:
        out["over"] = over
    if inverse:
        out["inverse"] = True
    return out


def _bool(text: str | None) -> bool | None:
    if text is None:
        return None
    if text.lower() not in ("true", "false"):
        raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def add(args: argparse.Namespace, rows: Path | None = None, results: Path | None = None) -> dict:
    """Append a row to ``rows/<device file>.json`` from a window's JSON; returns the row."""
    from addnorm.ops.measured import SPREAD, Measured, Provenance

    prov = provenance_of(args.json, args.key, args.over, args.inverse, results)
    ratio = value_of(Provenance(**prov), results)
    if abs(ratio - 1) <= SPREAD:
        raise ValueError(f"ratio {ratio:.3f} is within the spread ({SPREAD:.0%}): a tie is no row")
    path = (rows or ROWS) / f"{args.device_file}.json"
    data = json.loads(path.read_text()) if path.exists() else {"device": args.device, "rows": []}
    if args.device and args.device != data["device"]:
        raise ValueError(f"--device {args.device!r}: {path.name} holds {data['device']!r}'s rows")
    regime = dict(mode=args.mode, norm=args.norm, prenorm=args.prenorm, dropout=args.dropout)
    regime.update(min_hidden=args.min_hidden, max_numel=args.max_numel, model=args.model)
    row = Measured(
        data["device"], args.scope, **regime, ratio=ratio, what=args.what, provenance=Provenance(**prov)
    )
    data["rows"].append(row.record())
    path.write_text(json.dumps(data, indent=2) + "\n")
    return row.record()


def check(rows: Path | None = None, results: Path | None = None) -> list[str]:
    """Every row whose ratio differs from its file's value (one line each); [] when all agree."""
    from addnorm.ops.measured import load_rows

    return [
        f"{r.device} {r.scope} {r.source} {r.provenance.key}: row {r.ratio!r}, file {v!r}"
        for r in load_rows(rows or ROWS)
        if (v := value_of(r.provenance, results)) != r.ratio
    ]


def parser() -> argparse.ArgumentParser:
    """The command line: ``check`` and ``add`` (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m tools.measured_rows", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("check", help="every row's ratio equals the value its provenance points at")
    a = sub.add_parser("add", help="append a row read from a window's benchmark JSON")
    a.add_argument("device_file", help="the data file's name without .json (cpu, h100, h200)")
    a.add_argument("--device", help="torch's name of the device (a new file needs it; default: the file's)")
    a.add_argument("--json", required=True, help="the benchmark JSON, relative to benchmarks/results")
    a.add_argument("--key", required=True, help="JSON pointer to the value")
    a.add_argument("--over", help="JSON pointer to a value the first is divided by")
    a.add_argument("--inverse", action="store_true", help="the value is unfused over fused: invert it")
    a.add_argument("--scope", required=True, choices=("step", "op"))
    a.add_argument("--mode", choices=("eager", "compile"))
    a.add_argument("--norm", choices=("layernorm", "rmsnorm"))
    a.add_argument("--prenorm", type=_bool)
    a.add_argument("--dropout", type=_bool)
    a.add_argument("--min-hidden", type=int, default=0)
    a.add_argument("--max-numel", type=int)
    a.add_argument("--model", choices=("hf", "addnorm"))
    a.add_argument("--what", required=True, help="what was timed, in words")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.command == "add":
            print(json.dumps(add(args), indent=2))
            return 0
        bad = check()
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    for line in bad:
        print(line)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
