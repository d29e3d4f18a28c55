"""``add_norm`` on DTensors: what each placement communicates, against gathering everything.

Two ranks on ``gloo`` (CPU, one torch thread each; spawned here, or the processes ``torchrun`` gives).
For a few (batch, seq, hidden) shapes and both norms, each strategy runs the Pre-LN op (y, s =
add_norm(x, r, w, b, prenorm=True)) forward, and forward + backward (gradients of y and s given):

- ``SP``: x and residual Shard(1) (the sequence; SP / CP), weight and bias Replicate DTensors: the
  registered op under its sharding rules, computed locally;
- ``TP``: x and residual Shard(-1) (the hidden dimension), weight and bias Shard(0): one collective
  of the per-row statistics forward, one of the per-row sums backward;
- ``gather``: the baseline that peers ship (Liger-Kernel's fix for its RMSNorm under TP):
  ``full_tensor()`` of x, residual, weight and bias on every rank, the op on the whole tensors, the
  outputs re-sharded like x (from Shard(-1) and from Shard(1): the same forward, a different backward).

:class:`CommBytes` (a ``CommDebugMode``) counts the collectives and the bytes each rank puts into them
(an all-gather's input, an all-reduce's tensor; a ring all-reduce moves about 2(k-1)/k times that per
rank, an all-gather (k-1) times). The weight and bias gradients the SP path leaves ``Partial`` are
reduced later, with every other parameter's (one all-reduce of 2 x hidden floats per call, listed
apart). Time per call (median of ``--reps``, rank 0's wall and CPU time) is secondary: gloo on a
shared CPU says little about NCCL. Writes ``sharded_cpu.{md,json}``.

    python -m benchmarks.op.sharded [--reps 5] [--shapes 8x512x1024 4x1024x4096] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

from benchmarks.common.machine import machine_info, machine_line, write_results
from benchmarks.common.results_path import add_out_argument
from tools.procs import run_spawned

__all__ = ["CommBytes", "STRATEGIES", "main", "run_rank"]

WORLD = 2
DEFAULT_SHAPES = ("8x512x1024", "4x1024x4096", "1x2048x8192")
STRATEGIES = ("SP", "TP", "gather from Shard(-1)", "gather from Shard(1)")
# c10d's in-place collectives whose first argument is the output (the input is the second)
_OUTPUT_FIRST = ("allgather", "_allgather_base", "reduce_scatter", "_reduce_scatter_base", "alltoall_base")


class CommBytes(CommDebugMode):
    """``CommDebugMode`` that also adds up the payload of each collective: the bytes this rank puts into
    it (``bytes``; ``ops``: (name, bytes) per collective, in order)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = self.get_total_counts()
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self.get_total_counts() > before:  # it ran a collective (DTensor ops come back desugared)
            name = func._overloadpacket.__name__.rstrip("_")
            first = 1 if func.namespace == "c10d" and name in _OUTPUT_FIRST else 0
            payload = args[first]
            tensors = payload if isinstance(payload, (list, tuple)) else [payload]
            n = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
            self.bytes += n
            self.ops.append((name, n))
        return out


