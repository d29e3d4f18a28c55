"""``add_norm`` on DTensors (``addnorm.ops.sharded``): every placement of x and residual (Shard(0),
Shard(1), Shard(-1), Replicate; mixtures on 2-D meshes; uneven shards) gives, gathered, the outputs and
gradients of the single-process op, on both backends; the sequence-sharded path communicates nothing,
the hidden-sharded one exactly one collective of the per-row statistics each way; dropout drops the
whole tensor's elements; bad placements are one clear error. A rank with no columns, and a rank that
fails inside the collectives: ``test_ops_sharded_faults.py``.

Oracle: the op in this process on the whole tensors (itself tested against float64 in
``test_ops_add_norm.py``), and the float64 formula for the cancellation case. Every distributed case
runs in one spawn of 2 ``gloo`` processes (1 thread each, a free loopback port, a bounded wait); the
Triton kernels run through the interpreter where ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch
from _sharded_cases import (
    BACKENDS,
    CONFIGS,
    SHAPE,
    TOL,
    WORLD,
    _data,
    _got,
    _kwargs,
    single_process,
)
from procs import SPAWNED_RANKS, run_jobs

from addnorm.ops import add_norm, add_norm_reference, dropout_keep_mask
from addnorm.ops import library as lib
from addnorm.ops.args import XHAT_FROM_S
from tools.procs import run_spawned

pytestmark = SPAWNED_RANKS  # slow: spawned ranks

# placements of x and residual per mesh: (mesh shape, x placements as (kind, dim))
LAYOUTS = {
    "Shard(0)": ((2,), [("S", 0)]),
    "Shard(1)": ((2,), [("S", 1)]),
    "Shard(-1)": ((2,), [("S", -1)]),
    "Replicate": ((2,), [("R", None)]),
    "2d Shard(1),Shard(-1)": ((2, 1), [("S", 1), ("S", -1)]),
    "2d Shard(0),Shard(-1)": ((1, 2), [("S", 0), ("S", -1)]),
}


def _cases() -> dict[str, dict]:
    cases = {}
    for backend in BACKENDS:
        for layout in LAYOUTS:
            for norm in ("layernorm", "rmsnorm"):
                configs = CONFIGS if not layout.startswith("2d") else ["post-dropout-layerscale"]
                for config in configs:
                    cases[f"{backend}-{layout}-{norm}-{config}"] = {
                        "backend": backend, "layout": layout, "norm": norm, "config": config,
                    }  # fmt: skip
    # the kernels' column-chunk loops on these small rows (chunks of 2 columns)
    if "triton" in BACKENDS:
        for layout in ("Shard(1)", "Shard(-1)"):
            for norm in ("layernorm", "rmsnorm"):
                for config in ("pre-dropout-rezero", "post-dropout-layerscale"):
                    cases[f"triton-{layout}-{norm}-{config}-small-chunks"] = {
                        "backend": "triton", "layout": layout, "norm": norm, "config": config,
                        "small_chunks": True,
                    }  # fmt: skip
    # a replicated weight with the hidden dimension sharded (each rank reads its columns), and plain
    # tensors for weight, bias and gate (taken as replicated: their gradients come back whole)
    for params in ("replicated", "plain"):
        for layout in ("Shard(-1)", "Shard(1)"):
            key = f"torch-{layout}-layernorm-pre-dropout-rezero-{params}-params"
            cases[key] = {
                "backend": "torch", "layout": layout, "norm": "layernorm", "config": "pre-dropout-rezero",
                "params": params,
            }  # fmt: skip
    return cases


CASES = _cases()


# --- what each rank runs --------------------------------------------------------------------------------


def _placements(spec):
    from torch.distributed.tensor import Replicate, Shard

    return [Replicate() if kind == "R" else Shard(dim % len(SHAPE)) for kind, dim in spec]


def _param_placements(x_placements, case: dict):
    """A norm parameter's placements: Shard(0) where x's hidden dimension is sharded (unless the case
    asks for replicated parameters), Replicate elsewhere."""
    from torch.distributed.tensor import Replicate, Shard

    shard = case.get("params") != "replicated"
    return [Shard(0) if shard and p.is_shard(len(SHAPE) - 1) else Replicate() for p in x_placements]


@contextlib.contextmanager
def small_chunks():
    """Launch configurations that split every row into chunks of 2 columns (forward and backward,
    register-heavy variants too), so the chunk loops run on small shapes in the interpreter."""
    from addnorm.ops import launch_config as k
    from addnorm.ops import policy
    from addnorm.ops.triton import launchers as triton_launch

    names = ("FWD_MAX_ONE_PASS", "BWD_MAX_ONE_PASS", "BWD_MAX_ONE_PASS_HEAVY", "FWD_CHUNK", "BWD_SLICE")
    names += ("BWD_SLICE_NARROW",)
    saved = {n: getattr(k, n) for n in names}
    small = (1, 1, 1, k.Launch(2, 2, True, 1), k.Launch(1, 2, True, 1), k.Launch(1, 2, True, 1))
    try:
        for n, v in zip(names, small, strict=True):
            setattr(k, n, v)
        triton_launch.clear_caches()
        policy.invalidate()  # cached call plans hold launch specs
        yield
    finally:
        for n, v in saved.items():
            setattr(k, n, v)
        triton_launch.clear_caches()
        policy.invalidate()


def run_case(case: dict) -> dict:
    """One case on this rank: the gathered outputs and gradients, the gradients' placements, and the
    collectives (count, payload bytes) of forward and backward."""
    with small_chunks() if case.get("small_chunks") else contextlib.nullcontext():
        return _run_case(case)


def _run_case(case: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from benchmarks.op.sharded import CommBytes

    mesh_shape, spec = LAYOUTS[case["layout"]]
    mesh = init_device_mesh("cpu", mesh_shape)
    data = _data(case)
    pl = _placements(spec)
    ppl = _param_placements(pl, case)
    names = [n for n in ("x", "r", "w", "b", "g") if data[n] is not None]
    leaves = {}
    for n in names:
        if n in ("x", "r"):
            leaves[n] = distribute_tensor(data[n], mesh, pl).requires_grad_(True)
        elif case.get("params") == "plain":
            leaves[n] = data[n].clone().requires_grad_(True)
        else:  # a one-element gate is replicated
            placements = [Replicate()] * mesh.ndim if data[n].numel() == 1 else ppl
            leaves[n] = distribute_tensor(data[n], mesh, placements).requires_grad_(True)
    with CommBytes() as fwd:
        out = add_norm(
            leaves["x"], leaves["r"], leaves["w"], leaves["b"], gate=leaves.get("g"), seed=11,
            backend=case["backend"], **_kwargs(case),
        )  # fmt: skip
    outs = list(out) if isinstance(out, tuple) else [out]
    dout = [distribute_tensor(data[k], mesh, pl) for k in ("dy", "ds")][: len(outs)]
    with CommBytes() as bwd:
        grads = torch.autograd.grad(outs, [leaves[n] for n in names], dout)
    full = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    return {
        "outs": [o.full_tensor() for o in outs],
        "out_placements": [tuple(o.placements) for o in outs],
        "grads": full,
        "grad_placements": [tuple(g.placements) if hasattr(g, "placements") else None for g in grads],
        "local_rows": outs[0].to_local().numel() // outs[0].to_local().shape[-1],
        "fwd": (fwd.get_total_counts(), fwd.bytes, [n for n, _ in fwd.ops]),
        "bwd": (bwd.get_total_counts(), bwd.bytes, [n for n, _ in bwd.ops]),
    }


def run_cancellation() -> dict:
    """TP LayerNorm in float64 on rows with |mean| = 1e6 and std 1: E[s^2] - mean^2 would lose every
    digit below 1e-4; the merged (mean, M2) keep the float64 oracle's values."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    data = _data({"config": "post"}, torch.float64, offset=1e6)
    x, r = (distribute_tensor(data[k], mesh, [Shard(2)]) for k in ("x", "r"))
    w, b = (distribute_tensor(data[k], mesh, [Shard(0)]) for k in ("w", "b"))
    return {"y": add_norm(x, r, w, b, backend="torch").full_tensor(), "data": data}


