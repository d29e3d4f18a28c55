"""The NumPy reference against closed forms and against the torch modules with copied weights."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import addnorm as an
from addnorm import explain as ref


def test_worked_example_closed_form():
    # x = [1, 2, 3], F(x) = [0.5, -1, 1.5]: z = [1.5, 1.0, 4.5], mean = 7/3,
    # var = ((1.5-7/3)^2 + (1-7/3)^2 + (4.5-7/3)^2) / 3 = (25/36 + 64/36 + 169/36) / 3 = 43/18.
    eps = 1e-5
    z = [1.5, 1.0, 4.5]
    mean = 7 / 3
    var = 43 / 18
    expected = [(zi - mean) / math.sqrt(var + eps) for zi in z]
    steps = ref.explain_add_norm([1, 2, 3], [0.5, -1.0, 1.5], eps=eps)
    np.testing.assert_allclose(steps.z, z)
    np.testing.assert_allclose(steps.mean, mean)
    np.testing.assert_allclose(steps.var, var)
    np.testing.assert_allclose(steps.std, math.sqrt(var + eps))
    np.testing.assert_allclose(steps.normalised, expected, rtol=1e-12)
    np.testing.assert_allclose(steps.output, expected, rtol=1e-12)
    y = ref.add_norm_post([1, 2, 3], [0.5, -1.0, 1.5], gamma=1.0, beta=0.0, eps=eps)
    np.testing.assert_allclose(y, expected, rtol=1e-12)
    np.testing.assert_allclose(y, [-0.54, -0.86, 1.40], atol=5e-3)  # the text's rounded numbers
    assert y.dtype == np.float64
    assert set(steps.to_dict()) >= {"z", "mean", "var", "std", "normalised", "output"}


def test_layer_norm_output_has_zero_mean_unit_variance():
    x = np.random.default_rng(0).normal(3.0, 5.0, size=(4, 7, 16))
    y = ref.layer_norm(x, eps=1e-12)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-9)


@pytest.mark.parametrize("module_kind", ["addnorm", "torch"])
def test_layer_norm_matches_torch(module_kind):
    g = torch.Generator().manual_seed(1)
    d = 12
    x = torch.randn(3, 5, d, generator=g, dtype=torch.float64)
    mod = an.LayerNorm(d, eps=1e-6) if module_kind == "addnorm" else torch.nn.LayerNorm(d, eps=1e-6)
    mod = mod.double()
    with torch.no_grad():
        mod.weight.copy_(torch.randn(d, generator=g))
        mod.bias.copy_(torch.randn(d, generator=g))
        expected = mod(x).numpy()
    got = ref.layer_norm(x.numpy(), mod.weight.detach().numpy(), mod.bias.detach().numpy(), eps=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_rms_norm_matches_torch():
    g = torch.Generator().manual_seed(2)
    d = 10
    x = torch.randn(4, d, generator=g, dtype=torch.float64)
    mod = torch.nn.RMSNorm(d, eps=1e-6).double()
    with torch.no_grad():
        mod.weight.copy_(torch.randn(d, generator=g))
        expected = mod(x).numpy()
    got = ref.rms_norm(x.numpy(), mod.weight.detach().numpy(), eps=1e-6)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def _fixed_linear(d: int, seed: int) -> torch.nn.Linear:
    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(d, d).double()
    with torch.no_grad():
        lin.weight.copy_(torch.randn(d, d, generator=g) / math.sqrt(d))
        lin.bias.copy_(torch.randn(d, generator=g))
    return lin


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_add_norm_matches_addnorm_module(placement):
    d = 8
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 6, d, generator=g, dtype=torch.float64)
    lin = _fixed_linear(d, seed=4)
    conn = an.AddNorm(d, placement=placement, norm="layernorm", dropout=0.0, eps=1e-5).double().eval()
    with torch.no_grad():
        conn.norm.weight.copy_(torch.rand(d, generator=g) + 0.5)
        conn.norm.bias.copy_(torch.randn(d, generator=g))
        expected = conn(x, lin).numpy()
    w, b = lin.weight.detach().numpy(), lin.bias.detach().numpy()
    gamma, beta = conn.norm.weight.detach().numpy(), conn.norm.bias.detach().numpy()

    def f(h: np.ndarray) -> np.ndarray:
        return h @ w.T + b

    xn = x.numpy()
    if placement == "post":
        got = ref.add_norm_post(xn, f(xn), gamma, beta, eps=1e-5)
    else:
        got = ref.add_norm_pre(xn, f, gamma, beta, eps=1e-5)
    np.testing.assert_allclose(got, expected, rtol=1e-10, atol=1e-12)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="fx"):
        ref.add_norm_post([1, 2, 3], [1, 2])
    with pytest.raises(ValueError, match="eps"):
        ref.layer_norm([1.0, 2.0], eps=0)
    with pytest.raises(ValueError, match="gamma"):
        ref.layer_norm([1.0, 2.0], gamma=[1.0, 2.0, 3.0])
    with pytest.raises(TypeError, match="sublayer"):
        ref.add_norm_pre([1.0, 2.0], sublayer=3)
    with pytest.raises(ValueError, match="x"):
        ref.layer_norm(3.0)
