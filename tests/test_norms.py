"""Norms against torch.nn with copied weights and against float64 closed forms."""

import pytest
import torch
from torch import nn

import addnorm as an


def _randomise(*modules):
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                p.uniform_(-2, 2)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("eps", [1e-5, 1e-3])
def test_layernorm_matches_torch(bias, eps):
    ours, ref = an.build_norm("layernorm", 24, eps=eps, bias=bias), nn.LayerNorm(24, eps=eps, bias=bias)
    _randomise(ref)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(4, 5, 24) * 3 + 1
    torch.testing.assert_close(ours(x), ref(x), rtol=1.3e-6, atol=1e-5)
    assert (ours.bias is None) == (not bias)


@pytest.mark.parametrize("eps", [1e-6, 1e-2])
def test_rmsnorm_matches_torch(eps):
    ours, ref = an.build_norm("rmsnorm", 16, eps=eps), nn.RMSNorm(16, eps=eps)
    _randomise(ref)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 7, 16) * 2
    torch.testing.assert_close(ours(x), ref(x), rtol=1.3e-6, atol=1e-5)


def test_layernorm_float64_closed_form():
    x = torch.randn(6, 10, dtype=torch.float64)
    ln = an.LayerNorm(10, eps=1e-5, dtype=torch.float64)
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    torch.testing.assert_close(ln(x), (x - mean) / torch.sqrt(var + 1e-5))


def test_rmsnorm_bias_and_no_affine():
    x = torch.randn(5, 8, dtype=torch.float64)
    rms = torch.sqrt((x**2).mean(-1, keepdim=True) + 1e-5)
    plain = an.RMSNorm(8, affine=False, dtype=torch.float64)
    assert list(plain.parameters()) == []
    torch.testing.assert_close(plain(x), x / rms)
    shifted = an.RMSNorm(8, bias=True, dtype=torch.float64)
    with torch.no_grad():
        shifted.bias.fill_(0.5)
    torch.testing.assert_close(shifted(x), x / rms + 0.5)


def test_batchnorm_pools_batch_and_time_and_matches_batchnorm1d():
    x = torch.randn(4, 6, 8) * 2 + 3
    ours = an.build_norm("batchnorm", 8)
    ref = nn.BatchNorm1d(8)
    _randomise(ref)
    ours.load_state_dict(ref.state_dict(), strict=False)
    ours.weight.data.copy_(ref.weight.data)
    ours.bias.data.copy_(ref.bias.data)
    expected = ref(x.reshape(-1, 8)).reshape(x.shape)
    torch.testing.assert_close(ours(x), expected)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    # statistics couple examples: changing one sequence changes another's output (LayerNorm's does not)
    y = x.clone()
    y[0] += 10
    assert not torch.allclose(ours(y)[1], ours(x)[1])
    ln = an.LayerNorm(8)
    torch.testing.assert_close(ln(y)[1], ln(x)[1])
    ours.eval()
    torch.testing.assert_close(
        ours(x),
        nn.functional.batch_norm(
            x.reshape(-1, 8), ours.running_mean, ours.running_var, ours.weight, ours.bias, False
        ).reshape(x.shape),
    )


def test_none_is_identity():
    x = torch.randn(3, 4)
    assert an.build_norm("none", 4)(x) is x


def test_registry_names_and_errors():
    assert set(an.NORMS) >= {"layernorm", "rmsnorm", "batchnorm", "none"}
    assert isinstance(an.build_norm("LayerNorm", 4), an.LayerNorm)
    assert isinstance(an.build_norm("RMS-Norm", 4), an.RMSNorm)
    with pytest.raises(ValueError, match=r"norm: unknown norm 'lyernorm'; expected one of: layernorm"):
        an.build_norm("lyernorm", 4)
    with pytest.raises(ValueError, match="dim: expected a positive int"):
        an.build_norm("layernorm", 0)
    with pytest.raises(ValueError, match=r"last dimension must be dim=4, got shape \(2, 5\)"):
        an.LayerNorm(4)(torch.randn(2, 5))


def test_every_norm_shares_one_signature():
    for name in an.NORMS:
        m = an.build_norm(name, 6, eps=1e-4, affine=True, bias=False, device="cpu", dtype=torch.float64)
        assert m(torch.randn(2, 3, 6, dtype=torch.float64)).shape == (2, 3, 6)


def test_norm_options_are_checked():
    with pytest.raises(
        ValueError, match="norm_options: 'layernorm' takes no option 'zero_centered'; its options are: none"
    ):
        an.build_norm("layernorm", 4, zero_centered=True)
    with pytest.raises(ValueError, match="its options are: zero_centered"):
        an.TransformerConfig(d_model=8, n_heads=2, norm="rmsnorm", norm_options={"alpha0": 1.0})


@pytest.mark.parametrize("name, source_cls", [("layernorm", nn.LayerNorm), ("rmsnorm", nn.RMSNorm)])
def test_a_reading_norm_computes_with_its_source_s_parameters_as_they_are_at_each_call(name, source_cls):
    """norms.reading: the norm owns no parameter (its state dict is empty), computes what the source
    module computes with the source's weight (and bias) as they are when called, a replaced Parameter
    included (what load_state_dict(assign=True) or FSDP2's unshard do), and is still the norm the fused
    op computes (op_norm); a source with no bias computes without one."""
    from addnorm.connection import op_norm
    from addnorm.norms import reading

    torch.manual_seed(0)
    source = source_cls(8, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        source.weight.uniform_(0.5, 1.5)
        if getattr(source, "bias", None) is not None:
            source.bias.uniform_(-0.5, 0.5)
    norm = reading(an.build_norm(name, 8), source, eps=1e-6)
    assert dict(norm.state_dict()) == {} and not list(norm.parameters())
    assert op_norm(norm) == name and norm.weight is source.weight
    x = torch.randn(3, 8, dtype=torch.float64)
    torch.testing.assert_close(norm(x), source(x), rtol=0, atol=1e-12)
    source.weight = nn.Parameter(torch.full((8,), 2.0, dtype=torch.float64))  # replaced, not edited
    torch.testing.assert_close(norm(x), source(x), rtol=0, atol=1e-12)
    assert norm.weight is source.weight
    with pytest.raises(TypeError, match="norm: expected an addnorm LayerNorm or RMSNorm, got ScaleNorm"):
        reading(an.build_norm("scalenorm", 8), source, eps=1e-6)
