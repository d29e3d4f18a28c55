"""Where the norm goes around a residual branch: every placement is data filling the same slots.

x = connection input, F = sublayer, N = norm, D = dropout on the branch. One connection computes

    h = N1(x) if input_norm else x
    f = D(N2(F(h)) if branch_norm else F(h))
    s = alpha * (h if residual_from == "normed_input" else x) + f
    y = N3(s) if output_norm else s

then ``gate`` scales f (ReZero's scalar, LayerScale's vector), ``layer_gate`` shares one gate
between the connections of a layer (ReZero's ``resweight``), ``omega`` replaces alpha by a
per-feature vector (Admin), ``sublayer_norm`` puts a norm inside each sublayer (Sub-LN),
``attention_norm`` normalises queries/keys(/values) inside attention (``"ngpt"``: unit queries and keys
times s_qk, softmax scale sqrt(d_head)), ``ffn_scale`` scales the FFN hidden units per feature (nGPT's
s_u, s_v), ``stream`` names designs that change the residual stream itself (B2T, ResiDual, nGPT) and
``layers`` names the per-layer placements that a stack expands this one into (Mix-LN, HybridNorm*);
``attention_connection`` gives the attention sublayer its own (placement, norm) (HybridNorm) and
``norm`` forces a norm (nGPT's unit L2 norm). ``init`` names the depth-aware initialisation
(``addnorm.model.init``). ``final_norm`` says whether a stack of such connections leaves the residual
stream unnormalised and so needs one more norm after the last layer (by default ``not output_norm``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from .registry import Registry

RESIDUAL_SOURCES = ("input", "normed_input")
GATES = ("none", "rezero", "layerscale", "ngpt")
STREAMS = ("standard", "b2t", "resi_dual", "ngpt")
ATTENTION_NORMS = (None, "qk", "qkv", "ngpt")


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
    layer_gate: bool = False
    omega: bool = False
    sublayer_norm: bool = False
    attention_norm: str | None = None
    ffn_scale: bool = False
    stream: str = "standard"
    layers: tuple[str | Placement, str | Placement, float | int] | None = None
    attention_connection: tuple[str, str] | None = None
    norm: str | None = None
    init: str | None = None
    needs_final_norm: bool | None = None
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.residual_from not in RESIDUAL_SOURCES:
            raise ValueError(f"residual_from: expected one of {RESIDUAL_SOURCES}, got {self.residual_from!r}")
        if self.residual_from == "normed_input" and not self.input_norm:
            raise ValueError("residual_from='normed_input' needs input_norm=True")
        if self.gate not in GATES:
            raise ValueError(f"gate: expected one of {GATES}, got {self.gate!r}")
        if self.stream not in STREAMS:
            raise ValueError(f"stream: expected one of {STREAMS}, got {self.stream!r}")
        if self.attention_norm not in ATTENTION_NORMS:
            raise ValueError(
                f"attention_norm: expected one of {ATTENTION_NORMS}, got {self.attention_norm!r}"
            )
        if self.layers is not None:
            split = self.layers[2] if len(self.layers) == 3 else None
            if isinstance(split, bool) or not (
                (isinstance(split, int) and split >= 0) or (isinstance(split, float) and 0.0 <= split <= 1.0)
            ):
                raise ValueError(
                    "layers: expected (bottom, top, split), split a fraction in [0, 1] (float) or a layer "
                    f"count (int >= 0), got {self.layers!r}"
                )

    def layer_placements(self, n_layers: int, fraction: float | None = None) -> list[Placement]:
        """The placement of each of ``n_layers`` layers: this one repeated, or, for a placement with
        ``layers=(bottom, top, split)``, ``bottom`` for the first ceil(split * L) layers when split is a
        float fraction (Mix-LN; ``fraction`` overrides it) or for the first ``split`` layers when it is an
        int count (HybridNorm*), ``top`` for the rest."""
        if self.layers is None:
            return [self] * n_layers
        bottom, top, split = self.layers
        if isinstance(split, float):
            split = split if fraction is None else fraction
            n_bottom = min(n_layers, math.ceil(split * n_layers - 1e-9))
        else:
            n_bottom = min(n_layers, split)
        return [get_placement(bottom)] * n_bottom + [get_placement(top)] * (n_layers - n_bottom)

    def layer_kinds(self) -> tuple[Placement, ...]:
        """The placements this one's layers run, whatever the depth: ``(bottom, top)`` of ``layers``
        (Mix-LN: Post-LN then Pre-LN), else this placement alone; the distinct values of
        :meth:`layer_placements` at a depth that has both."""
        if self.layers is None:
            return (self,)
        return (get_placement(self.layers[0]), get_placement(self.layers[1]))

    @property
    def final_norm(self) -> bool:
        """A stack of these layers needs a final norm when the stream leaves a layer unnormalised."""
        return (not self.output_norm) if self.needs_final_norm is None else self.needs_final_norm

    @property
    def parameter_signature(self) -> tuple:
        """What a connection of this placement holds: placements with equal signatures can be switched."""
        return (len(self.norm_slots), self.gate, self.omega)

    @property
    def norm_slots(self) -> tuple[str, ...]:
        """The norm slots in use, in order: their count is the connection's parameter signature."""
        slots = ("input_norm", "branch_norm", "output_norm")
        return tuple(s for s in slots if getattr(self, s))


