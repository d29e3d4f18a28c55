"""Normalization layers over the last (feature) dimension, all with one constructor signature.

``Norm(dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None)``; ``bias`` adds a learned shift
(LayerNorm's beta). Build them by name through :func:`build_norm` / the ``NORMS`` registry.
"""

from __future__ import annotations

import inspect
import math

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
    ``zero_centered=True`` stores w with gamma = 1 + w, w initialised to 0 (Gemma), so weight decay
    pulls the gain toward 1 rather than 0.
    """

    def __init__(self, dim, eps=1e-5, affine=True, bias=False, device=None, dtype=None, zero_centered=False):
        super().__init__(dim, eps, affine, bias, device, dtype)
        self.zero_centered = bool(zero_centered)
        if self.zero_centered and self.weight is not None:
            nn.init.zeros_(self.weight)

    @property
    def gain(self) -> Tensor | None:
        """gamma: the weight, or 1 + weight when zero-centred."""
        if self.weight is None or not self.zero_centered:
            return self.weight
        return 1.0 + self.weight

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        y = F.rms_norm(x, (self.dim,), self.gain, self.eps)
        return y if self.bias is None else y + self.bias


@NORMS.register("scalenorm", aliases=("scale_norm",))
class ScaleNorm(_FeatureNorm):
    """ScaleNorm (Nguyen & Salazar, 2019): y = g * x / max(||x||_2, eps), one scalar g initialised to
    sqrt(dim). ``affine=False`` fixes g = sqrt(dim); ``bias`` adds a learned shift."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=False, device=None, dtype=None):
        super().__init__(dim, eps, False, False, device, dtype)
        self.affine = bool(affine)
        kw = {"device": device, "dtype": dtype}
        g = torch.full((1,), math.sqrt(dim), **kw)
        self.weight = nn.Parameter(g) if affine else None
        if not affine:
            self.register_buffer("g", g)
        self.bias = nn.Parameter(torch.zeros(dim, **kw)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        g = self.weight if self.weight is not None else self.g
        y = g * x / x.norm(dim=-1, keepdim=True).clamp_min(self.eps)
        return y if self.bias is None else y + self.bias


@NORMS.register("dyt", aliases=("dynamic_tanh", "dynamictanh"))
class DyT(_FeatureNorm):
    """Dynamic Tanh (Zhu et al., 2025, "Transformers without Normalization"):
    y = gamma * tanh(alpha * x) + beta, one learned scalar alpha initialised to ``alpha0`` (0.5).
    Element-wise, no statistics; ``eps`` is accepted for the common signature and unused."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None, alpha0=0.5):
        super().__init__(dim, eps, affine, bias, device, dtype)
        self.alpha0 = float(alpha0)
        self.alpha = nn.Parameter(torch.full((1,), self.alpha0, device=device, dtype=dtype))

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        y = torch.tanh(self.alpha * x)
        if self.weight is not None:
            y = y * self.weight
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


@NORMS.register("l2", aliases=("l2norm", "unit"))
class L2Norm(_FeatureNorm):
    """Projection onto the unit sphere: y = x / max(||x||_2, eps), no parameters (nGPT, Loshchilov et
    al. 2024). Takes the common signature and ignores ``affine``/``bias``."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=False, device=None, dtype=None):
        super().__init__(dim, eps, False, False, device, dtype)

    def forward(self, x: Tensor) -> Tensor:
        self._check(x)
        return F.normalize(x, dim=-1, eps=self.eps)


@NORMS.register("none", aliases=("identity",))
class NoNorm(nn.Module):
    """No normalization (the "no norm" ablation): y = x. Takes the common signature and ignores it."""

    def __init__(self, dim, eps=1e-5, affine=True, bias=True, device=None, dtype=None):
        super().__init__()
        self.dim = _check_dim(dim)

    def forward(self, x: Tensor) -> Tensor:
        return x


class _ReadsSource:
    """A norm whose ``weight`` and ``bias`` are another module's (its source, e.g. a Hugging Face model's
    own norm), read at each access: whatever replaces or moves the source's parameters (loading with
    ``assign=True``, ``to_empty``, FSDP2's unshard, an offload hook) is what the norm computes with,
    and nothing is ever assigned to the norm. Made by :func:`reading`."""

    @property
    def weight(self) -> Tensor | None:
        return _read(self, "weight")

    @property
    def bias(self) -> Tensor | None:
        return _read(self, "bias")


def _read(norm: nn.Module, name: str) -> Tensor | None:
    how = norm.__dict__["_source_reads"].get(name)
    if how is None:  # the source had no such attribute
        return None
    source = norm.__dict__["_source"]
    if how:  # a parameter of the source when it was read first: one dictionary lookup
        found = source._parameters.get(name)
        if found is not None:
            return found
    return getattr(source, name, None)


class ReadingLayerNorm(_ReadsSource, LayerNorm):
    """:class:`LayerNorm` computing with its source's weight and bias (see :func:`reading`)."""


class ReadingRMSNorm(_ReadsSource, RMSNorm):
    """:class:`RMSNorm` computing with its source's weight and bias (see :func:`reading`)."""


READERS = {LayerNorm: ReadingLayerNorm, RMSNorm: ReadingRMSNorm}


def reading(norm: nn.Module, source: nn.Module, eps: float) -> nn.Module:
    """Make ``norm`` (exactly a :class:`LayerNorm` or :class:`RMSNorm`) compute with ``source``'s
    ``weight`` and ``bias`` as they are at each call, and epsilon ``eps``; returns it. Its own parameters
    are dropped, so no state dict or parameter list sees the source's twice, and the source is held as a
    plain reference, not a submodule. A name the source has as a parameter is read from its parameters
    (a dictionary lookup per call), any other attribute by ``getattr``; one the source lacks now (a norm
    without a bias) is None for good."""
    cls = READERS.get(type(norm))
    if cls is None:
        raise TypeError(f"norm: expected an addnorm LayerNorm or RMSNorm, got {type(norm).__name__}")
    for name in ("weight", "bias"):
        if name in norm._parameters:
            delattr(norm, name)
    reads = {}
    for name in ("weight", "bias"):
        if name in source._parameters:
            reads[name] = True
        elif getattr(source, name, None) is not None:
            reads[name] = False
    norm.__dict__.update(_source=source, _source_reads=reads)
    norm.__class__ = cls
    norm.eps = float(eps)
    return norm


def build_norm(
    name: str = "layernorm",
    dim: int = 512,
    *,
    eps: float = 1e-5,
    affine: bool = True,
    bias: bool | None = None,
    device=None,
    dtype=None,
    **options,
) -> nn.Module:
    """Build a norm by registry name.

    Args:
        name: a name of :data:`NORMS` (``layernorm``, ``rmsnorm``, ``scalenorm``, ``dyt``, ...).
        dim: the feature size (the last dimension).
        eps: added inside the square root.
        affine: learn a per-feature gain.
        bias: learn a per-feature shift; ``None`` takes the norm's default (LayerNorm yes, RMSNorm no).
        device: where the parameters are created.
        dtype: the parameters' dtype.
        **options: the norm's own options (``zero_centered`` for RMSNorm, ``alpha0`` for DyT).

    Returns:
        The norm module.

    Raises:
        UnknownNameError: ``name`` is not registered (a ValueError and a KeyError).
        ValueError: an option the norm does not take.
    """
    cls = NORMS[name]
    accepted = set(inspect.signature(cls).parameters) - {"dim", "eps", "affine", "bias", "device", "dtype"}
    unknown = sorted(set(options) - accepted)
    if unknown:
        raise ValueError(
            f"norm_options: {name!r} takes no option {', '.join(map(repr, unknown))}; "
            f"its options are: {', '.join(sorted(accepted)) or 'none'}"
        )
    kwargs = {"eps": eps, "affine": affine, "device": device, "dtype": dtype, **options}
    if bias is not None:
        kwargs["bias"] = bias
    return cls(dim, **kwargs)
