"""AddNorm: one residual connection with normalization, in any placement, around any sublayer."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.nn.modules import module as _torch_module

from .norms import NORMS, READERS, LayerNorm, RMSNorm, build_norm
from .ops import add_norm, policy
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


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is True or False, else a one-line ``TypeError`` naming the argument (an option such
    as ``fused="no"`` or ``residual=0`` would otherwise be read by its truthiness)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected True or False, got {value!r} ({type(value).__name__})")
    return value


_OP_NORMS = {LayerNorm: "layernorm", RMSNorm: "rmsnorm"}
_OP_NORMS |= {reader: _OP_NORMS[cls] for cls, reader in READERS.items()}  # the same, reading another's
_OP_GATES = ("none", "rezero", "layerscale")


def op_norm(norm: nn.Module | None) -> str | None:
    """The ``norm=`` under which :func:`addnorm.ops.add_norm` computes ``norm`` itself: ``"layernorm"`` or
    ``"rmsnorm"`` for exactly addnorm's LayerNorm or RMSNorm, or one reading another module's parameters
    (:func:`addnorm.norms.reading`) (another subclass may compute something else), else None."""
    return _OP_NORMS.get(type(norm))


CONNECTION_KINDS = ("attention", "cross_attention", "ffn", "parallel")


@dataclass(frozen=True)
class ConnectionRole:
    """What a connection is to the layer that holds it, for observers (:class:`addnorm.Probe`, the
    training loop's statistics), who read it by duck typing as ``module.connection_role``; set by whoever
    registers the connection on a layer (addnorm's layers, :mod:`addnorm.hf`, an integration).

    ``sublayer``: the name observers give the connection (the layer attribute holding F, ``"self_attn"``,
    ``"ff"``, ``"mlp"``); ``kind``: one of :data:`CONNECTION_KINDS` (``"parallel"``: a parallel block's
    attention and FFN in one connection); ``weights``: the layer attributes holding F's weight matrices
    (default: ``(sublayer,)``)."""

    sublayer: str
    kind: str
    weights: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.sublayer, str) or not self.sublayer:
            raise ValueError(f"sublayer: expected a non-empty name, got {self.sublayer!r}")
        if self.kind not in CONNECTION_KINDS:
            raise ValueError(f"kind: expected one of {CONNECTION_KINDS}, got {self.kind!r}")
        if not self.weights:
            object.__setattr__(self, "weights", (self.sublayer,))


# torch's module-global hook tables (mutated in place by ``register_module_*_hook``, never rebound)
_GLOBAL_HOOKS = (
    _torch_module._global_backward_pre_hooks,
    _torch_module._global_backward_hooks,
    _torch_module._global_forward_hooks,
    _torch_module._global_forward_pre_hooks,
)


class ObservationPoint(nn.Module):
    """A point of the residual stream that hooks read (:class:`addnorm.Probe`, activation statistics):
    the identity, called on every step whether or not anything is hooked, so observing never changes
    the computation.

    Called as ``point(t)`` on the tensor at that point. Where the stream s leaves a fused op together
    with the next norm (a held-back add, :mod:`addnorm.model.stream`), no tensor carries the whole
    gradient dL/ds: the norm's share stays inside the op. The point is then called as
    ``point(s, grad_from=r, grad_scale=alpha)``: ``r`` is the op's residual input, read by that op only,
    and dL/ds = dL/dr / alpha. Hooks registered ``with_kwargs=True`` see both.

    A call runs ``nn.Module.__call__`` (its hooks) only where a hook could see it (:attr:`observed`:
    the point's own hooks or torch's global module hooks); otherwise it returns ``t`` at once, the
    same result without the module call's host time (a connection calls three points a step).
    """

    def __call__(self, *args, **kwargs):
        return self._wrapped_call_impl(*args, **kwargs) if self.observed else args[0]

    @property
    def observed(self) -> bool:
        """Whether a hook sees this point's calls: its own hooks, or torch's global module hooks."""
        return bool(
            self._forward_hooks
            or self._forward_pre_hooks
            or self._backward_hooks
            or self._backward_pre_hooks
            or any(_GLOBAL_HOOKS)
        )

    def forward(self, x: Tensor, grad_from: Tensor | None = None, grad_scale: float = 1.0) -> Tensor:
        return x


class AddNorm(nn.Module):
    """Residual connection + normalization around a sublayer F, in the given placement.

    ``conn(x, sublayer)`` computes, for placement slots N1/N2/N3 (see :mod:`addnorm.placements`)::

        h = N1(x);  f = g * D(N2(F(h)));  s = alpha * (x or h) + f;  y = N3(s)

    e.g. ``post``: N(x + D(F(x))) (Vaswani et al. 2017), ``pre``: x + D(F(N(x))) (Xiong et al. 2020).
    g is 1, ReZero's scalar (init 0) or LayerScale's vector; Admin replaces alpha by a vector omega;
    nGPT uses s = h + |a| * (f - h) with a per-feature step a (init 0.05).

    Args:
        d_model: feature size of x.
        placement: a name from ``addnorm.PLACEMENTS`` or a :class:`Placement`.
        norm: a name from ``addnorm.NORMS``; ``"none"`` is the no-normalization ablation.
        dropout: dropout rate D.
        eps: the norms' epsilon.
        bias: whether the norms have a learned shift (``None``: the norm's default).
        norm_options: the norm's own options (``zero_centered`` for RMSNorm, ``alpha0`` for DyT).
        residual: ``False`` removes the add (the no-residual ablation): s = f.
        dropout_at: ``"branch"`` (on F's output before the add, as the original Transformer) or
            ``"after_add"`` (on the sum).
        alpha: the residual scale; ``None`` takes the placement's (DeepNorm's depends on depth).
        gate_init: initial gate value (ReZero 0, LayerScale 0.1 by default).
        fused: let the add run inside :func:`addnorm.ops.add_norm` where the fusion rule allows it
            (below); ``False`` keeps the unfused modules.
        device: where the parameters are created.
        dtype: the parameters' dtype.

    Raises:
        ValueError: a ``d_model`` that is not a positive int, a dropout outside [0, 1), an unknown
            ``dropout_at``, placement or norm.

    ``conn.placement = "post"`` switches placement at run time between placements whose parameters
    are the same (same number of norms, same gate); otherwise it raises ``ValueError``.

    Observation points, to hook (never the norms, which the fused op may compute without calling):
    ``conn.stream_in`` (the stream x), ``conn.branch`` (N2(F(h)), before dropout and gate) and
    ``conn.stream_out`` (the connection's output y); see :class:`ObservationPoint`. ``conn.connection_role``
    (a :class:`ConnectionRole`, None until the layer holding it sets one) tells observers which sublayer
    it wraps.

    ``fused=True`` (the default) lets the connection's add run inside :func:`addnorm.ops.add_norm`
    (Triton on CUDA) where :meth:`add_fusion` allows it: with its own output norm (post, pre_post,
    deepnorm, ...) when that is a LayerNorm or RMSNorm, or, for placements without one (pre,
    layerscale, sandwich, ...), with the norm that next reads the stream in a layer or stack
    (:mod:`addnorm.model.stream`). ``fused=False`` keeps the unfused modules, the readable reference.
    ``conn.fusion_model`` (``"addnorm"``; ``"hf"`` in a model :mod:`addnorm.hf` rewired) names whose
    recorded training steps the policy reads for it (:func:`addnorm.ops.fusion_decision`).
    Same function, except that the fused dropout mask comes from a counter-based hash of a seed drawn
    from torch's generator, not from ``nn.Dropout``'s RNG stream: equally distributed, but a different
    mask for the same manual seed.
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
        self.residual = check_bool("residual", residual)
        self.dropout_at = dropout_at
        self.dropout = nn.Dropout(dropout)
        self.alpha = float(p.alpha if alpha is None else alpha)
        self._use(p)
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
        self.stream_in = ObservationPoint()
        self.branch = ObservationPoint()
        self.stream_out = ObservationPoint()
        self.connection_role: ConnectionRole | None = None
        # whose recorded training steps decide where this connection fuses (addnorm.ops.measured.MODELS):
        # addnorm's and a user's models; addnorm.hf sets "hf" on the connections it puts in a HF model
        self.fusion_model = "addnorm"
        self.fused = fused

    @property
    def fused(self) -> bool:
        """Whether the add may run inside the fused op (where :meth:`add_fusion` allows)."""
        return self._fused

    @fused.setter
    def fused(self, value: bool) -> None:
        self._fused = check_bool("fused", value)

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
        self._use(new)

    def _use(self, placement: Placement) -> None:
        """Take ``placement``, and note which norm module fills each of its slots (input, branch, output)."""
        self._placement = placement
        attrs = dict(zip(placement.norm_slots, _NORM_ATTRS, strict=False))
        self._norm_attrs = tuple(attrs.get(slot) for slot in ("input_norm", "branch_norm", "output_norm"))

    def _norm(self, index: int) -> nn.Module | None:
        attr = self._norm_attrs[index]
        return None if attr is None else self._modules[attr]

    @property
    def input_norm(self) -> nn.Module | None:
        return self._norm(0)

    @property
    def branch_norm(self) -> nn.Module | None:
        return self._norm(1)

    @property
    def output_norm(self) -> nn.Module | None:
        return self._norm(2)

    @property
    def gate_value(self) -> Tensor | None:
        """The gate as applied: ReZero's scalar, LayerScale's vector, nGPT's step |alpha| (the stored
        parameter times alpha_init / scale, made non-negative as in the authors' code)."""
        if self.gate is None or self._placement.gate != "ngpt":
            return self.gate
        return (self.gate * (self.gate_init_value / self.gate_scale)).abs()

    # --- forward: tensors in, tensors out ---------------------------------------------------------
    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        """y = N3(alpha * base + g * D(N2(F(N1(x))))), base = x or N1(x) (see the class docstring)."""
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a Tensor, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: last dimension must be d_model={self.d_model}, got shape {tuple(x.shape)}")
        x = self.stream_in(x)
        n1 = self.input_norm
        f, base = self.branch_of(x, n1(x) if n1 is not None else x, sublayer)
        return self.add_and_norm(f, base, fuse=self.add_fusion(f, base) == "now")[0]

    def branch_of(self, x: Tensor, h: Tensor, sublayer: Callable[[Tensor], Tensor]) -> tuple[Tensor, Tensor]:
        """(f, base) for the stream x and its normed input h = N1(x): the branch f = N2(F(h)), through
        the ``branch`` point, and the residual base, x or h (``residual_from``)."""
        if not callable(sublayer):
            raise TypeError(f"sublayer: expected a callable tensor -> tensor, got {type(sublayer).__name__}")
        f = _check_same_shape(h, sublayer(h))
        n2 = self.branch_norm
        if n2 is not None:
            f = n2(f)
        return self.branch(f), (h if self._placement.residual_from == "normed_input" else x)

    def add_fusion(self, f: Tensor, base: Tensor) -> str | None:
        """How this call's add s = alpha * base + g * D(f) runs: the one place fusion is decided.

        ``"now"``: in one :func:`addnorm.ops.add_norm` call with the connection's output norm;
        ``"next"`` (no output norm): held back, to run inside the op with the norm that next reads the
        stream (:mod:`addnorm.model.stream`; where none does, or the op cannot compute it, the add runs
        unfused then); None: the unfused modules. Fused when ``fused`` is on, the op computes this add
        (residual on, dropout on the branch, a scalar alpha, gate none / ReZero / LayerScale, a stream
        dtype it keeps: base's, or float32) and :func:`addnorm.ops.policy.fusion_decision` says so for
        the stream's device, this call's dropout and its size, and :attr:`fusion_model` (on a GPU: a
        recorded step of such a model on that GPU ran faster fused; always on a DTensor stream). Hooks
        play no part.
        """
        if not (
            self._fused
            and self.residual
            and self.dropout_at == "branch"
            and self.omega is None
            and self._placement.gate in _OP_GATES
            and (
                f.dtype is base.dtype
                or torch.promote_types(f.dtype, base.dtype) in (base.dtype, torch.float32)
            )
        ):
            return None
        dropout = self.training and self.dropout.p > 0
        sharded = type(base) is not Tensor and policy.is_dtensor(base)
        if not policy.fused_op_preferred(
            base.device, dropout=dropout, sharded=sharded, numel=base.numel(), model=self.fusion_model
        ):
            return None
        n3 = self.output_norm
        if n3 is None:
            return "next"
        return "now" if op_norm(n3) is not None else None

    def add_and_norm(
        self, f: Tensor, base: Tensor, extra: Tensor | None = None, *, fuse: bool = False
    ) -> tuple[Tensor, Tensor | None]:
        """(y, d): y = N3(alpha * base + g * D(f) + extra) through the ``stream_out`` point, in one fused
        op with ``fuse`` (``add_fusion`` said ``"now"``; no ``extra``), and d the branch as added (for
        ResiDual's second stream; None when fused)."""
        if fuse:
            return self.stream_out(self.add_then_norm(f, base, self.output_norm)), None
        s, d = self.add(f, base, extra)
        n3 = self.output_norm
        return self.stream_out(n3(s) if n3 is not None else s), d

    def add(
        self, f: Tensor, base: Tensor, extra: Tensor | None = None, *, gate: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """(s, d), unfused: d = D(f) (dropout on the branch) or f, s = alpha * base + g * d + extra, then
        D(s) with dropout after the add. Admin's omega replaces alpha; nGPT's s = base + a * (d - base);
        without the residual s = d. ``gate``: g to apply in place of the gate parameter (a held add's
        copy of it, :class:`addnorm.model.stream.HeldAdd`)."""
        d = self.dropout(f) if self.dropout_at == "branch" else f
        s = self._combine(d, base, self.gate if gate is None else gate)
        if extra is not None:
            s = s + extra
        if self.dropout_at == "after_add":
            s = self.dropout(s)
        return s, d

    def _combine(self, d: Tensor, base: Tensor, gate: Tensor | None) -> Tensor:
        if not self.residual:
            return d
        if self._placement.gate == "ngpt":
            return base + self.gate_value * (d - base)
        if gate is not None:
            d = gate * d
        if self.omega is not None:
            base = base * self.omega
        elif self.alpha != 1.0:
            base = self.alpha * base
        return base + d

    def add_then_norm(
        self,
        f: Tensor,
        base: Tensor,
        norm: nn.Module,
        *,
        prenorm: bool = False,
        gate: Tensor | None = None,
        y_dtype: torch.dtype | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """N(alpha * base + g * D(f)) for a LayerNorm/RMSNorm ``norm`` (see :func:`op_norm`) in one
        :func:`addnorm.ops.add_norm` call; with ``prenorm`` also the stream s, as (N(s), s). s and y take
        the dtype that the unfused add would give (base's, or float32 when f promotes it), y ``y_dtype``
        where given (the dtype its reader casts it to: :func:`addnorm.model.stream.sublayer_dtype`).
        ``gate``: as in :meth:`add`."""
        kind = op_norm(norm)
        dtype = torch.promote_types(f.dtype, base.dtype)
        return add_norm(
            f,
            base,
            norm.gain if kind == "rmsnorm" else norm.weight,
            norm.bias,
            norm=kind,
            eps=norm.eps,
            prenorm=prenorm,
            alpha=self.alpha,
            gate=self.gate if gate is None else gate,
            dropout_p=self.dropout.p,
            training=self.training,
            residual_in_fp32=dtype == torch.float32,
            out_dtype=dtype if y_dtype is None else y_dtype,
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
        super().__init__(
            d_model, "pre" if check_bool("pre_norm", pre_norm) else "post", dropout=dropout, **kwargs
        )

    @property
    def pre_norm(self) -> bool:
        return self.placement.name == "pre"

    @pre_norm.setter
    def pre_norm(self, value: bool) -> None:
        self.placement = "pre" if check_bool("pre_norm", value) else "post"
