"""The shared models of the tensor-parallel tests (``test_tensor_parallel*.py``): addnorm's tiny
LanguageModel with its 1-D parameters moved off their initial values, and that model made parallel
(TP + SP, FSDP2 over TP, built on the meta device) on a 2-rank mesh."""

from __future__ import annotations

import torch
from torch import nn

WORLD, VOCAB = 2, 50
LAYERS = 3


def lm(
    placement: str = "pre", norm: str = "layernorm", *, tie: bool = False, device=None, **options
) -> nn.Module:
    """addnorm's LanguageModel, its 1-D parameters (norm gains and biases, gates) moved off their
    initial values so that a norm or gate applied wrongly shows."""
    from addnorm.model import LanguageModel, TransformerConfig

    torch.manual_seed(0)
    sizes = {"d_model": 16, "n_heads": 2, "d_ff": 32, "n_layers": LAYERS, "max_len": 16, "dropout": 0.0}
    cfg = TransformerConfig(placement=placement, norm=norm, **(sizes | options))
    model = LanguageModel(cfg, VOCAB, tie_embeddings=tie, device=device)
    return model if device == "meta" else perturbed(model)


def perturbed(model: nn.Module) -> nn.Module:
    """Noise on every 1-D parameter (norm gains and biases, gates), in place."""
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=gen))
    return model


def off_on_rank_1(model: nn.Module) -> nn.Module:
    """On rank 1, every parameter and buffer changed (a model built differently there)."""
    if torch.distributed.get_rank() == 1:
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                t.add_(0.5)
    return model


def tp_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (WORLD,), mesh_dim_names=("tp",))


def parallel(model: nn.Module, **options) -> nn.Module:
    from addnorm import parallelize

    return parallelize(model, tp_mesh(), **options)


def fsdp_over_tp(model: nn.Module) -> nn.Module:
    """TP on the mesh's "tp" dimension, then FSDP2 (per layer and root) on its "dp" dimension."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from addnorm import parallelize

    mesh = init_device_mesh("cpu", (1, WORLD), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh["dp"])
    return fully_shard(model, mesh=mesh["dp"])


def meta_built(placement: str) -> nn.Module:
    """Built on the meta device, parallelized, ``to_empty`` on the CPU, its position table recomputed,
    then the reference's weights loaded as a full state dict (each rank keeps its shards)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from addnorm.model import reset_buffers

    model = parallel(lm(placement, device="meta"))
    reset_buffers(model.to_empty(device="cpu"))
    set_model_state_dict(model, lm(placement).state_dict(), options=StateDictOptions(full_state_dict=True))
    return model
