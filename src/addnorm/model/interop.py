"""torch.nn <-> addnorm, both ways, for the placements torch.nn can express (post and pre).

:func:`from_torch` turns ``nn.Transformer``, ``nn.Transformer{Encoder,Decoder}`` and their layers into
addnorm modules; :func:`to_torch` turns addnorm layers, stacks and :class:`EncoderDecoder` back. Both
compute the same function, take the same call arguments and keep the tensor layout. The structure
(sizes, activation, bias, layout, norm_first) goes through a :class:`TransformerConfig`; every module's
own settings are read from the module itself: each LayerNorm keeps its ``eps``, ``elementwise_affine``
and ``bias``, each dropout its rate, so a stack whose final norm differs from its layers' converts
exactly.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..connection import AddNorm
from ..norms import LayerNorm
from ..placements import PLACEMENTS
from .attention import MultiHeadAttention
from .config import TransformerConfig
from .feedforward import FeedForward
from .layers import DecoderLayer, EncoderLayer
from .models import EncoderDecoder, LanguageModel, Transformer
from .stacks import Decoder, Encoder

_FROM = (
    "nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder, nn.TransformerEncoderLayer, "
    "nn.TransformerDecoderLayer"
)
_TO = "EncoderLayer, DecoderLayer, Encoder, Decoder or EncoderDecoder"
_NORM_FIRST = {"post": False, "pre": True}


class UnsupportedModuleError(ValueError):
    """A module (or one of its options) that the other library cannot reproduce exactly."""


# --- torch.nn -> addnorm ------------------------------------------------------------------------------


def _activation_name(layer: nn.Module) -> str:
    act = layer.activation
    if act is F.relu or type(act) is nn.ReLU:
        return "relu"
    if act is F.gelu or (type(act) is nn.GELU and act.approximate == "none"):
        return "gelu"
    raise UnsupportedModuleError(
        f"activation: only relu and gelu (as names, F.relu/F.gelu or nn.ReLU()/nn.GELU()) convert exactly, "
        f"got {act!r}"
    )


def _check_attention(mha: nn.MultiheadAttention, where: str) -> None:
    if not mha._qkv_same_embed_dim:
        raise UnsupportedModuleError(f"{where}: kdim/vdim different from embed_dim are not supported")
    if mha.bias_k is not None or mha.add_zero_attn:
        raise UnsupportedModuleError(f"{where}: add_bias_kv and add_zero_attn are not supported")


def _linears(layer: nn.Module) -> dict[str, nn.Module]:
    out = {
        "self_attn.in_proj": layer.self_attn,
        "self_attn.out_proj": layer.self_attn.out_proj,
        "linear1": layer.linear1,
        "linear2": layer.linear2,
    }
    if isinstance(layer, nn.TransformerDecoderLayer):
        out["multihead_attn.in_proj"] = layer.multihead_attn
        out["multihead_attn.out_proj"] = layer.multihead_attn.out_proj
    return out


def _has_bias(module: nn.Module) -> bool:
    return (module.in_proj_bias if isinstance(module, nn.MultiheadAttention) else module.bias) is not None


def _structure(layer: nn.Module, where: str) -> dict:
    """The options of one torch layer that a TransformerConfig holds (everything but norms and dropout)."""
    mha: nn.MultiheadAttention = layer.self_attn
    _check_attention(mha, f"{where}self_attn")
    if isinstance(layer, nn.TransformerDecoderLayer):
        _check_attention(layer.multihead_attn, f"{where}multihead_attn")
    biases = {name: _has_bias(m) for name, m in _linears(layer).items()}
    if len(set(biases.values())) > 1:
        with_bias = ", ".join(n for n, b in biases.items() if b)
        raise UnsupportedModuleError(
            f"{where}bias: addnorm uses one bias setting for every Linear, but only {with_bias} have one"
        )
    return {
        "d_model": mha.embed_dim,
        "n_heads": mha.num_heads,
        "d_ff": layer.linear1.out_features,
        "activation": _activation_name(layer),
        "placement": "pre" if layer.norm_first else "post",
        "bias": biases["linear1"],
        "batch_first": mha.batch_first,
    }


def _check_norm(norm: nn.Module, where: str, d_model: int) -> nn.LayerNorm:
    if type(norm) is not nn.LayerNorm:
        raise UnsupportedModuleError(f"{where}: only nn.LayerNorm converts, got {type(norm).__name__}")
    if tuple(norm.normalized_shape) != (d_model,):
        shape = tuple(norm.normalized_shape)
        raise UnsupportedModuleError(f"{where}: LayerNorm must normalise ({d_model},) only, not {shape}")
    return norm


@torch.no_grad()
def _norm_from_torch(src: nn.Module, where: str, d_model: int) -> LayerNorm:
    """An addnorm LayerNorm with ``src``'s own eps, elementwise_affine, bias and values."""
    src = _check_norm(src, where, d_model)
    dst = LayerNorm(d_model, eps=src.eps, affine=src.elementwise_affine, bias=src.bias is not None)
    for name in ("weight", "bias"):
        if getattr(dst, name) is not None:
            getattr(dst, name).copy_(getattr(src, name))
    return dst


