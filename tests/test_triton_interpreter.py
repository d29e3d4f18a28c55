"""tests/triton_interpreter.py: a kernel calling ``@triton.jit`` helpers computes what it computes without
the skip, patches the language once, and leaves ``triton.language`` as it found it."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("the interpreter's patching: TRITON_INTERPRET=1", allow_module_level=True)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
import triton_interpreter  # noqa: E402


@triton.jit
def _square(x):
    return x * x


@triton.jit
def _sum_of_squares(x):
    return tl.sum(_square(x), axis=0)


@triton.jit
def _kernel(x_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + tl.program_id(0) * N + offs)
    total = _sum_of_squares(x)
    for _ in tl.static_range(3):  # more helper calls in the same program
        total += tl.max(_square(x), axis=0)
    tl.store(out_ptr + tl.program_id(0), total)


def _language_state() -> dict[str, object]:
    return {name: getattr(tl, name) for name in ("sum", "max", "load", "store", "arange")} | {
        "tensor.__add__": tl.tensor.__add__,
        "math.exp": tl.math.exp,
    }


def test_helpers_skip_the_pass_and_the_kernel_still_computes_its_oracle(monkeypatch):
    assert triton_interpreter.install()
    passes = []
    real = triton_interpreter._original  # Triton's own pass, which the installed one calls
    monkeypatch.setattr(triton_interpreter, "_original", lambda fn: passes.append(fn.__name__) or real(fn))
    before = _language_state()
    x = torch.randn(4, 16, dtype=torch.float64).float()
    out = torch.empty(4)
    _kernel[(4,)](x, out, N=16)
    expected = (x.double() ** 2).sum(1) + 3 * (x.double() ** 2).amax(1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)
    # the kernel's own pass, once, and Triton's tl.sum's (a helper whose globals name triton.language.core,
    # which the kernel's do not), once; every other helper call of the 4 programs skipped
    assert passes == ["_kernel", "sum"]
    assert _language_state() == before  # restored when the kernel ended
    _kernel[(2,)](x, out, N=16)  # a second kernel patches again (its pass, its restore)
    assert passes == ["_kernel", "sum"] * 2 and _language_state() == before