PLACEMENTS: Registry[Placement] = Registry("placement")


def register_placement(placement: Placement, aliases: tuple[str, ...] = ()) -> Placement:
    """Add a placement to the registry (for users' own placements too).

    Args:
        placement: the placement; its ``name`` is its key.
        aliases: other names that find it.

    Returns:
        ``placement``, as registered.

    Raises:
        ValueError: the name or an alias is taken.
    """
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

register_placement(
    Placement(
        "pre_post",
        "y = N3(x + D(F(N1(x))))",
        "x-transformers' pre_and_post_norm; Xie et al. 2023 (ResiDual) discuss it as Pre+Post-LN",
        input_norm=True,
        output_norm=True,
        description="Norms on both sides: the branch sees a normalised input and the stream is "
        "renormalised after every add, so no final norm.",
    ),
    aliases=("pre_and_post", "prepost"),
)
register_placement(
    Placement(
        "res_post",
        "y = x + D(N(F(x)))",
        "Liu et al. 2022, Swin Transformer V2 (res-post-norm); OLMo 2 (Team OLMo 2024)",
        branch_norm=True,
        description="The norm moves onto the branch output: the stream stays an identity path but "
        "each layer adds a normalised update, which keeps activations from growing with depth.",
    ),
    aliases=("res_post_norm", "swinv2"),
)
register_placement(
    Placement(
        "deepnorm",
        "y = N(alpha * x + D(F(x))), Xavier init with gain beta on FFN, V and output projections",
        "Wang et al. 2022, DeepNet: Scaling Transformers to 1,000 Layers",
        output_norm=True,
        init="deepnorm",
        description="Post-LN with the residual up-weighted by alpha > 1 and the branch weights "
        "down-scaled by beta < 1, both set by depth, which bounds the model update and lets "
        "Post-LN train at hundreds of layers.",
    ),
    aliases=("deepnet",),
)
register_placement(
    Placement(
        "admin",
        "y = N(x * omega + D(F(x))), omega_0 = 1, omega_{i+1}^2 = Var[omega_i x_i] + Var[D(F_i(x_i))] "
        "from a profiling pass",
        "Liu et al. 2020, Understanding the Difficulty of Training Transformers (Admin)",
        output_norm=True,
        omega=True,
        init="admin",
        description="Post-LN whose residual is rescaled per feature by omega, set by one profiling "
        "forward pass in training mode so that no layer's update dominates (addnorm.admin_init).",
    ),
)
register_placement(
    Placement(
        "rezero",
        "y = x + a * D(F(x)), one a per layer, a = 0 at initialisation, no norm",
        "Bachlechner et al. 2020, ReZero is All You Need",
        gate="rezero",
        layer_gate=True,
        needs_final_norm=False,
        description="No normalization at all: one learned scalar per layer, shared by its "
        "connections and zero at init, so every layer starts as the identity.",
    ),
)
register_placement(
    Placement(
        "layerscale",
        "y = x + diag(l) * D(F(N(x))), l = 0.1 / 1e-5 / 1e-6 at init by depth",
        "Touvron et al. 2021, Going deeper with Image Transformers (CaiT)",
        input_norm=True,
        gate="layerscale",
        description="Pre-LN with a learned per-feature scale on the branch, small at init "
        "(0.1 up to 18 layers, 1e-5 up to 24, 1e-6 beyond).",
    ),
    aliases=("layer_scale", "cait"),
)
register_placement(
    Placement(
        "sub_ln",
        "y = x + D(F'(N(x))), F' with a norm inside (before the attention output and FFN W2 "
        "projections), Xavier init with gain sqrt(log 2N)",
        "Wang et al. 2022, Foundation Transformers (Magneto / Sub-LN)",
        input_norm=True,
        sublayer_norm=True,
        init="sub_ln",
        description="Pre-LN plus one more norm inside each sublayer, with a depth-aware init; "
        "theory-derived for stable training across modalities.",
    ),
    aliases=("subln", "magneto"),
)
register_placement(
    Placement(
        "mix",
        "post for the first ceil(f * L) layers, pre for the rest (f = 0.25)",
        "Li et al. 2024, Mix-LN: Unleashing the Power of Deeper Layers by Combining Pre-LN and Post-LN",
        input_norm=True,
        layers=("post", "pre", 0.25),
        description="Post-LN in the shallow layers (healthy gradients there), Pre-LN in the deep ones "
        "(stable training); the fraction is TransformerConfig.mix_fraction.",
    ),
    aliases=("mix_ln",),
)
register_placement(
    Placement(
        "b2t",
        "h = N(x + D(F1(x))); y = N(h + D(F2(h)) + x): the layer input skips to the last norm; "
        "weights scaled by L^(-1/2) at init",
        "Takase et al. 2023, B2T Connection: Serving Stability and Performance in Deep Transformers",
        output_norm=True,
        stream="b2t",
        init="b2t",
        description="Post-LN with a bottom-to-top connection: each layer's input is added before "
        "its last norm, an identity path that bypasses the layer's inner norms; every weight "
        "matrix starts scaled by L^(-1/2).",
    ),
    aliases=("bottom_to_top",),
)
register_placement(
    Placement(
        "resi_dual",
        "xa = N(xa + D(F(xa))); xd = xd + D(F(xa)); output xa + N(xd)",
        "Xie et al. 2023, ResiDual: Transformer with Dual Residual Connections",
        output_norm=True,
        stream="resi_dual",
        needs_final_norm=True,
        description="Two streams: a Post-LN stream and an unnormalised Pre-LN-like sum of every "
        "branch; the stack's final norm applies to the second and the two are added.",
    ),
    aliases=("residual", "resiDual"),
)
HYBRIDNORM = register_placement(
    Placement(
        "hybridnorm",
        "attention: y = x + D(Attn_QKVnorm(x)); FFN: y = N(x) + D(FFN(N(x)))",
        "Zhuo et al. 2025, HybridNorm: Towards Stable and Efficient Transformer Training via Hybrid "
        "Normalization",
        input_norm=True,
        residual_from="normed_input",
        attention_norm="qkv",
        attention_connection=("pre", "none"),
        description="Queries, keys and values are normalised inside attention (no norm on its "
        "residual); the FFN reads a normalised stream and adds to it (the residual taken after the "
        "norm), so a stack ends with a final norm.",
    ),
    aliases=("hybrid_norm",),
)
HYBRIDNORM_STAR_FIRST = Placement(
    "hybridnorm_star_first",
    "y = x + D(F(N(x))), attention with QKV-norm",
    "Zhuo et al. 2025 (HybridNorm*'s first layer)",
    input_norm=True,
    attention_norm="qkv",
    description="Pre-Norm with queries, keys and values normalised inside attention.",
)
register_placement(
    Placement(
        "hybridnorm_star",
        "layer 0: Pre-Norm with QKV-norm; layers 1..L-1: hybridnorm",
        "Zhuo et al. 2025, HybridNorm (HybridNorm*)",
        input_norm=True,
        residual_from="normed_input",
        attention_norm="qkv",
        layers=(HYBRIDNORM_STAR_FIRST, HYBRIDNORM, 1),
        description="HybridNorm whose first layer is Pre-Norm (attention and FFN), keeping the "
        "QKV-norm; the authors' variant for the first block.",
    ),
    aliases=("hybridnorm*", "hybrid_norm_star"),
)
register_placement(
    Placement(
        "ngpt",
        "h = Norm(h + |alpha| * (Norm(F(h)) - h)), Norm = unit L2 norm, alpha init 0.05; unit "
        "q, k times s_qk, softmax scale sqrt(d_head); s_u, s_v on the FFN; s_z on the logits; "
        "weights renormalised after every step (addnorm.ngpt_normalize_)",
        "Loshchilov et al. 2024, nGPT: Normalized Transformer with Representation Learning on the "
        "Hypersphere",
        branch_norm=True,
        output_norm=True,
        gate="ngpt",
        attention_norm="ngpt",
        ffn_scale=True,
        stream="ngpt",
        norm="l2",
        init="ngpt",
        description="Hidden states and the embedding-side vectors of every matrix live on the unit "
        "sphere: each layer moves the state toward the normalised sublayer output by a learned "
        "per-feature step alpha; learned scales replace the norms' gains.",
    ),
    aliases=("normalized_transformer",),
)


def get_placement(placement: str | Placement) -> Placement:
    """A Placement from a name or a Placement.

    Args:
        placement: a registered name or alias (case-insensitive, ``-`` and ``_`` alike: ``"Pre-LN"``),
            or a :class:`Placement`, returned as it is.

    Returns:
        The placement.

    Raises:
        UnknownNameError: no placement has that name (the message lists them).
    """
    if isinstance(placement, Placement):
        return placement
    return PLACEMENTS[placement]
