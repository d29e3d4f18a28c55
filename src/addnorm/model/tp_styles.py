"""What :func:`addnorm.model.parallel.parallelize` adds to PyTorch's tensor parallelism: two
``ParallelStyle``\\ s, the replication of the parameters no style owns, the reduction of their partial
gradients, and per-rank dropout streams on shards.

Imported only by ``parallelize`` (``torch.distributed.tensor`` is not loaded by ``import addnorm``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, SequenceParallel
from torch.distributed.tensor.placement_types import Placement, _StridedShard

__all__ = [
    "PackedColwiseParallel",
    "RankDropoutStream",
    "ReplicatedParallel",
    "broadcast_plain",
    "reduce_partial_gradients",
    "replicate_parameters",
]


def _replicated(tensor: Tensor, mesh: DeviceMesh) -> DTensor:
    """``tensor`` as a Replicate DTensor holding rank 0's values (a broadcast; none on the meta device)."""
    return distribute_tensor(tensor.detach(), mesh, [Replicate()], src_data_rank=0)


class PackedColwiseParallel(ColwiseParallel):
    """Column-wise parallel for a Linear whose output packs ``parts`` equal blocks side by side:
    attention's (q; k; v) projection (``parts=3``) or SwiGLU's (gate; value) (``parts=2``).

    Plain ``ColwiseParallel`` cuts the weight's rows into contiguous shards, which would give the
    first rank all of q and part of k. Here the weight and bias are distributed as
    ``_StridedShard(0, split_factor=parts)``: each block is cut into shards, and each rank holds its
    shard of every block ([q_r; k_r; v_r]: the projections of its own heads), so the local output
    splits into ``parts`` blocks as the unsharded one does. The DTensor still stands for the whole
    weight in the model's own layout (``full_tensor()``, full state dicts), and ``F.linear``
    propagates the placement with no communication. ``torch.distributed.checkpoint`` (torch 2.13)
    cannot save it sharded: it records one contiguous chunk per rank. The local output is returned
    (``use_local_output`` True), like ``ColwiseParallel``'s default.
    """

    def __init__(self, parts: int, *, input_layouts: Placement | None = None) -> None:
        super().__init__(input_layouts=input_layouts)
        self.parts = parts
        self.output_layouts = (_StridedShard(-1, split_factor=parts),)

    def _partition_linear_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            placement = _StridedShard(0, split_factor=self.parts)
            sharded = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(param_name, nn.Parameter(sharded, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        return outputs.to_local()  # already laid out as the blocks' shards: no redistribution

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Linear):
            raise TypeError(f"PackedColwiseParallel: expected an nn.Linear, got {type(module).__name__}")
        if module.out_features % (self.parts * device_mesh.size()):
            raise ValueError(
                f"PackedColwiseParallel: {module.out_features} output features do not split into "
                f"{self.parts} blocks of {device_mesh.size()} equal shards"
            )
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        return f"PackedColwiseParallel(parts={self.parts}, input_layouts={self.input_layouts})"


class ReplicatedParallel(SequenceParallel):
    """``SequenceParallel`` whose parameters hold rank 0's values on every rank.

    PyTorch's ``SequenceParallel`` makes each rank's own parameter a Replicate DTensor as it is
    (``from_local``), which assumes every rank built the same values; a norm whose gains were set
    or loaded on rank 0 only would then silently differ between ranks. Here they are broadcast from
    rank 0, as ``ColwiseParallel`` and ``RowwiseParallel`` take their shards from rank 0.
    """

    def _replicate_module_fn(self, name: str, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for param_name, param in module.named_parameters(recurse=False):
            if not isinstance(param, DTensor):
                replicated = _replicated(param, device_mesh)
                module.register_parameter(param_name, nn.Parameter(replicated, param.requires_grad))


def replicate_parameters(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter and buffer of ``module`` that is not yet a DTensor becomes a Replicate DTensor
    with rank 0's values. A parameter shared by several modules (ReZero's one gate per layer, tied
    weights) stays one parameter: it is distributed once and given to each owner."""
    done: dict[int, Tensor] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if id(param) not in done:
                done[id(param)] = nn.Parameter(_replicated(param, mesh), param.requires_grad)
            sub._parameters[name] = done[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is None or isinstance(buffer, DTensor):
                continue
            if id(buffer) not in done:
                done[id(buffer)] = _replicated(buffer, mesh)
            sub._buffers[name] = done[id(buffer)]


def _sum_partial_gradient(param: DTensor) -> None:
    grad = param.grad
    if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
        param.grad = grad.redistribute(placements=param.placements)


def reduce_partial_gradients(module: nn.Module) -> None:
    """Have each replicated parameter's gradient summed over the ranks once, as it is accumulated.

    A parameter used on sequence (or head) shards gets a ``Partial`` gradient, each rank's sum over
    its rows; DTensor would reduce it at each later use (AdamW: three all-reduces per parameter per
    step). After this, backward leaves a Replicate gradient (one all-reduce), which the optimizer,
    clipping and probes read like one process's."""
    for param in module.parameters():
        if isinstance(param, DTensor) and all(p.is_replicate() for p in param.placements):
            param.register_post_accumulate_grad_hook(_sum_partial_gradient)


def broadcast_plain(module: nn.Module, mesh: DeviceMesh) -> None:
    """Every parameter and buffer of ``module`` that is not a DTensor gets rank 0's values, in place
    (without sequence parallel they stay plain tensors, replicated on every rank)."""
    group = mesh.get_group()
    source = dist.get_global_rank(group, 0)
    with torch.no_grad():
        for tensor in (*module.parameters(), *module.buffers()):
            if not isinstance(tensor, DTensor) and not tensor.is_meta:
                dist.broadcast(tensor, source, group=group)


class RankDropoutStream:
    """Forward hooks that give a module's dropout this rank's own random stream.

    Where a rank holds a shard (its heads, its hidden units, its sequence rows), each rank must drop
    its own elements; with every rank seeded alike (which the replicated parts need), torch's generator
    would draw the same local mask on every shard (correlated heads or positions). On entry the module
    draws one number from the global generator (the same on every rank, so the global stream stays in
    step) and runs under a generator seeded with it plus the rank; on exit the global state is back as
    after that draw. A recomputation under activation checkpointing, which restores the global state
    first, draws the same masks. On CUDA, DTensor's own random ops keep their tracker's state.
    """

    def __init__(self, mesh: DeviceMesh) -> None:
        self.rank = mesh.get_local_rank()
        self.cuda = mesh.device_type == "cuda"
        self._forks: list = []

    def attach(self, module: nn.Module) -> None:
        module.register_forward_pre_hook(self._enter)
        module.register_forward_hook(self._exit, always_call=True)

    def _enter(self, module: nn.Module, args) -> None:
        if not module.training:
            self._forks.append(None)
            return
        seed = int(torch.randint(0, 2**62, (1,)))
        fork = torch.random.fork_rng(devices=[torch.cuda.current_device()] if self.cuda else [])
        fork.__enter__()
        torch.default_generator.manual_seed(seed + self.rank)
        if self.cuda:
            torch.cuda.manual_seed(seed + self.rank)
        self._forks.append(fork)

    def _exit(self, module: nn.Module, args, output) -> None:
        fork = self._forks.pop()
        if fork is not None:
            fork.__exit__(None, None, None)
