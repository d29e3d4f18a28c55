"""One placement spec for both worlds: for every placement and a few depths, addnorm's own language model
and a re-placed Hugging Face model build what ``addnorm.placement_spec`` says (per-layer placements, alpha,
gates, their sharing and starting values, norm slots, each weight role's initialisation), checked against
the placements' formulas; and a placement with its own initialisation and lifecycle is two registrations
(``register_placement`` and one ``PLACEMENT_INITS`` entry) that both worlds and the training loop follow."""

from __future__ import annotations

import math

import pytest
import torch
from hf_models import tiny

import addnorm as an
import addnorm.hf as anhf
import addnorm.hf.placement as hf_placement
import addnorm.model.init as model_init
from addnorm import placement_spec
from addnorm.placement_spec import PLACEMENT_INITS, Depth, PlacementInit, WeightInit, layer_spec
from addnorm.placements import PLACEMENTS, Placement
from addnorm.train import RunConfig, train

D, FF, HEADS = 32, 64, 4
DEPTHS = [1, 2, 5]


@pytest.fixture
def drawn(monkeypatch):
    """Each call of the one weight-init applier, in both worlds: (roles of the matrices, init)."""
    calls: list[tuple[frozenset, WeightInit]] = []
    apply = placement_spec.apply_weight_init

    def recorded(weights, init):
        calls.append((frozenset(w.role for w in weights), init))
        return apply(weights, init)

    monkeypatch.setattr(model_init, "apply_weight_init", recorded)
    monkeypatch.setattr(hf_placement, "apply_weight_init", recorded)
    return calls


def _gate_start(block: an.AddNorm) -> float | None:
    """The gate's starting value as the placement's formula reads it (nGPT's alpha: its step size)."""
    if block.gate is None:
        return None
    value = block.gate_value if block.placement.gate == "ngpt" else block.gate
    return float(value.detach().flatten()[0])


def _layers_as_built(blocks_per_layer: list[list[an.AddNorm]]) -> list[dict]:
    built = []
    for blocks in blocks_per_layer:
        gates = [b.gate for b in blocks if b.gate is not None]
        built.append(
            {
                "placements": [b.placement.name for b in blocks],
                "alphas": [b.alpha for b in blocks],
                "gate_starts": [_gate_start(b) for b in blocks],
                "distinct_gates": len({id(g) for g in gates}),
                "norms": [len(b.placement.norm_slots) for b in blocks],
            }
        )
    return built


def _layers_as_specified(placement: str, n: int, kinds: tuple[str, ...]) -> list[dict]:
    """The spec, read independently of either world's building code."""
    depth = Depth("decoder", 0, n)
    out = []
    for p in placement_spec.layer_placements(placement, n):
        spec = layer_spec(p, depth, kinds)
        gated = [c for c in spec.connections if c.placement.gate != "none"]
        out.append(
            {
                "placements": [c.placement.name for c in spec.connections],
                "alphas": [c.placement.alpha if c.alpha is None else c.alpha for c in spec.connections],
                "gate_starts": [
                    None if c.placement.gate == "none" else float(c.gate_init) for c in spec.connections
                ],
                "distinct_gates": min(len(gated), 1) if spec.shared_gate else len(gated),
                "norms": [len(c.norm_slots) for c in spec.connections],
                "init": spec.init,
            }
        )
    return out


@pytest.mark.parametrize("n", DEPTHS)
@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_both_worlds_build_each_layer_from_the_spec(placement, n, drawn):
    specified = _layers_as_specified(placement, n, ("attention", "ffn"))
    torch.manual_seed(0)
    cfg = an.TransformerConfig(d_model=D, n_heads=HEADS, d_ff=FF, n_layers=n, placement=placement)
    ours = an.LanguageModel(cfg, 50)
    ours_built = _layers_as_built([layer.blocks() for layer in ours.layers])
    ours_inits = list(drawn)
    drawn.clear()
    worlds = {"addnorm": (ours_built, ours_inits)}
    if placement in anhf.supported_placements():
        hf = anhf.with_placement(tiny("llama", layers=n, hidden=D, intermediate=FF), placement)
        blocks = [[layer.self_attn_block, layer.mlp_block] for layer in hf.model.layers]
        worlds["hf"] = (_layers_as_built(blocks), list(drawn))
    else:  # refused in one line, naming why
        with pytest.raises(ValueError, match=rf"^placement: '{placement}' .*; supported: ") as err:
            anhf.with_placement(tiny("llama", layers=n), placement)
        assert "\n" not in str(err.value)
    for world, (built, inits) in worlds.items():
        for i, (b, s) in enumerate(zip(built, specified, strict=True)):
            for key, got in b.items():
                assert got == pytest.approx(s[key]), f"{world}, layer {i}: {key}"
        # each weight role of each layer drawn as the spec says (Admin's "profiled": nothing at build)
        want_inits = [s["init"] for s in specified if s["init"] is not None]
        assert [init for _, init in inits] == want_inits, world
        assert all(roles == {"unit", "scaled"} for roles, _ in inits), world


