"""Where the norm goes around a residual branch: every placement is data filling the same slots.

x = connection input, F = sublayer, N = norm, D = dropout on the branch. One connection computes

    h = N1(x) if input_norm else x
    f = D(N2(F(h)) if branch_norm else F(h))
    s = alpha * (h if residual_from == "normed_input" else x) + f
    y = N3(s) if output_norm else s

``final_norm`` says whether a stack of such connections leaves the residual stream unnormalised and
so needs one more norm after the last layer (it is ``not output_norm``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .registry import Registry

RESIDUAL_SOURCES = ("input", "normed_input")
GATES = ("none", "rezero", "layerscale")


@dataclass(frozen=True)
class Placement:
    """One residual/normalization placement: its slots, formula and source."""

    name: str
    formula: str
    citation: str
    input_norm: bool = False
    branch_norm: bool = False
    output_norm: bool = False
    residual_from: str = "input"
    alpha: float = 1.0
    gate: str = "none"
    init: str | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.residual_from not in RESIDUAL_SOURCES:
            raise ValueError(f"residual_from: expected one of {RESIDUAL_SOURCES}, got {self.residual_from!r}")
        if self.residual_from == "normed_input" and not self.input_norm:
            raise ValueError("residual_from='normed_input' needs input_norm=True")
        if self.gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {self.gate!r}")

    @property
    def final_norm(self) -> bool:
        """A stack of these layers needs a final norm when the stream leaves a layer unnormalised."""
        return not self.output_norm

    @property
    def norm_slots(self) -> tuple[str, ...]:
        """The norm slots in use, in order: their count is the connection's parameter signature."""
        slots = ("input_norm", "branch_norm", "output_norm")
        return tuple(s for s in slots if getattr(self, s))


PLACEMENTS: Registry[Placement] = Registry("placement")


def register_placement(placement: Placement, aliases: tuple[str, ...] = ()) -> Placement:
    """Add a placement to the registry (for users' own placements too)."""
    return PLACEMENTS.register(placement.name, placement, aliases=aliases)


register_placement(
    Placement(
        "post",
        "y = N(x + D(F(x)))",
        "Vaswani et al. 2017, Attention Is All You Need",
        output_norm=True,
        description="The original Transformer. Every layer's output is normalised, so no final norm; "
        "gradients near the output are large at initialisation and training needs LR warmup.",
    ),
    aliases=("post_ln", "postln", "post_norm"),
)
register_placement(
    Placement(
        "pre",
        "y = x + D(F(N(x)))",
        "Xiong et al. 2020, On Layer Normalization in the Transformer Architecture; "
        "GPT-2 (Radford et al. 2019)",
        input_norm=True,
        description="Norm on the branch input; the residual stream is an identity path, so a stack "
        "needs a final norm. Trains without warmup; the stream grows with depth.",
    ),
    aliases=("pre_ln", "preln", "pre_norm"),
)
register_placement(
    Placement(
        "sandwich",
        "y = x + D(N2(F(N1(x))))",
        "Ding et al. 2021, CogView (Sandwich-LN); Kim et al. 2025, Peri-LN",
        input_norm=True,
        branch_norm=True,
        description="Pre-LN plus a norm on the branch output before the add, which bounds what each "
        "layer adds to the stream.",
    ),
    aliases=("sandwich_ln", "peri_ln", "peri"),
)
register_placement(
    Placement(
        "normed_residual",
        "y = N(x) + D(F(N(x)))",
        "the 'sandwich' exercise of our source text; Megatron-LM's apply_residual_connection_post_layernorm",
        input_norm=True,
        residual_from="normed_input",
        description="The residual is taken after the norm, so the stream is renormalised at every "
        "layer's input but not at its output; a stack needs a final norm.",
    ),
    aliases=("residual_after_norm",),
)


def get_placement(placement: str | Placement) -> Placement:
    """A Placement from a name or a Placement."""
    if isinstance(placement, Placement):
        return placement
    return PLACEMENTS[placement]
