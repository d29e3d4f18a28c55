"""Tensor and sequence parallelism for addnorm's language model, with PyTorch's own plans.

:func:`parallelize` applies ``torch.distributed.tensor.parallel.parallelize_module`` to a
:class:`~addnorm.model.LanguageModel` on a 1-D device mesh of ``tp`` ranks:

- **Tensor parallel** (TP; Shoeybi et al. 2019, Megatron-LM): attention's query/key/value projection
  column-wise (each rank computes its ``n_heads / tp`` heads) and its output projection row-wise; the
  feed-forward's first matrix column-wise and its second row-wise. One all-gather (or, without
  sequence parallel, nothing) before each sublayer and one reduce-scatter (all-reduce) after it.
- **Sequence parallel** (SP, ``sp=True``; Korthikanti et al. 2022): everything between the
  sublayers, the residual stream with every Add & Norm, is a DTensor sharded on the sequence
  (``Shard(1)``); norms, gates and the other parameters on the stream are Replicate DTensors. The
  adds, including the held-back adds that fuse with the next norm (:mod:`addnorm.model.stream`), run
  on each rank's rows with no communication: the all-gather before a sublayer and the reduce-scatter
  after it are the only collectives of a layer's forward.
- **Embedding and head** as torchtitan plans them: the token table row-wise (vocabulary shards),
  whose output is reduce-scattered onto the sequence shards; the head column-wise, its logits
  gathered (``loss_parallel=False``) or left sharded over the vocabulary for
  ``torch.distributed.tensor.parallel.loss_parallel``.

Every rank gets the whole batch; the model computes what it computes on one process (tests: 1e-5
after 3 optimiser steps). What this cannot give is refused with a one-line error (see
:func:`parallelize`).
"""

from __future__ import annotations

from torch import nn

from ..connection import AddNorm
from ..norms import BatchNorm
from ..placements import PLACEMENTS, Placement
from .models import LanguageModel

__all__ = ["parallelize", "parallelizable_placements"]


def _unsupported(p: Placement) -> str | None:
    """Why tensor parallelism cannot run a layer of placement ``p`` exactly, or None."""
    if p.sublayer_norm:
        return "its norm inside each sublayer (Sub-LN) normalises a hidden state that TP splits across ranks"
    if p.stream == "ngpt" or p.attention_norm == "ngpt" or p.ffn_scale or p.gate == "ngpt":
        return (
            "nGPT keeps its weights on the unit sphere (ngpt_normalize_ renormalises matrices along "
            "dimensions that TP splits) and scales the sharded heads and hidden units"
        )
    return None


def parallelizable_placements() -> list[str]:
    """The registered placements :func:`parallelize` takes (every layer of theirs is supported)."""
    names = []
    for name in PLACEMENTS:
        if all(_unsupported(p) is None for p in PLACEMENTS[name].layer_placements(4)):
            names.append(name)
    return names


def _tp_mesh(mesh):
    """The 1-D mesh to shard over: ``mesh`` itself, or its dimension named ``"tp"``."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"mesh: expected a torch.distributed DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim == 1:
        return mesh
    names = mesh.mesh_dim_names or ()
    if "tp" in names:
        return mesh["tp"]
    raise ValueError(
        f"mesh: expected a 1-D mesh or one with a dimension named 'tp', got a {mesh.ndim}-D mesh with "
        f"dimensions {names}"
    )


def _check(model: nn.Module, size: int, tp: bool) -> None:
    """Raise what this rank's ``model`` cannot be made tensor-parallel for, one line naming it."""
    from torch.distributed.tensor import DTensor

    if not tp:
        raise ValueError(
            "tp: sequence parallel shards the stream between tensor-parallel sublayers, so parallelize "
            "needs tp=True (for sequence sharding alone see context parallel in the README)"
        )
    if not isinstance(model, LanguageModel):
        raise TypeError(
            f"model: parallelize supports addnorm's LanguageModel, got {type(model).__name__} (the "
            "encoder-decoder Transformer's cross-attention and bare stacks are not supported)"
        )
    if any(isinstance(p, DTensor) for p in model.parameters()):
        raise ValueError("model: it is already distributed (DTensor parameters); parallelize it once")
    cfg = model.cfg
    sizes = {"n_heads": cfg.n_heads, "d_ff": cfg.d_ff, "vocab": model.embed.vocab}
    for name, value in sizes.items():
        if value % size:
            raise ValueError(f"{name}: {value} is not divisible by the tensor-parallel size {size}")
    for i, layer in enumerate(model.layers):
        why = _unsupported(layer.placement)
        if why is not None:
            raise ValueError(
                f"placement: layer {i} is {layer.placement.name!r}, which tensor parallelism does not "
                f"support: {why}; supported: {', '.join(parallelizable_placements())}"
            )
    if any(isinstance(m, BatchNorm) for m in model.modules()):
        raise ValueError(
            "norm: 'batchnorm' is not supported under tensor parallelism: its statistics run over the "
            "batch and the sequence (and heads), which the ranks hold in shards"
        )


