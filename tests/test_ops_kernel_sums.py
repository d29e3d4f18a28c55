"""The backward variant "kernel_sums" (``launch_config.BWD_VARIANTS``): the programs' partial parameter
gradients added up inside the backward kernel by its last programs (``triton_tiles.finish_col_sums``),
run by Triton's CPU interpreter. Against the float64 formula (``reference.add_norm_reference``), against
the default variant's torch sums, call after call (deterministic), and the counters left at zero."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import add_norm
from addnorm.ops.reference import add_norm_reference

pytest.importorskip("triton")


@pytest.fixture
def several_groups(triton_backend, monkeypatch):
    """Several backward programs (the interpreter's grid: 4) in groups of ``group``, with the variant
    selected; the counters forgotten before and after. Yields a setter for the group size."""
    from addnorm.ops import launch_config as lc
    from addnorm.ops import param_grads, policy
    from addnorm.ops.triton import launchers as triton_launch

    def use(group: int, variant: str = "kernel_sums") -> None:
        monkeypatch.setattr(lc, "BWD_FINISH_GROUP", group)
        lc.use_bwd_variant(variant)
        triton_launch.clear_caches()
        policy.invalidate()

    monkeypatch.setattr(lc, "BWD_ONE_PROGRAM_TILES", 0)
    previous = lc.BWD_VARIANT
    param_grads.forget_counters()
    yield use
    monkeypatch.undo()
    lc.use_bwd_variant(previous)
    triton_launch.clear_caches()
    policy.invalidate()
    param_grads.forget_counters()


def _grads(n, rows, norm, p, gate_kind, param_dtype=torch.float32):
    g = torch.Generator().manual_seed(3)
    x, r = (torch.randn(rows, n, generator=g).requires_grad_() for _ in range(2))
    w = torch.randn(n, generator=g).to(param_dtype).requires_grad_()
    b = torch.randn(n, generator=g).to(param_dtype).requires_grad_() if norm == "layernorm" else None
    gate = {0: None, 1: torch.tensor([0.7]), 2: torch.randn(n, generator=g)}[gate_kind]
    gate = None if gate is None else gate.requires_grad_()
    dy, ds = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g)
    leaves = [t for t in (x, r, w, b, gate) if t is not None]
    y, s = add_norm(x, r, w, b, norm=norm, prenorm=True, dropout_p=p, seed=11, gate=gate, backend="triton")
    got = torch.autograd.grad((y, s), leaves, (dy, ds))
    y64, s64 = add_norm_reference(x, r, w, b, norm=norm, prenorm=True, gate=gate, dropout_p=p, seed=11)
    want = torch.autograd.grad((y64, s64), leaves, (dy.double(), ds.double()))
    return got, want


@pytest.mark.parametrize(
    ("n", "rows", "norm", "p", "gate_kind", "group"),
    [
        (64, 40, "layernorm", 0.1, 2, 2),  # one pass, 4 programs in 2 groups
        (64, 40, "rmsnorm", 0.0, 1, 3),  # a last group of one program; a one-element gate
        (48, 40, "layernorm", 0.0, 0, 1),  # groups of one: every program finishes its own group
        (64, 40, "layernorm", 0.1, 2, 32),  # one group (the default size)
    ],
)
def test_in_kernel_sums_match_the_float64_formula_and_the_torch_sums(
    several_groups, n, rows, norm, p, gate_kind, group
):
    from addnorm.ops import param_grads

    several_groups(group, "row_sums")
    default, _ = _grads(n, rows, norm, p, gate_kind)
    several_groups(group)
    got, want = _grads(n, rows, norm, p, gate_kind)
    again, _ = _grads(n, rows, norm, p, gate_kind)
    for a, d, b, w in zip(got, default, again, want, strict=True):
        torch.testing.assert_close(a.double(), w.double(), rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(a, d, rtol=1e-5, atol=1e-5)  # the same sums, another order
        assert torch.equal(a, b)  # fixed groups and order: the same bits call after call
    (buf,) = param_grads._COUNTERS.values()  # the counters it counted on: all back at zero
    assert int(buf.count_nonzero()) == 0


def test_in_kernel_sums_write_the_parameters_dtype(several_groups):
    """A bf16 weight and bias get bf16 gradients from the kernel (no cast after it), the fp32 sums
    rounded once."""
    several_groups(2)
    got, want = _grads(64, 40, "layernorm", 0.0, 0, torch.bfloat16)
    assert got[2].dtype == got[3].dtype == torch.bfloat16
    for a, w in zip(got[2:], want[2:], strict=True):
        torch.testing.assert_close(a.double(), w.double(), rtol=1e-2, atol=1e-2)


def test_counters_grow_and_start_at_zero():
    from addnorm.ops import param_grads

    param_grads.forget_counters()
    t = torch.empty(3)
    small = param_grads.counters(t, 10)
    assert small.dtype == torch.int32 and small.numel() >= 10 and int(small.count_nonzero()) == 0
    assert param_grads.counters(t, 10) is small  # one buffer per device and stream
    big = param_grads.counters(t, small.numel() + 1)
    assert big.numel() > small.numel() and int(big.count_nonzero()) == 0
    assert param_grads.counters(t, 10) is big
    param_grads.forget_counters()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    ("hidden", "rows", "dtype", "param_dtype"),
    [
        (768, 8192, torch.bfloat16, torch.float32),  # one pass: about a thousand programs, 30+ groups
        (4096, 4096, torch.bfloat16, torch.bfloat16),  # slices given the row sums; bf16 parameters
        (1024, 16384, torch.float32, torch.float32),
    ],
)
def test_gpu_in_kernel_sums_match_torch_sums_and_repeat_exactly(hidden, rows, dtype, param_dtype):
    """On a GPU the backward's grid fills the device (hundreds of programs, dozens of groups finishing
    in whatever order the hardware runs them): the in-kernel sums against the default variant's torch
    sums and the float64 formula, the same bits call after call, and the counters back at zero."""
    from addnorm.ops import launch_config as lc
    from addnorm.ops import param_grads, policy
    from addnorm.ops.triton import launchers as triton_launch

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    x, r = (
        torch.randn(rows, hidden, generator=g, device=dev, dtype=dtype).requires_grad_() for _ in range(2)
    )
    w, b = (torch.randn(hidden, generator=g, device=dev).to(param_dtype).requires_grad_() for _ in range(2))
    dy, ds = (torch.randn(rows, hidden, generator=g, device=dev, dtype=dtype) for _ in range(2))

    def grads(variant):
        lc.use_bwd_variant(variant)
        triton_launch.clear_caches()
        y, s = add_norm(x, r, w, b, prenorm=True, dropout_p=0.1, seed=9, backend="triton")
        return torch.autograd.grad((y, s), (x, r, w, b), (dy, ds))

    previous = lc.BWD_VARIANT
    try:
        default = grads("row_sums")
        first, second = grads("kernel_sums"), grads("kernel_sums")
    finally:
        lc.use_bwd_variant(previous)
        triton_launch.clear_caches()
        policy.invalidate()
    torch.cuda.synchronize()
    y64, s64 = add_norm_reference(x, r, w, b, prenorm=True, dropout_p=0.1, seed=9)
    want = torch.autograd.grad((y64, s64), (w, b), (dy.double(), ds.double()))
    for a, d, c in zip(first, default, second, strict=True):
        assert torch.equal(a, c)  # fixed groups and order, whatever order the programs finish in
        assert a.dtype == d.dtype
        torch.testing.assert_close(a.float(), d.float(), rtol=2e-2 if param_dtype is torch.bfloat16 else 1e-4,
                                   atol=1e-2 if param_dtype is torch.bfloat16 else 1e-3)  # fmt: skip
    for a, ref in zip(first[2:], want, strict=True):
        scale = float(ref.abs().max())
        torch.testing.assert_close(a.double(), ref.double(), rtol=2e-2, atol=2e-2 * scale)
    assert all(int(c.count_nonzero()) == 0 for c in param_grads._COUNTERS.values())
