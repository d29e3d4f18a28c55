"""AddNorm's fused path (one addnorm.ops.add_norm call) against its unfused modules: same outputs and
gradients wherever it applies, the unfused path everywhere else."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import addnorm as an
import addnorm.connection as connection_module
from addnorm.model.stream import Connection, Stream
from addnorm.ops import policy
from addnorm.placements import Placement

POST_LAYERSCALE = Placement(
    "post_layerscale", "y = N(x + diag(l) D(F(x)))", "test", output_norm=True, gate="layerscale"
)
POST_REZERO = Placement("post_rezero", "y = N(x + a D(F(x)))", "test", output_norm=True, gate="rezero")


def _spy_add_norm(monkeypatch, key: str) -> list:
    """The ``key`` argument of every add_norm call that AddNorm (and a held-back add) makes."""
    calls = []
    original = connection_module.add_norm

    def spy(*args, **kwargs):
        calls.append(kwargs.get(key))
        return original(*args, **kwargs)

    monkeypatch.setattr(connection_module, "add_norm", spy)
    return calls


@pytest.fixture
def count_fused(monkeypatch):
    return _spy_add_norm(monkeypatch, "norm")


def _pair(d, placement, norm, **kwargs):
    torch.manual_seed(0)
    fused = an.AddNorm(d, placement, norm, fused=True, **kwargs)
    with torch.no_grad():  # non-trivial norm parameters and gates
        for p in fused.parameters():
            p.add_(0.3 * torch.randn_like(p))
    unfused = copy.deepcopy(fused)
    unfused.fused = False
    return fused, unfused


def _compare(fused, unfused, d, train, dtype=torch.float64):
    sub = nn.Sequential(nn.Linear(d, d), nn.GELU()).to(dtype)
    fused.to(dtype), unfused.to(dtype)
    fused.train(train), unfused.train(train)
    x = torch.randn(3, 5, d, dtype=dtype)
    outs, grads = [], []
    for conn in (fused, unfused):
        xi = x.clone().requires_grad_(True)
        sub.zero_grad()
        y = conn(xi, sub)
        y.pow(3).sum().backward()
        outs.append(y.detach())
        grads.append(
            [xi.grad] + [p.grad for p in conn.parameters()] + [p.grad.clone() for p in sub.parameters()]
        )
    torch.testing.assert_close(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "placement, norm, kwargs",
    [
        ("post", "layernorm", {}),
        ("post", "rmsnorm", {}),
        ("pre_post", "layernorm", {}),
        ("deepnorm", "layernorm", {"alpha": 2.5}),
        ("post", "rmsnorm", {"bias": True, "norm_options": {"zero_centered": True}}),
        ("post", "layernorm", {"norm_options": {}, "eps": 1e-3}),
        (POST_LAYERSCALE, "rmsnorm", {}),
        (POST_REZERO, "layernorm", {"gate_init": 0.5}),
    ],
    ids=lambda v: v.name if isinstance(v, Placement) else str(v),
)
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train-dropout0"])
def test_fused_equals_unfused(placement, norm, kwargs, train, count_fused):
    fused, unfused = _pair(8, placement, norm, dropout=0.0, **kwargs)
    _compare(fused, unfused, 8, train)
    assert count_fused == [norm]  # the fused connection, and only it, used the op


def test_fused_without_affine_and_in_eval_with_dropout(count_fused):
    fused, unfused = _pair(8, "post", "layernorm", dropout=0.3)
    fused.output_norm.weight = None
    unfused.output_norm.weight = None
    _compare(fused, unfused, 8, train=False)
    assert len(count_fused) == 1


@pytest.mark.parametrize(
    "placement, norm, kwargs",
    [
        ("pre", "layernorm", {}),  # no output norm
        ("sandwich", "layernorm", {}),  # branch norm
        ("post", "scalenorm", {}),  # not a LayerNorm/RMSNorm
        ("post", "layernorm", {"dropout_at": "after_add"}),
        ("post", "layernorm", {"residual": False}),
        ("admin", "layernorm", {}),  # omega vector
        ("ngpt", "l2", {}),
    ],
)
def test_other_structures_stay_unfused(placement, norm, kwargs, count_fused):
    fused, unfused = _pair(8, placement, norm, **kwargs)
    _compare(fused, unfused, 8, train=False)
    assert count_fused == []


def test_hooks_never_change_the_path(count_fused):
    """A hook on the output norm neither unfuses the connection nor fires (the op computes the norm
    from its parameters): the observation points are what to hook, and they see the same y."""
    fused, _ = _pair(8, "post", "layernorm")
    seen = []
    handles = [
        fused.output_norm.register_forward_hook(lambda m, a, o: seen.append("norm")),
        fused.stream_out.register_forward_hook(lambda m, a, o: seen.append(o)),
    ]
    x = torch.randn(2, 8)
    y = fused(x, nn.Identity())
    assert len(count_fused) == 1 and len(seen) == 1 and seen[0] is y
    for handle in handles:
        handle.remove()
    torch.testing.assert_close(fused(x, nn.Identity()), y)
    assert len(count_fused) == 2


@pytest.mark.parametrize("placement", ["b2t", "resi_dual"])
def test_b2t_and_resi_dual_adds_that_need_their_branch_or_an_extra_input_stay_unfused(placement, count_fused):
    """B2T's last add takes the layer input too, and ResiDual's branch also joins the second stream:
    neither is one add_norm call. B2T's first connection is a plain Post-LN one and fuses."""
    torch.manual_seed(0)
    cfg = an.TransformerConfig(d_model=8, n_heads=2, d_ff=16, n_layers=2, dropout=0.0, placement=placement)
    model = an.Encoder(cfg).double()
    _perturb(model)
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    fused = _outputs_and_grads(model, lambda m: m(x))
    assert count_fused == (["layernorm"] * 2 if placement == "b2t" else [])
    _assert_same(fused, _outputs_and_grads(_unfused_copy(model), lambda m: m(x)))


