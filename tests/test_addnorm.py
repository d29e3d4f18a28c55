"""AddNorm in every placement against the formulas written out by hand in float64."""

import pytest
import torch

import addnorm as an


def _ln(z, eps=1e-5):
    mean = z.mean(-1, keepdim=True)
    return (z - mean) / torch.sqrt(((z - mean) ** 2).mean(-1, keepdim=True) + eps)


@pytest.fixture
def sub():
    w = torch.randn(8, 8, dtype=torch.float64) / 3
    return lambda h: torch.tanh(h @ w)


def _conn(placement, **kw):
    conn = an.AddNorm(8, placement, dtype=torch.float64, **kw)
    with torch.no_grad():
        for p in conn.parameters():
            p.uniform_(0.5, 1.5)
    return conn.eval()


def _affine(norm, z):
    return _ln(z) * norm.weight + norm.bias


def test_worked_example_post():
    """x = [1, 2, 3], F(x) = [0.5, -1, 1.5], post, gamma = 1, beta = 0 -> [-0.54, -0.86, 1.40]."""
    conn = an.AddNorm(3, "post", dtype=torch.float64)
    x = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    y = conn(x, lambda h: torch.tensor([0.5, -1.0, 1.5], dtype=torch.float64))
    # closed form: z = [1.5, 1, 4.5], mean 7/3, variance 43/18
    z = torch.tensor([1.5, 1.0, 4.5], dtype=torch.float64)
    torch.testing.assert_close(y, (z - 7 / 3) / (43 / 18 + 1e-5) ** 0.5)
    torch.testing.assert_close(y, torch.tensor([-0.54, -0.86, 1.40], dtype=torch.float64), atol=5e-3, rtol=0)


def test_placements_follow_their_formulas(sub):
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    post = _conn("post")
    torch.testing.assert_close(post(x, sub), _affine(post.norm, x + sub(x)))
    pre = _conn("pre")
    torch.testing.assert_close(pre(x, sub), x + sub(_affine(pre.norm, x)))
    sw = _conn("sandwich")
    torch.testing.assert_close(sw(x, sub), x + _affine(sw.norm2, sub(_affine(sw.norm, x))))
    nr = _conn("normed_residual")
    h = _affine(nr.norm, x)
    torch.testing.assert_close(nr(x, sub), h + sub(h))


@pytest.mark.parametrize("placement", ["post", "pre", "sandwich", "normed_residual"])
def test_ablations(placement, sub):
    x = torch.randn(2, 5, 8, dtype=torch.float64)
    no_norm = _conn(placement, norm="none")
    assert list(no_norm.parameters()) == []
    torch.testing.assert_close(no_norm(x, sub), x + sub(x))
    no_res = _conn(placement, residual=False)
    with_res = _conn(placement)
    with_res.load_state_dict(no_res.state_dict())
    out, out_res = no_res(x, sub), with_res(x, sub)
    if placement == "post":
        torch.testing.assert_close(out, _affine(no_res.norm, sub(x)))
    elif placement == "pre":
        torch.testing.assert_close(out, sub(_affine(no_res.norm, x)))
        torch.testing.assert_close(out_res - out, x)


def test_dropout_on_branch_before_add():
    conn = an.AddNorm(16, "pre", norm="none", dropout=0.5).train()
    x = torch.randn(64, 16, dtype=torch.float64)
    conn.double()
    ones = torch.ones_like(x)
    y = conn(x, lambda h: ones)
    diff = y - x  # dropped branch entries are 0, kept ones are scaled by 1 / (1 - p)
    dropped, kept = diff.abs() < 1e-12, (diff - 2).abs() < 1e-12
    assert (dropped | kept).all()
    assert 0.4 < dropped.double().mean() < 0.6
    conn.eval()
    torch.testing.assert_close(conn(x, lambda h: ones), x + 1)
    after = an.AddNorm(16, "pre", norm="none", dropout=0.5, dropout_at="after_add").train().double()
    y = after(x, lambda h: ones)
    assert ((y == 0) | torch.isclose(y, 2 * (x + 1))).all()


def test_runtime_switching_keeps_parameters(sub):
    conn = an.SublayerConnection(8, dropout=0.0, pre_norm=True, dtype=torch.float64)
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(conn(x, sub), x + sub(_ln(x)))
    weight = conn.norm.weight
    conn.pre_norm = False
    assert conn.placement.name == "post" and conn.norm.weight is weight
    torch.testing.assert_close(conn(x, sub), _ln(x + sub(x)))
    conn.placement = "normed_residual"
    torch.testing.assert_close(conn(x, sub), _ln(x) + sub(_ln(x)))
    with pytest.raises(ValueError, match="cannot switch from 'normed_residual'.*to 'sandwich'"):
        conn.placement = "sandwich"


