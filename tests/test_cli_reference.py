"""``docs/cli.md`` is the command line's own account of itself: the committed page equals what
``addnorm.cli.reference`` renders from the Typer app (regenerate with ``python -m addnorm.cli.reference``),
it names every command and every option, and the generator, which lives in the CLI package, imports no
torch until it renders."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from addnorm.cli import reference

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "cli.md"


def test_the_committed_page_is_the_generated_one():
    assert PAGE.read_text() == reference.markdown(), "docs/cli.md is stale: python -m addnorm.cli.reference"


def test_the_page_names_every_command_and_option():
    text = PAGE.read_text()
    found = reference.commands()
    assert {"study", "report", "export", "compare", "inspect", "explain", "list"} <= set(found)
    for name, command in found.items():
        assert f"## `addnorm {name}`" in text, name
        section = text.split(f"## `addnorm {name}`", 1)[1].split("\n## ", 1)[0]
        for param in command.params:
            shown = param.opts[0] if param.param_type_name == "option" else param.name.upper()
            assert f"`{shown}`" in section, (name, shown)


def test_importing_the_generator_imports_no_torch():
    code = "import sys, addnorm.cli.reference; assert 'torch' not in sys.modules, 'torch imported'"
    ran = subprocess.run(
        [sys.executable, "-c", code],
        env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr[-2000:]


def test_check_says_whether_the_page_is_stale(capsys):
    assert reference.main(["--check"]) == 0
    assert "up to date" in capsys.readouterr().out
