"""Each literature placement and norm pinned to its formula, its paper's constants and its init."""

import math

import pytest
import torch
import torch.nn.functional as F

import addnorm as an
from addnorm.model.init import Depth, admin_init, deepnorm_constants, sub_ln_gain

D = 16


def cfg(**kw):
    base = dict(d_model=D, n_heads=4, d_ff=32, n_layers=2, dropout=0.0)
    base.update(kw)
    return an.TransformerConfig(**base)


def _ln(z, eps=1e-5):
    mean = z.mean(-1, keepdim=True)
    return (z - mean) / torch.sqrt(((z - mean) ** 2).mean(-1, keepdim=True) + eps)


def _heads(x, attn):
    """Q, K, V of a (2, 4, D) input for 4 heads, by hand from the packed projection."""
    w, b = attn.in_proj.weight, attn.in_proj.bias
    return [
        (x @ w[i * D : (i + 1) * D].T + b[i * D : (i + 1) * D]).view(2, 4, 4, 4).transpose(1, 2)
        for i in range(3)
    ]


def _sub():
    w = torch.randn(D, D, dtype=torch.float64) / 4
    return lambda h: torch.tanh(h @ w)


# --- norms -------------------------------------------------------------------------------------------


def test_scalenorm_and_dyt_formulas():
    x = torch.randn(4, D, dtype=torch.float64)
    sn = an.build_norm("scalenorm", D, dtype=torch.float64)
    assert sn.weight.item() == pytest.approx(math.sqrt(D))
    torch.testing.assert_close(sn(x), math.sqrt(D) * x / x.norm(dim=-1, keepdim=True))
    dyt = an.build_norm("dyt", D, dtype=torch.float64, alpha0=0.8)
    with torch.no_grad():
        dyt.weight.uniform_(0.5, 1.5)
        dyt.bias.uniform_(-1, 1)
    torch.testing.assert_close(dyt(x), dyt.weight * torch.tanh(0.8 * x) + dyt.bias)
    assert an.build_norm("dyt", D).alpha.item() == 0.5


def test_zero_centred_rmsnorm_with_w_zero_equals_gamma_one():
    x = torch.randn(3, D)
    zc = an.build_norm("rmsnorm", D, zero_centered=True)
    assert torch.count_nonzero(zc.weight) == 0
    torch.testing.assert_close(zc(x), torch.nn.RMSNorm(D, eps=1e-5)(x))
    with torch.no_grad():
        zc.weight.fill_(0.5)
    torch.testing.assert_close(zc(x), 1.5 * torch.nn.RMSNorm(D, eps=1e-5)(x))


def test_l2_norm_projects_onto_the_unit_sphere():
    x = torch.randn(5, D)
    torch.testing.assert_close(an.build_norm("l2", D)(x).norm(dim=-1), torch.ones(5))


# --- connection-level placements --------------------------------------------------------------------


def test_pre_post_and_res_post_formulas():
    x, sub = torch.randn(2, 3, D, dtype=torch.float64), _sub()
    pp = an.AddNorm(D, "pre_post", dtype=torch.float64)
    torch.testing.assert_close(pp(x, sub), _ln(x + sub(_ln(x))))
    rp = an.AddNorm(D, "res_post", dtype=torch.float64)
    torch.testing.assert_close(rp(x, sub), x + _ln(sub(x)))
    assert not an.PLACEMENTS["pre_post"].final_norm and an.PLACEMENTS["res_post"].final_norm


def test_deepnorm_with_alpha_one_is_post_ln_and_scales_the_residual():
    x, sub = torch.randn(2, 3, D, dtype=torch.float64), _sub()
    post = an.AddNorm(D, "post", dtype=torch.float64)
    deep1 = an.AddNorm(D, "deepnorm", alpha=1.0, dtype=torch.float64)
    torch.testing.assert_close(deep1(x, sub), post(x, sub))
    deep = an.AddNorm(D, "deepnorm", alpha=2.5, dtype=torch.float64)
    torch.testing.assert_close(deep(x, sub), _ln(2.5 * x + sub(x)))