def _config(layer: nn.Module, where: str, **stack) -> TransformerConfig:
    """The TransformerConfig of one torch layer (norm settings from its norm1, dropout from its
    dropout1/dropout/self_attn: the converted modules then take each one's own)."""
    s = _structure(layer, where)
    norm = _check_norm(layer.norm1, f"{where}norm1", s["d_model"])
    return TransformerConfig(
        **s,
        dropout=layer.dropout1.p,
        attention_dropout=layer.self_attn.dropout,
        activation_dropout=layer.dropout.p,
        norm="layernorm",
        norm_eps=norm.eps,
        norm_bias=norm.bias is not None,
        **{"n_layers": 1, "final_norm": False, **stack},
    )


@torch.no_grad()
def _copy_linear(dst: nn.Linear, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    dst.weight.copy_(weight)
    if dst.bias is not None:
        dst.bias.copy_(bias)


def _attention_from_torch(dst: MultiHeadAttention, src: nn.MultiheadAttention) -> None:
    _copy_linear(dst.in_proj, src.in_proj_weight, src.in_proj_bias)
    _copy_linear(dst.out_proj, src.out_proj.weight, src.out_proj.bias)
    dst.dropout = float(src.dropout)


def _layer_from_torch(dst: nn.Module, src: nn.Module, where: str) -> None:
    """Weights, norms (each with its own settings) and dropout rates of ``src`` into ``dst``."""
    _attention_from_torch(dst.self_attn, src.self_attn)
    _copy_linear(dst.ff.w1, src.linear1.weight, src.linear1.bias)
    _copy_linear(dst.ff.w2, src.linear2.weight, src.linear2.bias)
    dst.ff.dropout.p = src.dropout.p
    if isinstance(src, nn.TransformerDecoderLayer):
        _attention_from_torch(dst.cross_attn, src.multihead_attn)
    for i, block in enumerate(dst.blocks(), start=1):  # norm1/dropout1 with the first connection, ...
        block.norm = _norm_from_torch(getattr(src, f"norm{i}"), f"{where}norm{i}", dst.cfg.d_model)
        block.dropout.p = getattr(src, f"dropout{i}").p


def _stack_from_torch(src: nn.Module, where: str) -> tuple[list[nn.Module], dict, TransformerConfig]:
    """The layers of a torch stack, their shared structure and the config of its first layer."""
    layers = list(src.layers)
    if not layers:
        raise UnsupportedModuleError(f"{where}layers: a stack with no layers cannot be converted")
    structure = _structure(layers[0], f"{where}layers[0].")
    for i, layer in enumerate(layers[1:], start=1):
        if _structure(layer, f"{where}layers[{i}].") != structure:
            raise UnsupportedModuleError(
                f"{where}layers[{i}]: every layer must have the options of layers[0] ({structure}), got "
                f"{_structure(layer, '')}"
            )
    return layers, structure, _config(layers[0], f"{where}layers[0].")


def _fill_stack(dst: nn.Module, src: nn.Module, where: str) -> None:
    for i, (d, s) in enumerate(zip(dst.layers, src.layers, strict=True)):
        _layer_from_torch(d, s, f"{where}layers[{i}].")
    dst.norm = None if src.norm is None else _norm_from_torch(src.norm, f"{where}norm", dst.cfg.d_model)


def _convert_stack(src: nn.Module, stack_cls: type[nn.Module]) -> nn.Module:
    layers, _, cfg = _stack_from_torch(src, "")
    out = stack_cls(cfg.replace(n_layers=len(layers), final_norm=src.norm is not None))
    _fill_stack(out, src, "")
    return out


def _convert_transformer(src: nn.Transformer) -> EncoderDecoder:
    for part, cls in (("encoder", nn.TransformerEncoder), ("decoder", nn.TransformerDecoder)):
        if not isinstance(getattr(src, part), cls):
            raise UnsupportedModuleError(
                f"{part}: expected an nn.{cls.__name__}, got {type(getattr(src, part)).__name__}"
            )
    enc_layers, enc, cfg = _stack_from_torch(src.encoder, "encoder.")
    dec_layers, dec, _ = _stack_from_torch(src.decoder, "decoder.")
    if enc != dec:
        raise UnsupportedModuleError(
            f"decoder: its layers' options {dec} must equal the encoder layers' {enc}"
        )
    if src.batch_first != enc["batch_first"]:
        raise UnsupportedModuleError(
            f"batch_first: nn.Transformer says {src.batch_first} but its layers say {enc['batch_first']}"
        )
    cfg = cfg.replace(
        n_layers=len(enc_layers),
        n_encoder_layers=len(enc_layers),
        n_decoder_layers=len(dec_layers),
        final_norm=src.encoder.norm is not None,
    )
    out = EncoderDecoder(cfg)
    _fill_stack(out.encoder, src.encoder, "encoder.")
    _fill_stack(out.decoder, src.decoder, "decoder.")
    return out


def _like(module: nn.Module, converted: nn.Module) -> nn.Module:
    """``converted`` on ``module``'s device and dtype, in its train/eval mode."""
    param = next(module.parameters(), None)
    if param is not None:
        converted = converted.to(device=param.device, dtype=param.dtype)
    return converted.train(module.training)


def from_torch(module: nn.Module) -> nn.Module:
    """Convert a torch.nn transformer module into the addnorm module computing the same function.

    ``nn.TransformerEncoderLayer`` -> :class:`EncoderLayer`, ``nn.TransformerDecoderLayer`` ->
    :class:`DecoderLayer`, ``nn.TransformerEncoder`` (with or without ``norm``) -> :class:`Encoder`,
    ``nn.TransformerDecoder`` -> :class:`Decoder`, ``nn.Transformer`` -> :class:`EncoderDecoder` (its
    encoder and decoder with their final norms). ``norm_first`` maps to the ``pre``/``post``
    placement; weights, each norm's own eps/elementwise_affine/bias, each dropout rate, ``batch_first``,
    dtype, device and train/eval mode are copied. Options without an exact equivalent raise
    :class:`UnsupportedModuleError`. :func:`to_torch` converts back.
    """
    if isinstance(module, (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)):
        decoder = isinstance(module, nn.TransformerDecoderLayer)
        out = (DecoderLayer if decoder else EncoderLayer)(_config(module, ""))
        _layer_from_torch(out, module, "")
    elif isinstance(module, nn.TransformerEncoder):
        out = _convert_stack(module, Encoder)
    elif isinstance(module, nn.TransformerDecoder):
        out = _convert_stack(module, Decoder)
    elif isinstance(module, nn.Transformer):
        out = _convert_transformer(module)
    else:
        raise TypeError(f"module: expected one of {_FROM}, got {type(module).__name__}")
    return _like(module, out)


# --- addnorm -> torch.nn ------------------------------------------------------------------------------


def _torch_norm(norm: nn.Module | None, where: str) -> nn.LayerNorm:
    """An ``nn.LayerNorm`` with addnorm ``norm``'s eps, affine, bias and values."""
    if type(norm) is not LayerNorm:
        raise _no_torch(where, f": {type(norm).__name__}", " (torch.nn's transformer layers use LayerNorm)")
    like = {} if norm.weight is None else {"device": norm.weight.device, "dtype": norm.weight.dtype}
    out = nn.LayerNorm(
        norm.dim, eps=norm.eps, elementwise_affine=norm.weight is not None, bias=norm.bias is not None, **like
    )
    with torch.no_grad():
        for name in ("weight", "bias"):
            if getattr(out, name) is not None:
                getattr(out, name).copy_(getattr(norm, name))
    return out


def _no_torch(where: str, what: str, note: str = "") -> UnsupportedModuleError:
    """The one-line error for something torch.nn cannot compute the same way."""
    return UnsupportedModuleError(f"{where}{what} has no torch.nn equivalent{note}")


def _check_block(block: AddNorm, where: str) -> bool:
    """norm_first of a post/pre connection that torch.nn computes the same way, else a clear error."""
    p = block.placement
    if PLACEMENTS.get(p.name) != p or p.name not in _NORM_FIRST:
        note = "; to_torch converts 'post' (norm_first=False) and 'pre' (norm_first=True)"
        raise _no_torch(where, f"placement: {p.name!r}", note)
    if not block.residual:
        raise _no_torch(where, "residual: False (the no-residual ablation)")
    if block.dropout_at != "branch":
        raise _no_torch(where, f"dropout_at: {block.dropout_at!r}", " (torch drops the branch)")
    if block.alpha != 1.0:
        raise _no_torch(where, f"alpha: a residual scale of {block.alpha:g}")
    return _NORM_FIRST[p.name]


def _torch_structure(layer: nn.Module, where: str) -> dict:
    """The nn.Transformer*Layer arguments of one addnorm layer, after checking torch.nn can express it."""
    norm_first = {_check_block(b, where) for b in layer.blocks()}
    attns = [layer.self_attn] + ([layer.cross_attn] if isinstance(layer, DecoderLayer) else [])
    for attn in attns:
        if attn.normalize is not None:
            raise _no_torch(where, f"qk_norm: normalising {attn.normalize!r} inside attention")
        if attn.inner_norm is not None:
            raise _no_torch(where, "inner_norm: Sub-LN's norm inside attention")
    ff: FeedForward = layer.ff
    if ff.gated or ff.activation not in ("relu", "gelu"):
        raise _no_torch(where, f"activation: {ff.activation!r}", " (torch's layers take relu or gelu)")
    if ff.inner_norm is not None:
        raise _no_torch(where, "inner_norm: Sub-LN's norm inside the FFN")
    linears = [lin for a in attns for lin in (a.in_proj, a.out_proj)] + [ff.w1, ff.w2]
    biases = {lin.bias is not None for lin in linears}
    if len(biases) > 1:
        raise _no_torch(where, "bias: Linears with and without bias in one layer")
    return {
        "d_model": layer.self_attn.d_model,
        "nhead": layer.self_attn.n_heads,
        "dim_feedforward": ff.w2.in_features,
        "activation": ff.activation,
        "batch_first": layer.cfg.batch_first,
        "norm_first": norm_first.pop(),
        "bias": biases.pop(),
    }


def _fill_torch_layer(dst: nn.Module, src: nn.Module, where: str) -> None:
    """Weights, norms (each with its own settings) and dropout rates of addnorm ``src`` into torch ``dst``."""
    attns = [(dst.self_attn, src.self_attn)]
    if isinstance(src, DecoderLayer):
        attns.append((dst.multihead_attn, src.cross_attn))
    with torch.no_grad():
        for t, ours in attns:
            t.in_proj_weight.copy_(ours.in_proj.weight)
            t.out_proj.weight.copy_(ours.out_proj.weight)
            if t.in_proj_bias is not None:
                t.in_proj_bias.copy_(ours.in_proj.bias)
                t.out_proj.bias.copy_(ours.out_proj.bias)
            t.dropout = ours.dropout
        for t, ours in ((dst.linear1, src.ff.w1), (dst.linear2, src.ff.w2)):
            _copy_linear(t, ours.weight, ours.bias)
    dst.dropout.p = src.ff.dropout.p
    for i, block in enumerate(src.blocks(), start=1):
        norm = block.input_norm if block.input_norm is not None else block.output_norm
        setattr(dst, f"norm{i}", _torch_norm(norm, f"{where}norm{i}"))
        getattr(dst, f"dropout{i}").p = block.dropout.p
    if isinstance(dst, nn.TransformerEncoderLayer) and dst.self_attn.in_proj_bias is not None:
        norms = (dst.norm1, dst.norm2)
        if any(n.weight is None or n.bias is None for n in norms):
            # torch's inference fast path (eval, no grad) reads every norm's weight and bias and fails on
            # a None (pytorch/pytorch#116385, #143293); 0 is torch's own "not relu/gelu: no fast path"
            dst.activation_relu_or_gelu = 0


def _new_torch_layer(structure: dict, decoder: bool, factory: dict) -> nn.Module:
    cls = nn.TransformerDecoderLayer if decoder else nn.TransformerEncoderLayer
    return cls(**structure, **factory)


def _factory(module: nn.Module) -> dict:
    p = next(module.parameters(), None)
    return {} if p is None else {"device": p.device, "dtype": p.dtype}


def _torch_stack(stack: nn.Module, where: str) -> nn.Module:
    """An nn.TransformerEncoder/Decoder with ``stack``'s layers and final norm (nested tensors off, so
    padded positions are computed as addnorm computes them)."""
    layers = list(stack.layers)
    if not layers:
        raise UnsupportedModuleError(f"{where}layers: a stack with no layers cannot be converted")
    structures = [_torch_structure(layer, f"{where}layers[{i}].") for i, layer in enumerate(layers)]
    for i, s in enumerate(structures[1:], start=1):
        if s["norm_first"] != structures[0]["norm_first"]:
            names = {False: "post", True: "pre"}
            raise UnsupportedModuleError(
                f"{where}placement: layers[0] is {names[structures[0]['norm_first']]!r} and layers[{i}] "
                f"{names[s['norm_first']]!r}; per-layer placements mixing post and pre have no torch.nn "
                "equivalent (a torch.nn stack repeats one layer)"
            )
        if s != structures[0]:
            diff = {k: (structures[0][k], v) for k, v in s.items() if structures[0][k] != v}
            raise UnsupportedModuleError(
                f"{where}layers[{i}]: options {diff} (layers[0], layers[{i}]) differ; a torch.nn stack "
                "repeats one layer"
            )
    decoder = isinstance(stack, Decoder)
    first = _new_torch_layer(structures[0], decoder, _factory(stack))
    if decoder:
        out = nn.TransformerDecoder(first, len(layers))
    else:
        out = nn.TransformerEncoder(first, len(layers), enable_nested_tensor=False)
    _fill_torch_stack(out, stack, where)
    return out


def _fill_torch_stack(dst: nn.Module, src: nn.Module, where: str) -> None:
    for i, (t, ours) in enumerate(zip(dst.layers, src.layers, strict=True)):
        _fill_torch_layer(t, ours, f"{where}layers[{i}].")
    dst.norm = None if src.norm is None else _torch_norm(src.norm, f"{where}norm")


def _torch_transformer(model: EncoderDecoder) -> nn.Transformer:
    enc = _torch_stack(model.encoder, "encoder.")
    dec = _torch_stack(model.decoder, "decoder.")
    out = nn.Transformer(
        model.cfg.d_model,
        model.cfg.n_heads,
        custom_encoder=enc,
        custom_decoder=dec,
        batch_first=model.cfg.batch_first,
        **_factory(model),
    )
    # nn.Transformer re-initialises every matrix of its custom stacks: copy the weights in again
    _fill_torch_stack(out.encoder, model.encoder, "encoder.")
    _fill_torch_stack(out.decoder, model.decoder, "decoder.")
    return out


def to_torch(module: nn.Module) -> nn.Module:
    """Convert an addnorm module whose placement torch.nn can express back into torch.nn.

    :class:`EncoderLayer` -> ``nn.TransformerEncoderLayer``, :class:`DecoderLayer` ->
    ``nn.TransformerDecoderLayer``, :class:`Encoder` / :class:`Decoder` -> ``nn.TransformerEncoder`` /
    ``nn.TransformerDecoder`` (with the final norm if the stack has one), :class:`EncoderDecoder` ->
    ``nn.Transformer``. Placement ``post`` becomes ``norm_first=False`` and ``pre`` ``norm_first=True``;
    weights, each norm's eps/affine/bias, each dropout rate, ``batch_first``, dtype, device and
    train/eval mode are copied. Anything torch.nn cannot compute the same way (another placement,
    RMSNorm or another norm, SwiGLU, qk_norm, Sub-LN's inner norms, a stack mixing post and pre,
    ``residual=False``, dropout after the add) raises :class:`UnsupportedModuleError` naming it.
    ``to_torch(from_torch(m))`` computes what ``m`` computes. In training mode with dropout the
    fused op's dropout masks differ from ``nn.Dropout``'s (same distribution, another random stream).
    Stacks come back with ``enable_nested_tensor=False`` (torch's nested path zeroes padded positions);
    an encoder layer with Linear biases but a norm without weight or bias comes back with torch's
    inference fast path off, since that path fails on a missing norm parameter.
    """
    if isinstance(module, (EncoderLayer, DecoderLayer)):
        structure = _torch_structure(module, "")
        out = _new_torch_layer(structure, isinstance(module, DecoderLayer), _factory(module))
        _fill_torch_layer(out, module, "")
    elif isinstance(module, (Encoder, Decoder)):
        out = _torch_stack(module, "")
    elif isinstance(module, EncoderDecoder):
        out = _torch_transformer(module)
    else:
        hint = ""
        if isinstance(module, (Transformer, LanguageModel)):
            parts = "model.encoder and model.decoder" if isinstance(module, Transformer) else "model.stack"
            hint = f" (token embeddings and head have no torch.nn transformer equivalent: convert {parts})"
        raise TypeError(f"module: expected an addnorm {_TO}, got {type(module).__name__}{hint}")
    return out.train(module.training)


__all__ = ["UnsupportedModuleError", "from_torch", "to_torch"]
