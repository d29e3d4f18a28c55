"""The ``addnorm`` command line, one package: :mod:`.commands` (the Typer app, ``list``, ``explain``,
``inspect`` and the entry point), :mod:`.lazy` (the command group that answers ``--help``, ``--list``
and ``--show`` without importing torch), :mod:`.study` (``study``, ``report``, ``export``,
``compare``) and :mod:`.errors` (one ``error:`` line and an exit code for every failure).

Importing this package imports no torch."""

from .commands import app, ffn_grad_norms_at_init, main

__all__ = ["app", "ffn_grad_norms_at_init", "main"]