def test_fused_dropout_trains_and_reproduces():
    fused, unfused = _pair(16, "post", "rmsnorm", dropout=0.5)
    fused.train()
    x = torch.randn(4, 16)
    torch.manual_seed(1)
    a = fused(x, nn.Identity())
    torch.manual_seed(1)
    b = fused(x, nn.Identity())
    torch.testing.assert_close(a, b)
    assert not torch.allclose(a, fused(x, nn.Identity()))
    fused.eval(), unfused.eval()
    torch.testing.assert_close(fused(x, nn.Identity()), unfused(x, nn.Identity()))


@pytest.mark.parametrize("placement", ["post", "deepnorm"])
def test_models_same_with_fused_and_unfused(placement, count_fused):
    torch.manual_seed(0)
    cfg = an.TransformerConfig(
        d_model=32, n_heads=4, d_ff=64, n_layers=2, dropout=0.0, placement=placement, norm="layernorm"
    )
    model = an.LanguageModel(cfg, vocab=50).double()
    ref = copy.deepcopy(model)
    conns = [m for m in ref.modules() if isinstance(m, an.AddNorm)]
    assert conns
    for m in conns:
        m.fused = False
    tokens = torch.randint(0, 50, (2, 7))
    for train in (False, True):
        outs = []
        for mdl in (model, ref):
            mdl.train(train)
            mdl.zero_grad()
            out = mdl(tokens)
            out.float().square().mean().backward()
            outs.append((out.detach(), [p.grad.clone() for p in mdl.parameters()]))
        torch.testing.assert_close(outs[0][0], outs[1][0])
        assert count_fused  # the model's post-norm connections went through the op
        for a, b in zip(outs[0][1], outs[1][1], strict=True):
            torch.testing.assert_close(a, b)


# --- Pre-LN sublayer boundaries: the add of sublayer i fused with the input norm of sublayer i+1 ----


@pytest.fixture
def count_prenorm(monkeypatch):
    return _spy_add_norm(monkeypatch, "prenorm")


def _unfused_copy(model):
    ref = copy.deepcopy(model)
    for m in ref.modules():
        if isinstance(m, an.AddNorm):
            m.fused = False
    return ref


def _perturb(model):
    """Non-trivial norm weights, biases and gates, so that a swapped parameter would show."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))


def _outputs_and_grads(model, call):
    model.zero_grad()
    out = call(model)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


def _assert_same(a, b):
    torch.testing.assert_close(a[0], b[0])
    for ga, gb in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(ga, gb)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("placement", ["pre", "layerscale", "sandwich", "normed_residual"])
def test_pre_ln_stack_fuses_every_add_with_the_next_norm(placement, norm, count_prenorm):
    """A Pre-LN language model of L layers has 2L adds, 2L add_norm calls: 2L - 1 meet the next
    sublayer's input norm (within a layer and across layers) and the last meets the final norm, all
    returning (N(s), s) (the last s for the last connection's stream_out point); outputs and gradients
    equal the unfused modules' in float64."""
    torch.manual_seed(0)
    layers = 3
    cfg = an.TransformerConfig(
        d_model=16, n_heads=2, d_ff=32, n_layers=layers, dropout=0.0, placement=placement, norm=norm
    )
    model = an.LanguageModel(cfg, vocab=40).double()
    _perturb(model)
    ref = _unfused_copy(model)
    tokens = torch.randint(0, 40, (2, 9))
    for train in (False, True):
        model.train(train), ref.train(train)
        count_prenorm.clear()
        fused = _outputs_and_grads(model, lambda m: m(tokens))
        assert count_prenorm == [True] * (2 * layers)
        count_prenorm.clear()
        _assert_same(fused, _outputs_and_grads(ref, lambda m: m(tokens)))
        assert count_prenorm == []


def test_encoder_decoder_and_mixed_stacks_fuse_their_pre_ln_boundaries(count_prenorm):
    torch.manual_seed(1)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="pre")
    model = an.Transformer(cfg, src_vocab=30, tgt_vocab=30).double()
    _perturb(model)
    src, tgt = torch.randint(1, 30, (2, 6)), torch.randint(1, 30, (2, 5))
    fused = _outputs_and_grads(model, lambda m: m(src, tgt))
    # encoder: 2 layers x 2 adds; decoder: 2 layers x 3 adds; each stack's last add meets its final norm
    assert count_prenorm == [True] * 4 + [True] * 6
    _assert_same(fused, _outputs_and_grads(_unfused_copy(model), lambda m: m(src, tgt)))

    # Mix-LN: post layers fuse their own add + norm, pre layers hand theirs on
    count_prenorm.clear()
    mixed = an.Encoder(cfg.replace(placement=["post", "pre", "pre"], n_layers=3)).double()
    _perturb(mixed)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    fused = _outputs_and_grads(mixed, lambda m: m(x))
    assert count_prenorm == [False, False, True, True, True, True]
    _assert_same(fused, _outputs_and_grads(_unfused_copy(mixed), lambda m: m(x)))