def run_unseeded() -> dict:
    """seed=None: every rank draws the seed from torch's generator, seeded alike, so the shards of a
    Shard(1) call and of a Shard(-1) call drop the elements the replicated call drops; so does a
    Post-LN ``AddNorm`` with dropout on the CPU (which fuses a DTensor stream whatever the device)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from addnorm import AddNorm

    mesh = init_device_mesh("cpu", (2,))
    data = _data({"config": "post"})
    conn = AddNorm(SHAPE[-1], placement="post", dropout=0.5).train()
    out = {}
    for name, pl in (("Shard(1)", [Shard(1)]), ("Shard(-1)", [Shard(2)]), ("Replicate", [Replicate()])):
        x, r = (distribute_tensor(data[k], mesh, pl) for k in ("x", "r"))
        torch.manual_seed(123)
        out[name] = add_norm(x, r, None, dropout_p=0.5).full_tensor()
        if name != "Shard(-1)":  # the connection's own LayerNorm weight is a plain (replicated) one
            torch.manual_seed(5)
            out[f"AddNorm {name}"] = conn(r, lambda h: 2 * h).full_tensor()
    out["no dropout"] = add_norm(data["x"], data["r"], None)
    return out


def run_compiled() -> dict:
    """torch.compile(fullgraph=True) (``compile_path`` "kernel": the registered op) of the op with
    dropout on a sequence-sharded DTensor (Inductor) and a hidden-sharded one (AOT autograd run
    eagerly, the collectives in the graph): one graph each, no break."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from addnorm.ops.policy import using_compile_path

    mesh = init_device_mesh("cpu", (2,))
    data = _data({"config": "post"})
    out = {}
    for name, pl, wpl, compiler in (
        ("Shard(1)", [Shard(1)], [Replicate()], "inductor"),
        ("Shard(-1)", [Shard(2)], [Shard(0)], "aot_eager"),
    ):
        torch._dynamo.reset()
        x, r = (distribute_tensor(data[k], mesh, pl) for k in ("x", "r"))
        w = distribute_tensor(data["w"], mesh, wpl)
        with using_compile_path("kernel"):
            f = torch.compile(
                lambda x, r, w: add_norm(x, r, w, prenorm=True, dropout_p=0.25, seed=3),
                backend=compiler,
                fullgraph=True,
            )
            y, s = f(x, r, w)
        out[name] = (y.full_tensor(), s.full_tensor())
    return out