def test_deepnet_constants_table():
    # Wang et al. 2022, Table 1: closed forms at N = 6 encoder layers and M = 12 decoder layers
    n, m = 6, 12
    assert deepnorm_constants(Depth("encoder", n, 0)) == pytest.approx((12**0.25, 48**-0.25))
    assert deepnorm_constants(Depth("decoder", 0, m)) == pytest.approx((24**0.25, 96**-0.25))
    enc = deepnorm_constants(Depth("encoder", n, m))
    assert enc == pytest.approx((0.81 * (6**4 * 12) ** (1 / 16), 0.87 * (6**4 * 12) ** (-1 / 16)))
    assert deepnorm_constants(Depth("decoder", n, m)) == pytest.approx((36**0.25, 144**-0.25))
    assert deepnorm_constants(Depth("encoder", 6, 0))[0] == pytest.approx(1.8612, abs=1e-4)


def test_deepnorm_model_uses_its_constants():
    c = cfg(placement="deepnorm", n_encoder_layers=6, n_decoder_layers=12, d_ff=64)
    model = an.Transformer(c, 10, 10)
    alpha_enc, _ = deepnorm_constants(Depth("encoder", 6, 12))
    alpha_dec, _ = deepnorm_constants(Depth("decoder", 6, 12))
    assert model.encoder.layers[0].ff_block.alpha == pytest.approx(alpha_enc)
    assert model.decoder.layers[3].cross_attn_block.alpha == pytest.approx(alpha_dec)
    lm = an.LanguageModel(cfg(placement="deepnorm", n_layers=8, d_model=256, n_heads=4, d_ff=1024), 10)
    alpha, beta = deepnorm_constants(Depth("decoder", 0, 8))
    assert lm.layers[0].ff_block.alpha == pytest.approx(alpha)
    layer = lm.layers[0]
    xavier = math.sqrt(2 / (256 + 1024))
    assert layer.ff.w1.weight.std().item() == pytest.approx(beta * xavier, rel=0.03)
    v = layer.self_attn.in_proj.weight[512:]
    q = layer.self_attn.in_proj.weight[:256]
    assert v.std().item() == pytest.approx(beta * math.sqrt(2 / 512), rel=0.03)
    assert q.std().item() == pytest.approx(math.sqrt(2 / 512), rel=0.03)


@pytest.mark.parametrize("placement", ["rezero", "layerscale"])
def test_rezero_and_zero_layerscale_are_the_identity_at_init(placement):
    torch.manual_seed(0)
    layer = an.EncoderLayer(cfg(placement=placement)).eval()
    if placement == "layerscale":
        for block in layer.blocks():
            torch.nn.init.zeros_(block.gate)
    x = torch.randn(2, 5, D)
    torch.testing.assert_close(layer(x), x)
    assert an.Encoder(cfg(placement="rezero")).norm is None


def test_layerscale_init_follows_cait_by_depth():
    for n, value in ((12, 0.1), (18, 0.1), (24, 1e-5), (36, 1e-6)):
        enc = an.Encoder(cfg(placement="layerscale", n_layers=n, d_model=8, n_heads=2, d_ff=8))
        gate = enc.layers[0].ff_block.gate
        assert gate.shape == (8,) and torch.all(gate == torch.tensor(value, dtype=gate.dtype))


def test_normed_residual_equals_megatron_residual_after_norm():
    """Megatron-LM with apply_residual_connection_post_layernorm=True, written out by hand."""
    layer = an.EncoderLayer(cfg(placement="normed_residual")).double().eval()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    h = layer.self_attn_block.norm(x)
    x1 = h + layer.self_attn(h)  # the residual is the normalised input
    h = layer.ff_block.norm(x1)
    torch.testing.assert_close(layer(x), h + layer.ff(h))


def test_admin_profiling_follows_transformer_clinic():
    """Transformer-Clinic's adaptive-profiling pass, by hand: training mode (dropout on), each omega set
    from the running value r before its connection runs, then r = sqrt(Var[omega x] + Var[D(F(x))])."""
    c = cfg(placement="admin", n_layers=3, dropout=0.3)
    enc = an.Encoder(c).double().eval()
    x = 3.0 * torch.randn(2, 5, D, dtype=torch.float64)  # not unit variance: Var[omega x] matters
    torch.manual_seed(1)
    omegas = admin_init(enc, x)
    assert not enc.training  # mode restored
    enc.train()
    for block in (b for layer in enc.layers for b in layer.blocks()):
        torch.nn.init.ones_(block.omega)
    torch.manual_seed(1)  # the same dropout masks, drawn in the same order
    r, h, expected = 1.0, x, []
    with torch.no_grad():
        for layer in enc.layers:
            for fn in (layer.self_attn, layer.ff):
                omega = r
                expected.append(omega)
                f = F.dropout(fn(h), 0.3, training=True)  # the branch as added
                r = math.sqrt((omega * h).var(unbiased=False).item() + f.var(unbiased=False).item())
                h = _ln(omega * h + f)  # Post-LN with the residual scaled by omega
    assert len(omegas) == 6 and expected[0] == 1.0 and expected[1] > 2.0  # ~ sqrt(Var x = 9)
    for omega, value in zip(omegas, expected, strict=True):
        torch.testing.assert_close(omega, torch.full((D,), value, dtype=torch.float64))
    with pytest.raises(ValueError, match="no Admin connections"):
        admin_init(an.LanguageModel(cfg(), 20), torch.randint(0, 20, (2, 5)))


