"""torch.nn <-> addnorm: convert ``nn.Transformer{Encoder,Decoder}{Layer,}`` into addnorm modules that
compute the same function, take the same call arguments and keep the same tensor layout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import TransformerConfig
from .layers import DecoderLayer, EncoderLayer
from .stacks import Decoder, Encoder

_SUPPORTED = (
    "nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.TransformerEncoder, nn.TransformerDecoder"
)


class UnsupportedModuleError(ValueError):
    """A torch module (or one of its options) that addnorm cannot reproduce exactly."""


def _activation_name(layer: nn.Module) -> str:
    act = layer.activation
    if act is F.relu or isinstance(act, nn.ReLU):
        return "relu"
    if act is F.gelu or (isinstance(act, nn.GELU) and act.approximate == "none"):
        return "gelu"
    raise UnsupportedModuleError(f"activation: only relu and gelu convert exactly, got {act!r}")


def _check_attention(mha: nn.MultiheadAttention, where: str) -> None:
    if not mha._qkv_same_embed_dim:
        raise UnsupportedModuleError(f"{where}: kdim/vdim different from embed_dim are not supported")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise UnsupportedModuleError(f"{where}: add_bias_kv and add_zero_attn are not supported")


def _check_norm(norm: nn.Module, where: str) -> nn.LayerNorm:
    if not isinstance(norm, nn.LayerNorm):
        raise UnsupportedModuleError(f"{where}: only nn.LayerNorm converts, got {type(norm).__name__}")
    if not norm.elementwise_affine:
        raise UnsupportedModuleError(f"{where}: LayerNorm(elementwise_affine=False) is not supported")
    if len(norm.normalized_shape) != 1:
        raise UnsupportedModuleError(f"{where}: LayerNorm must normalise the last dimension only")
    return norm


def _config(layer: nn.Module, n_layers: int, final_norm: bool | str) -> TransformerConfig:
    """The TransformerConfig of one torch encoder/decoder layer."""
    mha: nn.MultiheadAttention = layer.self_attn
    _check_attention(mha, "self_attn")
    if hasattr(layer, "multihead_attn"):
        _check_attention(layer.multihead_attn, "multihead_attn")
    norm = _check_norm(layer.norm1, "norm1")
    return TransformerConfig(
        d_model=mha.embed_dim,
        n_heads=mha.num_heads,
        d_ff=layer.linear1.out_features,
        n_layers=n_layers,
        dropout=layer.dropout1.p,
        attention_dropout=mha.dropout,
        activation_dropout=layer.dropout.p,
        activation=_activation_name(layer),
        placement="pre" if layer.norm_first else "post",
        norm="layernorm",
        norm_eps=norm.eps,
        bias=mha.in_proj_bias is not None,
        norm_bias=norm.bias is not None,
        final_norm=final_norm,
        batch_first=mha.batch_first,
    )


@torch.no_grad()
def _copy_linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dst.weight.copy_(weight)
    if dst.bias is not None:
        dst.bias.copy_(bias)


@torch.no_grad()
def _copy_norm(dst: nn.Module, src: nn.LayerNorm) -> None:
    dst.weight.copy_(src.weight)
    if dst.bias is not None:
        dst.bias.copy_(src.bias)


def _copy_attention(dst, src: nn.MultiheadAttention) -> None:
    _copy_linear(dst.in_proj, src.in_proj_weight, src.in_proj_bias)
    _copy_linear(dst.out_proj, src.out_proj.weight, src.out_proj.bias)


def _copy_layer(dst: nn.Module, src: nn.Module) -> None:
    _copy_attention(dst.self_attn, src.self_attn)
    _copy_linear(dst.ff.w1, src.linear1.weight, src.linear1.bias)
    _copy_linear(dst.ff.w2, src.linear2.weight, src.linear2.bias)
    _copy_norm(dst.self_attn_block.norm, src.norm1)
    if isinstance(src, nn.TransformerDecoderLayer):
        _copy_attention(dst.cross_attn, src.multihead_attn)
        _copy_norm(dst.cross_attn_block.norm, src.norm2)
        _copy_norm(dst.ff_block.norm, src.norm3)
    else:
        _copy_norm(dst.ff_block.norm, src.norm2)


def _like(module: nn.Module, converted: nn.Module) -> nn.Module:
    param = next(module.parameters(), None)
    if param is not None:
        converted = converted.to(device=param.device, dtype=param.dtype)
    return converted.train(module.training)


def _convert_stack(module: nn.Module, stack_cls: type[nn.Module]) -> nn.Module:
    layers = list(module.layers)
    if not layers:
        raise UnsupportedModuleError("module: a stack with no layers cannot be converted")
    cfg = _config(layers[0], len(layers), final_norm=module.norm is not None)
    for i, layer in enumerate(layers[1:], start=1):
        if _config(layer, len(layers), cfg.final_norm) != cfg:
            raise UnsupportedModuleError(f"layers[{i}]: every layer must have the same options as layers[0]")
    out = stack_cls(cfg)
    for dst, src in zip(out.layers, layers, strict=True):
        _copy_layer(dst, src)
    if module.norm is not None:
        _copy_norm(out.norm, _check_norm(module.norm, "norm"))
    return out


def from_torch(module: nn.Module) -> nn.Module:
    """Convert a torch.nn transformer module into the addnorm module computing the same function.

    ``nn.TransformerEncoderLayer`` -> :class:`EncoderLayer`, ``nn.TransformerDecoderLayer`` ->
    :class:`DecoderLayer`, ``nn.TransformerEncoder`` (with or without ``norm``) -> :class:`Encoder`,
    ``nn.TransformerDecoder`` -> :class:`Decoder`. ``norm_first`` maps to the ``pre``/``post``
    placement; weights, eps, bias, dropout rates, ``batch_first``, dtype, device and train/eval mode
    are copied. Options without an exact equivalent raise :class:`UnsupportedModuleError`.
    """
    if isinstance(module, nn.TransformerEncoderLayer):
        out = EncoderLayer(_config(module, 1, "auto"))
        _copy_layer(out, module)
    elif isinstance(module, nn.TransformerDecoderLayer):
        out = DecoderLayer(_config(module, 1, "auto"))
        _copy_layer(out, module)
    elif isinstance(module, nn.TransformerEncoder):
        out = _convert_stack(module, Encoder)
    elif isinstance(module, nn.TransformerDecoder):
        out = _convert_stack(module, Decoder)
    else:
        raise TypeError(f"module: expected one of {_SUPPORTED}, got {type(module).__name__}")
    return _like(module, out)
