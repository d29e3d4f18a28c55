"""torch.nn <-> addnorm: from_torch and to_torch compute the same function as the module they convert.

The oracle is torch.nn itself: randomised torch modules (norm_first, activation names and callables,
bias, batch_first, eps, layer counts, final norms with and without bias or affine, per-norm eps) with
random non-trivial weights and norm parameters, under every mask kind, compared on outputs and input
gradients in eval mode (with autograd and under no_grad, where torch takes its fused fast path) and in
train mode where dropout is 0; then the round trip ``to_torch(from_torch(m))`` against ``m``.
"""

import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import addnorm as an
from addnorm.model import EncoderDecoder

D, S, T, B = 16, 7, 5, 3
TOL = {"rtol": 1e-5, "atol": 1e-5}
ACTIVATIONS = ["relu", "gelu", F.relu, F.gelu, nn.ReLU(), nn.GELU()]  # names, functions, modules
N_CASES = 6


# --- random torch modules -----------------------------------------------------------------------------


def _options(seed: int, kind: str = "") -> dict:
    rng = random.Random(seed)
    # a module activation does not survive nn.Transformer(Decoder)'s deep copies (see the test below)
    activations = ACTIVATIONS[:4] if kind == "transformer" else ACTIVATIONS
    return {
        "norm_first": rng.random() < 0.5,
        "activation": rng.choice(activations),
        "bias": rng.random() < 0.6,
        "batch_first": rng.random() < 0.5,
        "layer_norm_eps": rng.choice([1e-5, 1e-6, 1e-3]),
        "dropout": rng.choice([0.0, 0.0, 0.1]),
        "nhead": rng.choice([1, 2, 4]),
    }


def _layer(cls, o: dict) -> nn.Module:
    return cls(D, o["nhead"], 24, o["dropout"], o["activation"], o["layer_norm_eps"], o["batch_first"],
               o["norm_first"], o["bias"])  # fmt: skip


def _final_norm(rng: random.Random) -> nn.Module | None:
    kind = rng.choice(["none", "bias", "no_bias", "no_affine"])
    if kind == "none":
        return None
    eps = rng.choice([1e-5, 1e-4])
    return nn.LayerNorm(D, eps=eps, elementwise_affine=kind != "no_affine", bias=kind == "bias")


@torch.no_grad()
def _randomise(module: nn.Module, rng: random.Random) -> None:
    """Non-trivial weights everywhere and per-layer differences (stacks deep-copy one layer); per-norm
    eps (and, where torch's fast path allows, per-norm bias/affine) differ from the layer's."""
    for name, p in module.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5) if name.endswith("weight") else p.uniform_(-0.5, 0.5)
        else:
            p.add_(0.1 * torch.randn_like(p))
    torch_layers = (nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)
    for layer in [m for m in module.modules() if isinstance(m, torch_layers)]:
        if rng.random() < 0.5:
            layer.norm2.eps = rng.choice([1e-4, 1e-2])
        if layer.self_attn.in_proj_bias is None and rng.random() < 0.5:  # no fast path: any norm
            layer.norm1 = nn.LayerNorm(D, elementwise_affine=False, eps=layer.norm1.eps)


def _torch_module(kind: str, seed: int) -> nn.Module:
    rng = random.Random(1000 + seed)
    o = _options(seed, kind)
    if kind == "encoder_layer":
        m = _layer(nn.TransformerEncoderLayer, o)
    elif kind == "decoder_layer":
        m = _layer(nn.TransformerDecoderLayer, o)
    elif kind == "encoder":
        nested = rng.random() < 0.5
        m = nn.TransformerEncoder(_layer(nn.TransformerEncoderLayer, o), rng.randint(1, 3), _final_norm(rng),
                                  enable_nested_tensor=nested)  # fmt: skip
    elif kind == "decoder":
        m = nn.TransformerDecoder(_layer(nn.TransformerDecoderLayer, o), rng.randint(1, 3), _final_norm(rng))
    else:
        kw = {
            k: o[k] for k in ("dropout", "activation", "layer_norm_eps", "batch_first", "norm_first", "bias")
        }
        m = nn.Transformer(D, o["nhead"], rng.randint(1, 3), rng.randint(1, 3), 24, **kw)
        for stack in (m.encoder, m.decoder):
            stack.norm = _final_norm(rng)
    _randomise(m, rng)
    return m


