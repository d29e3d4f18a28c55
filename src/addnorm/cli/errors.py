"""One rule for every command line entry point: an error becomes one ``error: ...`` line on stderr and
its own exit code, never a traceback. Shared by ``addnorm.cli`` and ``addnorm.cli.study``.

Exit codes: 1 a run of the study failed (the study command's own), 2 bad input (a library
ValueError/TypeError/KeyError), 3 the study folder is in use by another process (an error carrying
``exit_code = 3``), 4 a storage fault (an OSError or an SQLite error: unreadable, locked or corrupt
database, read-only folder, full disk, a file where a folder should be), 130 interrupted (Ctrl-C, or
SIGTERM turned into one)."""

from __future__ import annotations

import functools
import sqlite3
from collections.abc import Callable
from typing import TypeVar

import typer

F = TypeVar("F", bound=Callable)
LIBRARY_ERRORS = (ValueError, TypeError, KeyError)
EXIT_RUN_FAILED, EXIT_BAD_INPUT, EXIT_IN_USE, EXIT_STORAGE, EXIT_INTERRUPTED = 1, 2, 3, 4, 130


def fail(err: BaseException, code: int = EXIT_BAD_INPUT, prefix: str = "") -> typer.Exit:
    """Print ``err`` as one ``error:`` line on stderr; the Exit (``code``, 2 unless told) to raise."""
    message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    typer.echo(f"error: {prefix}{' '.join(message.split())}", err=True)
    return typer.Exit(code=code)


def handle_errors(command: F) -> F:
    """Turn an error of ``command`` into one ``error: ...`` line on stderr and its exit code (above)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except typer.Exit:  # already reported (click's Exit is a RuntimeError with an exit_code)
            raise
        except LIBRARY_ERRORS as err:
            raise fail(err) from None
        except (OSError, sqlite3.Error) as err:
            raise fail(err, EXIT_STORAGE, "storage fault: ") from None
        except RuntimeError as err:
            if not hasattr(err, "exit_code"):
                raise
            raise fail(err, err.exit_code) from None
        except KeyboardInterrupt:
            typer.echo("interrupted: finished runs are stored; the same command resumes", err=True)
            # CPython 3.11 notes a KeyboardInterrupt that leaves a string exec (dataclasses' generated
            # methods, while torch imports a module lazily) as unhandled and, after finalising, ends the
            # process by SIGINT (exit -2) whatever it returns; the next string exec that succeeds clears
            # that note, so the exit is the 130 above (2 of 40 Ctrl-Cs early in a run, before this).
            exec("pass")  # noqa: S102
            raise typer.Exit(code=EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]
