"""``add_norm`` on DTensors whose hidden dimension leaves a rank no columns (or uneven ones), and a rank
that fails inside the collectives (its columns not DTensor's shard; a failure injected into the
forward's statistics or the backward's row sums): the call equals the one-process op, or every rank
gets an error after the same collective and the group runs on. One spawn of 2 ``gloo`` processes,
with a bounded collective timeout."""

from __future__ import annotations

import os
import tempfile
import warnings

import pytest
import torch
from _sharded_cases import BACKENDS, SHAPE, TOL, WORLD, _data, _got, _kwargs, single_process
from procs import SPAWNED_RANKS, run_jobs

from addnorm.ops import add_norm
from tools.procs import run_spawned

pytestmark = SPAWNED_RANKS  # slow: spawned ranks

# --- a rank with no columns, and a rank that fails inside the collectives ---------------------------------

# hidden sizes whose column shards over 2 ranks leave one rank with nothing (1: 1 + 0, as 5 or 6 over 4
# ranks do) or uneven (3: 2 + 1)
EMPTY_SHARDS = {
    f"{backend}-h{h}-{norm}-{config}": {"backend": backend, "norm": norm, "config": config, "hidden": h}
    for backend in BACKENDS
    for h in (1, 3)
    for norm in ("layernorm", "rmsnorm")
    for config in ("pre-dropout-rezero", "post-dropout-layerscale")
}
FAULTS = ("a rank's columns disagree with its shard", "forward fails on rank 0", "backward fails on rank 1")


def run_empty_shard(case: dict) -> dict:
    """x, residual, weight, bias and gate sharded on the hidden dimension of (2, 3, hidden): the gathered
    outputs and gradients."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    shape = (2, 3, case["hidden"])
    data = _data(case, shape=shape)
    names = [n for n in ("x", "r", "w", "b", "g") if data[n] is not None]
    leaves = {}
    for n in names:
        pl = [Shard(2)] if n in ("x", "r") else [Replicate() if data[n].numel() == 1 else Shard(0)]
        leaves[n] = distribute_tensor(data[n], mesh, pl).requires_grad_(True)
    out = add_norm(
        leaves["x"], leaves["r"], leaves["w"], leaves["b"], gate=leaves.get("g"), seed=11,
        backend=case["backend"], **_kwargs(case),
    )  # fmt: skip
    outs = list(out) if isinstance(out, tuple) else [out]
    dout = [distribute_tensor(data[k], mesh, [Shard(2)]) for k in ("dy", "ds")][: len(outs)]
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], dout)
    return {"outs": [o.full_tensor() for o in outs], "grads": [g.full_tensor() for g in grads]}


def run_fault(name: str) -> list[str]:
    """Every rank's error (type: first line) for a call that fails on one rank only, then a good call on
    the same group (which must still work: every rank left the failed call after the same collective)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    from addnorm.ops import sharded

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2,))
    data = _data({"config": "post"})
    x, r = (distribute_tensor(data[k], mesh, [Shard(2)]).requires_grad_(True) for k in ("x", "r"))
    norm = "rmsnorm" if name == "forward fails on rank 0" else "layernorm"

    def fail(*args):
        raise RuntimeError(f"injected on rank {rank}")

    saved = sharded._stats_torch, sharded._sums_torch
    try:
        if name == "a rank's columns disagree with its shard":  # 5 + 4 columns, rank 1 holding 3
            local = x.to_local()[..., :3] if rank == 1 else x.to_local()
            stride = torch.empty(SHAPE, device="meta").stride()
            x = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=SHAPE, stride=stride)
            r = DTensor.from_local(local, mesh, [Shard(2)], run_check=False, shape=SHAPE, stride=stride)
        elif name == "forward fails on rank 0" and rank == 0:
            sharded._stats_torch = fail
        elif name == "backward fails on rank 1" and rank == 1:
            sharded._sums_torch = fail
        y = add_norm(x, r, None, norm=norm, backend="torch")
        y.to_local().sum().backward()
        error = "no error"
    except Exception as e:  # the test reads every rank's type and message
        error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
    finally:
        sharded._stats_torch, sharded._sums_torch = saved
    errors = [None, None]
    dist.all_gather_object(errors, error)
    x, r = (distribute_tensor(data[k], mesh, [Shard(2)]) for k in ("x", "r"))
    good = add_norm(x, r, None, norm=norm, backend="torch").full_tensor()
    torch.testing.assert_close(good, add_norm(data["x"], data["r"], None, norm=norm, backend="torch"))
    return errors


def _fault_worker(rank: int, port: int, out: str) -> None:
    import datetime

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    # a rank left waiting in a collective errors after this long instead of gloo's 30 minutes (what the
    # tests see without the fix; with it, no rank waits for one that has left)
    timeout = datetime.timedelta(seconds=90)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timeout
    )
    jobs = {name: (lambda c=case: run_empty_shard(c)) for name, case in EMPTY_SHARDS.items()}
    jobs.update({name: (lambda n=name: run_fault(n)) for name in FAULTS})
    run_jobs(jobs, rank, out, barrier=False)  # a fault leaves a rank out of any barrier
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def fault_results():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        run_spawned(_fault_worker, out, nprocs=WORLD, deadline=900.0)
        yield torch.load(out, weights_only=False)


@pytest.mark.parametrize("name", list(EMPTY_SHARDS))
def test_a_rank_with_no_columns_takes_part_and_the_call_equals_one_process(fault_results, name):
    """Hidden 1 over 2 ranks (one rank holds no column, as hidden 5 or 6 over 4 ranks leaves one) and 3
    over 2 (2 + 1), both backends, forward and backward: the one-process op's outputs and gradients, to
    within twice the one-process fp32 op's own distance from the float64 op (LayerNorm of one column is
    degenerate: x_hat is 0 and rstd 1 / sqrt(eps) magnifies rounding)."""
    case = EMPTY_SHARDS[name]
    got = _got(fault_results, name)
    shape = (2, 3, case["hidden"])
    outs, grads = single_process(case, _data(case, shape=shape))
    outs64, grads64 = single_process({**case, "backend": "torch"}, _data(case, torch.float64, shape=shape))
    for a, b, ref in zip(got["outs"] + got["grads"], outs + grads, outs64 + grads64, strict=True):
        err, base = (a.double() - ref).abs().max().item(), (b.double() - ref).abs().max().item()
        assert err <= 2 * base + TOL["atol"] * max(1.0, ref.abs().max().item()), (err, base)


@pytest.mark.parametrize("name", FAULTS)
def test_a_rank_that_fails_inside_the_collectives_is_an_error_on_every_rank(fault_results, name):
    """A failure on one rank before a collective (its columns not DTensor's shard; a failure injected
    into the forward's statistics or the backward's row sums) is that rank's own error and, on the other
    rank, an error naming it, after the same collective; the group then runs a good call."""
    errors = _got(fault_results, name)
    failing = {"a rank's columns disagree with its shard": 1, "forward fails on rank 0": 0}.get(name, 1)
    own = {
        "a rank's columns disagree with its shard": "ValueError: x: this rank holds 3 of the 9 columns",
        "forward fails on rank 0": "RuntimeError: injected on rank 0",
        "backward fails on rank 1": "RuntimeError: injected on rank 1",
    }[name]
    assert errors[failing].startswith(own), errors
    other = errors[1 - failing]
    assert other.startswith("RuntimeError: add_norm: "), errors
    assert ("another rank" if name != "a rank's columns disagree with its shard" else "rank 1") in other