def _inputs(shape: tuple[int, int, int], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, h = shape
    return {
        "x": torch.randn(b, t, h, generator=g),
        "r": torch.randn(b, t, h, generator=g),
        "w": 1 + 0.1 * torch.randn(h, generator=g),
        "b": 0.1 * torch.randn(h, generator=g),
        "dy": torch.randn(b, t, h, generator=g),
        "ds": torch.randn(b, t, h, generator=g),
    }


def _call(strategy: str, mesh, data: dict, norm: str):
    """(a function running the strategy's forward on leaf DTensors, the leaves, the output gradients)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from addnorm.ops import add_norm

    rows = Shard(1)
    x_pl = [Shard(2)] if strategy in ("TP", "gather from Shard(-1)") else [rows]
    w_pl = [Shard(0)] if strategy == "TP" else [Replicate()]
    x, r = (distribute_tensor(data[k], mesh, x_pl).requires_grad_() for k in ("x", "r"))
    w, b = (distribute_tensor(data[k], mesh, w_pl).requires_grad_() for k in ("w", "b"))
    grads = [distribute_tensor(data[k], mesh, x_pl) for k in ("dy", "ds")]
    bias = b if norm == "layernorm" else None

    if strategy in ("SP", "TP"):

        def fwd():
            return add_norm(x, r, w, bias, norm=norm, prenorm=True)

    else:

        def fwd():
            whole = [t.full_tensor() for t in (x, r, w, b)]
            y, s = add_norm(*whole[:3], whole[3] if bias is not None else None, norm=norm, prenorm=True)
            rep = [Replicate()]
            return tuple(
                DTensor.from_local(t, mesh, rep, run_check=False).redistribute(mesh, x_pl) for t in (y, s)
            )

    leaves = [x, r, w] + ([b] if bias is not None else [])
    return fwd, leaves, grads


def _measure(fwd, leaves, grads, reps: int) -> dict:
    with CommBytes() as fc:
        out = fwd()
    with CommBytes() as bc:
        torch.autograd.grad(out, leaves, grads)
    row = {
        "fwd_collectives": fc.get_total_counts(),
        "fwd_bytes": fc.bytes,
        "fwd_ops": fc.ops,
        "bwd_collectives": bc.get_total_counts(),
        "bwd_bytes": bc.bytes,
        "bwd_ops": bc.ops,
    }
    for label, body in (("fwd", fwd), ("fwd+bwd", lambda: torch.autograd.grad(fwd(), leaves, grads))):
        body()  # warm-up
        wall, cpu = [], []
        for _ in range(reps):
            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            body()
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        row[f"{label}_ms"] = 1e3 * statistics.median(wall)
        row[f"{label}_cpu_ms"] = 1e3 * statistics.median(cpu)
    return row


def run_rank(shapes: list[tuple[int, int, int]], reps: int, norms=("layernorm", "rmsnorm")) -> list[dict]:
    """Every (shape, norm, strategy) on this rank (the process group initialised, ``WORLD`` ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    rows = []
    for shape in shapes:
        data = _inputs(shape)
        for norm in norms:
            for strategy in STRATEGIES:
                row = {"shape": list(shape), "norm": norm, "strategy": strategy}
                row.update(_measure(*_call(strategy, mesh, data, norm), reps))
                rows.append(row)
    return rows


def _worker(rank: int, port: int, shapes, reps: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        rows = run_rank(shapes, reps)
        if rank == 0:
            torch.save(rows, out)
    finally:
        dist.destroy_process_group()


def _spawn(shapes, reps: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        run_spawned(_worker, shapes, reps, out, nprocs=WORLD, deadline=600.0)
        return torch.load(out)


def _kib(n: int) -> str:
    return f"{n / 2**10:,.1f}" if n else "0"


def markdown(rows: list[dict], machine: dict, world: int) -> str:
    lines = [
        f"# add_norm on DTensors: communication per call (CPU, gloo, {world} ranks)",
        "",
        machine_line(machine) + f" {world} processes, one torch thread each, on a machine shared with other "
        "work: the times are indicative only.",
        "",
        "Pre-LN call (y, s = add_norm(x, r, w, b, prenorm=True)); payload = bytes each rank puts into the "
        "collectives (an all-gather's input, an all-reduce's tensor), fp32. SP and TP never call "
        "`full_tensor()`; the SP weight/bias gradients come out `Partial` and are reduced with the other "
        "parameters' gradients (2 x hidden floats, not counted here).",
        "",
        "| shape (B, T, H) | norm | strategy | fwd collectives | fwd KiB | bwd collectives | bwd KiB "
        "| fwd ms | fwd+bwd ms | fwd+bwd CPU ms |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        lines.append(
            f"| {' x '.join(map(str, r['shape']))} | {r['norm']} | {r['strategy']} | {r['fwd_collectives']} "
            f"| {_kib(r['fwd_bytes'])} | {r['bwd_collectives']} | {_kib(r['bwd_bytes'])} | {r['fwd_ms']:.1f} "
            f"| {r['fwd+bwd_ms']:.1f} | {r['fwd+bwd_cpu_ms']:.1f} |"
        )
    lines += [
        "",
        "Collectives per call: TP LayerNorm forward all-gathers (mean, M2) per row (8 bytes per row per "
        "rank), RMSNorm all-reduces sum(s^2) (4 bytes per row); the backward all-reduces the row sums "
        "(8 / 4 bytes per row); each collective carries one row more, the ranks' failure flags. The "
        "gather baselines move the whole activations: x and residual forward, and the output gradients "
        "backward.",
        "",
    ]
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int, int]:
    b, t, h = (int(v) for v in text.lower().split("x"))
    return b, t, h


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=list(DEFAULT_SHAPES), help="BxTxH, e.g. 8x512x1024")
    ap.add_argument("--reps", type=int, default=5)
    add_out_argument(ap)
    args = ap.parse_args(argv)
    shapes = [_shape(s) for s in args.shapes]
    world = WORLD
    if "RANK" in os.environ:  # under torchrun: these processes are the ranks
        dist.init_process_group("gloo")
        torch.set_num_threads(1)
        rows = run_rank(shapes, args.reps)
        rank, world = dist.get_rank(), dist.get_world_size()
        dist.destroy_process_group()
        if rank != 0:
            return {}
    else:
        rows = _spawn(shapes, args.reps)
    machine = machine_info("cpu")
    machine["torch_threads"] = 1
    payload = {"machine": machine, "world": world, "rows": rows}
    write_results(args.out, "sharded_cpu", markdown(rows, machine, world), payload)
    return payload


if __name__ == "__main__":
    main()
