"""The candidate ``addnorm.model.stream.AUTOCAST_SUBLAYER_INPUT``: under autocast a fused add & norm writes
a sublayer's normed input h in autocast's dtype where the sublayer reads h only through one linear
layer (which would cast it to that dtype). The oracle is the model without it (h in the stream's
dtype, cast by the linear layer): the same logits and gradients, bit for bit on the torch backend and
on a GPU's round-to-nearest, while the sublayer is handed h in autocast's dtype."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import addnorm as an
from addnorm.model import stream
from addnorm.model.stream import Connection, Stream, sublayer_dtype
from addnorm.ops import policy

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("scalar_inductor")]  # compilers (torch.compile)

VOCAB = 50
MODELS = {
    "gelu": {"activation": "gelu", "norm": "layernorm", "bias": True, "dropout": 0.1},
    "llama": {"activation": "swiglu", "norm": "rmsnorm", "bias": False, "dropout": 0.0},
}


def _model(kind: str, placement: str = "pre", device: str = "cpu", layers: int = 3) -> an.LanguageModel:
    torch.manual_seed(0)
    cfg = an.TransformerConfig(
        d_model=64, n_heads=4, d_ff=128, n_layers=layers, placement=placement, max_len=16, **MODELS[kind]
    )
    model = an.LanguageModel(cfg, VOCAB).to(device)
    with torch.no_grad():  # non-trivial norm weights and biases
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.2 * torch.randn_like(p))
    return model


def _step(model, cast: bool, device: str = "cpu", autocast: bool = True, compiled: bool = False):
    """Logits, loss, every gradient and the dtypes the attention and FFN of the second layer were handed,
    with the candidate ``cast`` on or off, under autocast to bfloat16 for ``device``."""
    seen = []
    layer = model.stack.layers[1]
    hooks = [
        m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].dtype))
        for m in (layer.self_attn, layer.ff)
    ]
    tokens = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1)).to(device)
    fwd = torch.compile(model, fullgraph=True) if compiled else model
    model.zero_grad()
    previous, stream.AUTOCAST_SUBLAYER_INPUT = stream.AUTOCAST_SUBLAYER_INPUT, cast
    try:
        torch.manual_seed(2)  # the same dropout draws for both
        with policy.fusion("always"), torch.autocast(device, dtype=torch.bfloat16, enabled=autocast):
            logits = fwd(tokens[:, :-1])
            loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))
        loss.backward()
    finally:
        stream.AUTOCAST_SUBLAYER_INPUT = previous
        for h in hooks:
            h.remove()
    return logits.detach(), loss.detach(), [p.grad.clone() for p in model.parameters()], seen


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_autocast_h_hands_the_sublayers_autocast_dtype_and_changes_no_value(kind):
    model = _model(kind)
    new, old = _step(model, True), _step(model, False)
    assert new[3] == [torch.bfloat16] * 2 and old[3] == [torch.float32] * 2
    assert torch.equal(new[0], old[0]) and torch.equal(new[1], old[1])
    for a, b in zip(new[2], old[2], strict=True):
        assert torch.equal(a, b)


def test_autocast_h_leaves_the_unfused_model_and_steps_without_autocast_alone():
    model = _model("llama")
    for m in model.modules():
        if isinstance(m, an.AddNorm):
            m.fused = False
    assert _step(model, True)[3] == [torch.float32] * 2  # the unfused norm: its own dtype
    fused = _model("llama")
    assert _step(fused, True, autocast=False)[3] == [torch.float32] * 2


def test_sublayer_dtype_asks_for_the_declaration_the_placement_and_autocast_on_that_device(monkeypatch):
    conn = an.AddNorm(16, "pre", "layernorm")
    ff = an.model.feedforward.FeedForward(16, 32, "gelu", 0.0, True)
    t = torch.randn(2, 16)
    monkeypatch.setattr(stream, "AUTOCAST_SUBLAYER_INPUT", True)
    assert sublayer_dtype(conn, ff, t) is None  # autocast off
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sublayer_dtype(conn, ff, t) is torch.bfloat16
        assert sublayer_dtype(conn, lambda h: ff(h), t) is None  # no declaration: h as it is
        normed = an.AddNorm(16, "normed_residual", "layernorm")  # h is the residual too
        assert normed.placement.residual_from == "normed_input"
        assert sublayer_dtype(normed, ff, t) is None
    with torch.autocast("cpu", dtype=torch.float16):
        assert sublayer_dtype(conn, ff, t) is torch.float16
    monkeypatch.setattr(stream, "AUTOCAST_SUBLAYER_INPUT", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert sublayer_dtype(conn, ff, t) is None  # the candidate off: the previous way


def test_a_held_add_read_for_an_undeclared_sublayer_keeps_the_stream_dtype(monkeypatch):
    """Connection's own callable sublayers (a lambda, a foreign module) declare nothing: h keeps the
    stream's dtype under autocast, with the candidate on."""
    conn, nxt = an.AddNorm(16, "pre", "layernorm"), an.AddNorm(16, "pre", "layernorm")
    seen = []
    monkeypatch.setattr(stream, "AUTOCAST_SUBLAYER_INPUT", True)
    with policy.fusion("always"), torch.autocast("cpu", dtype=torch.bfloat16):
        x = Connection(conn)(Stream(torch.randn(3, 16)), torch.nn.Linear(16, 16))
        assert x.held is not None
        Connection(nxt)(x, lambda h: seen.append(h.dtype) or h)
    assert seen == [torch.float32]


def test_autocast_h_compiles_without_graph_breaks():
    model = _model("llama", layers=2)
    torch._dynamo.reset()
    new = _step(model, True, compiled=True)
    old = _step(model, False)
    torch.testing.assert_close(new[0], old[0], rtol=2e-2, atol=2e-2)
    for a, b in zip(new[2], old[2], strict=True):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_autocast_h_on_the_triton_backend(kind, triton_backend):
    """The GPU's path through the interpreter, which rounds fp32 to bf16 towards zero where a GPU and
    torch round to nearest: h differs from the linear layer's cast by at most one bf16 step, so the
    values agree to bf16's precision (bit for bit on a GPU: test_gpu_autocast_h_changes_no_value)."""
    from addnorm.ops import functional as fn

    fn.clear_plans()
    model = _model(kind, layers=2)
    new, old = _step(model, True), _step(model, False)
    assert any(plan.triton and plan.y_dtype is torch.bfloat16 for plan in fn._PLANS.values())
    assert new[3] == [torch.bfloat16] * 2
    torch.testing.assert_close(new[1], old[1], rtol=2e-2, atol=2e-2)
    for a, b in zip(new[2], old[2], strict=True):
        scale = b.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= 3e-2 * scale


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_gpu_autocast_h_changes_no_value(kind):
    """On a GPU the op rounds h to bf16 to nearest, as the linear layer's cast does: the same logits and
    loss, and gradients within the op's own launch-to-launch rounding."""
    model = _model(kind, device="cuda")
    new, old = _step(model, True, "cuda"), _step(model, False, "cuda")
    assert new[3] == [torch.bfloat16] * 2 and old[3] == [torch.float32] * 2
    torch.testing.assert_close(new[0], old[0], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(new[1], old[1], rtol=1e-3, atol=1e-3)
    for a, b in zip(new[2], old[2], strict=True):
        scale = b.abs().max().item() or 1.0
        assert (a - b).abs().max().item() <= 1e-2 * scale
