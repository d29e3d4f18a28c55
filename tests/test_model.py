"""Layers, stacks and models: parameter counts, masks, final norms, initialisation, training."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import addnorm as an
from addnorm.model import FeedForward, MultiHeadAttention


def nparams(m):
    return sum(p.numel() for p in m.parameters())


def small(**kw):
    base = dict(d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0)
    base.update(kw)
    return an.TransformerConfig(**base)


def test_parameter_counts_follow_the_formulas():
    d, f = 512, 2048
    assert nparams(MultiHeadAttention(d, 8)) + nparams(an.LayerNorm(d)) == 1_051_648
    attn = 4 * d * d + 4 * d
    ffn = 2 * d * f + f + d
    cfg = an.TransformerConfig()
    assert nparams(an.EncoderLayer(cfg)) == attn + ffn + 2 * 2 * d
    assert nparams(an.EncoderLayer(cfg)) == nparams(nn.TransformerEncoderLayer(d, 8, f))
    assert nparams(an.DecoderLayer(cfg)) == nparams(nn.TransformerDecoderLayer(d, 8, f))
    # post-LN encoder: no final norm; pre-LN: one more LayerNorm
    assert nparams(an.Encoder(cfg)) == 6 * nparams(an.EncoderLayer(cfg))
    assert nparams(an.Encoder(cfg.replace(placement="pre"))) == 6 * nparams(an.EncoderLayer(cfg)) + 2 * d
    swiglu = an.TransformerConfig(activation="swiglu", bias=False)
    assert nparams(FeedForward(d, f, "swiglu", bias=False)) == 3 * d * f
    assert nparams(an.EncoderLayer(swiglu)) == 4 * d * d + 3 * d * f + 2 * d  # LayerNorms keep no bias


def test_attention_matches_float64_formula():
    torch.manual_seed(1)
    mha = MultiHeadAttention(16, 4).double().eval()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    mem = torch.randn(2, 7, 16, dtype=torch.float64)

    def manual(q_in, kv_in, mask=None):
        w, b = mha.in_proj.weight, mha.in_proj.bias
        q = (q_in @ w[:16].T + b[:16]).view(2, -1, 4, 4).transpose(1, 2)
        k = (kv_in @ w[16:32].T + b[16:32]).view(2, -1, 4, 4).transpose(1, 2)
        v = (kv_in @ w[32:].T + b[32:]).view(2, -1, 4, 4).transpose(1, 2)
        scores = q @ k.transpose(-1, -2) / math.sqrt(4)
        if mask is not None:
            scores = scores + mask
        out = torch.softmax(scores, -1) @ v
        return mha.out_proj(out.transpose(1, 2).reshape(2, -1, 16))

    torch.testing.assert_close(mha(x), manual(x, x))
    torch.testing.assert_close(mha(x, mem), manual(x, mem))
    causal = torch.triu(torch.full((5, 5), float("-inf"), dtype=torch.float64), 1)
    torch.testing.assert_close(mha(x, is_causal=True), manual(x, x, causal))
    kpm = torch.tensor([[False] * 5 + [True] * 2, [False] * 7])
    add = torch.zeros(2, 1, 1, 7, dtype=torch.float64).masked_fill(kpm.view(2, 1, 1, 7), float("-inf"))
    torch.testing.assert_close(mha(x, mem, key_padding_mask=kpm), manual(x, mem, add))


def test_bool_and_float_masks_agree_and_batch_head_masks_work():
    mha = MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 6, 16)
    bool_mask = torch.rand(6, 6) > 0.6
    bool_mask.fill_diagonal_(False)
    float_mask = torch.zeros(6, 6).masked_fill(bool_mask, float("-inf"))
    torch.testing.assert_close(mha(x, attn_mask=bool_mask), mha(x, attn_mask=float_mask))
    per_head = bool_mask.expand(2 * 4, 6, 6)
    torch.testing.assert_close(mha(x, attn_mask=per_head), mha(x, attn_mask=bool_mask))


def test_mask_errors_name_the_argument():
    layer = an.EncoderLayer(small())
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match=r"src_mask: expected shape \(5, 5\) or \(8, 5, 5\)"):
        layer(x, src_mask=torch.zeros(4, 4, dtype=torch.bool))
    with pytest.raises(
        TypeError, match="src_key_padding_mask: expected a bool mask .* got dtype torch.int64"
    ):
        layer(x, src_key_padding_mask=torch.zeros(2, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=r"src_key_padding_mask: expected shape \(2, 5\)"):
        layer(x, src_key_padding_mask=torch.zeros(5, 2, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"src: expected shape \(batch, seq, 32\)"):
        layer(torch.randn(2, 5, 31))
    with pytest.raises(ValueError, match="d_model: 30 is not divisible by n_heads=4"):
        an.TransformerConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="placement: unknown placement"):
        an.TransformerConfig(placement="preln2")
    with pytest.raises(ValueError, match="placement: a per-layer list needs one entry per layer"):
        an.Encoder(small(placement=["post", "pre", "pre"]))
    with pytest.raises(ValueError, match="activation: expected one of"):
        an.TransformerConfig(activation="tanh")


def test_language_model_is_causal_and_padding_is_ignored():
    lm = an.LanguageModel(small(placement="pre"), vocab=50).eval()
    tokens = torch.randint(0, 50, (2, 12))
    changed = tokens.clone()
    changed[:, 8:] = torch.randint(0, 50, (2, 4))
    torch.testing.assert_close(lm(tokens)[:, :8], lm(changed)[:, :8])
    assert not torch.allclose(lm(tokens)[:, 8:], lm(changed)[:, 8:])
    model = an.Transformer(small(), 20, 20, pad_id=0).eval()
    src = torch.randint(1, 20, (2, 9))
    tgt = torch.randint(1, 20, (2, 6))
    padded = src.clone()
    padded[:, 7:] = 0
    other_tokens = torch.cat([padded[:, :7], torch.zeros(2, 4, dtype=torch.long)], 1)
    # extra padding at the end of the source changes nothing
    torch.testing.assert_close(model(padded, tgt), model(other_tokens, tgt))
    with pytest.raises(ValueError, match="tokens: expected integer token ids"):
        lm(torch.randn(2, 3))
    with pytest.raises(ValueError, match="exceeds max_len"):
        an.LanguageModel(small(max_len=8), 50)(torch.zeros(1, 9, dtype=torch.long))


@pytest.mark.parametrize(
    "placement, expected",
    [
        ("post", False),
        ("pre", True),
        ("sandwich", True),
        ("normed_residual", True),
        (["pre", "post"], False),
        (["post", "pre"], True),
    ],
)
def test_final_norm_auto(placement, expected):
    enc = an.Encoder(small(placement=placement))
    assert (enc.norm is not None) == expected
    assert [p.name for p in enc.placements] == ([placement] * 2 if isinstance(placement, str) else placement)
    assert an.Encoder(small(placement=placement, final_norm=True)).norm is not None
    assert an.Encoder(small(placement=placement, final_norm=False)).norm is None


def test_layers_are_initialised_independently_and_gpt2_init_scales_residual_projections():
    enc = an.Encoder(small(n_layers=3))
    w = [layer.ff.w1.weight for layer in enc.layers]
    assert not torch.equal(w[0], w[1]) and not torch.equal(w[1], w[2])
    cfg = an.TransformerConfig(d_model=256, n_heads=4, d_ff=1024, n_layers=8, init="gpt2")
    layer = an.EncoderLayer(cfg)
    assert abs(layer.ff.w1.weight.std().item() - 0.02) < 1e-3
    assert abs(layer.ff.w2.weight.std().item() - 0.02 / math.sqrt(16)) < 3e-4
    assert abs(layer.self_attn.out_proj.weight.std().item() - 0.02 / math.sqrt(16)) < 3e-4
    torch_init = an.EncoderLayer(cfg.replace(init="torch"))
    bound = math.sqrt(6 / (256 + 768))  # Xavier-uniform on the packed (3d, d) projection
    assert torch_init.self_attn.in_proj.weight.abs().max() <= bound
    assert torch_init.self_attn.in_proj.weight.abs().max() > 0.95 * bound
    assert torch.count_nonzero(torch_init.self_attn.in_proj.bias) == 0


def test_swiglu_matches_formula():
    ff = FeedForward(8, 6, "swiglu").double()
    x = torch.randn(3, 8, dtype=torch.float64)
    w1, b1 = ff.w1.weight, ff.w1.bias
    gate, value = x @ w1[:6].T + b1[:6], x @ w1[6:].T + b1[6:]
    torch.testing.assert_close(ff(x), ff.w2(F.silu(gate) * value))


def test_unbatched_and_seq_first_layouts():
    layer = an.EncoderLayer(small()).eval()
    seq_first = an.EncoderLayer(small(batch_first=False)).eval()
    seq_first.load_state_dict(layer.state_dict())
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(seq_first(x.transpose(0, 1)).transpose(0, 1), layer(x))
    torch.testing.assert_close(layer(x[0]), layer(x[:1])[0])


@pytest.mark.parametrize("placement", ["post", "pre", "sandwich", "normed_residual"])
def test_every_placement_learns_a_copy_task(placement):
    torch.manual_seed(0)
    cfg = small(placement=placement, n_layers=2)
    model = an.Transformer(cfg, 12, 12)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    src = torch.randint(2, 12, (32, 6))
    tgt_in = torch.cat([torch.ones(32, 1, dtype=torch.long), src[:, :-1]], 1)
    losses = []
    for _ in range(40):
        loss = F.cross_entropy(model(src, tgt_in).reshape(-1, 12), src.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < 0.5 * losses[0]
