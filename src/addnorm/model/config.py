"""TransformerConfig: every dimension and choice of a model, validated, with torch.nn.Transformer defaults."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from ..norms import NORMS, build_norm
from ..placements import Placement, get_placement
from .feedforward import ACTIVATIONS as _POINTWISE
from .feedforward import GATED_ACTIVATIONS
from .init import INITS

ACTIVATIONS = (*_POINTWISE, *GATED_ACTIVATIONS)
FINAL_NORM_CHOICES = ("auto", True, False)
POSITIONALS = ("sinusoidal", "learned", "none")


@dataclass
class TransformerConfig:
    """Dimensions and choices of a transformer built from AddNorm connections.

    Defaults follow ``torch.nn.Transformer`` so parameter counts and conversions line up:

    - ``d_model=512, n_heads=8, d_ff=2048, n_layers=6``: the base model of Vaswani et al. 2017.
    - ``dropout=0.1``: on each sublayer's branch before the add; ``attention_dropout`` (on attention
      weights) and ``activation_dropout`` (inside the FFN) default to the same rate, as in torch.
    - ``activation="relu"`` (also ``"gelu"``, ``"swiglu"``).
    - ``placement="post"`` (torch's ``norm_first=False``); a name, a Placement, or a per-layer list.
    - ``norm="layernorm"``, ``norm_eps=1e-5``.
    - ``bias=True``: bias in every Linear and (for norms that have one) in every norm, as torch's
      ``bias`` argument; ``norm_bias`` overrides it for the norms alone.
    - ``final_norm="auto"``: a stack ends with a norm exactly when its last layer leaves the residual
      stream unnormalised (pre, sandwich, ...); ``True``/``False`` force it.
    - ``batch_first=True``: (batch, seq, feature) tensors. *Differs from torch*, whose default is
      False; ``from_torch`` copies the converted module's layout.
    - ``init="torch"``: torch.nn's own initialisation (Xavier-uniform attention projections, zero
      attention biases, Kaiming-uniform FFN); ``"xavier"`` (Xavier-uniform on every matrix, as
      ``nn.Transformer``); ``"gpt2"`` (N(0, 0.02), residual output projections scaled by
      1/sqrt(2 * n_layers), Radford et al. 2019).
    - ``n_encoder_layers``/``n_decoder_layers`` default to ``n_layers``.
    - ``max_len=4096`` positions, ``positional="sinusoidal"`` (also "learned", "none").
    - ``residual=True``; ``False`` removes every residual add (the ablation).
    - ``dropout_at="branch"`` (also ``"after_add"``).
    - ``norm_options={}``: the norm's own options (``zero_centered`` for RMSNorm, ``alpha0`` for DyT).
    - ``qk_norm=False``: normalise queries and keys per head before the dot product (Dehghani et al.
      2023); placements may ask for it themselves (HybridNorm normalises values too).
    - ``mix_fraction=None``: for ``placement="mix"``, the fraction of layers (from the bottom) that
      use Post-LN; ``None`` takes Mix-LN's 0.25.
    """

    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_layers: int = 6
    dropout: float = 0.1
    attention_dropout: float | None = None
    activation_dropout: float | None = None
    activation: str = "relu"
    placement: str | Placement | Sequence[str | Placement] = "post"
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    bias: bool = True
    norm_bias: bool | None = None
    final_norm: str | bool = "auto"
    batch_first: bool = True
    init: str = "torch"
    n_encoder_layers: int | None = None
    n_decoder_layers: int | None = None
    max_len: int = 4096
    positional: str = "sinusoidal"
    residual: bool = True
    dropout_at: str = "branch"
    norm_options: dict = field(default_factory=dict)
    qk_norm: bool = False
    mix_fraction: float | None = None

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
            if value is not None and not 0.0 <= float(value) < 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1), got {value!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation: expected one of {ACTIVATIONS}, got {self.activation!r}")
        self.norm = NORMS.resolve(self.norm)
        build_norm(self.norm, 1, **self.norm_options)  # checks the options name real arguments
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps: expected a positive float, got {self.norm_eps!r}")
        if self.final_norm not in FINAL_NORM_CHOICES:
            raise ValueError(f"final_norm: expected one of 'auto', True, False, got {self.final_norm!r}")
        self.init = INITS.resolve(self.init)
        if self.positional not in POSITIONALS:
            raise ValueError(f"positional: expected one of {POSITIONALS}, got {self.positional!r}")
        if self.mix_fraction is not None and not 0.0 <= float(self.mix_fraction) <= 1.0:
            raise ValueError(f"mix_fraction: expected a fraction in [0, 1], got {self.mix_fraction!r}")
        if isinstance(self.placement, (str, Placement)):
            get_placement(self.placement)
        else:
            placements = list(self.placement)
            for p in placements:
                get_placement(p)
            if not placements:
                raise ValueError("placement: a per-layer list must not be empty")

    # --- derived values ----------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def attn_dropout(self) -> float:
        return self.dropout if self.attention_dropout is None else self.attention_dropout

    @property
    def act_dropout(self) -> float:
        return self.dropout if self.activation_dropout is None else self.activation_dropout

    @property
    def encoder_layers(self) -> int:
        return self.n_layers if self.n_encoder_layers is None else self.n_encoder_layers

    @property
    def decoder_layers(self) -> int:
        return self.n_layers if self.n_decoder_layers is None else self.n_decoder_layers

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

    def to_dict(self) -> dict:
        d = asdict(self)
        p = self.placement
        if isinstance(p, Placement):
            d["placement"] = p.name
        elif not isinstance(p, str):
            d["placement"] = [x.name if isinstance(x, Placement) else x for x in p]
        return d