def test_sub_ln_has_inner_norms_and_magneto_gain():
    assert sub_ln_gain(Depth("encoder", 6, 0)) == pytest.approx(math.sqrt(math.log(12)))
    assert sub_ln_gain(Depth("encoder", 6, 6)) == pytest.approx(math.sqrt(math.log(18) * math.log(12) / 3))
    assert sub_ln_gain(Depth("decoder", 6, 6)) == pytest.approx(math.sqrt(math.log(18)))
    layer = an.EncoderLayer(cfg(placement="sub_ln")).double().eval()
    assert isinstance(layer.self_attn.inner_norm, an.LayerNorm) and layer.ff.inner_norm.dim == 32
    x = torch.randn(2, 4, D, dtype=torch.float64)
    h = layer.self_attn_block.norm(x)
    q, k, v = _heads(h, layer.self_attn)
    att = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v
    x1 = x + layer.self_attn.out_proj(layer.self_attn.inner_norm(att.transpose(1, 2).reshape(2, 4, D)))
    h = layer.ff_block.norm(x1)
    x2 = x1 + layer.ff.w2(layer.ff.inner_norm(F.relu(layer.ff.w1(h))))
    torch.testing.assert_close(layer(x), x2)


def test_sub_ln_cross_attention_and_ffn_dropout_follow_torchscale():
    """torchscale: no inner norm in cross-attention and no Magneto gain on it (decoder.py skips
    encoder_attn); activation dropout before the FFN's inner norm (FeedForwardNetwork.forward)."""
    torch.manual_seed(0)
    pre = an.DecoderLayer(cfg(placement="pre"))
    torch.manual_seed(0)
    sub = an.DecoderLayer(cfg(placement="sub_ln", activation_dropout=0.5))
    assert sub.cross_attn.inner_norm is None and sub.self_attn.inner_norm is not None
    for name in ("in_proj", "out_proj"):  # cross-attention keeps the config's init
        torch.testing.assert_close(getattr(sub.cross_attn, name).weight, getattr(pre.cross_attn, name).weight)
        assert not torch.equal(getattr(sub.self_attn, name).weight, getattr(pre.self_attn, name).weight)
    ff = sub.ff.train()
    _randomise_norms(ff)
    x = torch.randn(2, 4, D)
    torch.manual_seed(3)
    out = ff(x)
    torch.manual_seed(3)
    hidden = F.dropout(F.relu(ff.w1(x)), 0.5, training=True)
    torch.testing.assert_close(out, ff.w2(ff.inner_norm(hidden)))


def test_b2t_rescaling_init_scales_every_weight_matrix():
    """takase/b2t_connection's rescaling_init: every non-norm weight (not the biases) times L^(-1/2)."""
    torch.manual_seed(0)
    post = an.DecoderLayer(cfg(placement="post", n_layers=4))
    torch.manual_seed(0)
    b2t = an.DecoderLayer(cfg(placement="b2t", n_layers=4))
    params = dict(post.named_parameters())
    scaled = 0
    for name, p in b2t.named_parameters():
        is_matrix = name.endswith(".weight") and "norm" not in name
        torch.testing.assert_close(p, params[name] * (0.5 if is_matrix else 1.0))
        scaled += is_matrix
    assert scaled == 2 * 2 + 2  # in_proj and out_proj of two attentions, w1 and w2


def test_rezero_shares_one_gate_per_layer():
    """majumderb/rezero: one resweight per layer, used by every sublayer (RZTXDecoderLayer)."""
    layer = an.DecoderLayer(cfg(placement="rezero"))
    gates = {id(b.gate) for b in layer.blocks()}
    assert len(gates) == 1 and sum(p.numel() for n, p in layer.named_parameters() if "gate" in n) == 1
    enc_layer = an.EncoderLayer(cfg(placement="rezero")).double().eval()
    with torch.no_grad():
        enc_layer.self_attn_block.gate.fill_(0.5)
    x = torch.randn(2, 4, D, dtype=torch.float64)
    x1 = x + 0.5 * enc_layer.self_attn(x)
    torch.testing.assert_close(enc_layer(x), x1 + 0.5 * enc_layer.ff(x1))
    conn = an.AddNorm(D, "rezero")  # standalone: its own gate
    assert conn.gate.shape == (1,) and conn.gate.item() == 0.0