def _layout(model: nn.Module) -> list[tuple[str, tuple[int, ...], str]]:
    """What must be the same on every rank: each parameter's and buffer's name, shape and dtype (its
    values may differ: rank 0's are kept)."""
    tensors = [*model.named_parameters(), *model.named_buffers()]
    return [(name, tuple(t.shape), str(t.dtype)) for name, t in tensors]


def _check_every_rank(model: nn.Module, mesh, tp: bool) -> None:
    """:func:`_check` on every rank of ``mesh`` at once: each rank's verdict on its own model (and
    the model's layout) is gathered before any other collective, so a rank that refuses, or whose
    model differs from rank 0's, makes every rank raise (naming that rank) instead of leaving the
    others waiting in ``parallelize_module``'s first collective until the process group's timeout."""
    import torch.distributed as dist

    try:
        _check(model, mesh.size(), tp)
        mine = None
    except (TypeError, ValueError) as err:
        mine = err
    verdict = None if mine is None else (type(mine).__name__, str(mine))
    views: list = [None] * mesh.size()
    layout = _layout(model) if mine is None else None
    dist.all_gather_object(views, (verdict, layout), group=mesh.get_group())
    if mine is not None:
        raise mine
    for rank, (other, _) in enumerate(views):
        if other is not None:
            kind = TypeError if other[0] == "TypeError" else ValueError
            raise kind(f"{other[1]} (rank {rank}'s model: parallelize refuses it on every rank)")
    first = views[0][1]
    for rank, (_, other) in enumerate(views[1:], start=1):
        if other != first:
            pairs = zip(first, other, strict=False)
            differs = next(
                (f"{a[0]} {a[1]} {a[2]} vs {b[0]} {b[1]} {b[2]}" for a, b in pairs if a != b),
                f"{len(first)} vs {len(other)} parameters and buffers",
            )
            raise ValueError(
                f"model: rank {rank}'s model differs from rank 0's ({differs}); parallelize needs the "
                "same model on every rank (its weights may differ: rank 0's are kept)"
            )


