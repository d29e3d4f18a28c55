"""Normalization layers over the last (feature) dimension, all with one constructor signature.

``Norm(dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None)``; ``bias`` adds a learned shift
(LayerNorm's beta). Build them by name through :func:`build_norm` / the ``NORMS`` registry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .registry import Registry

NORMS: Registry[type[nn.Module]] = Registry("norm")


def _check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int) or dim <= 0:
        raise ValueError(f"dim: expected a positive int (the feature size), got {dim!r}")
    return dim


class _FeatureNorm(nn.Module):
    """Shared parameters of the per-feature norms: weight (gamma) and optional bias (beta)."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        self.dim = _check_dim(dim)
        if not eps > 0:
            raise ValueError(f"eps: expected a positive float, got {eps!r}")
        self.eps = float(eps)
        self.affine = bool(affine)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.ones(dim, **kw)) if affine else None
        self.bias = nn.Parameter(torch.zeros(dim, **kw)) if affine and bias else None

    def _check(self, x: Tensor) -> None:
        if not isinstance(x, Tensor):
            raise TypeError(f"{type(self).__name__}: expected a Tensor, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != self.dim:
            raise ValueError(
                f"{type(self).__name__}: input's last dimension must be dim={self.dim}, "
                f"got shape {tuple(x.shape)}"
            )

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.affine}, bias={self.bias is not None}"


@NORMS.register("layernorm", aliases=("ln", "layer_norm"))
class LayerNorm(_FeatureNorm):
    """LayerNorm (Ba et al., 2016): y = gamma * (x - mean) / sqrt(var + eps) + beta.

    Mean and (biased) variance over the last dimension; same function as ``torch.nn.LayerNorm``.
    """

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)


@NORMS.register("rmsnorm", aliases=("rms", "rms_norm"))
class RMSNorm(_FeatureNorm):
    """RMSNorm (Zhang & Sennrich, 2019): y = gamma * x / sqrt(mean(x^2) + eps) (+ beta if bias).

    No centring; with ``bias=False`` it is the function of ``torch.nn.RMSNorm`` for the same eps.
    """

    def __init__(self, dim, eps=1e-5, affine=True, bias=False, device=None, dtype=None):
        super().__init__(dim, eps, affine, bias, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        y = F.rms_norm(x, (self.dim,), self.weight, self.eps)
        return y if self.bias is None else y + self.bias


@NORMS.register("batchnorm", aliases=("bn", "batch_norm"))
class BatchNorm(_FeatureNorm):
    """BatchNorm over batch *and* time (Ioffe & Szegedy, 2015) — an ablation, not a recommendation.

    Each feature is normalised with statistics pooled over every position of every sequence in the
    batch (running averages in eval). It couples examples and positions, which is why transformers
    use LayerNorm instead; it exists here to show that.
    """

    def __init__(self, dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None, momentum=0.1):
        super().__init__(dim, eps, affine, bias, device, dtype)
        self.momentum = momentum
        kw = {"device": device, "dtype": dtype}
        self.register_buffer("running_mean", torch.zeros(dim, **kw))
        self.register_buffer("running_var", torch.ones(dim, **kw))

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        flat = x.reshape(-1, self.dim)  # (batch * time, dim)
        y = F.batch_norm(
            flat,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            training=self.training,
            momentum=self.momentum,
            eps=self.eps,
        )
        return y.reshape(x.shape)


@NORMS.register("none", aliases=("identity",))
class NoNorm(nn.Module):
    """No normalization (the "no norm" ablation): y = x. Takes the common signature and ignores it."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        self.dim = _check_dim(dim)

    def forward(self, x: Tensor) -> Tensor:
        return x


def build_norm(
    name: str = "layernorm",
    dim: int = 512,
    *,
    eps: float = 1e-5,
    affine: bool = True,
    bias: bool | None = None,
    device=None,
    dtype=None,
) -> nn.Module:
    """Build a norm by registry name. ``bias=None`` takes the norm's default (LayerNorm yes, RMSNorm no)."""
    cls = NORMS[name]
    kwargs = {"eps": eps, "affine": affine, "device": device, "dtype": dtype}
    if bias is not None:
        kwargs["bias"] = bias
    return cls(dim, **kwargs)