def run_errors() -> dict:
    """The message of each bad call (or 'no error')."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (2,))
    mesh2 = init_device_mesh("cpu", (1, 2))
    data = _data({"config": "post"})
    x1, r1 = (distribute_tensor(data[k], mesh, [Shard(1)]) for k in ("x", "r"))
    r0 = distribute_tensor(data["r"], mesh, [Shard(0)])
    w_sharded = distribute_tensor(data["w"], mesh, [Shard(0)])
    x_partial = DTensor.from_local(data["x"], mesh, [Partial()], run_check=False)
    r_partial = DTensor.from_local(data["r"], mesh, [Partial()], run_check=False)
    short_x, short_r = (distribute_tensor(data[k][:1], mesh, [Shard(0)]) for k in ("x", "r"))
    x_2d, r_2d = (distribute_tensor(data[k], mesh2, [Shard(2), Shard(2)]) for k in ("x", "r"))
    w_rep = distribute_tensor(data["w"], mesh, [Replicate()])
    calls = {
        "residual placed otherwise": lambda: add_norm(x1, r0, None),
        "residual plain": lambda: add_norm(x1, data["r"], None),
        "weight sharded where x is not": lambda: add_norm(x1, r1, w_sharded),
        "x partial": lambda: add_norm(x_partial, r_partial, None),
        "a rank without rows": lambda: add_norm(short_x, short_r, None),
        "hidden sharded twice": lambda: add_norm(x_2d, r_2d, None),
        "plain x, DTensor weight": lambda: add_norm(data["x"], data["r"], w_rep),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except Exception as e:  # the test reads the type and message
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _worker(rank: int, port: int, names: list[str], out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    jobs = {name: (lambda n=name: run_case(CASES[n])) for name in names}
    jobs.update(
        cancellation=run_cancellation, unseeded=run_unseeded, errors=run_errors, compiled=run_compiled
    )
    run_jobs(jobs, rank, out)
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def results():
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "results.pt")
        run_spawned(_worker, list(CASES), out, nprocs=WORLD, deadline=240.0)
        yield torch.load(out, weights_only=False)


# --- the distributed cases ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CASES))
def test_sharded_call_equals_the_single_process_op(results, name):
    case, got = CASES[name], _got(results, name)
    outs, grads = single_process(case, _data(case))
    assert len(got["outs"]) == len(outs)
    for a, b in zip(got["outs"], outs, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    for a, b in zip(got["grads"], grads, strict=True):
        torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("name", [n for n in CASES if "params" not in n])
def test_outputs_and_gradients_are_placed_as_promised(results, name):
    """y, s, dx and dresidual like x; weight/bias/gate gradients Partial where x's rows are sharded,
    Shard(0) like a sharded weight, Partial for a replicated scalar gate where x's columns are
    sharded, Replicate elsewhere."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    case, got = CASES[name], _got(results, name)
    _, spec = LAYOUTS[case["layout"]]
    x = tuple(_placements(spec))
    assert all(p == x for p in got["out_placements"])
    assert got["grad_placements"][:2] == [x, x]
    last = len(SHAPE) - 1
    for i, grad in enumerate(got["grad_placements"][2:]):
        scalar = i == 2 and CONFIGS[case["config"]]["gate"] == "scalar"
        want = []
        for kind, dim in spec:
            if kind == "R":
                want.append(Replicate())
            elif dim in (-1, last):
                want.append(Partial() if scalar else Shard(0))
            else:
                want.append(Partial())
        assert grad == tuple(want), (i, grad)


