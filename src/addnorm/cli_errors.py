"""One rule for every command line entry point: a library error becomes one ``error: ...`` line on
stderr and exit code 2, never a traceback. Shared by ``addnorm.cli`` and ``addnorm.study.cli``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TypeVar

import typer

F = TypeVar("F", bound=Callable)
LIBRARY_ERRORS = (ValueError, TypeError, KeyError)


def fail(err: BaseException) -> typer.Exit:
    """Print ``err`` as one ``error:`` line on stderr; the Exit (code 2) to raise."""
    message = str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)
    typer.echo(f"error: {' '.join(message.split())}", err=True)
    return typer.Exit(code=2)


def handle_errors(command: F) -> F:
    """Turn a library ValueError/TypeError/KeyError into one ``error: ...`` line on stderr, exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except LIBRARY_ERRORS as err:
            raise fail(err) from None

    return wrapper  # type: ignore[return-value]