# --- stack-level placements ---------------------------------------------------------------------------


def test_mix_ln_layer_split():
    enc = an.Encoder(cfg(placement="mix", n_layers=12))
    assert [p.name for p in enc.placements] == ["post"] * 3 + ["pre"] * 9
    assert enc.norm is not None
    half = an.Encoder(cfg(placement="mix", n_layers=6, mix_fraction=0.5))
    assert [p.name for p in half.placements] == ["post"] * 3 + ["pre"] * 3
    with pytest.raises(ValueError, match="give it to a stack"):
        an.EncoderLayer(cfg(), "mix")


def test_resi_dual_two_streams_by_hand():
    enc = an.Encoder(cfg(placement="resi_dual", n_layers=2)).double().eval()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    xa, xd = x, x
    for layer in enc.layers:
        for block, fn in ((layer.self_attn_block, layer.self_attn), (layer.ff_block, layer.ff)):
            f = fn(xa)
            xa = block.norm(xa + f)
            xd = xd + f
    torch.testing.assert_close(enc(x), xa + enc.norm(xd))


def test_b2t_by_hand():
    layer = an.EncoderLayer(cfg(placement="b2t")).double().eval()
    x = torch.randn(2, 5, D, dtype=torch.float64)
    h = layer.self_attn_block.norm(x + layer.self_attn(x))
    torch.testing.assert_close(layer(x), layer.ff_block.norm(h + layer.ff(h) + x))


def _rms(z, weight, eps=1e-5):
    return weight * z / torch.sqrt((z**2).mean(-1, keepdim=True) + eps)


def _qkv_attention(h, attn):
    """Attention with per-head RMS-normalised queries, keys and values (HybridNorm's QKV-norm)."""
    q, k, v = _heads(h, attn)
    q, k, v = _rms(q, attn.q_norm.weight), _rms(k, attn.k_norm.weight), _rms(v, attn.v_norm.weight)
    att = torch.softmax(q @ k.transpose(-1, -2) / 2, -1) @ v  # d_head = 4
    return att.transpose(1, 2).reshape(2, 4, D) @ attn.out_proj.weight.T + attn.out_proj.bias


def _ffn(h, ff):
    return F.relu(h @ ff.w1.weight.T + ff.w1.bias) @ ff.w2.weight.T + ff.w2.bias


def _randomise_norms(module):
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def _ffn_input(layer, x):
    """N(Y), Y = X + Attn_QKV(X): what a HybridNorm layer's FFN reads and its residual."""
    return _rms(x + _qkv_attention(x, layer.self_attn), layer.ff_block.norm.weight)


def test_hybridnorm_is_the_authors_block():
    """BryceZhuo/HybridNorm, OLMoSequentialBlock.forward with the 1.2B HybridNorm switches:
    Y = X + Attn_QKV(X); X_next = N(Y) + FFN(N(Y)); a final norm after the stack."""
    enc = an.Encoder(cfg(placement="hybridnorm", norm="rmsnorm", n_layers=2)).double().eval()
    _randomise_norms(enc)
    layer = enc.layers[0]
    assert layer.self_attn_block.norm_name == "none" and enc.norm is not None
    x = torch.randn(2, 4, D, dtype=torch.float64)
    h = x
    for layer in enc.layers:
        y = h + _qkv_attention(h, layer.self_attn)
        z = _rms(y, layer.ff_block.norm.weight)
        h = z + _ffn(z, layer.ff)  # the residual is taken after the norm; no norm at the output
    torch.testing.assert_close(enc(x), _rms(h, enc.norm.weight))
    z = _ffn_input(layer, x)
    torch.testing.assert_close(layer(x), z + _ffn(z, layer.ff))


