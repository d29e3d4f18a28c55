"""The ``addnorm`` command group, quick to start: what lets ``addnorm --help``, ``--version``,
``study --list``, ``study --show PRESET`` and ``study --keys [--markdown]`` answer without importing
torch (``benchmarks/host/cli_startup.py`` times them against ``import torch``).

- The study commands (``study``, ``report``, ``export``, ``compare``: :mod:`addnorm.cli.study`, which
  imports torch) are registered when one of them runs; until then the group holds placeholders whose
  help is the commands' docstrings, read from that module's source without importing it.
- ``study`` given only ``--list``, ``--show PRESET`` (a shipped preset) or ``--keys [--markdown]`` is
  answered here: the presets are read from their files, the spec keys from :mod:`addnorm.study.keys`
  (which the study command prints too, and which imports no torch). Any other arguments go to the
  study command itself.
- The other commands (``list``, ``explain``, ``inspect``, in :mod:`addnorm.cli`) import what they use
  inside their bodies.
"""

from __future__ import annotations

import ast
import contextlib
import io
from collections.abc import Callable
from importlib import resources

import typer
from typer.core import TyperCommand, TyperGroup

STUDY_COMMANDS = (
    "study",
    "report",
    "export",
    "compare",
)  # what addnorm.cli.study.register adds (its function names)
_PACKAGE = resources.files("addnorm")
_PRESETS = _PACKAGE / "study" / "presets"


class _Placeholder(TyperCommand):
    """A study command before it is loaded: its name and help, for ``addnorm --help``."""


def _docstrings(source: str, names: tuple[str, ...]) -> dict[str, str]:
    """The cleaned docstrings of the top-level functions ``names`` in Python ``source``."""
    tree = ast.parse(source)
    return {
        node.name: ast.get_docstring(node, clean=True) or ""
        for node in tree.body
        if isinstance(node, ast.FunctionDef) and node.name in names
    }


def preset_names() -> list[str]:
    """The shipped presets (as :func:`addnorm.study.spec.preset_names`, without importing the study)."""
    return sorted(p.name[: -len(".yaml")] for p in _PRESETS.iterdir() if p.name.endswith(".yaml"))


def _list_presets() -> None:
    import yaml

    for name in preset_names():
        data = yaml.safe_load((_PRESETS / f"{name}.yaml").read_text())
        typer.echo(f"{name}: {' '.join(str(data.get('description') or '').split())}")


def quick_study(args: list[str]) -> Callable[[], None] | None:
    """What ``addnorm study ARGS`` prints when ARGS only ask for presets or keys; None otherwise."""
    if args == ["--list"]:
        return _list_presets
    if len(args) == 1 and args[0].startswith("--show="):
        args = ["--show", args[0].split("=", 1)[1]]
    if len(args) == 2 and args[0] == "--show" and args[1] in preset_names():
        text = (_PRESETS / f"{args[1]}.yaml").read_text()
        return lambda: typer.echo(text, nl=False)
    if sorted(args) in (["--keys"], ["--keys", "--markdown"]):
        text = spec_keys("markdown" if "--markdown" in args else "text")
        return lambda: typer.echo(text, nl=False)
    return None


class LazyGroup(TyperGroup):
    """The ``addnorm`` group: its own commands, and the study commands loaded when one runs."""

    def __init__(self, **attrs) -> None:
        super().__init__(**attrs)
        docs = _docstrings((_PACKAGE / "cli" / "study.py").read_text(), STUDY_COMMANDS)
        for name in STUDY_COMMANDS:
            self.commands.setdefault(
                name, _Placeholder(name, help=docs.get(name), rich_markup_mode=self.rich_markup_mode)
            )

    def resolve_command(self, ctx, args):
        name = args[0] if args else None
        if isinstance(self.commands.get(name), _Placeholder):
            answer = quick_study(args[1:]) if name == "study" else None
            if answer is not None:
                return name, TyperCommand(name, callback=answer, help=self.commands[name].help), []
            self._load_study_commands()
        return super().resolve_command(ctx, args)

    def _load_study_commands(self) -> None:
        for name, command in study_commands(self.rich_markup_mode).items():
            self.commands[name] = command


def study_commands(rich_markup_mode=None) -> dict[str, typer.core.TyperCommand]:
    """The study commands as :mod:`addnorm.cli.study` registers them (imports torch)."""
    from typer.main import get_command_from_info

    from .study import register

    app = typer.Typer()
    register(app)
    build = get_command_from_info
    return {
        info.name: build(info, pretty_exceptions_short=True, rich_markup_mode=rich_markup_mode)
        for info in app.registered_commands
    }


def run_study_command(args: list[str]) -> str:
    """What the study command itself prints for ``addnorm study ARGS`` (its stdout; imports torch)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        study_commands()["study"].main(args, prog_name="addnorm study", standalone_mode=False)
    return out.getvalue()


def spec_keys(kind: str) -> str:
    """``study --keys`` (``text``) or ``study --keys --markdown`` (``markdown``), without torch."""
    from ..study import keys

    return keys.markdown() if kind == "markdown" else keys.text()
