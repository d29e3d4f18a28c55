"""Optional integrations are extras (``pip install 'addnorm[ray]'``), imported only when asked for."""

from __future__ import annotations

import importlib
import importlib.util
from types import ModuleType


class MissingExtra(ImportError, ValueError):
    """An optional integration was asked for without its extra installed; the message names the extra.
    An ImportError (what a caller of an optional import expects) and a ValueError (what the command line
    turns into one error line)."""


def message(feature: str, extra: str) -> str:
    return f"{feature} needs the {extra!r} extra: pip install 'addnorm[{extra}]'"


def require(module: str, extra: str, feature: str) -> ModuleType:
    """Import ``module`` for ``feature`` (e.g. "--track mlflow"), or raise :class:`MissingExtra`
    naming ``extra``."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtra(message(feature, extra)) from None


def check(module: str, extra: str, feature: str) -> None:
    """Like :func:`require` without importing ``module`` yet (a module that must be set up first)."""
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # ValueError: a module set to None in sys.modules
        found = False
    if not found:
        raise MissingExtra(message(feature, extra))