def test_fusion_asks_the_op_policy_with_the_stream_device_and_dropout(monkeypatch, count_prenorm):
    """Every fusable add asks ops.policy.fused_op_preferred(device, dropout=..., sharded=..., numel=...,
    model=...) with the stream's device, whether its branch dropout is active in that call, whether the stream
    is a DTensor, its element count and whose steps decide (addnorm's model: "addnorm"); where the policy
    declines, the model runs exactly the unfused modules (the same nn.Dropout masks for the same seed)."""
    asked = []

    def decline(device, *, dropout, sharded, numel, model):
        asked.append((device, dropout, sharded, numel, model))
        return False

    monkeypatch.setattr(policy, "fused_op_preferred", decline)
    torch.manual_seed(5)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.1, placement="pre")
    model = an.LanguageModel(cfg, vocab=40)
    ref = _unfused_copy(model)
    tokens = torch.randint(0, 40, (2, 7))
    for train in (True, False):
        asked.clear()
        outs = []
        for m in (model, ref):
            m.train(train)
            torch.manual_seed(6)
            outs.append(_outputs_and_grads(m, lambda m: m(tokens)))
        assert (
            asked == [(torch.device("cpu"), train, False, 2 * 7 * 16, "addnorm")] * 4
        )  # 2 layers x 2 adds, fused model
        assert torch.equal(outs[0][0], outs[1][0])
        assert all(torch.equal(a, b) for a, b in zip(outs[0][1], outs[1][1], strict=True))
    assert count_prenorm == []


def test_probe_reads_the_fused_streams_as_the_unfused_model_has_them(count_prenorm):
    """Probed, the fused model still fuses every boundary, and Probe's statistics and stream gradient
    norms (a held add's gradient read from the op's residual input) are the unfused model's."""
    torch.manual_seed(2)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=3, dropout=0.0, placement="pre")
    model = an.LanguageModel(cfg, vocab=40).double().eval()
    _perturb(model)
    ref = _unfused_copy(model)
    tokens = torch.randint(0, 40, (2, 9))
    rows = []
    for m in (model, ref):
        with an.Probe(m) as probe:
            _outputs_and_grads(m, lambda m: m(tokens))
            rows.append(probe.snapshot())
    assert count_prenorm == [True] * 6
    assert len(rows[0]) == len(rows[1]) > 0
    assert {r["metric"] for r in rows[0] if r["param"] is None} == {
        "grad_norm",
        "act_mean",
        "act_std",
        "act_rms",
    }
    for a, b in zip(rows[0], rows[1], strict=True):
        assert (a["layer"], a["sublayer"], a["metric"], a["param"]) == (
            b["layer"],
            b["sublayer"],
            b["metric"],
            b["param"],
        )
        assert a["value"] == pytest.approx(b["value"], rel=1e-9, abs=1e-12)


def test_held_add_in_mixed_precision_keeps_the_unfused_dtypes():
    """Branch in bfloat16, stream in float32 (autocast's pattern): s and N(s) are float32 as the unfused
    add and norm give them."""
    torch.manual_seed(3)
    conn = an.AddNorm(24, "pre", "layernorm")
    nxt = an.AddNorm(24, "pre", "layernorm")
    _perturb(nxt)
    x = torch.randn(4, 24)
    branch = torch.nn.Linear(24, 24).to(torch.bfloat16)
    stream = Connection(conn)(Stream(x), lambda h: branch(h.to(torch.bfloat16)))
    assert stream.held is not None  # held back for the next norm
    s, y = stream.read(nxt.input_norm)
    s_ref = stream.tensor()
    assert s.dtype == s_ref.dtype == torch.float32 and y.dtype == torch.float32
    torch.testing.assert_close(s, s_ref)
    torch.testing.assert_close(y, nxt.input_norm(s_ref))


