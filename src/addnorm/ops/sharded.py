"""``add_norm`` on DTensors (``torch.distributed.tensor``): x and residual sharded on any leading
dimension (batch; sequence: SP / CP), replicated, or sharded on the hidden dimension (TP), on 1-D or
N-D device meshes; exact (the single-process op's values) and without gathering x.

Which path runs (:func:`add_norm_dtensor`, chosen by :func:`addnorm.ops.add_norm` when x is a DTensor):

- **no mesh dimension shards the hidden dimension** (leading-dimension shards, Replicate, mixtures):
  the registered op ``addnorm::add_norm_fwd`` on the DTensors themselves. Its sharding rules
  (:func:`register_rules`, through DTensor's public ``register_sharding``) run every row locally: the
  outputs and statistics sharded like the rows, weight/bias/gate replicated; the backward op's
  weight, bias and gate gradients come out ``Partial()`` along the mesh dimensions that shard rows
  (DTensor reduces them as it reduces any Partial), Replicate elsewhere. No communication.
- **one mesh dimension shards the hidden dimension** (TP; with any leading-dimension shards on the
  others): :class:`TensorParallelAddNorm` on the local shards. Each rank computes s on its columns
  and their per-row statistics; one collective over that mesh dimension combines them; each rank
  normalises its own columns, so y and s stay sharded like x:

  - LayerNorm: an all-gather of (mean, M2) per row, two numbers (fp32; fp64 for fp64 inputs) from
    each rank, merged as ``mean = sum_i n_i mean_i / N``, ``M2 = sum_i M2_i + sum_i n_i (mean_i -
    mean)^2`` (Chan et al. 1979: sums of squares about the means, never E[s^2] - mean^2, which
    cancels catastrophically when |mean| >> std);
  - RMSNorm: an all-reduce of sum(s^2) per row (one number).

  Backward: one all-reduce of the row sums of x_hat * w * dy and w * dy (RMSNorm: the first only),
  then every gradient locally; dweight / dbias stay Shard(0) like the weight (Partial along mesh
  dimensions sharding rows). Weight, bias and a LayerScale gate are Shard(0) on the TP mesh
  dimension, or Replicate (each rank reads its columns; their gradient is then Partial there).

Plain tensors for weight, bias or gate are taken as replicated on x's mesh (``DTensor.from_local``):
their gradient is the whole gradient, reduced over the ranks in backward (one all-reduce of their
size); DTensor parameters avoid that.

**Dropout** drops exactly the elements the whole tensor's mask drops
(:func:`addnorm.ops.reference.dropout_keep_mask` of (seed, global row, global column)): each shard
hashes its global coordinates, ``rows`` (the global row of each local row: a replicated arange
redistributed like x, i.e. local slicing, no communication) and ``col0`` (the first global column of
a column shard). With ``seed=None`` every rank draws the seed from torch's generator, which must
therefore be seeded alike on every rank (``torch.manual_seed(same)``, as DTensor's own random ops
require); nothing is communicated for it.

This module imports ``torch.distributed.tensor``; ``addnorm.ops.functional`` imports it only when a
DTensor arrives (or is already imported), so plain-tensor users never pay for that import.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torch.compiler import is_compiling
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.experimental import register_sharding

from .args import BwdArgs, FwdArgs, needs_dx
from .library import add_norm_bwd, add_norm_fwd
from .reference import dropout_keep_mask
from .torch_path import _stream, branch_grads, compute_dtype

# the all-gather into one tensor (torch 2.13 renames it all_gather_single; earlier releases have only
# all_gather_into_tensor)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["TPCall", "TensorParallelAddNorm", "add_norm_dtensor", "chunk_sizes", "register_rules"]


# --- sharding rules of the registered ops ---------------------------------------------------------


def _placeholder(spec) -> bool:
    """An op's empty stand-in for an absent tensor (s not stored, RMSNorm's mean, no dx, ...)."""
    return tuple(spec.shape) == (0,)


def _fwd_rules(*args, **kwargs):
    """``add_norm_fwd``'s placements per mesh dimension: all Replicate, or rows sharded on a leading
    dimension d (x, residual, rows, and the outputs y, s, mean, rstd Shard(d); weight, bias, gate and
    seed Replicate). The hidden dimension is never sharded here (that needs communication: TP)."""
    a = FwdArgs(*args, **kwargs)  # DTensorSpecs where the op has tensors
    rep, rules = Replicate(), []
    for p in [rep, *(Shard(d) for d in range(len(a.x.shape) - 1))]:
        outputs = [p, p if a.store_s else rep, p if a.norm == "layernorm" else rep, p]
        inputs = [p, p, *(None if t is None else rep for t in (a.weight, a.bias, a.gate, a.seed))]
        rules.append((outputs, [*inputs, None if a.rows is None else p]))
    return rules


def _bwd_rules(*args, **kwargs):
    """``add_norm_bwd``'s placements per mesh dimension: all Replicate, or rows sharded on a leading
    dimension d: every per-row tensor Shard(d), and the weight/bias/gate gradients Partial() (each
    rank's sum over its rows)."""
    a = BwdArgs(*args, **kwargs)
    rep, rules = Replicate(), []
    for p in [rep, *(Shard(d) for d in range(len(a.dy.shape) - 1))]:
        part = rep if p == rep else Partial()

        def like(spec, p=p):
            return None if spec is None else (rep if _placeholder(spec) else p)

        grads = (rep if t is None else part for t in (a.weight, a.bias, a.gate))
        outputs = [p if a.need_dx else rep, p, *grads]
        inputs = [p, like(a.ds), like(a.saved), like(a.x), like(a.residual)]
        inputs += [None if t is None else rep for t in (a.weight, a.bias, a.gate, a.seed)]
        rules.append((outputs, [*inputs, like(a.rows), like(a.mean), p]))
    return rules


_registered = False


def register_rules() -> None:
    """Register the sharding rules of ``addnorm::add_norm_fwd`` / ``add_norm_bwd`` with DTensor (once
    per process; :func:`addnorm.ops.add_norm` calls it before the first DTensor call, and at import
    when ``torch.distributed.tensor`` is already imported). Call it yourself before calling the
    registered ops directly on DTensors."""
    global _registered
    if not _registered:
        register_sharding(add_norm_fwd._opoverload)(_fwd_rules)
        register_sharding(add_norm_bwd._opoverload)(_bwd_rules)
        _registered = True


# --- the call's layout ----------------------------------------------------------------------------


def chunk_sizes(n: int, k: int) -> tuple[int, ...]:
    """The sizes DTensor's ``Shard`` gives the k ranks of a mesh dimension for a dimension of size n
    (``torch.chunk``'s rule: chunks of ceil(n / k), the last ones smaller or empty)."""
    c = -(-n // k)
    return tuple(max(0, min(c, n - i * c)) for i in range(k))


def _check_layout(x: DTensor, residual) -> tuple[int | None, list[int]]:
    """x's and residual's placements checked: (the mesh dimension sharding the hidden dimension or
    None, the mesh dimensions sharding a leading dimension)."""
    mesh = x.device_mesh
    if not isinstance(residual, DTensor):
        raise ValueError(
            f"residual: expected a DTensor placed like x ({tuple(x.placements)} on {mesh}), got a plain "
            f"{type(residual).__name__}"
        )
    if residual.device_mesh != mesh:
        raise ValueError(
            f"residual: expected a DTensor on x's mesh {mesh}, got one on {residual.device_mesh}"
        )
    if tuple(residual.placements) != tuple(x.placements):
        raise ValueError(
            f"residual: expected x's placements {tuple(x.placements)}, got {tuple(residual.placements)} "
            "(redistribute one of them)"
        )
    last, tp, lead = x.ndim - 1, [], []
    for i, p in enumerate(x.placements):
        if p.is_replicate():
            continue
        if type(p) is not Shard:
            raise ValueError(
                f"x: placement {p!r} on mesh dim {i}: expected Shard(d) or Replicate() (a Partial x holds "
                "no rows to normalise: redistribute it first)"
            )
        if p.dim == last:
            tp.append(i)
            continue
        if x.shape[p.dim] < mesh.size(i):
            raise ValueError(
                f"x: dim {p.dim} of size {x.shape[p.dim]} is sharded over the {mesh.size(i)} ranks of mesh "
                f"dim {i}: some rank would hold nothing and DTensor would gather; shard a longer dimension"
            )
        lead.append(i)
    if len(tp) > 1:
        raise ValueError(
            f"x: its last (hidden) dimension is sharded over mesh dims {tp}; add_norm combines row "
            "statistics over one mesh dimension: shard it over one"
        )
    return (tp[0] if tp else None), lead


def _as_dtensor(name: str, t: Tensor | None, x: DTensor, tp: int | None) -> DTensor | None:
    """weight / bias / gate as a DTensor on x's mesh: a plain tensor is taken as replicated; a
    DTensor must be Replicate, or Shard(0) on the mesh dimension sharding the hidden dimension (a
    vector of the hidden size only)."""
    if t is None:
        return None
    mesh = x.device_mesh
    if not isinstance(t, DTensor):
        return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)
    if t.device_mesh != mesh:
        raise ValueError(f"{name}: expected a DTensor on x's mesh {mesh}, got one on {t.device_mesh}")
    vector = t.numel() > 1
    for i, p in enumerate(t.placements):
        if p.is_replicate() or (vector and i == tp and type(p) is Shard and p.dim == 0):
            continue
        expected = "Replicate() or Shard(0)" if vector and i == tp else "Replicate()"
        raise ValueError(
            f"{name}: placement {p!r} on mesh dim {i}, where x is {x.placements[i]!r}: expected {expected} "
            "(a norm parameter is sharded only along the mesh dimension that shards x's hidden dimension)"
        )
    return t


_ROWS: dict[tuple, Tensor] = {}


def _row_ids(x: DTensor, placements: tuple) -> Tensor:
    """This rank's rows' global indices (int64, the local shape of ``x.shape[:-1]`` under
    ``placements``): the whole tensor's arange, replicated and redistributed (local slicing, no
    communication). Cached per layout."""
    mesh, lead = x.device_mesh, tuple(x.shape[:-1])
    key = (mesh, placements, lead, x.device)
    ids = _ROWS.get(key)
    if ids is None:
        whole = torch.arange(math.prod(lead), dtype=torch.int64, device=x.device).reshape(lead)
        rep = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        ids = _ROWS[key] = rep.redistribute(mesh, placements).to_local()
        if len(_ROWS) > 64:
            _ROWS.pop(next(iter(_ROWS)))
    return ids


def add_norm_dtensor(plan, x: DTensor, residual, weight, bias, gate, seed_t: Tensor | None, via_op):
    """:func:`addnorm.ops.add_norm` for a DTensor x (``plan``: its checked call plan; ``seed_t``: the
    dropout seed as a plain int64 tensor, the same on every rank, or None; ``via_op(plan, x, residual,
    weight, bias, gate, seed, rows)``: the call through the registered op). Returns DTensors placed
    like x: y, or (y, s) with prenorm."""
    register_rules()
    tp, lead = _check_layout(x, residual)
    weight, bias, gate = (
        _as_dtensor(n, t, x, tp) for n, t in (("weight", weight), ("bias", bias), ("gate", gate))
    )
    mesh = x.device_mesh
    if tp is None:
        rep = [Replicate()] * mesh.ndim
        seed_d = None if seed_t is None else DTensor.from_local(seed_t, mesh, rep, run_check=False)
        rows = None
        if plan.p and lead:
            placements = tuple(x.placements)
            shape = x.shape[:-1]
            rows = DTensor.from_local(
                _row_ids(x, placements), mesh, placements, run_check=False, shape=shape,
                stride=torch.empty(shape, device="meta").stride(),
            )  # fmt: skip
        return via_op(plan, x, residual, weight, bias, gate, seed_d, rows)
    return _tensor_parallel(plan, x, residual, weight, bias, gate, seed_t, tp, lead)


# --- the hidden dimension sharded (TP) ------------------------------------------------------------


class TPCall(NamedTuple):
    """What a tensor-parallel call's local computation needs besides tensors: the process group of
    the mesh dimension sharding the hidden dimension, every rank's column count there (``counts``),
    this rank's first global column ``col0`` and column count ``n``, the whole row's size ``hidden``,
    and the options."""

    group: dist.ProcessGroup
    counts: tuple[int, ...]
    col0: int
    n: int
    hidden: int
    rms: bool
    eps: float
    alpha: float
    p: float
    cdt: torch.dtype
    x_dtype: torch.dtype
    res_dtype: torch.dtype
    s_dtype: torch.dtype
    y_dtype: torch.dtype
    triton: bool


def _local_param(t: DTensor | None, x: DTensor, tp: int, col0: int, n: int) -> Tensor | None:
    """A parameter's columns on this rank, its gradient declared as DTensor should see it: Shard(0)
    where it is sharded with the columns, Partial() where x's rows are sharded or the parameter is
    replicated across the column shards (each rank's gradient covers its columns or its rows),
    Replicate elsewhere."""
    if t is None:
        return None
    grad = []
    for i, (px, pt) in enumerate(zip(x.placements, t.placements, strict=True)):
        if i == tp:
            grad.append(pt if pt.is_shard() else Partial())
        else:
            grad.append(Partial() if px.is_shard() else Replicate())
    local = t.to_local(grad_placements=grad)
    if t.numel() > 1 and not t.placements[tp].is_shard():  # a replicated vector: this rank's columns
        local = local.narrow(0, col0, n)
    return local


def _tensor_parallel(plan, x, residual, weight, bias, gate, seed_t, tp: int, lead: list[int]):
    mesh, placements = x.device_mesh, tuple(x.placements)
    hidden, k = x.shape[-1], mesh.size(tp)
    counts = chunk_sizes(hidden, k)
    coord = mesh.get_local_rank(tp)
    col0, n = sum(counts[:coord]), counts[coord]
    x_l, r_l = x.to_local(), residual.to_local()  # their columns are checked inside the collective's guard
    w_l, b_l, g_l = (_local_param(t, x, tp, col0, n) for t in (weight, bias, gate))
    rows = None
    if plan.p and lead:  # rows sharded too: their global indices for the dropout hash
        rows = _row_ids(x, tuple(Replicate() if i == tp else p for i, p in enumerate(placements)))
    call = TPCall(
        mesh.get_group(tp), counts, col0, n, hidden, plan.rms, plan.eps, plan.alpha, plan.p,
        compute_dtype(x.dtype, residual.dtype, plan.s_dtype), x.dtype, residual.dtype, plan.s_dtype,
        plan.y_dtype, plan.triton,
    )  # fmt: skip
    y_l, s_l = TensorParallelAddNorm.apply(x_l, r_l, w_l, b_l, g_l, seed_t, rows, call)
    stride = torch.empty(x.shape, device="meta").stride()
    y = DTensor.from_local(y_l, mesh, placements, run_check=False, shape=x.shape, stride=stride)
    if not plan.prenorm:
        return y
    return y, DTensor.from_local(s_l, mesh, placements, run_check=False, shape=x.shape, stride=stride)


def _exchange(call: TPCall, mine: Tensor | None, failure: Exception | None, rows: int, device, gather: bool):
    """The collective of a tensor-parallel step, joined by every rank whatever happened before it:
    ``mine`` is this rank's per-row numbers ((rows,) for RMSNorm, (rows, 2) for LayerNorm, in
    ``call.cdt``), or None where computing them raised ``failure``, and the rank sends zeros instead.
    One more row carries each rank's failure flag, so a failure on one rank is an error on every rank
    right after the same collective, never ranks waiting for one that left (the failing rank raises
    its own error, the others a RuntimeError saying so). Returns the all-gathered (k, rows, ...)
    numbers (``gather``) or the all-reduced (rows, ...). The flag is read on the host, so it is sent
    only where that costs no wait: CPU tensors (gloo). On an accelerator reading it would stall the
    host on every call until the collective finished, so there the numbers go alone and a rank that
    failed before the collective is noticed by the backend's own watchdog (NCCL's timeout, which
    aborts the waiting ranks); a graph torch.compile traces has no Python to catch a failure in, and
    exchanges the numbers alone too."""
    width, k = (() if call.rms else (2,)), len(call.counts)
    flagged = not is_compiling() and torch.device(device).type == "cpu"
    if failure is not None and not flagged:
        raise failure
    if not flagged:
        if gather:
            out = mine.new_empty((k * rows, *width))
            _all_gather(out, mine, group=call.group)
            return out.view(k, rows, *width)
        dist.all_reduce(mine, group=call.group)
        return mine
    if failure is not None:
        mine = torch.zeros((rows, *width), dtype=call.cdt, device=device)
    flag = mine.new_zeros((1, *width))
    if failure is not None:
        flag.view(-1)[0] = 1.0
    payload = torch.cat([mine, flag])
    if gather:
        out = payload.new_empty((k * (rows + 1), *width))
        _all_gather(out, payload, group=call.group)
        every = out.view(k, rows + 1, *width)
        failed = every[:, rows].reshape(k, -1)[:, 0].tolist()
        result = every[:, :rows]
    else:
        dist.all_reduce(payload, group=call.group)
        failed = payload[rows:].reshape(-1)[:1].tolist()
        result = payload[:rows]
    if failure is not None:
        raise failure
    if any(failed):
        which = f"rank {failed.index(1.0)} of the group" if gather else "another rank"
        raise RuntimeError(
            f"add_norm: {which} sharding the hidden dimension failed before the "
            f"{'row sums' if not gather and not call.rms else 'statistics'}' collective (its own error says "
            "why); this rank stops too"
        )
    return result


def _combine(call: TPCall, stats: Tensor) -> tuple[Tensor | None, Tensor]:
    """The whole rows' (mean or None, rstd) from every rank's per-row statistics of its columns
    (exchanged by :func:`_exchange`): RMSNorm sum(s^2) (rows,), all-reduced; LayerNorm (mean, M2)
    (k, rows, 2), all-gathered, merged with the column counts (sums of squares about the means: no
    cancellation)."""
    if call.rms:
        return None, torch.rsqrt(stats / call.hidden + call.eps)
    n = _counts(call.counts, stats.dtype, stats.device)
    mean = (n * stats[..., 0]).sum(0) / call.hidden
    m2 = stats[..., 1].sum(0) + (n * (stats[..., 0] - mean).square()).sum(0)
    return mean, torch.rsqrt(m2 / call.hidden + call.eps)


_COUNTS: dict[tuple, Tensor] = {}


def _counts(counts: tuple[int, ...], dtype: torch.dtype, device) -> Tensor:
    """The ranks' column counts as a (k, 1) tensor, cached (no host-to-device copy per call)."""
    key = (counts, dtype, device)
    t = _COUNTS.get(key)
    if t is None:
        t = _COUNTS[key] = torch.tensor(counts, dtype=dtype, device=device).view(-1, 1)
        if len(_COUNTS) > 64:
            _COUNTS.pop(next(iter(_COUNTS)))
    return t


def _keep(call: TPCall, seed: Tensor | None, rows: Tensor | None, nrows: int, device) -> Tensor | None:
    if seed is None or not call.p:
        return None
    return dropout_keep_mask(seed, nrows, call.n, call.p, device, row_ids=rows, col0=call.col0)


def _stats_torch(call: TPCall, x, residual, gate, seed, rows) -> tuple[Tensor, Tensor]:
    """(s in s's dtype, this rank's per-row statistics: RMSNorm sum(s^2), LayerNorm (mean, M2))."""
    keep = _keep(call, seed, rows, x.shape[0], x.device)
    s_out, s = _stream(x, residual, gate, keep, call.alpha, call.p, call.cdt, call.s_dtype)
    if call.rms:
        return s_out, torch.linalg.vecdot(s, s)
    if not call.n:  # no columns here: nothing to merge
        return s_out, s.new_zeros(s.shape[0], 2)
    var, mean = torch.var_mean(s, -1, correction=0)  # one pass, centred
    return s_out, torch.stack([mean, var * call.n], -1)


def _normalise_torch(call: TPCall, s_out, mean, rstd, weight, bias) -> Tensor:
    s = s_out.to(call.cdt)
    y = s * rstd[:, None] if mean is None else (s - mean[:, None]).mul_(rstd[:, None])  # never s itself
    w = None if weight is None else weight.to(call.cdt)
    b = None if bias is None else bias.to(call.cdt)
    if w is not None:
        y = y.mul_(w) if b is None else torch.addcmul(b, y, w)
    elif b is not None:
        y = y.add_(b)
    return y.to(call.y_dtype)


def _xhat_wdy(call: TPCall, dy, s_out, mean, rstd, weight) -> tuple[Tensor, Tensor, Tensor]:
    s = s_out.to(call.cdt)
    xhat = (s if mean is None else s - mean[:, None]) * rstd[:, None]
    dyf = dy.to(call.cdt)
    return xhat, dyf, (dyf * weight.to(call.cdt) if weight is not None else dyf)


def _sums_torch(call: TPCall, dy, s_out, mean, rstd, weight) -> Tensor:
    """This rank's per-row sums of x_hat * w dy (RMSNorm), and of w dy (LayerNorm: (rows, 2))."""
    xhat, _, wdy = _xhat_wdy(call, dy, s_out, mean, rstd, weight)
    c1 = torch.linalg.vecdot(xhat, wdy)
    return c1 if call.rms else torch.stack([c1, wdy.sum(-1)], -1)


def _grads_torch(call: TPCall, dy, ds, s_out, x, weight, bias, gate, seed, rows, mean, rstd, sums, need_dx):
    """(dx or empty, dresidual, dweight, dbias, dgate) from the whole rows' sums."""
    xhat, dyf, wdy = _xhat_wdy(call, dy, s_out, mean, rstd, weight)
    c1 = (sums if call.rms else sums[:, 0]) / call.hidden
    dsum = torch.addcmul(wdy, xhat, c1[:, None], value=-1.0)
    if not call.rms:
        dsum.sub_((sums[:, 1] / call.hidden)[:, None])
    dsum.mul_(rstd[:, None])
    if ds is not None:
        dsum.add_(ds.to(call.cdt))
    keep = _keep(call, seed, rows, dy.shape[0], dy.device)
    dx, dres, dg = branch_grads(
        dsum, x, gate, keep, call.alpha, call.p, call.x_dtype, call.res_dtype, need_dx
    )
    dw = None if weight is None else (dyf * xhat).sum(0).to(weight.dtype)
    db = None if bias is None else dyf.sum(0).to(bias.dtype)
    return dx, dres, dw, db, (None if gate is None else dg)


class TensorParallelAddNorm(torch.autograd.Function):
    """The op on the local column shards of x and residual (..., n) of rows whose whole size is
    ``call.hidden``: a statistics pass, one collective (:func:`_combine`), a normalise pass; the
    backward: a row-sums pass, one all-reduce, the gradients. Torch ops, or the Triton kernels of
    :mod:`addnorm.ops.triton.tp_launchers` where ``call.triton``. Returns (y, s) of x's local shape."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, gate, seed, rows, call: TPCall):
        shape, n = x.shape, call.n
        nrows = math.prod(shape[:-1])  # reshaped with the row count: a rank may hold no columns
        if call.triton:
            from .triton import tp_launchers as impl

        failure = None
        try:  # this rank's part before the collective: a failure joins it (_exchange), then raises
            if x.shape[-1] != n:
                raise ValueError(
                    f"x: this rank holds {x.shape[-1]} of the {call.hidden} columns, DTensor's Shard would "
                    f"give it {n} (a DTensor built with from_local and uneven shards of its own): "
                    "redistribute it"
                )
            x2, r2 = x.reshape(nrows, n), residual.reshape(nrows, n)
            stats_of = impl.stats if call.triton else _stats_torch
            s_out, stats = stats_of(call, x2, r2, gate, seed, rows)
        except Exception as e:
            failure, s_out, stats = e, None, None
        stats = _exchange(call, stats, failure, nrows, x.device, not call.rms)
        mean, rstd = _combine(call, stats)
        if call.triton:
            y = impl.normalise(call, s_out, mean, rstd, weight, bias)
        else:
            y = _normalise_torch(call, s_out, mean, rstd, weight, bias)
        ctx.save_for_backward(
            x if gate is not None else None, weight, bias, gate, seed, rows, s_out, mean, rstd
        )
        ctx.call, ctx.shape = call, shape
        ctx.need_dx = needs_dx(bool(call.p), gate is not None, call.alpha, call.x_dtype, call.res_dtype)
        ctx.set_materialize_grads(False)
        return y.reshape(shape), s_out.reshape(shape)

    @staticmethod
    def backward(ctx, dy, ds):
        x, weight, bias, gate, seed, rows, s_out, mean, rstd = ctx.saved_tensors
        call, shape = ctx.call, ctx.shape
        nrows, n = s_out.shape
        dy = torch.zeros_like(s_out) if dy is None else dy.reshape(nrows, n)
        ds = None if ds is None else ds.reshape(nrows, n)
        x2 = None if x is None else x.reshape(nrows, n)
        if call.triton:
            from .triton import tp_launchers as impl

        failure = None
        try:  # as in forward: a failure joins the collective, then raises
            sums_of = impl.sums if call.triton else _sums_torch
            sums = sums_of(call, dy, s_out, mean, rstd, weight)
        except Exception as e:
            failure, sums = e, None
        sums = _exchange(call, sums, failure, nrows, s_out.device, False)
        args = (call, dy, ds, s_out, x2, weight, bias, gate, seed, rows, mean, rstd, sums, ctx.need_dx)
        dx, dres, dw, db, dg = impl.grads(*args) if call.triton else _grads_torch(*args)
        dres = dres.reshape(shape)
        dx = dx.reshape(shape) if ctx.need_dx else dres
        return dx, dres, dw, db, dg, None, None, None