# --- inputs and every mask kind -------------------------------------------------------------------------


def _x(batch_first: bool, length: int, unbatched: bool = False) -> torch.Tensor:
    shape = (length, D) if unbatched else (B, length, D) if batch_first else (length, B, D)
    return torch.randn(*shape, requires_grad=True)


def _bool_mask(*shape: int) -> torch.Tensor:
    m = torch.rand(*shape) < 0.3
    m[..., 0] = False  # key 0 is never masked or padded: no row is fully masked
    return m


def _kpm(length: int, as_float: bool = False, unbatched: bool = False) -> torch.Tensor:
    m = torch.zeros(length, dtype=torch.bool) if unbatched else torch.zeros(B, length, dtype=torch.bool)
    m[..., -2:] = True
    if unbatched is False:
        m[1:, -2:] = False  # only the first sequence is padded
    return torch.zeros(m.shape).masked_fill(m, float("-inf")) if as_float else m


def _self_masks(length: int, heads: int) -> list[dict]:
    """(attn_mask, key_padding_mask, is_causal) kinds of one self-attention, named generically."""
    causal = nn.Transformer.generate_square_subsequent_mask(length)
    return [
        {},
        {"mask": torch.randn(length, length)},
        {"mask": _bool_mask(length, length)},
        {"mask": _bool_mask(B * heads, length, length)},
        {"mask": torch.randn(B * heads, length, length)},
        {"kpm": _kpm(length)},
        {"kpm": _kpm(length, as_float=True)},
        {"mask": causal, "causal": True},
        {"mask": causal.isinf(), "kpm": _kpm(length)},
        {"mask": causal, "kpm": _kpm(length, as_float=True), "causal": True},
    ]


def _memory_masks(heads: int) -> list[dict]:
    return [
        {"memory_mask": torch.randn(T, S)},
        {"memory_mask": _bool_mask(T, S), "memory_key_padding_mask": _kpm(S)},
        {"memory_mask": torch.randn(B * heads, T, S)},
        {"memory_key_padding_mask": _kpm(S, as_float=True)},
    ]


def _call_kwargs(kind: str, case: dict, prefix: str) -> dict:
    """Generic mask names -> the argument names of ``kind``'s forward."""
    names = {
        "encoder_layer": ("src_mask", "src_key_padding_mask", "is_causal"),
        "encoder": ("mask", "src_key_padding_mask", "is_causal"),
        "decoder": ("tgt_mask", "tgt_key_padding_mask", "tgt_is_causal"),
        "src": ("src_mask", "src_key_padding_mask", "src_is_causal"),
        "tgt": ("tgt_mask", "tgt_key_padding_mask", "tgt_is_causal"),
    }[prefix]
    out = {names[i]: case[key] for i, key in enumerate(("mask", "kpm", "causal")) if key in case}
    return out


def _cases(kind: str, heads: int) -> list[tuple[tuple, dict]]:
    """(input lengths, kwargs) for every mask kind of ``kind``; ("unbatched", lengths...): (L, d) inputs."""
    if kind in ("encoder_layer", "encoder"):
        cases = [((S,), _call_kwargs(kind, c, kind)) for c in _self_masks(S, heads)]
        unbatched_kpm = {"src_key_padding_mask": _kpm(S, unbatched=True)}
        return [*cases, (("unbatched", S), {}), (("unbatched", S), unbatched_kpm)]
    if kind == "transformer":
        src_cases = [_call_kwargs(kind, c, "src") for c in _self_masks(S, heads)]
        tgt_cases = [_call_kwargs(kind, c, "tgt") for c in _self_masks(T, heads)]
        cases = [{**s, **t} for s, t in zip(src_cases, tgt_cases, strict=True)]
        cases += [{**s, **m} for s, m in zip(src_cases, _memory_masks(heads), strict=False)]
        return [((S, T), c) for c in cases] + [(("unbatched", S, T), {})]
    tgt_cases = [_call_kwargs(kind, c, "decoder") for c in _self_masks(T, heads)]
    return [((T, S), c) for c in tgt_cases + _memory_masks(heads)] + [(("unbatched", T, S), {})]