@pytest.mark.parametrize("name", [n for n in CASES if "params" not in n])
def test_communication_is_none_for_rows_and_one_collective_of_row_statistics_for_columns(results, name):
    """Leading-dimension shards and Replicate: no collective forward or backward (no gather). The
    hidden dimension sharded: forward one all-gather of (mean, M2) per row (LayerNorm: 8 bytes a row)
    or one all-reduce of sum(s^2) (RMSNorm: 4), backward one all-reduce of the row sums (8 / 4), each
    with one row more: the ranks' failure flags."""
    case, got = CASES[name], _got(results, name)
    _, spec = LAYOUTS[case["layout"]]
    if not any(kind == "S" and dim in (-1, len(SHAPE) - 1) for kind, dim in spec):
        assert got["fwd"] == (0, 0, []) and got["bwd"] == (0, 0, [])
        return
    per_row = 8 if case["norm"] == "layernorm" else 4
    rows = got["local_rows"]
    fwd_op = "_allgather_base" if case["norm"] == "layernorm" else "allreduce"
    assert got["fwd"] == (1, (rows + 1) * per_row, [fwd_op])
    assert got["bwd"] == (1, (rows + 1) * per_row, ["allreduce"])


def test_plain_parameters_get_their_whole_gradient_with_one_all_reduce_each(results):
    """Plain weight, bias and gate are taken as replicated: their gradients are the whole ones
    (checked against one process above), reduced in backward by one all-reduce each."""
    for layout in ("Shard(-1)", "Shard(1)"):
        got = _got(results, f"torch-{layout}-layernorm-pre-dropout-rezero-plain-params")
        tp = 1 if layout == "Shard(-1)" else 0
        assert got["bwd"][0] == tp + 3 and got["bwd"][2][tp:] == ["all_reduce"] * 3
        assert got["grad_placements"][2:] == [None, None, None]


def test_tensor_parallel_statistics_do_not_cancel(results):
    got = _got(results, "cancellation")
    d = got["data"]
    want = add_norm_reference(d["x"], d["r"], d["w"], d["b"])
    torch.testing.assert_close(got["y"], want, atol=1e-7, rtol=0)


def test_unseeded_dropout_drops_the_whole_tensors_elements(results):
    got = _got(results, "unseeded")
    torch.testing.assert_close(got["Shard(1)"], got["Replicate"], atol=0, rtol=0)
    torch.testing.assert_close(got["Shard(-1)"], got["Replicate"], **TOL)
    assert (got["Replicate"] - got["no dropout"]).abs().max() > 0.1  # it dropped something
    torch.testing.assert_close(got["AddNorm Shard(1)"], got["AddNorm Replicate"], atol=0, rtol=0)


def test_a_dtensor_stream_always_takes_the_op():
    from addnorm.ops import fused_op_preferred

    assert not fused_op_preferred("cpu", dropout=True)  # nn.Dropout is faster on plain CPU tensors
    assert fused_op_preferred("cpu", dropout=True, sharded=True)


def test_compiled_calls_on_dtensors_equal_the_eager_op(results):
    got = _got(results, "compiled")
    data = _data({"config": "post"})
    want = add_norm(data["x"], data["r"], data["w"], prenorm=True, dropout_p=0.25, seed=3)
    for name, (y, s) in got.items():
        torch.testing.assert_close(y, want[0], **TOL, msg=name)
        torch.testing.assert_close(s, want[1], **TOL, msg=name)


