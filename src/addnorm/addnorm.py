"""AddNorm: one residual connection with normalization, in any placement, around any sublayer."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from .norms import NORMS, build_norm
from .placements import Placement, get_placement

DROPOUT_SITES = ("branch", "after_add")
_NORM_ATTRS = ("norm", "norm2", "norm3")


def _check_same_shape(x: Tensor, fx: object, what: str = "sublayer") -> Tensor:
    if not isinstance(fx, Tensor):
        raise TypeError(f"{what}: must return a Tensor, got {type(fx).__name__}")
    if fx.shape != x.shape:
        raise ValueError(
            f"{what}: output shape {tuple(fx.shape)} must equal its input shape {tuple(x.shape)} "
            "(Add & Norm adds x and F(x) element-wise)"
        )
    return fx


class AddNorm(nn.Module):
    """Residual connection + normalization around a sublayer F, in the given placement.

    ``conn(x, sublayer)`` computes, for placement slots N1/N2/N3 (see :mod:`addnorm.placements`)::

        h = N1(x);  f = D(N2(F(h)));  s = alpha * (x or h) + f;  y = N3(s)

    e.g. ``post``: N(x + D(F(x))) (Vaswani et al. 2017), ``pre``: x + D(F(N(x))) (Xiong et al. 2020).

    Args:
        d_model: feature size of x.
        placement: a name from ``addnorm.PLACEMENTS`` or a :class:`Placement`.
        norm: a name from ``addnorm.NORMS``; ``"none"`` is the no-normalization ablation.
        dropout: dropout rate D.
        eps, bias: passed to the norms (``bias=None`` takes the norm's default).
        residual: ``False`` removes the add (the no-residual ablation): s = f.
        dropout_at: ``"branch"`` (on F's output before the add, as the original Transformer) or
            ``"after_add"`` (on the sum).

    ``conn.placement = "post"`` switches placement at run time between placements whose norms have
    the same parameters (same number of norms); otherwise it raises ``ValueError``.
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
        self.d_model = d_model
        self.norm_name = NORMS.resolve(norm)
        self.residual = bool(residual)
        self.dropout_at = dropout_at
        self.dropout = nn.Dropout(dropout)
        self._placement = get_placement(placement)
        for attr in _NORM_ATTRS[: len(self._placement.norm_slots)]:
            self.add_module(attr, build_norm(norm, d_model, eps=eps, bias=bias, device=device, dtype=dtype))

    # --- placement ------------------------------------------------------------------------------
    @property
    def placement(self) -> Placement:
        return self._placement

    @placement.setter
    def placement(self, value: str | Placement) -> None:
        new = get_placement(value)
        if len(new.norm_slots) != len(self._placement.norm_slots):
            raise ValueError(
                f"placement: cannot switch from {self._placement.name!r} "
                f"({len(self._placement.norm_slots)} norm(s)) to {new.name!r} "
                f"({len(new.norm_slots)} norm(s)) at run time: they need different parameters; "
                "build a new AddNorm instead"
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

    # --- forward --------------------------------------------------------------------------------
    def forward(self, x: Tensor, sublayer: Callable[[Tensor], Tensor]) -> Tensor:
        if not isinstance(x, Tensor):
            raise TypeError(f"x: expected a Tensor, got {type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] != self.d_model:
            raise ValueError(f"x: last dimension must be d_model={self.d_model}, got shape {tuple(x.shape)}")
        if not callable(sublayer):
            raise TypeError(f"sublayer: expected a callable tensor -> tensor, got {type(sublayer).__name__}")
        p = self._placement
        n1, n2, n3 = self.input_norm, self.branch_norm, self.output_norm
        h = n1(x) if n1 is not None else x
        f = _check_same_shape(h, sublayer(h))
        if n2 is not None:
            f = n2(f)
        if self.dropout_at == "branch":
            f = self.dropout(f)
        if self.residual:
            base = h if p.residual_from == "normed_input" else x
            s = base + f if p.alpha == 1.0 else p.alpha * base + f
        else:
            s = f
        if self.dropout_at == "after_add":
            s = self.dropout(s)
        return n3(s) if n3 is not None else s

    def extra_repr(self) -> str:
        return (
            f"{self.d_model}, placement={self._placement.name!r}, norm={self.norm_name!r}, "
            f"residual={self.residual}, dropout_at={self.dropout_at!r}"
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