# --- the comparison -----------------------------------------------------------------------------------


def _inputs(spec: tuple, batch_first: bool) -> list[torch.Tensor]:
    if spec[0] == "unbatched":
        return [_x(batch_first, n, unbatched=True) for n in spec[1:]]
    return [_x(batch_first, n) for n in spec]


def _nested(ref: nn.Module) -> bool:
    """Whether torch may run ``ref``'s encoder as nested tensors (padded positions then come out 0)."""
    enc = ref.encoder if isinstance(ref, nn.Transformer) else ref
    return isinstance(enc, nn.TransformerEncoder) and enc.use_nested_tensor


def _assert_same(ref: nn.Module, ours: nn.Module, inputs: list, kwargs: dict, batch_first: bool) -> None:
    out_ref, out = ref(*inputs, **kwargs), ours(*inputs, **kwargs)
    torch.testing.assert_close(out, out_ref, **TOL)
    g = torch.randn_like(out)
    grads_ref = torch.autograd.grad(out_ref, inputs, g, allow_unused=True)
    grads = torch.autograd.grad(out, inputs, g, allow_unused=True)
    for a, b in zip(grads, grads_ref, strict=True):
        torch.testing.assert_close(a, b, **TOL)
    with torch.no_grad():  # torch's inference fast path, where it applies
        out_ref, out = ref(*inputs, **kwargs), ours(*inputs, **kwargs)
    mask = kwargs.get("src_mask", kwargs.get("mask"))
    if mask is not None and mask.is_floating_point() and out_ref.isnan().any():
        # torch's encoder fast path returns NaN for a float attention mask (pytorch/pytorch#118628);
        # addnorm does not, and a module converted back to torch.nn behaves as torch.nn does
        if isinstance(ours, nn.TransformerEncoderLayer | nn.TransformerEncoder | nn.Transformer):
            torch.testing.assert_close(out, out_ref, equal_nan=True, **TOL)
        else:
            assert torch.isfinite(out).all()
        return
    kpm = kwargs.get("src_key_padding_mask")
    if _nested(ref) and kpm is not None and out.ndim == 3:  # torch returns 0 at padded positions
        if isinstance(ref, nn.Transformer):
            return  # and its decoder reads those zeros from the memory: nothing left to compare
        keep = kpm == 0 if kpm.is_floating_point() else ~kpm
        valid = keep if batch_first else keep.T
        out_ref, out = out_ref[valid], out[valid]
    torch.testing.assert_close(out, out_ref, **TOL)


def _assert_equivalent(ref: nn.Module, ours: nn.Module, kind: str, batch_first: bool, heads: int) -> None:
    rates = [m.p for m in ref.modules() if isinstance(m, nn.Dropout)]
    rates += [m.dropout for m in ref.modules() if isinstance(m, nn.MultiheadAttention)]
    modes = [False] + ([True] if not any(rates) else [])  # train mode too where dropout is 0
    for training in modes:
        ref.train(training)
        ours.train(training)
        for spec, kwargs in _cases(kind, heads):
            _assert_same(ref, ours, _inputs(spec, batch_first), kwargs, batch_first)


KINDS = ["encoder_layer", "decoder_layer", "encoder", "decoder", "transformer"]
TYPES = {
    "encoder_layer": (nn.TransformerEncoderLayer, an.EncoderLayer),
    "decoder_layer": (nn.TransformerDecoderLayer, an.DecoderLayer),
    "encoder": (nn.TransformerEncoder, an.Encoder),
    "decoder": (nn.TransformerDecoder, an.Decoder),
    "transformer": (nn.Transformer, EncoderDecoder),
}


