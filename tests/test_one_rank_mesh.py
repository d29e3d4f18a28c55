"""The tensor-parallel code paths on a one-rank mesh, in this process (fast tier: no spawned ranks; the
two-process checks are ``test_ops_sharded.py`` and ``test_tensor_parallel.py``, in the slow tier).

On one rank a column shard is the whole row, so every collective is the identity and the results must
equal the single-process op's and the unsharded model's: the op's tensor-parallel passes
(:class:`addnorm.ops.sharded.TensorParallelAddNorm`, its Triton launchers and kernels through the
interpreter where they can run), and ``addnorm.parallelize`` with the styles of
:mod:`addnorm.model.tp_styles` (packed q/k/v and SwiGLU columns, the replicated norms)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _sharded_cases import BACKENDS, TOL, _data, _kwargs, single_process
from _tp_models import VOCAB, lm

import addnorm as an
from addnorm.ops import add_norm

pytestmark = pytest.mark.skipif(not dist.is_available(), reason="torch.distributed")


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank gloo group (a file store: no port) and its 1-D CPU mesh; torn down after the module."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("config", ["post", "pre-dropout-rezero", "post-dropout-layerscale"])
def test_the_tensor_parallel_op_on_one_rank_is_the_single_process_op(mesh, backend, norm, config):
    """x and residual Shard(-1) on the mesh take the tensor-parallel passes; outputs and every
    gradient equal the op on plain tensors (same seed: the same dropout mask)."""
    from torch.distributed.tensor import DTensor, Shard

    case = {"backend": backend, "norm": norm, "config": config}
    data = _data(case)
    want_out, want_grads = single_process(case, data)
    names = [n for n in ("x", "r", "w", "b", "g") if data[n] is not None]
    leaves = {n: data[n].clone().requires_grad_(True) for n in names}
    x, r = (DTensor.from_local(leaves[n], mesh, [Shard(-1)], run_check=False) for n in ("x", "r"))
    out = add_norm(
        x, r, leaves["w"], leaves["b"], gate=leaves.get("g"), seed=11, backend=backend, **_kwargs(case)
    )
    outs = list(out) if isinstance(out, tuple) else [out]
    assert all(isinstance(o, DTensor) and o.placements == (Shard(2),) for o in outs)
    cot = [DTensor.from_local(c, mesh, [Shard(-1)], run_check=False) for c in (data["dy"], data["ds"])]
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], cot[: len(outs)])
    for got, want in zip([o.to_local() for o in outs], want_out, strict=True):
        torch.testing.assert_close(got, want, **TOL)
    for got, want in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, **TOL)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_parallelize_on_one_rank_gives_the_unsharded_models_logits_and_gradients(mesh, activation):
    """``addnorm.parallelize`` (tensor and sequence parallel) on a one-rank mesh: the packed q/k/v (and
    SwiGLU) column styles and the replicated norms leave the model's function as it was (its norm gains
    and gates moved off their initial values, so a norm applied wrongly shows)."""
    plain = lm("pre", activation=activation)
    tp = an.parallelize(copy.deepcopy(plain), mesh)
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    for model in (plain, tp):
        model(tokens).square().mean().backward()
    torch.testing.assert_close(tp(tokens), plain(tokens), rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(plain.named_parameters(), tp.parameters(), strict=True):
        got = q.grad.full_tensor() if hasattr(q.grad, "full_tensor") else q.grad
        torch.testing.assert_close(got, p.grad, rtol=1e-5, atol=1e-6, msg=name)
