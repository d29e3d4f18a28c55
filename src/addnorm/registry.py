"""One small registry: name -> entry, with normalised names and a clear error on unknown names."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")


def normalise_name(name: str) -> str:
    """Registry keys are case-insensitive and treat '-' and ' ' like '_' ("Pre-LN" -> "pre_ln")."""
    return name.strip().lower().replace("-", "_").replace(" ", "_")


class UnknownNameError(KeyError, ValueError):
    """Raised for a name that is not registered; a KeyError for mappings, a ValueError for callers."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0])


class Registry(Mapping[str, T], Generic[T]):
    """A read-mostly mapping of normalised names to entries.

    ``kind`` names what the registry holds ("placement", "norm"), which is also the argument users pass
    a name through, so the error for an unknown name reads
    ``norm: unknown norm 'lyernorm'; expected one of: layernorm, rmsnorm, ...``.
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}
        self._aliases: dict[str, str] = {}

    def register(self, name: str, entry: T | None = None, *, aliases: tuple[str, ...] = ()):
        """Register ``entry`` under ``name``; usable as ``@REG.register("name")`` on a factory."""

        def add(obj: T) -> T:
            key = normalise_name(name)
            if key in self._entries or key in self._aliases:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[key] = obj
            for alias in aliases:
                self._aliases[normalise_name(alias)] = key
            return obj

        if entry is not None:
            return add(entry)
        return add

    def unregister(self, name: str) -> T:
        """Remove ``name`` (and its aliases); returns its entry. Raises UnknownNameError if absent."""
        key = self.resolve(name)
        for alias in [a for a, k in self._aliases.items() if k == key]:
            del self._aliases[alias]
        return self._entries.pop(key)

    def resolve(self, name: str) -> str:
        """The canonical key for ``name`` (or an alias of it); raises UnknownNameError."""
        if not isinstance(name, str):
            raise TypeError(f"{self.kind}: expected a {self.kind} name (str), got {type(name).__name__}")
        key = normalise_name(name)
        key = self._aliases.get(key, key)
        if key not in self._entries:
            raise UnknownNameError(
                f"{self.kind}: unknown {self.kind} {name!r}; expected one of: {', '.join(self)}"
            )
        return key

    def __getitem__(self, name: str) -> T:
        return self._entries[self.resolve(name)]

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        key = normalise_name(name)
        return key in self._entries or key in self._aliases

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {', '.join(self)})"