@pytest.mark.parametrize("seed", range(N_CASES))
@pytest.mark.parametrize("kind", KINDS)
def test_from_torch_and_round_trip_compute_the_same_function(kind, seed):
    torch.manual_seed(seed)
    ref = _torch_module(kind, seed).eval()
    o = _options(seed, kind)
    heads, batch_first = o["nhead"], o["batch_first"]
    ours = an.from_torch(ref)
    assert isinstance(ours, TYPES[kind][1]) and not ours.training
    _assert_equivalent(ref, ours, kind, batch_first, heads)

    back = an.to_torch(ours)
    assert type(back) is TYPES[kind][0]
    ref_state, back_state = ref.state_dict(), back.state_dict()
    assert back_state.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(back_state[key], value), key
    _assert_equivalent(ref, back.eval(), kind, batch_first, heads)


def test_each_norm_keeps_its_own_settings():
    """The reported bug: layers with bias=False, a final LayerNorm with bias (max error was 0.1-0.16)."""
    layer = nn.TransformerDecoderLayer(D, 4, 24, 0.0, bias=False, batch_first=True)
    ref = nn.TransformerDecoder(layer, 2, norm=nn.LayerNorm(D, eps=1e-3))
    ref.layers[1].norm3 = nn.LayerNorm(D, eps=1e-2, elementwise_affine=False)
    _randomise(ref, random.Random(0))
    ours = an.from_torch(ref.eval())
    assert ours.layers[0].ff_block.norm.bias is None and ours.norm.bias is not None
    assert ours.norm.eps == 1e-3 and ours.layers[1].ff_block.norm.eps == 1e-2
    assert ours.layers[1].ff_block.norm.weight is None
    torch.testing.assert_close(ours.norm.bias, ref.norm.bias)
    _assert_equivalent(ref, ours, "decoder", True, 4)


def test_each_dropout_keeps_its_own_rate():
    ref = nn.TransformerEncoderLayer(D, 2, 24, 0.1, batch_first=True)
    ref.dropout2.p, ref.dropout.p, ref.self_attn.dropout = 0.3, 0.2, 0.05
    ours = an.from_torch(ref)
    assert [b.dropout.p for b in ours.blocks()] == [0.1, 0.3]
    assert ours.ff.dropout.p == 0.2 and ours.self_attn.dropout == 0.05
    back = an.to_torch(ours)
    assert (back.dropout1.p, back.dropout2.p, back.dropout.p, back.self_attn.dropout) == (0.1, 0.3, 0.2, 0.05)


def test_nn_transformer_converts_with_both_final_norms():
    ref = nn.Transformer(D, 2, 2, 3, 24, 0.0, bias=False, batch_first=True)
    ref.encoder.norm, ref.decoder.norm = nn.LayerNorm(D, eps=1e-4), None
    ours = an.from_torch(ref)
    assert isinstance(ours, EncoderDecoder)
    assert len(ours.encoder.layers) == 2 and len(ours.decoder.layers) == 3
    assert ours.encoder.norm.eps == 1e-4 and ours.encoder.norm.bias is not None and ours.decoder.norm is None
    back = an.to_torch(ours)
    assert back.decoder.norm is None and back.encoder.norm.eps == 1e-4