ERRORS = {
    "residual placed otherwise": "residual: expected x's placements",
    "residual plain": "residual: expected a DTensor placed like x",
    "weight sharded where x is not": "weight: placement Shard(dim=0) on mesh dim 0, where x is Shard(dim=1)",
    "x partial": "x: placement Partial(sum) on mesh dim 0: expected Shard(d) or Replicate()",
    "a rank without rows": "x: dim 0 of size 1 is sharded over the 2 ranks of mesh dim 0",
    "hidden sharded twice": "x: its last (hidden) dimension is sharded over mesh dims [0, 1]",
    "plain x, DTensor weight": "weight: a DTensor while x is a plain tensor",
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_bad_placements_are_one_clear_error(results, name):
    got = _got(results, "errors")[name]
    assert got.startswith("ValueError: " + ERRORS[name]), got


# --- one process ----------------------------------------------------------------------------------------


def test_a_shards_dropout_mask_is_its_block_of_the_whole_mask():
    whole = dropout_keep_mask(99, 12, 20, 0.4)
    rows = torch.tensor([7, 2, 11, 5])
    block = dropout_keep_mask(99, 4, 6, 0.4, row_ids=rows, col0=9)
    assert torch.equal(block, whole[rows][:, 9:15])


def test_chunk_sizes_are_dtensors_shards():
    from addnorm.ops.sharded import chunk_sizes

    for n in (1, 5, 9, 16, 17):
        for k in (1, 2, 3, 4, 8):
            sizes = [c.numel() for c in torch.arange(n).chunk(k)]
            assert chunk_sizes(n, k) == tuple(sizes + [0] * (k - len(sizes)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_the_ops_take_leading_dimensions_and_the_rows_of_a_shard(backend, norm):
    """The registered ops on (B, T, H): the statistics shaped (B, T); with ``rows`` (a shard's rows in
    a bigger tensor) the dropout mask is the bigger tensor's mask at those rows; opcheck passes."""
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(2, 3, 8, generator=g), torch.randn(2, 3, 8, generator=g)
    w, gate = torch.randn(8, generator=g), torch.randn(8, generator=g)
    rows = torch.tensor([[4, 9, 1], [0, 7, 3]])
    seed = torch.tensor(5)
    args = (x, r, w, None, gate, seed, rows, XHAT_FROM_S, norm, 1e-5, 0.7, 0.4)
    args += (torch.float32, torch.float32, True, backend)
    y, s, mean, rstd = lib.add_norm_fwd(*args)
    assert rstd.shape == (2, 3) and mean.shape == ((2, 3) if norm == "layernorm" else (0,))
    mask = dropout_keep_mask(5, 10, 8, 0.4)[rows.reshape(-1)].reshape(2, 3, 8)
    want_y, want_s = add_norm_reference(
        x, r, w, norm=norm, prenorm=True, alpha=0.7, gate=gate, dropout_p=0.4, mask=mask
    )
    torch.testing.assert_close(y.double(), want_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(s.double(), want_s, atol=1e-5, rtol=1e-5)
    if backend == "torch":
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w)]
        torch.library.opcheck(lib.add_norm_fwd, (*leaves, *args[3:]))


def test_the_communication_benchmark_runs_and_counts_bytes(bench_module, tmp_path):
    """benchmarks/op/sharded.py on a tiny shape: every (norm, strategy) row, the SP path silent, the TP path 8
    (LayerNorm) or 4 (RMSNorm) bytes a row each way (and a row of failure flags), the gather baselines
    whole shards of x and r."""
    bench = bench_module("benchmarks.op.sharded")
    b, t, h = 2, 4, 8
    report = bench.main(["--shapes", f"{b}x{t}x{h}", "--reps", "1", "--out", str(tmp_path)])
    rows = {(r["norm"], r["strategy"]): r for r in report["rows"]}
    assert set(rows) == {(n, s) for n in ("layernorm", "rmsnorm") for s in bench.STRATEGIES}
    local_rows, shard_bytes = b * t, b * t * h * 4 // WORLD
    for (norm, strategy), r in rows.items():
        if strategy == "SP":
            assert (r["fwd_collectives"], r["fwd_bytes"], r["bwd_collectives"], r["bwd_bytes"]) == (
                0,
                0,
                0,
                0,
            )
        elif strategy == "TP":
            per_row = 8 if norm == "layernorm" else 4
            # one row more: the ranks' failure flags (addnorm.ops.sharded._exchange)
            assert (r["fwd_collectives"], r["fwd_bytes"]) == (1, (local_rows + 1) * per_row)
            assert (r["bwd_collectives"], r["bwd_bytes"]) == (1, (local_rows + 1) * per_row)
        else:  # x and residual gathered forward, the gradients of y and s backward
            assert (r["fwd_collectives"], r["fwd_bytes"]) == (2, 2 * shard_bytes)
            assert (r["bwd_collectives"], r["bwd_bytes"]) == (2, 2 * shard_bytes)
        assert r["fwd_ms"] > 0 and r["fwd+bwd_ms"] > 0
    md = (tmp_path / "sharded_cpu.md").read_text()
    assert "| shape (B, T, H) |" in md and "gather from Shard(-1)" in md
