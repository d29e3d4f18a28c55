"""Which addnorm placements a torchtitan block can take, and what each layer of a converted model is.

A converted block keeps torchtitan's attention and FFN modules and re-places only the norms, gates and
adds around them, so a placement fits when it changes nothing inside a sublayer and nothing of the
stream between layers but B2T's layer input. The per-layer rules (Mix-LN's split, DeepNet's alpha and
init, the gates' starting values) come from :mod:`addnorm.placement_spec`, the spec addnorm's own
layers and :mod:`addnorm.hf` read too. No torchtitan here.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..placement_spec import (
    ConnectionSpec,
    Depth,
    WeightInit,
    connection_spec,
    layer_placements,
    weight_init,
    why_not_around_sublayers,
)
from ..placements import PLACEMENTS, Placement, get_placement

__all__ = ["LayerPlan", "check_placement", "plan_layers", "supported_placements", "why_unsupported"]


def why_unsupported(p: Placement) -> str | None:
    """Why a torchtitan block cannot take ``p`` (a phrase), or None: the rule of every model whose own
    sublayers stay (:func:`~addnorm.placement_spec.why_not_around_sublayers`), and Admin's omegas, which
    need a profiling pass on data that torchtitan's ``init_weights`` cannot run."""
    why = why_not_around_sublayers(p, "the attention and FFN modules", "; torchtitan's blocks use RMSNorm")
    if why is None and any(q.omega for q in (p, *p.layer_kinds())):
        return "needs a profiling pass on data for its omegas, which torchtitan's init_weights cannot run"
    return why


def supported_placements() -> list[str]:
    """The placements a converted torchtitan model can take."""
    return [name for name, p in PLACEMENTS.items() if why_unsupported(p) is None]


def check_placement(placement: str | Placement) -> Placement:
    """``placement`` as a :class:`~addnorm.Placement`, or a one-line ``ValueError`` naming the supported
    ones (an unknown name: the registry's one-line error)."""
    p = get_placement(placement)
    why = why_unsupported(p)
    if why is not None:
        raise ValueError(
            f"placement: {p.name!r} {why}, which addnorm.titan cannot do around torchtitan's blocks; "
            f"supported: {', '.join(supported_placements())}"
        )
    return p


@dataclass(frozen=True)
class LayerPlan:
    """One layer of a converted model: its ``placement``, its two connections (attention, FFN: alpha,
    gate start, norm slots), how its matrices are initialised (``init``; None: torchtitan's own) and
    whether one gate serves both connections (ReZero's per-layer ``resweight``)."""

    placement: Placement
    connections: tuple[ConnectionSpec, ConnectionSpec]
    init: WeightInit | None
    shared_gate: bool


def plan_layers(
    placement: str | Placement, n_layers: int, mix_fraction: float | None = None
) -> list[LayerPlan]:
    """Each of ``n_layers`` decoder layers under ``placement`` (checked by :func:`check_placement`)."""
    p = check_placement(placement)
    depth = Depth("decoder", 0, n_layers)
    plans = []
    for q in layer_placements(p, n_layers, mix_fraction):
        specs = (connection_spec(q, depth, attention=True), connection_spec(q, depth))
        plans.append(LayerPlan(q, specs, weight_init(q, depth), q.layer_gate and q.gate != "none"))
    return plans