@pytest.mark.parametrize("seed", range(4))
def test_to_torch_of_random_addnorm_modules(seed):
    """The other direction from addnorm's side: configs torch.nn can express, random parameters and
    per-norm eps, including Linear biases with bias-free norms (torch's fast path must stay off)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    cfg = an.TransformerConfig(
        d_model=D,
        n_heads=rng.choice([2, 4]),
        d_ff=24,
        n_encoder_layers=rng.randint(1, 3),
        n_decoder_layers=rng.randint(1, 3),
        placement=rng.choice(["post", "pre"]),
        activation=rng.choice(["relu", "gelu"]),
        bias=rng.random() < 0.5,
        norm_bias=rng.choice([None, False, True]),
        norm_eps=rng.choice([1e-5, 1e-3]),
        batch_first=rng.random() < 0.5,
        dropout=rng.choice([0.0, 0.1]),
        attention_dropout=rng.choice([None, 0.0, 0.2]),
        final_norm=rng.choice(["auto", True, False]),
    )
    for ours, kind in ((EncoderDecoder(cfg), "transformer"), (an.Encoder(cfg), "encoder")):
        _randomise(ours, rng)
        encoder = ours.encoder if kind == "transformer" else ours
        encoder.layers[0].ff_block.norm.eps = 1e-2  # one norm with its own eps
        ref = an.to_torch(ours.eval())
        assert ref.state_dict().keys() == an.to_torch(an.from_torch(ref)).state_dict().keys()
        _assert_equivalent(ref, ours, kind, cfg.batch_first, cfg.n_heads)
        first = encoder.layers[0]
        _assert_equivalent(an.to_torch(first), first, "encoder_layer", cfg.batch_first, cfg.n_heads)


def test_a_module_activation_converts_as_torch_runs_it():
    """torch's TransformerDecoderLayer.__setstate__ turns a module activation into F.relu in the deep
    copies that nn.TransformerDecoder makes: from_torch converts the function torch computes."""
    layer = nn.TransformerDecoderLayer(D, 4, 24, 0.0, activation=nn.GELU(), batch_first=True)
    ref = nn.TransformerDecoder(layer, 2).eval()
    assert ref.layers[0].activation is F.relu
    ours = an.from_torch(ref)
    assert ours.cfg.activation == "relu" and an.from_torch(layer).cfg.activation == "gelu"
    _assert_equivalent(ref, ours, "decoder", True, 4)
    with pytest.raises(an.UnsupportedModuleError, match="decoder: its layers' options .*'relu'"):
        an.from_torch(nn.Transformer(D, 4, 1, 1, 24, activation=nn.GELU()))


def test_bias_free_norms_turn_torchs_fast_path_off_only_where_it_would_fail():
    x = torch.randn(B, S, D)
    for norm_bias in (False, True):
        ours = an.EncoderLayer(_cfg(norm_bias=norm_bias, dropout=0.0)).eval()
        ref = an.to_torch(ours)
        assert (ref.activation_relu_or_gelu == 0) == (not norm_bias)
        with torch.no_grad():
            torch.testing.assert_close(ref(x), ours(x), **TOL)


def test_train_mode_and_float64_gradients_match():
    ref = nn.TransformerEncoderLayer(D, 4, 24, 0.0, norm_first=True, batch_first=True).double()
    ours = an.from_torch(ref)
    assert next(ours.parameters()).dtype == torch.float64
    x = torch.randn(B, S, D, dtype=torch.float64)
    for model in (ref, ours):
        model.train()
        model(x).pow(2).sum().backward()
    torch.testing.assert_close(ours.ff.w1.weight.grad, ref.linear1.weight.grad)
    torch.testing.assert_close(ours.self_attn.in_proj.weight.grad, ref.self_attn.in_proj_weight.grad)
    torch.testing.assert_close(ours.ff_block.norm.weight.grad, ref.norm2.weight.grad)


# --- errors -------------------------------------------------------------------------------------------


def _cfg(**kw) -> an.TransformerConfig:
    return an.TransformerConfig(**{"d_model": D, "n_heads": 4, "d_ff": 24, "n_layers": 2, **kw})


OTHER_PLACEMENTS = [p for p in an.PLACEMENTS if p not in ("post", "pre")]


@pytest.mark.parametrize("placement", OTHER_PLACEMENTS)
def test_to_torch_names_every_other_placement(placement):
    with pytest.raises(an.UnsupportedModuleError) as err:
        an.to_torch(an.Encoder(_cfg(placement=placement)))
    msg = str(err.value)
    assert "\n" not in msg and "placement" in msg
    # placements that a stack expands per layer are named by the layer's own placement
    per_layer = {"mix": "mixing post and pre", "hybridnorm_star": "'hybridnorm_star_first'"}
    expected = per_layer.get(placement, repr(placement))
    assert expected in msg


@pytest.mark.parametrize(
    "cfg, match",
    [
        (_cfg(norm="rmsnorm"), r"layers\[0\]\.norm1: RMSNorm has no torch.nn equivalent"),
        (_cfg(norm="none"), r"NoNorm has no torch.nn equivalent"),
        (_cfg(activation="swiglu"), r"activation: 'swiglu' has no torch.nn equivalent"),
        (_cfg(qk_norm=True), r"qk_norm: normalising 'qk' inside attention has no torch.nn equivalent"),
        (_cfg(placement=["post", "pre"]), r"placement: layers\[0\] is 'post' and layers\[1\] 'pre'"),
        (_cfg(residual=False), r"residual: False .* has no torch.nn equivalent"),
        (_cfg(dropout_at="after_add"), r"dropout_at: 'after_add' has no torch.nn equivalent"),
    ],
)
def test_to_torch_rejects_what_torch_cannot_express(cfg, match):
    for module in (an.Encoder(cfg), EncoderDecoder(cfg)):
        with pytest.raises(an.UnsupportedModuleError, match=match) as err:
            an.to_torch(module)
        assert "\n" not in str(err.value)


def test_to_torch_rejects_other_modules_with_a_hint():
    with pytest.raises(TypeError, match=r"module: expected an addnorm EncoderLayer.*got Linear$"):
        an.to_torch(nn.Linear(3, 3))
    with pytest.raises(
        TypeError, match=r"got Transformer \(token embeddings .* model.encoder and model.decoder"
    ):
        an.to_torch(an.Transformer(_cfg(), 10, 10))
    with pytest.raises(TypeError, match=r"got LanguageModel .* convert model.stack"):
        an.to_torch(an.LanguageModel(_cfg(), 10))


def test_from_torch_rejects_what_addnorm_cannot_express():
    with pytest.raises(TypeError, match="module: expected one of nn.Transformer, nn.TransformerEncoder"):
        an.from_torch(nn.Linear(3, 3))
    for act in (nn.SiLU(), nn.GELU(approximate="tanh"), lambda x: F.relu(x) * 2):
        with pytest.raises(an.UnsupportedModuleError, match="activation: only relu and gelu"):
            an.from_torch(nn.TransformerEncoderLayer(D, 4, 24, activation=act))
    layer = nn.TransformerEncoderLayer(D, 4, 24)
    layer.self_attn = nn.MultiheadAttention(D, 4, add_bias_kv=True)
    with pytest.raises(an.UnsupportedModuleError, match="self_attn: add_bias_kv"):
        an.from_torch(layer)
    layer = nn.TransformerEncoderLayer(D, 4, 24)
    layer.norm2 = nn.RMSNorm(D)
    with pytest.raises(an.UnsupportedModuleError, match="norm2: only nn.LayerNorm converts, got RMSNorm"):
        an.from_torch(layer)
    layer = nn.TransformerDecoderLayer(D, 4, 24)
    layer.linear2 = nn.Linear(24, D, bias=False)
    with pytest.raises(an.UnsupportedModuleError, match="bias: addnorm uses one bias setting"):
        an.from_torch(layer)
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(D, 4, 24), 2, enable_nested_tensor=False)
    enc.layers[1] = nn.TransformerEncoderLayer(D, 4, 32)
    with pytest.raises(an.UnsupportedModuleError, match=r"layers\[1\]: every layer must have the options"):
        an.from_torch(enc)
    model = nn.Transformer(D, 4, 1, 1, 24)
    model.decoder = nn.TransformerDecoder(nn.TransformerDecoderLayer(D, 4, 24, norm_first=True), 1)
    with pytest.raises(an.UnsupportedModuleError, match="decoder: its layers' options"):
        an.from_torch(model)
