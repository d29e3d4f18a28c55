"""AddNorm: one residual connection with normalization, in any placement, around any sublayer."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn.modules import module as nn_module

from .norms import NORMS, LayerNorm, RMSNorm, build_norm
from .ops import add_norm
from .placements import Placement, get_placement

DROPOUT_SITES = ("branch", "after_add")
_NORM_ATTRS = ("norm", "norm2", "norm3")
LAYERSCALE_INIT = 0.1
NGPT_ALPHA_INIT = 0.05


def layerscale_init(n_layers: int) -> float:
    """CaiT's LayerScale initial value by depth (Touvron et al. 2021): 0.1 up to 18 layers, 1e-5 up
    to 24, 1e-6 beyond."""
    return 0.1 if n_layers <= 18 else 1e-5 if n_layers <= 24 else 1e-6


def _check_same_shape(x: Tensor, fx: object, what: str = "sublayer") -> Tensor:
    if not isinstance(fx, Tensor):
        raise TypeError(f"{what}: must return a Tensor, got {type(fx).__name__}")
    if fx.shape != x.shape:
        raise ValueError(
            f"{what}: output shape {tuple(fx.shape)} must equal its input shape {tuple(x.shape)} "
            "(Add & Norm adds x and F(x) element-wise)"
        )
    return fx


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` runs forward hooks (its own or global ones), which must see tensors."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or nn_module._global_forward_hooks
        or nn_module._global_forward_pre_hooks
    )


def fusable_norm(norm: nn.Module | None) -> bool:
    """A norm that :func:`addnorm.ops.add_norm` computes itself: exactly LayerNorm or RMSNorm, unhooked."""
    return type(norm) in (LayerNorm, RMSNorm) and not hooked(norm)


class PendingAdd:
    """A residual add held back until the norm that next reads the stream, so both run as one fused op.

    Stands for the stream s = alpha * residual + g * D(branch), with alpha, gate g and dropout D those of
    ``conn``. In a Pre-LN stack the add closing sublayer i meets the input norm of sublayer i+1 (in the
    same layer or the next) or the stack's final norm: ``add_norm(..., prenorm=True)`` returns
    (N(s), s) in one pass instead of an add kernel and a norm kernel. Stacks pass these between layers;
    :meth:`resolve` gives the tensor s (unfused) wherever a tensor is needed.
    """

    __slots__ = ("residual", "branch", "conn")

    def __init__(self, residual: Tensor, branch: Tensor, conn: AddNorm) -> None:
        self.residual, self.branch, self.conn = residual, branch, conn

    def resolve(self) -> Tensor:
        """The stream s as a tensor (the add alone, unfused)."""
        return self.conn.add(self.branch, self.residual)

    def normalize(self, norm: nn.Module | None, *, return_stream: bool = False):
        """N(s), or (N(s), s) with ``return_stream``: one fused op when ``norm`` is a plain LayerNorm or
        RMSNorm (see :func:`fusable_norm`), else the add then ``norm`` (None: the identity)."""
        if self.conn.fused and fusable_norm(norm):
            return self.conn.add_then_norm(self.branch, self.residual, norm, prenorm=return_stream)
        s = self.resolve()
        y = norm(s) if norm is not None else s
        return (y, s) if return_stream else y


def resolve(x: Tensor | PendingAdd) -> Tensor:
    """The stream as a tensor, doing a held-back add if there is one."""
    return x.resolve() if isinstance(x, PendingAdd) else x


class AddNorm(nn.Module):
    """Residual connection + normalization around a sublayer F, in the given placement.

    ``conn(x, sublayer)`` computes, for placement slots N1/N2/N3 (see :mod:`addnorm.placements`)::

        h = N1(x);  f = g * D(N2(F(h)));  s = alpha * (x or h) + f;  y = N3(s)

    e.g. ``post``: N(x + D(F(x))) (Vaswani et al. 2017), ``pre``: x + D(F(N(x))) (Xiong et al. 2020).
    g is 1, ReZero's scalar (init 0) or LayerScale's vector; Admin replaces alpha by a vector omega;
    nGPT uses s = h + a * (f - h) with a per-feature step a (init 0.05).

    Args:
        d_model: feature size of x.
        placement: a name from ``addnorm.PLACEMENTS`` or a :class:`Placement`.
        norm: a name from ``addnorm.NORMS``; ``"none"`` is the no-normalization ablation.
        dropout: dropout rate D.
        eps, bias, norm_options: passed to the norms (``bias=None`` takes the norm's default).
        residual: ``False`` removes the add (the no-residual ablation): s = f.
        dropout_at: ``"branch"`` (on F's output before the add, as the original Transformer) or
            ``"after_add"`` (on the sum).
        alpha: the residual scale; ``None`` takes the placement's (DeepNorm's depends on depth).
        gate_init: initial gate value (ReZero 0, LayerScale 0.1 by default).

    ``conn.placement = "post"`` switches placement at run time between placements whose parameters
    are the same (same number of norms, same gate); otherwise it raises ``ValueError``.
    ``conn.branch`` is an identity module applied to N2(F(h)): hook it to observe the branch.

    ``fused=True`` (the default) computes "add, then norm" in one call of :func:`addnorm.ops.add_norm`
    (Triton on CUDA) whenever the placement ends with an output norm (post, pre_post, deepnorm, ...)
    that is a LayerNorm or RMSNorm, with the residual on and dropout on the branch; placements without
    one (pre, layerscale, sandwich, ...) can hand their add on as a :class:`PendingAdd`
    (``defer_add=True``, which layers and stacks use) to fuse it with the next input or final norm.
    ``fused=False`` keeps the unfused modules, the readable reference. Same function, except that the
    fused dropout mask comes from a counter-based hash of a seed drawn from torch's generator, not from
    ``nn.Dropout``'s RNG stream: equally distributed, but a different mask for the same manual seed.
    """

    def __init__(
        self,
        d_model: int,
        placement: str | Placement = "pre",
        norm: str = "layernorm",
        dropout: float = 0.0,
        *,
        eps: float = 1e-5,
        bias: bool | None = None,
        residual: bool = True,
        dropout_at: str = "branch",
        alpha: float | None = None,
        gate_init: float | None = None,
        norm_options: dict | None = None,
        fused: bool = True,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        if isinstance(d_model, bool) or not isinstance(d_model, int) or d_model <= 0:
            raise ValueError(f"d_model: expected a positive int, got {d_model!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {dropout!r}")
        if dropout_at not in DROPOUT_SITES:
            raise ValueError(f"dropout_at: expected one of {DROPOUT_SITES}, got {dropout_at!r}")
        p = get_placement(placement)
        self.d_model = d_model
        self.norm_name = NORMS.resolve(p.norm or norm)
        self.residual = bool(residual)
        self.dropout_at = dropout_at
        self.dropout = nn.Dropout(dropout)
        self.alpha = float(p.alpha if alpha is None else alpha)
        self._placement = p
        kw = {"device": device, "dtype": dtype}
        for attr in _NORM_ATTRS[: len(p.norm_slots)]:
            norm_module = build_norm(
                self.norm_name, d_model, eps=eps, bias=bias, **kw, **(norm_options or {})
            )
            self.add_module(attr, norm_module)
        self.gate: nn.Parameter | None = None
        if p.gate == "rezero":
            self.gate = nn.Parameter(torch.full((1,), 0.0 if gate_init is None else gate_init, **kw))
        elif p.gate == "layerscale":
            self.gate = nn.Parameter(
                torch.full((d_model,), LAYERSCALE_INIT if gate_init is None else gate_init, **kw)
            )
        elif p.gate == "ngpt":
            # nGPT's eigen learning rate: stored at scale 1/sqrt(d), used as alpha_init / scale * stored
            self.gate_scale = 1.0 / math.sqrt(d_model)
            self.gate_init_value = NGPT_ALPHA_INIT if gate_init is None else gate_init
            self.gate = nn.Parameter(torch.full((d_model,), self.gate_scale, **kw))
        self.omega = nn.Parameter(torch.ones(d_model, **kw)) if p.omega else None
        self.branch = nn.Identity()
        self.fused = bool(fused)

    # --- placement ------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self._placement

    @placement.setter
    def placement(self, value: str | Placement) -> None:
        new = get_placement(value)
        old = self._placement
        if (
            new.parameter_signature != old.parameter_signature
            or (new.norm or self.norm_name) != self.norm_name
        ):
            raise ValueError(
                f"placement: cannot switch from {old.name!r} ({len(old.norm_slots)} norm(s), gate "
                f"{old.gate!r}) to {new.name!r} ({len(new.norm_slots)} norm(s), gate {new.gate!r}) at run "
                "time: they need different parameters; build a new AddNorm instead"
            )
        self._placement = new

    def _slot(self, slot: str) -> nn.Module | None:
        slots = self._placement.norm_slots
        return getattr(self, _NORM_ATTRS[slots.index(slot)]) if slot in slots else None

    @property
    def input_norm(self) -> nn.Module | None:
        return self._slot("input_norm")

    @property
    def branch_norm(self) -> nn.Module | None:
        return self._slot("branch_norm")

    @property
    def output_norm(self) -> nn.Module | None:
        return self._slot("output_norm")

    @property
    def gate_value(self) -> Tensor | None:
        """The gate as applied: ReZero's scalar, LayerScale's vector, nGPT's step alpha."""
        if self.gate is None or self._placement.gate != "ngpt":
            return self.gate
        return self.gate * (self.gate_init_value / self.gate_scale)

    # --- forward --------------------------------------------------------------------------------
    def forward(
        self,
        x: Tensor | PendingAdd,
        sublayer: Callable[[Tensor], Tensor],
        *,
        extra_residual: Tensor | None = None,
        return_branch: bool = False,
        defer_add: bool = False,
    ) -> Tensor | tuple[Tensor, Tensor] | PendingAdd:
        """y for input x; ``extra_residual`` is added to the sum (B2T's bottom-to-top input);
        ``return_branch=True`` also returns the branch f as added (ResiDual's second stream).

        ``defer_add=True`` lets a connection without output norm (Pre-LN and kin) return a
        :class:`PendingAdd` instead of doing its add, so that the add fuses with the next norm; ``x``
        may be such a :class:`PendingAdd` (its add then fuses with this connection's input norm)."""
        n1, n2, n3 = self.input_norm, self.branch_norm, self.output_norm
        if isinstance(x, PendingAdd):
            h, x = x.normalize(n1, return_stream=True) if n1 is not None else (x.resolve(),) * 2
        else:
            if not isinstance(x, Tensor):
                raise TypeError(f"x: expected a Tensor, got {type(x).__name__}")
            if x.ndim == 0 or x.shape[-1] != self.d_model:
                raise ValueError(
                    f"x: last dimension must be d_model={self.d_model}, got shape {tuple(x.shape)}"
                )
            h = n1(x) if n1 is not None else x
        if not callable(sublayer):
            raise TypeError(f"sublayer: expected a callable tensor -> tensor, got {type(sublayer).__name__}")
        f = _check_same_shape(h, sublayer(h))
        if n2 is not None:
            f = n2(f)
        f = self.branch(f)
        base = h if self._placement.residual_from == "normed_input" else x
        if extra_residual is None and not return_branch and self._add_fusable(f, base):
            if n3 is None and defer_add and not hooked(self):
                return PendingAdd(base, f, self)
            if fusable_norm(n3):
                return self.add_then_norm(f, base, n3)  # y = N3(alpha * base + g * D(f)), one op
        if self.dropout_at == "branch":
            f = self.dropout(f)
        s = self._combine(f, base)
        if extra_residual is not None:
            s = s + extra_residual
        if self.dropout_at == "after_add":
            s = self.dropout(s)
        y = n3(s) if n3 is not None else s
        return (y, f) if return_branch else y

    def _combine(self, f: Tensor, base: Tensor) -> Tensor:
        """s from the branch f (after dropout) and the residual base: alpha * base + g * f (omega for
        Admin, nGPT's base + a * (f - base)); f alone without the residual."""
        if not self.residual:
            return f
        if self._placement.gate == "ngpt":
            return base + self.gate_value * (f - base)
        if self.gate is not None:
            f = self.gate * f
        if self.omega is not None:
            base = base * self.omega
        elif self.alpha != 1.0:
            base = self.alpha * base
        return base + f

    def add(self, f: Tensor, base: Tensor) -> Tensor:
        """The connection's add alone, unfused: s = alpha * base + g * D(f) (dropout on the branch)."""
        return self._combine(self.dropout(f) if self.dropout_at == "branch" else f, base)

    def add_then_norm(
        self, f: Tensor, base: Tensor, norm: nn.Module, *, prenorm: bool = False
    ) -> Tensor | tuple[Tensor, Tensor]:
        """N(alpha * base + g * D(f)) for a LayerNorm/RMSNorm ``norm`` in one :func:`addnorm.ops.add_norm`
        call; with ``prenorm`` also the stream s, as (N(s), s). s and y take the dtype that the unfused
        add would give (base's, or float32 when f promotes it)."""
        rms = isinstance(norm, RMSNorm)
        dtype = torch.promote_types(f.dtype, base.dtype)
        return add_norm(
            f,
            base,
            norm.gain if rms else norm.weight,
            norm.bias,
            norm="rmsnorm" if rms else "layernorm",
            eps=norm.eps,
            prenorm=prenorm,
            alpha=self.alpha,
            gate=self.gate,
            dropout_p=self.dropout.p,
            training=self.training,
            residual_in_fp32=dtype == torch.float32,
            out_dtype=dtype,
        )

    def _add_fusable(self, f: Tensor, base: Tensor) -> bool:
        """Whether the add can be the first half of :func:`addnorm.ops.add_norm`: fused on, the residual
        on, dropout on the branch, a scalar alpha, a ReZero / LayerScale gate or none, and a stream
        dtype the op can keep (base's, or float32)."""
        return (
            self.fused
            and self.residual
            and self.dropout_at == "branch"
            and self._placement.gate in ("none", "rezero", "layerscale")
            and self.omega is None
            and torch.promote_types(f.dtype, base.dtype) in (base.dtype, torch.float32)
        )

    def extra_repr(self) -> str:
        extra = f", alpha={self.alpha:g}" if self.alpha != 1.0 else ""
        return (
            f"{self.d_model}, placement={self._placement.name!r}, norm={self.norm_name!r}, "
            f"residual={self.residual}, dropout_at={self.dropout_at!r}{extra}"
        )


class SublayerConnection(AddNorm):
    """The tutorial's name: ``SublayerConnection(d_model, dropout=0.1, pre_norm=True)``.

    ``pre_norm=True`` is x + D(F(LN(x))) (Pre-LN); ``False`` is LN(x + D(F(x))) (Post-LN). Both use one
    LayerNorm, so ``conn.pre_norm`` can be flipped at run time.
    """

    def __init__(self, d_model: int, dropout: float = 0.1, pre_norm: bool = True, **kwargs) -> None:
        super().__init__(d_model, "pre" if pre_norm else "post", dropout=dropout, **kwargs)

    @property
    def pre_norm(self) -> bool:
        return self.placement.name == "pre"

    @pre_norm.setter
    def pre_norm(self, value: bool) -> None:
        self.placement = "pre" if value else "post"
