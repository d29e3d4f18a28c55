"""The registered op's launches through ``wrap_triton`` (what Inductor compiles under torch.compile with
compile path "kernel") give every parameter their kernel declares. Inductor's launcher of a user-defined
kernel takes all of the kernel's parameters, its defaulted ones included, while the call it generates
passes only what the launch gave: torch 2.11 on an H200 failed with "launcher() missing 2 required
positional arguments: '_grid_1' and '_grid_2'" where the launches left ``ROWS`` and ``ROW_IDS`` to their
defaults. The kernels are recorded here, not run (no GPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")


class Recorder:
    """Stands for ``wrap_triton(kernel)``: ``k[grid](*args, **kwargs)`` records the call."""

    calls: list[tuple[str, list[str], dict]] = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        def call(*args, **kwargs):
            Recorder.calls.append((self.kernel.fn.__name__, list(self.kernel.arg_names), args, kwargs))

        return call


@pytest.fixture
def recorded(monkeypatch):
    from addnorm.ops.triton import launchers as triton_launch
    from addnorm.ops.triton import op_launchers as triton_op_launch

    monkeypatch.setattr(triton_op_launch, "wrap_triton", Recorder)
    monkeypatch.setattr(triton_op_launch, "interpreting", lambda: False)  # the GPU's path: wrap_triton
    Recorder.calls = []
    yield triton_op_launch
    triton_launch.clear_caches()


def _missing(arg_names, args, kwargs) -> set[str]:
    given = set(arg_names[: len(args)]) | set(kwargs)
    return set(arg_names) - given


@pytest.mark.parametrize("hidden", [256, 8192])  # one pass; sliced, with the row-sums pre-pass (row_sums)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("variant", ["slices", "row_sums", "kernel_sums"])
def test_traced_launches_pass_every_kernel_parameter(recorded, hidden, dropout, variant):
    from addnorm.ops import launch_config as lc
    from addnorm.ops.args import XHAT_FROM_S, BwdArgs, FwdArgs

    previous = lc.use_bwd_variant(variant)
    try:
        rows = 4
        x, r = torch.randn(rows, hidden), torch.randn(rows, hidden)
        w = torch.ones(hidden)
        seed = torch.tensor([7], dtype=torch.int64) if dropout else None
        fwd = FwdArgs(
            x, r, w, None, None, seed, None, XHAT_FROM_S, "rmsnorm", 1e-6, 1.0, dropout, x.dtype, x.dtype,
            True, "triton",
        )  # fmt: skip
        y, s, mean, rstd = recorded.add_norm_fwd_triton(fwd, traceable=True)
        bwd = BwdArgs(
            torch.randn(rows, hidden), torch.randn(rows, hidden), s, None, None, w, None, None, seed, None,
            mean, rstd, XHAT_FROM_S, "rmsnorm", 1.0, dropout, x.dtype, r.dtype, x.dtype, True, "triton",
        )  # fmt: skip
        recorded.add_norm_bwd_triton(bwd, traceable=True)
    finally:
        lc.use_bwd_variant(previous)
    names = [c[0] for c in Recorder.calls]
    assert names[0] == "_add_norm_fwd_kernel" and names[-1] == "_add_norm_bwd_kernel"
    assert ("_add_norm_bwd_sums_kernel" in names) == (variant != "slices" and hidden == 8192)
    for name, arg_names, args, kwargs in Recorder.calls:
        assert not _missing(arg_names, args, kwargs), (name, _missing(arg_names, args, kwargs))
        assert kwargs["ROW_IDS"] is False and kwargs["ROWS"] is None
        if name == "_add_norm_bwd_kernel":  # traced: torch sums the partials (no in-kernel sums)
            assert kwargs["FINISH_GROUP"] == 0 and kwargs["COUNT"] is None


def test_a_shards_launch_passes_its_row_ids(recorded):
    """With the rows' indices (a shard of a bigger tensor) the launch gives them, and nothing is left
    to its default either."""
    from addnorm.ops.args import XHAT_FROM_S, FwdArgs

    x, r, w = torch.randn(4, 64), torch.randn(4, 64), torch.ones(64)
    seed, rows = torch.tensor([7], dtype=torch.int64), torch.arange(10, 14)
    fwd = FwdArgs(x, r, w, None, None, seed, rows, XHAT_FROM_S, "layernorm", 1e-5, 1.0, 0.1, x.dtype,
                  x.dtype, True, "triton")  # fmt: skip
    recorded.add_norm_fwd_triton(fwd, traceable=True)
    ((_, arg_names, args, kwargs),) = Recorder.calls
    assert not _missing(arg_names, args, kwargs)
    assert kwargs["ROW_IDS"] is True and kwargs["ROWS"].tolist() == [10, 11, 12, 13]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("path", ["kernel", "composite"])
def test_gpu_compiled_step_equals_eager_on_each_compile_path(path):
    """torch.compile through each compile path ("kernel": Inductor launches the registered op's Triton
    kernels, the launches these tests check above), forward and backward, on wide rows (column slices,
    the row-sums pre-pass of the default backward), Pre-LN then Post-LN with a seeded dropout: the eager
    Triton path's outputs and gradients (narrow rows compiled: ``test_gpu_compile_fullgraph``)."""
    from addnorm.ops import add_norm, policy

    def f(x, r, w, b):
        y, s = add_norm(x, r, w, b, prenorm=True, dropout_p=0.1, seed=9)
        return add_norm(y, s, w, None, norm="rmsnorm", dropout_p=0.1, seed=11)

    for hidden in (8192,):
        gen = torch.Generator(device="cuda").manual_seed(0)
        x, r = (torch.randn(4, 16, hidden, device="cuda", generator=gen) for _ in range(2))
        w, b = torch.rand(hidden, device="cuda", generator=gen) + 0.5, torch.randn(hidden, device="cuda")
        outs, grads = [], []
        for run in (f, torch.compile(f, fullgraph=True, dynamic=False)):
            leaves = [t.clone().requires_grad_() for t in (x, r, w, b)]
            with policy.using_compile_path(path):
                out = run(*leaves)
                out.float().square().sum().backward()
            outs.append(out.detach())
            grads.append([t.grad for t in leaves])
        torch.testing.assert_close(outs[1], outs[0], rtol=1e-4, atol=1e-4)
        for got, want in zip(grads[1], grads[0], strict=True):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
