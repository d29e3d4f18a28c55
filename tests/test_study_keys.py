"""``addnorm study --keys`` and ``docs/study-spec.md`` name every key a spec may hold, the run keys from a
module generated from the run config (readable without torch), in Markdown tables whose every row has
its header's columns."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from typer.testing import CliRunner

from addnorm.cli import app
from addnorm.study import keys
from addnorm.study.spec import EXPERIMENT_KEYS, SPEC_KEYS, spec_keys
from addnorm.train import RunConfig

ROOT = Path(__file__).resolve().parents[1]
STUDY = ROOT / "src" / "addnorm" / "study"


def cells(line: str) -> list[str]:
    """A Markdown table row's cells: split on the pipes that are not escaped."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def tables(text: str) -> list[list[list[str]]]:
    out, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                out.append(current)
            current.append(cells(line))
        else:
            current = None
    return out


def test_keys_lists_the_spec_structure_and_every_run_key():
    result = CliRunner().invoke(app, ["study", "--keys"])
    assert result.exit_code == 0, result.output
    for key in (*RunConfig.keys(), *SPEC_KEYS, *EXPERIMENT_KEYS, "variant"):
        assert re.search(rf"^{key} ", result.output, re.M), key
    assert "rank" in EXPERIMENT_KEYS and "default false" in result.output.split("\nrank ")[1].splitlines()[0]


def test_the_run_keys_module_is_generated_from_the_run_config_and_needs_no_torch():
    assert keys.RUN_KEYS == tuple(spec_keys())
    generated = (STUDY / "run_keys_generated.py").read_text()
    assert generated == keys.generated(spec_keys()), "regenerate: addnorm.study.spec.write_run_keys()"
    for name in (
        "keys",
        "run_keys_generated",
    ):  # stdlib and each other only: `--keys` can answer without torch
        tree = ast.parse((STUDY / f"{name}.py").read_text())
        imported = {
            (n.module or "") if isinstance(n, ast.ImportFrom) else a.name
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom))
            for a in n.names
        }
        assert imported <= {"__future__", "json", "run_keys_generated"}, (name, imported)


def test_every_markdown_row_has_its_headers_columns():
    for text in (keys.markdown(), (ROOT / "docs" / "study-spec.md").read_text()):
        found = tables(text)
        assert len(found) == 2
        for table in found:
            header = table[0]
            assert all(len(row) == len(header) for row in table), [r for r in table if len(r) != len(header)]
    (distributed,) = [r for r in tables(keys.markdown())[1] if r[0] == "`distributed`"]
    assert "{strategy: ddp \\| fsdp2, nproc: N}" in distributed[2]  # the pipe kept, escaped
    assert keys.cell("a | b\nc") == "a \\| b c"