def test_placement_registry():
    for name in ("post", "pre", "sandwich", "normed_residual"):
        p = an.PLACEMENTS[name]
        assert p.formula.startswith("y = ") and p.citation
    assert an.PLACEMENTS["Pre-LN"] is an.PLACEMENTS["pre"]
    assert not an.PLACEMENTS["post"].final_norm and an.PLACEMENTS["pre"].final_norm
    assert an.PLACEMENTS["sandwich"].final_norm and an.PLACEMENTS["normed_residual"].final_norm


@pytest.mark.parametrize("name", ["pre", "mix", "hybridnorm_star"])
def test_layer_kinds_are_the_placements_a_built_stack_runs(name):
    """A placement's layer kinds: the distinct placements of the layers an encoder of it builds (Mix-LN:
    Post-LN below, Pre-LN above; HybridNorm*: its first layer, then HybridNorm), in order."""
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=4, placement=name)
    built = [p.name for p in an.Encoder(cfg).placements]
    assert [p.name for p in an.PLACEMENTS[name].layer_kinds()] == list(dict.fromkeys(built))


def test_errors_name_the_argument():
    conn = an.AddNorm(4, "post")
    x = torch.randn(2, 4)
    with pytest.raises(
        ValueError, match=r"sublayer: output shape \(2, 3\) must equal its input shape \(2, 4\)"
    ):
        conn(x, lambda h: h[:, :3])
    with pytest.raises(TypeError, match="sublayer: must return a Tensor, got list"):
        conn(x, lambda h: [h])
    with pytest.raises(TypeError, match="sublayer: expected a callable"):
        conn(x, 3)
    with pytest.raises(ValueError, match=r"x: last dimension must be d_model=4"):
        conn(torch.randn(2, 5), lambda h: h)
    with pytest.raises(
        ValueError, match="placement: unknown placement 'postln2'; expected one of: post, pre"
    ):
        an.AddNorm(4, "postln2")
    with pytest.raises(ValueError, match="dropout: expected a probability"):
        an.AddNorm(4, dropout=1.5)
    with pytest.raises(ValueError, match="dropout_at"):
        an.AddNorm(4, dropout_at="somewhere")


@pytest.mark.parametrize("value", ["yes", 1, 0, None, 1.0])
def test_boolean_options_reject_non_booleans(value):
    """A truthy string or a number is not read as a flag: a one-line TypeError names the argument."""
    for make in (
        lambda: an.AddNorm(4, residual=value),
        lambda: an.AddNorm(4, fused=value),
        lambda: an.SublayerConnection(4, pre_norm=value),
    ):
        with pytest.raises(TypeError, match=r"^(residual|fused|pre_norm): expected True or False, got "):
            make()
    conn = an.SublayerConnection(4, pre_norm=False)
    with pytest.raises(TypeError, match="^fused: expected True or False"):
        conn.fused = value
    with pytest.raises(TypeError, match="^pre_norm: expected True or False"):
        conn.pre_norm = value
    assert conn.fused is True and conn.pre_norm is False  # a rejected value changes nothing
    conn.pre_norm, conn.fused = True, False
    assert conn.placement.name == "pre" and conn.fused is False


def test_an_observation_point_runs_its_module_call_only_where_a_hook_could_see_it(monkeypatch):
    """Unobserved, a point's call is the tensor itself without nn.Module's call (no forward runs);
    a hook of its own or one of torch's global module hooks makes it observed, and then the hook sees
    the call and its keywords (what Probe reads)."""
    from torch.nn.modules.module import register_module_forward_hook

    from addnorm.connection import ObservationPoint

    point, x, r = ObservationPoint(), torch.randn(2, 3), torch.randn(2, 3)
    ran = []
    monkeypatch.setattr(ObservationPoint, "forward", lambda self, t, **kw: ran.append(t) or t)
    assert not point.observed and point(x, grad_from=r, grad_scale=2.0) is x and ran == []
    seen = []
    handle = point.register_forward_hook(lambda m, args, kwargs, out: seen.append(kwargs), with_kwargs=True)
    assert point.observed and point(x, grad_from=r, grad_scale=2.0) is x
    assert seen == [{"grad_from": r, "grad_scale": 2.0}] and ran == [x]
    handle.remove()
    global_handle = register_module_forward_hook(lambda m, args, out: seen.append(type(m).__name__))
    try:
        assert point.observed and point(x) is x and seen[-1] == "ObservationPoint"
    finally:
        global_handle.remove()
    assert not point.observed