def test_hybridnorm_star_makes_the_first_layer_pre_norm():
    """HybridNorm* (the authors' norm_pos_special_config for layer 0: attn_norm on, ffn_residual off):
    layer 0 is Pre-Norm for attention (with QKV-norm) and FFN, the other layers HybridNorm."""
    enc = an.Encoder(cfg(placement="hybridnorm*", norm="rmsnorm", n_layers=3)).double().eval()
    _randomise_norms(enc)
    assert [p.name for p in enc.placements] == ["hybridnorm_star_first", "hybridnorm", "hybridnorm"]
    first = enc.layers[0]
    assert first.self_attn.normalize == "qkv" and first.self_attn_block.norm_name == "rmsnorm"
    x = torch.randn(2, 4, D, dtype=torch.float64)
    h = x + _qkv_attention(_rms(x, first.self_attn_block.norm.weight), first.self_attn)
    h = h + _ffn(_rms(h, first.ff_block.norm.weight), first.ff)
    for layer in enc.layers[1:]:
        z = _ffn_input(layer, h)
        h = z + _ffn(z, layer.ff)
    torch.testing.assert_close(enc(x), _rms(h, enc.norm.weight))
    one = an.Encoder(cfg(placement="hybridnorm_star", n_layers=1))
    assert [p.name for p in one.placements] == ["hybridnorm_star_first"]


def test_qk_norm_option():
    layer = an.EncoderLayer(cfg(qk_norm=True))
    assert layer.self_attn.normalize == "qk" and layer.self_attn.v_norm is None
    assert layer.self_attn.q_norm.dim == D // 4


def test_ngpt_keeps_hidden_states_on_the_unit_sphere():
    lm = an.LanguageModel(cfg(placement="ngpt", n_layers=3), 20)
    outs = []
    for layer in lm.layers:  # each layer's output: its last connection's stream out
        layer.ff_block.stream_out.register_forward_hook(lambda m, i, o: outs.append(o))
    lm(torch.randint(0, 20, (2, 7)))
    assert len(outs) == 3
    for o in outs:
        torch.testing.assert_close(o.norm(dim=-1), torch.ones(2, 7), rtol=1e-5, atol=1e-5)
    block = lm.layers[0].ff_block
    torch.testing.assert_close(block.gate_value, torch.full((D,), 0.05))
    x = F.normalize(torch.randn(3, D), dim=-1)
    f = torch.randn(3, D)
    expected = F.normalize(x + 0.05 * (F.normalize(f, dim=-1) - x), dim=-1)
    torch.testing.assert_close(block(x, lambda h: f), expected)


# --- every placement trains ----------------------------------------------------------------------------


@pytest.mark.parametrize("placement", list(an.PLACEMENTS))
def test_every_placement_trains_without_nan_at_depth_6(placement):
    torch.manual_seed(0)
    c = cfg(placement=placement, n_layers=6)
    lm = an.LanguageModel(c, 30)
    tokens = torch.randint(0, 30, (8, 17))
    if placement == "admin":
        admin_init(lm, tokens[:, :-1])
    opt = torch.optim.AdamW(lm.parameters(), lr=1e-3)
    losses = []
    for _ in range(8):
        loss = F.cross_entropy(lm(tokens[:, :-1]).reshape(-1, 30), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    seq2seq = an.Transformer(cfg(placement=placement, n_layers=2), 12, 12)
    logits = seq2seq(torch.randint(0, 12, (2, 5)), torch.randint(0, 12, (2, 4)))
    logits.sum().backward()
    assert torch.isfinite(logits).all()
    assert all(torch.isfinite(p.grad).all() for p in seq2seq.parameters() if p.grad is not None)


def test_every_placement_and_norm_is_documented():
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "docs" / "placements.md").read_text()
    for name in an.PLACEMENTS:
        assert f"\n## {name}\n" in text, name
    for name in an.NORMS:
        assert f"| `{name}` |" in text, name
    # every placement names the reference implementation it was compared against, and that
    # repository's commit is recorded
    sections = dict(re.findall(r"(?m)^## ([^\n]+)\n(.*?)(?=^## |\Z)", text, re.S))
    commits = set(re.findall(r"(?m)^\| `([\w.-]+/[\w.-]+)`", sections["Reference commits"]))
    assert {"microsoft/torchscale", "NVIDIA/ngpt", "BryceZhuo/HybridNorm"} <= commits
    for name in an.PLACEMENTS:
        refs = re.findall(r"(?m)^- Reference: (.*?)(?=^- |^\Z|\Z)", sections[name], re.S)
        assert len(refs) == 1, f"{name}: expected one '- Reference:' bullet"
        repos = set(re.findall(r"`([\w-]+/[\w-]+)`", refs[0]))  # owner/name, not a path to a file
        assert repos, f"{name}: its reference names no repository"
        assert repos <= commits, f"{name}: {repos - commits} missing from the commit table"
