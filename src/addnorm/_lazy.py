"""Public names imported when first used (PEP 562), for the package and its subpackages whose import
must not pull torch: ``addnorm`` (the command line answers ``--help`` without it), ``addnorm.train``
(a rank checks its parent before torch, :mod:`addnorm.train.launch`) and ``addnorm.study``
(``study --keys`` reads :mod:`addnorm.study.keys`)."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable, Callable]:
    """The ``__getattr__`` and ``__dir__`` of ``package``, whose public names ``exports`` maps to the
    relative submodule defining each: a name is imported from it on first use and kept in the
    package's namespace; any other public attribute is tried as a submodule (``addnorm.model``)."""
    namespace = importlib.import_module(package).__dict__

    def __getattr__(name: str):
        module = exports.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module, package), name)
            namespace[name] = value
            return value
        if not name.startswith("_"):
            try:
                return importlib.import_module(f".{name}", package)
            except ModuleNotFoundError as err:
                if err.name != f"{package}.{name}":
                    raise  # the submodule exists; something it imports does not
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *exports})

    return __getattr__, __dir__