def test_layer_called_alone_returns_a_tensor_in_every_layout():
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="pre")
    layer = an.EncoderLayer(cfg.replace(batch_first=False)).double().eval()
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    expected = layer(x)
    assert isinstance(expected, torch.Tensor)
    torch.testing.assert_close(layer(x[:, 0]), expected[:, 0])  # unbatched
    stream = layer(Stream(x.transpose(0, 1)))  # as a stack calls it: batch-first, and a stream back
    assert isinstance(stream, Stream) and stream.held is not None
    torch.testing.assert_close(stream.tensor().transpose(0, 1), expected)


def _fused_model_matches_unfused(device, placement, norm, dtype, tol):
    """A 4-layer LM at d_model 256 in ``dtype`` on ``device`` (the Triton kernels on CUDA): same
    outputs and gradients as the unfused modules within ``tol``, relative to their scale."""
    torch.manual_seed(0)
    cfg = an.TransformerConfig(
        d_model=256, n_heads=4, d_ff=512, n_layers=4, dropout=0.0, placement=placement, norm=norm
    )
    model = an.LanguageModel(cfg, vocab=64).to(device=device, dtype=dtype)
    _perturb(model)
    tokens = torch.randint(0, 64, (4, 32), device=device)
    fused = _outputs_and_grads(model, lambda m: m(tokens))
    ref = _outputs_and_grads(_unfused_copy(model), lambda m: m(tokens))
    for a, b in zip([fused[0], *fused[1]], [ref[0], *ref[1]], strict=True):
        scale = b.double().abs().max().item() or 1.0
        assert (a.double() - b.double()).abs().max().item() <= tol * scale


@pytest.mark.parametrize("placement, norm", [("pre", "rmsnorm"), ("post", "layernorm")])
def test_fused_model_matches_unfused_at_width_256(placement, norm):
    _fused_model_matches_unfused("cpu", placement, norm, torch.float32, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("placement, norm", [("pre", "rmsnorm"), ("pre", "layernorm"), ("post", "layernorm")])
def test_gpu_fused_model_matches_unfused(placement, norm, dtype, tol):
    _fused_model_matches_unfused("cuda", placement, norm, dtype, tol)


# --- the GPU's path through a whole model, on the CPU --------------------------------------------


def _lm_step(model, tokens):
    logits = model(tokens)
    params = [p for p in model.parameters() if p.requires_grad]
    return logits.detach(), torch.autograd.grad(logits.square().mean(), params)


@pytest.mark.parametrize(
    "placement", ["pre", "sandwich", "post", "deepnorm", "pre_post", "layerscale", "res_post", "mix", "b2t"]
)
def test_a_model_on_the_triton_backend_equals_the_torch_backend(placement, request):
    """What a GPU runs, through the Triton interpreter: a LanguageModel whose every Add & Norm (the
    held-back adds, gates, alpha) takes the Triton kernels gives the torch backend's logits and
    gradients (under torch.compile(fullgraph=True) too: ``test_ops_compiled.py``, the slow tier)."""
    _triton_model_equals_torch(placement, False, request)


@pytest.mark.parametrize("placement", ["pre", "post"])
def test_a_model_with_rows_in_column_slices_on_the_triton_backend_equals_the_torch_backend(
    placement, small_chunks, request
):
    """The same with the backward's rows of 32 columns in slices of 16, in each backward variant."""
    _triton_model_equals_torch(placement, False, request)


def _triton_model_equals_torch(placement, compiled, request):
    from addnorm.ops import functional as fn

    cfg = an.TransformerConfig(d_model=32, n_heads=2, d_ff=64, n_layers=3, placement=placement, dropout=0.0)
    torch.manual_seed(0)
    model = an.LanguageModel(cfg, vocab=40)
    tokens = torch.randint(0, 40, (2, 8))
    want = _lm_step(model, tokens)  # the torch backend (auto on the CPU)
    request.getfixturevalue("triton_backend")
    fn.clear_plans()
    got = _lm_step(model, tokens)
    assert any(plan.triton for plan in fn._PLANS.values()), "no call took the Triton kernels"
    runs = [got]
    if compiled:
        torch._dynamo.reset()
        runs.append(_lm_step(torch.compile(model, fullgraph=True), tokens))
    for logits, grads in runs:
        torch.testing.assert_close(logits, want[0], rtol=1e-4, atol=1e-5)
        for g, w in zip(grads, want[1], strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
