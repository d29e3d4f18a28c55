"""TransformerConfig: every dimension and choice of a model, validated, with torch.nn.Transformer defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import MISSING, dataclass, field, replace
from typing import Any

from ..connection import DROPOUT_SITES
from ..norms import NORMS, build_norm
from ..placements import PLACEMENTS, Placement, get_placement
from ..registry import normalise_name
from .feedforward import ACTIVATIONS as _POINTWISE
from .feedforward import GATED_ACTIVATIONS
from .init import INITS

ACTIVATIONS = (*_POINTWISE, *GATED_ACTIVATIONS)
FINAL_NORM_CHOICES = ("auto", True, False)
POSITIONALS = ("sinusoidal", "learned", "none")


def _f(default: Any = MISSING, help: str = "", **kwargs: Any) -> Any:
    """A dataclass field with a one-line ``help`` (listed by ``addnorm study --keys``)."""
    return field(default=default, metadata={"help": help}, **kwargs)


class _Defaulting:
    """A derived setting of a config: its field ``name``, or where that is None the field ``default``
    (attention dropout defaults to dropout, an encoder's layer count to n_layers, ...)."""

    def __init__(self, name: str, default: str) -> None:
        self.name, self.default = name, default

    def __set_name__(self, owner: type, attr: str) -> None:
        self.attr = attr

    def __get__(self, config: Any, owner: type | None = None) -> Any:
        if config is None:
            return self
        value = getattr(config, self.name)
        return getattr(config, self.default) if value is None else value

    def __set__(self, config: Any, value: Any) -> None:  # read-only, as a property
        raise AttributeError(f"property {self.attr!r} of {type(config).__name__!r} object has no setter")


@dataclass
class TransformerConfig:
    """Dimensions and choices of a transformer built from AddNorm connections.

    Defaults follow ``torch.nn.Transformer`` so parameter counts and conversions line up: the base
    model of Vaswani et al. 2017 (``d_model=512, n_heads=8, d_ff=2048, n_layers=6``), dropout 0.1 on
    each branch before the add (attention and activation dropout default to the same rate), ReLU,
    Post-LN (torch's ``norm_first=False``) with LayerNorm and eps 1e-5, biases everywhere. Two
    differences: ``batch_first=True`` (torch's default is False; ``from_torch`` copies the converted
    module's layout) and ``init="torch"`` names torch.nn's own initialisation explicitly (Xavier-uniform
    attention projections, zero attention biases, Kaiming-uniform FFN); ``"xavier"`` puts Xavier-uniform
    on every matrix (``nn.Transformer``), ``"gpt2"`` draws N(0, 0.02) and scales the projections that
    write into the residual stream by 1/sqrt(2 * n_layers) (Radford et al. 2019).

    ``final_norm="auto"`` ends a stack with a norm exactly when its last layer leaves the residual
    stream unnormalised (pre, sandwich, ...). ``placement`` takes a name, a Placement, or one per layer;
    names are stored canonically ("Post-LN" becomes "post"), as are norm, init and activation names.
    Each field's ``help`` metadata is its one-line description.
    """

    d_model: int = _f(512, "width of the residual stream (hidden size)")
    n_heads: int = _f(8, "attention heads; must divide d_model")
    d_ff: int = _f(2048, "hidden width of the feed-forward sublayer")
    n_layers: int = _f(6, "layers per stack")
    dropout: float = _f(0.1, "dropout rate on each sublayer's branch (0 turns dropout off)")
    attention_dropout: float | None = _f(None, "dropout on attention weights (default: dropout)")
    activation_dropout: float | None = _f(None, "dropout inside the FFN (default: dropout)")
    activation: str = _f("relu", f"FFN activation: {', '.join(ACTIVATIONS)}")
    placement: str | Placement | Sequence[str | Placement] = _f(
        "post", "where the norm goes (see `addnorm list`), or a per-layer list of names"
    )
    norm: str = _f("layernorm", "the norm (see `addnorm list`)")
    norm_eps: float = _f(1e-5, "epsilon of every norm")
    bias: bool = _f(True, "bias in every Linear and norm")
    norm_bias: bool | None = _f(None, "bias in the norms alone (default: bias)")
    final_norm: str | bool = _f(
        "auto", "norm after the last layer: auto (when the stream needs it), true, false"
    )
    batch_first: bool = _f(True, "(batch, seq, feature) tensors")
    init: str = _f("torch", f"weight initialisation: {', '.join(INITS)}")
    n_encoder_layers: int | None = _f(None, "encoder layers of an encoder-decoder (default: n_layers)")
    n_decoder_layers: int | None = _f(None, "decoder layers of an encoder-decoder (default: n_layers)")
    max_len: int = _f(4096, "longest sequence the positional encoding covers")
    positional: str = _f("sinusoidal", f"positional encoding: {', '.join(POSITIONALS)}")
    residual: bool = _f(True, "false removes every residual add (the ablation)")
    dropout_at: str = _f("branch", f"where dropout acts: {', '.join(DROPOUT_SITES)}")
    norm_options: dict = _f(help="the norm's own options, e.g. {zero_centered: true}", default_factory=dict)
    qk_norm: bool = _f(False, "normalise queries and keys per head (Dehghani et al. 2023)")
    mix_fraction: float | None = _f(None, "for placement mix: fraction of Post-LN layers (default 0.25)")

    def __post_init__(self) -> None:
        for name in ("d_model", "n_heads", "d_ff", "n_layers", "max_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")
        for name in ("n_encoder_layers", "n_decoder_layers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name}: expected a non-negative int or None, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model: {self.d_model} is not divisible by n_heads={self.n_heads} "
                "(each head gets d_model / n_heads features)"
            )
        for name in ("dropout", "attention_dropout", "activation_dropout"):
            value = getattr(self, name)
            if value is not None:
                value = _number(name, value, "a probability in [0, 1)")
                if not 0.0 <= value < 1.0:
                    raise ValueError(f"{name}: expected a probability in [0, 1), got {value!r}")
                setattr(self, name, value)
        for name in ("bias", "batch_first", "residual", "qk_norm"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name}: expected true or false, got {getattr(self, name)!r}")
        if self.norm_bias is not None and not isinstance(self.norm_bias, bool):
            raise TypeError(f"norm_bias: expected true, false or None, got {self.norm_bias!r}")
        if isinstance(self.activation, str) and normalise_name(self.activation) in ACTIVATIONS:
            self.activation = normalise_name(self.activation)
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.dropout_at not in DROPOUT_SITES:
            raise ValueError(
                f"dropout_at: expected one of {', '.join(DROPOUT_SITES)}, got {self.dropout_at!r}"
            )
        self.norm = NORMS.resolve(self.norm)
        if not isinstance(self.norm_options, dict):
            raise TypeError(f"norm_options: expected a mapping of option -> value, got {self.norm_options!r}")
        build_norm(self.norm, 1, **self.norm_options)  # checks the options name real arguments
        self.norm_eps = _number("norm_eps", self.norm_eps, "a positive float")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps: expected a positive float, got {self.norm_eps!r}")
        if self.final_norm not in FINAL_NORM_CHOICES:
            raise ValueError(f"final_norm: expected one of 'auto', True, False, got {self.final_norm!r}")
        self.init = INITS.resolve(self.init)
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional: expected one of {POSITIONALS}, got {self.positional!r}")
        if self.mix_fraction is not None:
            self.mix_fraction = _number("mix_fraction", self.mix_fraction, "a fraction in [0, 1]")
            if not 0.0 <= self.mix_fraction <= 1.0:
                raise ValueError(f"mix_fraction: expected a fraction in [0, 1], got {self.mix_fraction!r}")
        # Names are canonical from here on ("Post-LN" -> "post"): equal configs compare and hash equal.
        if isinstance(self.placement, (str, Placement)):
            self.placement = _placement_name(self.placement)
        else:
            if isinstance(self.placement, (bytes, dict)) or not isinstance(self.placement, Sequence):
                raise TypeError(f"placement: expected a name or a per-layer list, got {self.placement!r}")
            self.placement = [_placement_name(p) for p in self.placement]
            if not self.placement:
                raise ValueError("placement: a per-layer list must not be empty")

    # --- derived values ----------------------------------------------------------------------------
    # settings that default to another where None (read-only; not fields)
    attn_dropout = _Defaulting("attention_dropout", "dropout")
    act_dropout = _Defaulting("activation_dropout", "dropout")
    encoder_layers = _Defaulting("n_encoder_layers", "n_layers")
    decoder_layers = _Defaulting("n_decoder_layers", "n_layers")

    def norm_kwargs(self) -> dict:
        """Keyword arguments for ``build_norm`` shared by every norm of the model."""
        if self.norm_bias is not None:
            bias = self.norm_bias
        else:
            bias = None if self.bias else False  # None: the norm's own default
        return {"eps": self.norm_eps, "bias": bias}

    def placements_for(self, n_layers: int) -> list[Placement]:
        """One Placement per layer: a single placement repeated, or the per-layer list checked."""
        if isinstance(self.placement, (str, Placement)):
            # Mix-LN and HybridNorm* expand into per-layer placements (``Placement.layer_placements``)
            return get_placement(self.placement).layer_placements(n_layers, self.mix_fraction)
        placements = [get_placement(p) for p in self.placement]
        if len(placements) != n_layers:
            raise ValueError(
                f"placement: a per-layer list needs one entry per layer ({n_layers}), got {len(placements)}"
            )
        return placements

    def replace(self, **changes) -> TransformerConfig:
        return replace(self, **changes)


def _number(name: str, value: Any, expected: str) -> float:
    """``value`` as a float (YAML may hand over ``1e-3`` as a string); a one-line error otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name}: expected {expected}, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected {expected}, got {value!r}") from None


def _placement_name(placement: str | Placement) -> str | Placement:
    """The registry's canonical name for a placement name; a Placement object stays as it is."""
    return placement if isinstance(placement, Placement) else PLACEMENTS.resolve(placement)
