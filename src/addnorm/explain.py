"""NumPy reference of Add & Norm, in float64: what ``addnorm explain`` works through step by step, for
teaching, and an oracle for the torch code. Not an op: nothing in the model or ``ops`` uses it.

Every function normalises over the last axis, like ``torch.nn.LayerNorm(d)``:

    LayerNorm(z) = gamma * (z - mean(z)) / sqrt(var(z) + eps) + beta     (Ba et al. 2016; biased var)
    RMSNorm(z)   = gamma * z / sqrt(mean(z^2) + eps)                     (Zhang & Sennrich 2019)
    Post-LN:  y = LayerNorm(x + F(x))                                    (Vaswani et al. 2017)
    Pre-LN:   y = x + F(LayerNorm(x))                                    (Xiong et al. 2020)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "AddNormSteps",
    "add_norm_post",
    "add_norm_pre",
    "explain_add_norm",
    "layer_norm",
    "rms_norm",
]


def _as_f64(value: ArrayLike, name: str) -> np.ndarray:
    try:
        arr = np.asarray(value, dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{name}: expected an array of numbers, got {type(value).__name__} ({err})") from None
    if arr.ndim == 0:
        raise ValueError(f"{name}: expected at least one axis (the features), got a scalar {value!r}")
    if arr.shape[-1] == 0:
        raise ValueError(f"{name}: the last axis (features) must not be empty, got shape {arr.shape}")
    return arr


def _check_eps(eps: float) -> float:
    if not (isinstance(eps, (int, float)) and np.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
    return float(eps)


def _affine(y: np.ndarray, gamma: ArrayLike | None, beta: ArrayLike | None) -> np.ndarray:
    d = y.shape[-1]
    for name, value in (("gamma", gamma), ("beta", beta)):
        if value is not None and np.shape(value) not in ((), (d,)):
            raise ValueError(f"{name}: expected a scalar or shape ({d},), got shape {np.shape(value)}")
    if gamma is not None:
        y = y * _as_f64(np.atleast_1d(gamma), "gamma")
    if beta is not None:
        y = y + _as_f64(np.atleast_1d(beta), "beta")
    return y


def layer_norm(
    x: ArrayLike, gamma: ArrayLike | None = None, beta: ArrayLike | None = None, eps: float = 1e-5
) -> np.ndarray:
    """gamma * (x - mean) / sqrt(var + eps) + beta over the last axis; var is biased (divides by d)."""
    x = _as_f64(x, "x")
    eps = _check_eps(eps)
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return _affine((x - mean) / np.sqrt(var + eps), gamma, beta)


def rms_norm(x: ArrayLike, gamma: ArrayLike | None = None, eps: float = 1e-5) -> np.ndarray:
    """gamma * x / sqrt(mean(x^2) + eps) over the last axis (no centring, no bias)."""
    x = _as_f64(x, "x")
    eps = _check_eps(eps)
    return _affine(x / np.sqrt((x**2).mean(axis=-1, keepdims=True) + eps), gamma, None)


def _check_same_shape(x: np.ndarray, fx: np.ndarray, fx_name: str) -> None:
    if x.shape != fx.shape:
        raise ValueError(
            f"{fx_name}: shape {fx.shape} must equal x's shape {x.shape} (Add & Norm adds them element-wise)"
        )


def add_norm_post(
    x: ArrayLike,
    fx: ArrayLike,
    gamma: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    eps: float = 1e-5,
) -> np.ndarray:
    """Post-LN Add & Norm, y = LayerNorm(x + F(x)), given F(x) (Vaswani et al. 2017)."""
    x, fx = _as_f64(x, "x"), _as_f64(fx, "fx")
    _check_same_shape(x, fx, "fx")
    return layer_norm(x + fx, gamma, beta, eps)


def add_norm_pre(
    x: ArrayLike,
    sublayer: Callable[[np.ndarray], ArrayLike],
    gamma: ArrayLike | None = None,
    beta: ArrayLike | None = None,
    eps: float = 1e-5,
) -> np.ndarray:
    """Pre-LN Add & Norm, y = x + F(LayerNorm(x)) (Xiong et al. 2020). F sees the normalised input."""
    if not callable(sublayer):
        raise TypeError(f"sublayer: expected a callable array -> array, got {type(sublayer).__name__}")
    x = _as_f64(x, "x")
    fx = _as_f64(sublayer(layer_norm(x, gamma, beta, eps)), "sublayer output")
    _check_same_shape(x, fx, "sublayer output")
    return x + fx


@dataclass(frozen=True)
class AddNormSteps:
    """The intermediate values of one Post-LN Add & Norm, y = gamma * (z - mean) / std + beta."""

    x: np.ndarray
    fx: np.ndarray
    z: np.ndarray  # x + F(x): the residual add
    mean: np.ndarray  # mean(z) over the last axis
    var: np.ndarray  # biased variance of z
    std: np.ndarray  # sqrt(var + eps)
    normalised: np.ndarray  # (z - mean) / std
    output: np.ndarray  # gamma * normalised + beta
    eps: float

    def to_dict(self) -> dict:
        return asdict(self)


def explain_add_norm(
    x: ArrayLike,
    fx: ArrayLike,
    eps: float = 1e-5,
    gamma: ArrayLike | None = None,
    beta: ArrayLike | None = None,
) -> AddNormSteps:
    """Post-LN Add & Norm step by step: z = x + F(x), mean, var, std = sqrt(var + eps), (z - mean)/std."""
    x, fx = _as_f64(x, "x"), _as_f64(fx, "fx")
    _check_same_shape(x, fx, "fx")
    eps = _check_eps(eps)
    z = x + fx
    mean = z.mean(axis=-1)
    var = ((z - mean[..., None]) ** 2).mean(axis=-1)
    std = np.sqrt(var + eps)
    normalised = (z - mean[..., None]) / std[..., None]
    return AddNormSteps(x, fx, z, mean, var, std, normalised, _affine(normalised, gamma, beta), eps)
