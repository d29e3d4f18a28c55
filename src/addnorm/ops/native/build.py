"""Building and loading the native call's C++ extension (``csrc/native_call.cpp``) with
``torch.utils.cpp_extension.load``: once per process, on the first CUDA call that takes the native
path, cached in torch's extension directory (``TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``) so that a later process loads it without building. Any failure (no
compiler, no triton headers, a build error) is returned as the reason, never raised: the caller warns
once and takes today's path.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

__all__ = ["SOURCE", "extension", "failure", "forget"]

SOURCE = Path(__file__).parent / "csrc" / "native_call.cpp"
_NAME = "addnorm_native_call"

_module: ModuleType | None = None
_failure: str | None = None


def _build() -> ModuleType:
    """Build (or load the cached build of) the extension; raises on any failure."""
    if os.environ.get("ADDNORM_NATIVE_FORCE_FAIL"):  # the tests' forced failure
        raise RuntimeError("ADDNORM_NATIVE_FORCE_FAIL is set")
    os.environ.setdefault("MAX_JOBS", "1")
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=_NAME, sources=[str(SOURCE)], extra_cflags=["-O2", "-std=c++17"], extra_ldflags=["-ldl"],
        verbose=bool(os.environ.get("ADDNORM_NATIVE_VERBOSE")),
    )  # fmt: skip


def extension() -> ModuleType | None:
    """The loaded extension, built on the first call; None where building or loading failed
    (:func:`failure` says why; not retried in this process)."""
    global _module, _failure
    if _module is None and _failure is None:
        try:
            _module = _build()
        except Exception as e:  # noqa: BLE001 (any failure: today's path)
            lines = str(e).strip().splitlines()
            _failure = f"{type(e).__name__}: {lines[-1] if lines else repr(e)}"
    return _module


def failure() -> str | None:
    """Why the extension could not be built or loaded (None: it was, or was never tried)."""
    return _failure


def forget() -> None:
    """Forget a failure (tests), so that the next :func:`extension` tries again."""
    global _failure
    _failure = None
