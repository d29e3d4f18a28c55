"""A module-level setting among fixed choices, as the op's switches are (the compile path and where models
fuse, :mod:`.policy`; the dropout seed's source, :mod:`.seeds`): a value checked against its choices
when it is set (from the environment or a call), and a setting changed for a block, then back."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

__all__ = ["one_of", "scoped"]


def one_of(name: str, value: str, choices: tuple[str, ...]) -> str:
    """``value``, if it is one of ``choices``; else a ``ValueError`` naming the setting (``name``: the
    argument or the environment variable), the choices and the value."""
    if value not in choices:
        raise ValueError(f"{name}: expected one of {choices}, got {value!r}")
    return value


@contextlib.contextmanager
def scoped(set_value: Callable[[str], None], get_value: Callable[[], str], value: str) -> Iterator[None]:
    """``set_value(value)`` for a block, then the value ``get_value()`` read on entering it again."""
    previous = get_value()
    set_value(value)
    try:
        yield
    finally:
        set_value(previous)