@pytest.mark.parametrize("n", DEPTHS)
def test_rezero_has_one_gate_per_layer_starting_at_zero_in_both_worlds(n):
    """ReZero's formula (Bachlechner et al. 2020): x_{i+1} = x_i + a_i F_i(x_i), one a per layer, a = 0 at
    initialisation: n gates in an n-layer model, each shared by the layer's attention and MLP."""
    worlds = {
        "addnorm": [
            layer.blocks()
            for layer in an.LanguageModel(
                an.TransformerConfig(d_model=D, n_heads=HEADS, d_ff=FF, n_layers=n, placement="rezero"), 50
            ).layers
        ],
        "hf": [
            [layer.self_attn_block, layer.mlp_block]
            for layer in anhf.with_placement(tiny("llama", layers=n), "rezero").model.layers
        ],
    }
    for world, layers in worlds.items():
        gates = {id(b.gate): b.gate for blocks in layers for b in blocks}
        assert len(gates) == n, world
        assert all(blocks[0].gate is blocks[1].gate for blocks in layers), world
        assert all(torch.equal(g, torch.zeros(1)) for g in gates.values()), world


def test_a_shared_gate_trains_as_one_parameter_in_a_re_placed_model():
    """The HF rewiring's ReZero gate is one Parameter per layer: its gradient is the sum of what both
    connections' branches contribute (the formula's dL/da = sum over the layer's sublayers)."""
    model = anhf.with_placement(tiny("llama"), "rezero", fused=False)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn_block.gate.fill_(0.5)
    ids = torch.randint(3, 100, (2, 7), generator=torch.Generator().manual_seed(0))
    model(input_ids=ids, labels=ids).loss.backward()
    names = [n for n, p in model.named_parameters() if n.endswith(".gate")]
    assert len(names) == 2  # one per layer: named_parameters lists a shared Parameter once
    assert all(layer.mlp_block.gate.grad is layer.self_attn_block.gate.grad for layer in model.model.layers)


def test_a_placement_with_its_own_init_and_lifecycle_is_two_registrations(registries_restored, tmp_path):
    """The worked example of docs/placements.md: a placement registered once (file 1:
    ``register_placement``) and its initialisation and lifecycle once (file 2: a ``PLACEMENT_INITS``
    entry) give addnorm's layers and a re-placed HF model the same weight-role init, and the training loop
    runs its hooks (a pass on data before training, one call after every optimiser step) in both."""
    calls: list[str] = []
    an.register_placement(
        Placement(
            "halved",
            "y = x + F(N(x)), values, outputs and FFN at half Xavier",
            "test",
            input_norm=True,
            init="halved",
        )
    )
    PLACEMENT_INITS.register(
        "halved",
        PlacementInit(
            lambda depth: WeightInit("xavier_normal", scaled=0.5),
            prepare=lambda model, *inputs: calls.append(f"prepare {type(model).__name__}"),
            after_step=lambda model: calls.append("step"),
        ),
    )
    n, d, ff = 4, 64, 256
    ours = an.LanguageModel(
        an.TransformerConfig(d_model=d, n_heads=4, d_ff=ff, n_layers=n, placement="halved"), 50
    )
    hf = anhf.with_placement(tiny("llama", layers=n, hidden=d, intermediate=ff), "halved")
    xavier = math.sqrt(2 / (d + ff))
    w2 = torch.cat([layer.ff.w2.weight.flatten() for layer in ours.layers])
    down = torch.cat([layer.mlp.down_proj.weight.flatten() for layer in hf.model.layers])
    assert w2.std().item() == pytest.approx(0.5 * xavier, rel=0.05)
    assert down.std().item() == pytest.approx(0.5 * xavier, rel=0.05)
    size = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, batch_size=4, seq_len=16, eval_every=0, steps=3)
    for model, extra in (("addnorm", {}), ("hf-llama", {"kv_heads": 2})):
        calls.clear()
        result = train(RunConfig(**size, **extra, model=model, placement="halved"))
        assert result.status == "done", result.error
        assert calls == [calls[0], "step", "step", "step"] and calls[0].startswith("prepare")
