"""The study commands of the ``addnorm`` CLI: ``study``, ``report`` and ``export``.

The main Typer app (``addnorm.cli``) calls :func:`register`; a library error in any of these commands
becomes one ``error: ...`` line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

from pathlib import Path

import typer

from ..cli_errors import handle_errors

DEFAULT_OUT = Path("addnorm-out")


def _database(out: Path) -> Path:
    db = Path(out) / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"out: no study database at {str(db)!r}; run `addnorm study --out {out}` first")
    return db


def study(
    spec: str = typer.Argument("quick", help="a preset name (see --list) or a path to a YAML spec"),
    out: Path = typer.Option(None, "--out", help="output folder (default addnorm-out/<study name>)"),
    set_: list[str] = typer.Option(
        [], "--set", help="override a setting: key=value, dotted keys, YAML values (repeatable)"
    ),
    workers: int = typer.Option(1, "--workers", help="run in N processes (1: in this process)"),
    csv: bool = typer.Option(False, "--csv", help="also export runs and metrics to <out>/csv"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
    list_presets: bool = typer.Option(False, "--list", help="list the shipped presets and exit"),
) -> None:
    """Run a study (resuming one already started in the same folder) and write its report."""
    from .runner import run_study
    from .spec import load_spec, preset_names

    if list_presets:
        for name in preset_names():
            typer.echo(f"{name}: {' '.join(load_spec(name).description.split())}")
        return
    if workers < 1:
        raise ValueError(f"--workers: expected a positive integer, got {workers}")
    plan = load_spec(spec, set_)
    folder = out or DEFAULT_OUT / plan.name
    outcome = run_study(plan, folder, workers=workers, progress=not quiet)
    typer.echo(f"{outcome.total} runs ({outcome.skipped} already stored, {outcome.ran} run now)")
    typer.echo(f"report: {outcome.report}")
    typer.echo(f"database: {folder / 'study.sqlite'}")
    if csv:
        from .store import Store

        with Store(folder / "study.sqlite") as store:
            store.export_csv(folder / "csv")
        typer.echo(f"csv: {folder / 'csv'}")


def report(out: Path = typer.Argument(..., help="a study folder holding study.sqlite")) -> None:
    """Rebuild a study's report from its database (nothing is retrained)."""
    from .report import build_report

    _database(out)
    typer.echo(f"report: {build_report(out)}")


def export(
    out: Path = typer.Argument(..., help="a study folder holding study.sqlite"),
    to: Path = typer.Option(None, "--to", help="folder for the CSV files (default <out>/csv)"),
) -> None:
    """Export a study's runs, per-step and per-layer metrics to CSV."""
    from .store import Store

    with Store(_database(out)) as store:
        for path in store.export_csv(to or out / "csv"):
            typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add the ``study``, ``report`` and ``export`` commands to ``app``."""
    app.command("study")(handle_errors(study))
    app.command("report")(handle_errors(report))
    app.command("export")(handle_errors(export))