def _layer_plan(layer: nn.Module, sp: bool) -> dict:
    """One layer's plan: attention and feed-forward TP, their per-head norms, the connections' norms."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from .tp_styles import PackedColwiseParallel, ReplicatedParallel

    stream = Shard(1) if sp else Replicate()  # what the sublayers take and give back
    out = {"output_layouts": stream, "use_local_output": not sp}
    plan = {
        "self_attn.in_proj": PackedColwiseParallel(3, input_layouts=stream),
        "self_attn.out_proj": RowwiseParallel(**out),
        "ff.w1": (
            PackedColwiseParallel(2, input_layouts=stream)  # SwiGLU's (gate; value)
            if layer.ff.gated
            else ColwiseParallel(input_layouts=stream)
        ),
        "ff.w2": RowwiseParallel(**out),
    }
    for name in ("q_norm", "k_norm", "v_norm"):  # per head, over (B, heads, L, head_dim): heads sharded
        if getattr(layer.self_attn, name) is not None:
            plan[f"self_attn.{name}"] = ReplicatedParallel(sequence_dim=1, use_local_output=True)
    if sp:  # the connections' norms run on the stream's sequence shards
        for block_name, block in layer.named_children():
            if not isinstance(block, AddNorm):
                continue
            slots = (block.input_norm, block.branch_norm, block.output_norm)
            for norm_name, norm in block.named_children():
                if any(norm is slot for slot in slots) and _has_weights(norm):
                    plan[f"{block_name}.{norm_name}"] = ReplicatedParallel()
    return plan


def _sharded_dropouts(model: LanguageModel, sp: bool) -> list[nn.Module]:
    """The modules whose dropout acts on a rank's shard, so each rank must draw its own mask:
    attention (its heads) and the feed-forward (its hidden units), and with ``sp`` the stream's
    dropouts (its rows: the embedding's, and each connection's where its add runs unfused; the fused
    op hashes global coordinates itself). Without ``sp`` the stream is replicated: one mask for all."""
    cfg = model.cfg
    modules = []
    for layer in model.layers:
        modules += [layer.self_attn] if cfg.attn_dropout > 0 else []
        modules += [layer.ff] if cfg.act_dropout > 0 else []
    if sp and cfg.dropout > 0:
        modules.append(model.embed.dropout)
        modules += [m.dropout for m in model.modules() if isinstance(m, AddNorm)]
    return modules


def _has_weights(module: nn.Module | None) -> bool:
    return module is not None and any(True for _ in module.parameters())


def parallelize(
    model: LanguageModel, mesh, *, tp: bool = True, sp: bool = True, loss_parallel: bool = False
) -> LanguageModel:
    """Make ``model`` tensor-parallel (and with ``sp`` sequence-parallel) over ``mesh``; returns it.

    ``mesh``: a 1-D ``DeviceMesh`` of the TP ranks, or a mesh with a dimension named ``"tp"`` (for
    FSDP2 on the others: ``fully_shard(layer, mesh=mesh["dp"])`` after this). Call it on every rank
    with the same model; rank 0's weights are the ones kept (sharded or broadcast), and each rank then
    feeds the whole batch. ``loss_parallel``: the logits stay a DTensor sharded over the vocabulary
    (compute the loss inside ``torch.distributed.tensor.parallel.loss_parallel()``); otherwise they are
    gathered into a plain tensor.

    Plans (PyTorch's ``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel`` and two styles of
    :mod:`addnorm.model.tp_styles`): the packed q/k/v projection and a SwiGLU's packed gate/value
    column-wise by blocks (each rank its heads' q, k and v); output projections row-wise; per-head
    QK(V) norms replicated over the head shards; the token table row-wise, the head column-wise. With
    ``sp`` the stream is ``Shard(1)`` between sublayers and every norm, gate and buffer on it a
    Replicate DTensor, so each Add & Norm (fused or not) runs on the local rows without communication.

    Refused with a one-line error: another model than ``LanguageModel``; ``n_heads``, ``d_ff`` or the
    vocabulary not divisible by the TP size; a placement whose layers TP cannot compute exactly
    (:func:`parallelizable_placements`: not Sub-LN, not nGPT); BatchNorm; ``tp=False``; a model already
    distributed. Each rank checks its own model and the ranks agree before any other collective: one
    rank refusing (or holding a model of another layout than rank 0's) is an error on every rank,
    naming that rank, not a hang. Dropout trains with other masks than one process's: seed every rank
    the same (the replicated stream without ``sp`` needs one mask); dropouts on a rank's shard (heads,
    hidden units, with ``sp`` the stream's rows) draw from a per-rank generator
    (:class:`~.tp_styles.RankDropoutStream`).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from .tp_styles import (
        RankDropoutStream,
        ReplicatedParallel,
        broadcast_plain,
        reduce_partial_gradients,
        replicate_parameters,
    )

    mesh = _tp_mesh(mesh)
    _check_every_rank(model, mesh, tp)
    tied = model.head.weight is model.embed.tokens.weight
    stream = Shard(1) if sp else Replicate()
    plan = {
        "embed.tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=stream, use_local_output=not sp
        ),
        "head": ColwiseParallel(
            input_layouts=stream,
            output_layouts=Shard(-1) if loss_parallel else Replicate(),
            use_local_output=not loss_parallel,
        ),
    }
    if sp and _has_weights(model.norm):
        plan["stack.norm"] = ReplicatedParallel()
    for i, layer in enumerate(model.layers):
        plan.update({f"stack.layers.{i}.{k}": v for k, v in _layer_plan(layer, sp).items()})
    parallelize_module(model, mesh, plan)
    if tied:  # both sharded over the vocabulary (Shard(0)): one parameter again
        model.head.weight = model.embed.tokens.weight
    if sp:  # gates, Admin's omega, position tables: Replicate DTensors on the stream
        replicate_parameters(model, mesh)
    else:  # the stream's parameters stay plain, replicated: rank 0's values
        broadcast_plain(model, mesh)
    reduce_partial_gradients(model)
    for module in _sharded_dropouts(model, sp):
        RankDropoutStream(mesh).attach(module)
    return model
