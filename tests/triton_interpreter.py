"""The tests' Triton interpreter (``TRITON_INTERPRET=1``) without its per-call re-patching.

Triton 3.9's interpreter patches ``triton.language`` for the interpreter (every builtin of ``tl``,
``tl.tensor``, ``tl.math`` and ``tl.core.tensor_descriptor_base`` found by ``inspect.getmembers``) when a
kernel starts, and restores it when the kernel ends; it also runs that whole patching again on every call
of a ``@triton.jit`` helper inside the kernel, discarding what that pass recorded (``InterpretedFunction.
__call__``). Those passes find the language already patched and patch nothing new: they only cost time,
about 0.2 ms a helper call, a third of the kernel tests' time on the CPU (measured with cProfile on
``tests/test_ops_paths_kernels.py``: 173,095 passes, 39 of 115 s).

:func:`install` makes a helper call skip the pass where the running kernel has already patched every
language module the helper's globals name (a helper naming another one is patched as before); the kernel's
own patching and restoring are Triton's. The kernels compute exactly what they computed before (every
interpreted test compares them with its oracle). Installed by ``tests/conftest.py`` in the pytest
processes and by ``tests/procs.run_jobs`` in spawned ranks; a Triton without these internals is left as it
is.
"""

from __future__ import annotations

import inspect
import os

_installed = False
_original = None  # Triton's own patching pass
_patched: set[int] = set()  # id() of the language modules the running kernel has patched


def install() -> bool:
    """Install the skip (once, only under ``TRITON_INTERPRET=1``); True where it is in place."""
    global _installed, _original
    if _installed:
        return True
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    _original = getattr(interpreter, "_patch_lang", None)
    if _original is None or not hasattr(interpreter, "GridExecutor"):
        return False
    langs = (tl, tl.core)

    named: dict[object, frozenset[int]] = {}  # fn -> the language modules its globals name (a module's
    # globals are read once: a per-call scan would cost a tenth of what the skip saves)

    def modules_of(fn) -> frozenset[int]:
        found = named.get(fn)
        if found is None:
            found = named[fn] = frozenset(
                id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in langs
            )
        return found

    class KernelScope:
        """The kernel's own patch scope: restoring it ends the kernel."""

        def __init__(self, scope) -> None:
            self.scope = scope

        def restore(self) -> None:
            try:
                self.scope.restore()
            finally:
                _patched.clear()

    def patch_lang(fn):
        wanted = modules_of(fn)
        if _patched and wanted <= _patched:  # a helper inside a kernel that patched its modules already
            return interpreter._LangPatchScope()  # nothing to restore (the caller discards it anyway)
        first = not _patched
        scope = _original(fn)
        _patched.update(wanted)
        return KernelScope(scope) if first else scope

    interpreter._patch_lang = patch_lang
    _installed = True
    return True
