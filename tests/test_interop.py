"""from_torch: converted modules compute the same function as the torch.nn originals (eval mode)."""

import itertools

import pytest
import torch
from torch import nn

import addnorm as an

D, H, FF, S, T, B = 16, 4, 32, 7, 5, 3
COMBOS = list(itertools.product([False, True], ["relu", "gelu"], [True, False], [True, False]))


def _ids(c):
    return "norm_first={}-{}-bias={}-batch_first={}".format(*c)


def _randomise(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
            elif name.endswith("bias"):
                p.uniform_(-0.2, 0.2)


def _inputs(batch_first, length):
    shape = (B, length, D) if batch_first else (length, B, D)
    return torch.randn(*shape, requires_grad=True)


def _masks(length):
    causal = nn.Transformer.generate_square_subsequent_mask(length)
    kpm = torch.zeros(B, length, dtype=torch.bool)
    kpm[0, -2:] = True
    return causal, kpm


def _compare(ref, ours, args, kwargs, valid=None):
    out_ref, out = ref(*args, **kwargs), ours(*args, **kwargs)
    if valid is not None:
        out_ref, out = out_ref[valid], out[valid]
    torch.testing.assert_close(out, out_ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(out)
    grads_ref = torch.autograd.grad(out_ref, [a for a in args if a.requires_grad], g)
    grads = torch.autograd.grad(out, [a for a in args if a.requires_grad], g)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _valid(batch_first, kpm):
    keep = ~kpm  # (B, L): compare only non-padded query positions
    return keep if batch_first else keep.T


@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_encoder_layer(combo):
    norm_first, act, bias, batch_first = combo
    ref = nn.TransformerEncoderLayer(
        D, H, FF, 0.1, act, norm_first=norm_first, bias=bias, batch_first=batch_first
    )
    _randomise(ref)
    ref.eval()
    ours = an.from_torch(ref)
    assert isinstance(ours, an.EncoderLayer) and not ours.training
    assert ours.placement.name == ("pre" if norm_first else "post")
    x = _inputs(batch_first, S)
    _compare(ref, ours, (x,), {})
    causal, kpm = _masks(S)
    _compare(ref, ours, (x,), {"src_mask": causal, "src_key_padding_mask": kpm}, _valid(batch_first, kpm))
    _compare(ref, ours, (x,), {"src_mask": causal, "is_causal": True})


@pytest.mark.parametrize("combo", COMBOS, ids=_ids)
def test_decoder_layer(combo):
    norm_first, act, bias, batch_first = combo
    ref = nn.TransformerDecoderLayer(
        D, H, FF, 0.1, act, norm_first=norm_first, bias=bias, batch_first=batch_first
    )
    _randomise(ref)
    ref.eval()
    ours = an.from_torch(ref)
    assert isinstance(ours, an.DecoderLayer)
    tgt, mem = _inputs(batch_first, T), _inputs(batch_first, S)
    _compare(ref, ours, (tgt, mem), {})
    causal, tgt_kpm = _masks(T)
    _, mem_kpm = _masks(S)
    kwargs = {
        "tgt_mask": causal,
        "tgt_key_padding_mask": tgt_kpm,
        "memory_key_padding_mask": mem_kpm,
        "tgt_is_causal": True,
    }
    _compare(ref, ours, (tgt, mem), kwargs, _valid(batch_first, tgt_kpm))
    float_mem_mask = torch.randn(T, S)
    _compare(ref, ours, (tgt, mem), {"memory_mask": float_mem_mask})


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("final_norm", [False, True])
def test_encoder_stack(norm_first, final_norm):
    layer = nn.TransformerEncoderLayer(D, H, FF, 0.0, "gelu", norm_first=norm_first, batch_first=True)
    ref = nn.TransformerEncoder(
        layer, 3, norm=nn.LayerNorm(D) if final_norm else None, enable_nested_tensor=False
    )
    for lyr in ref.layers:  # deep copies start identical: make them differ so the order matters
        _randomise(lyr)
        for p in lyr.parameters():
            p.data.add_(0.05 * torch.randn_like(p))
    if final_norm:
        _randomise(ref.norm)
    ref.eval()
    ours = an.from_torch(ref)
    assert isinstance(ours, an.Encoder) and len(ours.layers) == 3
    assert (ours.norm is not None) == final_norm
    x = _inputs(True, S)
    causal, kpm = _masks(S)
    _compare(ref, ours, (x,), {})
    _compare(ref, ours, (x,), {"mask": causal, "src_key_padding_mask": kpm}, _valid(True, kpm))


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack(norm_first):
    layer = nn.TransformerDecoderLayer(D, H, FF, 0.1, norm_first=norm_first, batch_first=False)
    ref = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D))
    for lyr in ref.layers:
        _randomise(lyr)
    ref.eval()
    ours = an.from_torch(ref)
    assert isinstance(ours, an.Decoder)
    tgt, mem = _inputs(False, T), _inputs(False, S)
    causal, _ = _masks(T)
    _compare(ref, ours, (tgt, mem), {"tgt_mask": causal, "tgt_is_causal": True})


def test_converted_model_trains_the_same_in_float64():
    ref = nn.TransformerEncoderLayer(D, H, FF, 0.0, norm_first=True, batch_first=True).double()
    ours = an.from_torch(ref)
    assert next(ours.parameters()).dtype == torch.float64
    x = torch.randn(B, S, D, dtype=torch.float64)
    for model in (ref, ours):
        model.train()
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(ours.ff.w1.weight.grad, ref.linear1.weight.grad)
    torch.testing.assert_close(ours.self_attn.in_proj.weight.grad, ref.self_attn.in_proj_weight.grad)


def test_unsupported_options_raise_clearly():
    with pytest.raises(TypeError, match="module: expected one of nn.TransformerEncoderLayer"):
        an.from_torch(nn.Linear(3, 3))
    layer = nn.TransformerEncoderLayer(D, H, FF, activation=nn.SiLU())
    with pytest.raises(an.UnsupportedModuleError, match="activation: only relu and gelu"):
        an.from_torch(layer)
    layer = nn.TransformerEncoderLayer(D, H, FF)
    layer.self_attn = nn.MultiheadAttention(D, H, add_bias_kv=True)
    with pytest.raises(ValueError, match="add_bias_kv"):
        an.from_torch(layer)
    layer = nn.TransformerEncoderLayer(D, H, FF)
    layer.norm1 = nn.LayerNorm(D, elementwise_affine=False)
    with pytest.raises(ValueError, match="norm1: LayerNorm.elementwise_affine=False"):
        an.from_torch(layer)
