"""``addnorm.titan`` in one process: torchtitan's debug-size Llama 3 and Qwen 3 converted by
``AddNormConverter``.

Oracles: the untouched torchtitan model built from the same config and seed (a fused model is it:
same state dict, same logits and gradients, 2L fused calls); each placement's formula written out here
with the model's own attention and FFN modules and a float32 RMSNorm (a re-placed model's first
forward); Xavier's formula and the placement spec's constants (the initialisation through torchtitan's
``init_weights``); the job configs through torchtitan's own ``ConfigManager``; the example of
``docs/torchtitan.md`` run as written. The distributed cases are in ``test_titan_parallel.py``.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VOCAB = 2048
TOL = 1e-5


@pytest.fixture(scope="module")
def titan():
    pytest.importorskip("torchtitan", reason="needs the torchtitan extra")
    import addnorm.titan

    return addnorm.titan


def registry(family: str):
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    return {"llama3": llama3, "qwen3": qwen3}[family]


def config(family: str = "llama3", flavor: str = "debugmodel"):
    from addnorm.titan import on_cpu

    return on_cpu(registry(family)(flavor).model)


def build(model_config, seed: int = 0):
    """As torchtitan's trainer builds a model: on the meta device, then ``to_empty`` and ``init_weights``."""
    with torch.device("meta"):
        model = model_config.build()
    model.verify_module_protocol()
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return model


def tokens(batch: int = 2, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(3))


# --- without the extra ----------------------------------------------------------------------------------


def test_without_torchtitan_the_package_imports_and_its_tools_are_one_line_errors(monkeypatch):
    from addnorm.extras import MissingExtra

    monkeypatch.setitem(sys.modules, "torchtitan", None)  # as if not installed
    for name in [m for m in sys.modules if m.startswith("addnorm.titan.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.delitem(sys.modules, "addnorm.titan", raising=False)
    import addnorm.titan as titan

    assert "sandwich" in titan.supported_placements()
    for name in ("AddNormConverter", "convert", "with_addnorm", "on_cpu"):
        with pytest.raises(MissingExtra) as e:
            getattr(titan, name)
        assert str(e.value) == "addnorm.titan needs the 'torchtitan' extra: pip install 'addnorm[torchtitan]'"


# --- fused: the untouched model's function, parameters and state dict --------------------------------


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_fused_model_is_the_untouched_model(titan, family):
    untouched = build(config(family))
    converted_config = titan.convert(config(family))
    fused = build(converted_config)
    n_layers = len(converted_config.layers)
    a, b = untouched.state_dict(), fused.state_dict()
    assert list(a) == list(b)  # same keys in the same order, initialised alike by torchtitan
    assert all(torch.equal(a[k], b[k]) for k in a)

    import addnorm.connection as connection_module

    calls, op = [], connection_module.add_norm

    def counted(*args, **kwargs):
        calls.append(kwargs["prenorm"])
        return op(*args, **kwargs)

    x = tokens()
    y = untouched(x)
    connection_module.add_norm = counted
    try:
        y_fused = fused(x)
    finally:
        connection_module.add_norm = op
    assert calls == [True] * (2 * n_layers)  # each add meets the next norm, the last the final norm
    assert (y_fused - y).abs().max().item() <= TOL
    y.square().mean().backward()
    y_fused.square().mean().backward()
    grads = dict(untouched.named_parameters())
    for name, p in fused.named_parameters():
        assert (p.grad - grads[name].grad).abs().max().item() <= TOL, name


def test_the_converter_runs_through_torchtitans_model_registry_and_leaves_the_config_alone(titan):
    from torchtitan.models.llama3.model import Llama3Model

    spec = registry("llama3")("debugmodel", converters=[titan.AddNormConverter.Config(placement="sandwich")])
    assert spec.model.addnorm == {"placement": "sandwich", "mix_fraction": None, "fused": True, "init": True}
    assert {layer.wiring.placement for layer in spec.model.layers} == {"sandwich"}
    original = registry("llama3")("debugmodel").model
    converted = titan.convert(original, "deepnorm")
    assert type(original) is Llama3Model.Config  # convert copies; the given config is not changed
    assert original.layers[0].attention.wo.param_init is not converted.layers[0].attention.wo.param_init


def test_the_converter_composes_with_torchtitans_float8_converter(titan):
    """torchtitan's Float8LinearConverter (emulated float8 matmuls: the CPU has no float8 GEMM) and
    addnorm's, in either order: the fused model computes what the untouched float8 model computes."""
    pytest.importorskip("torchao", reason="torchtitan's float8 converter runs torchao")
    from torchtitan.components.quantization import Float8LinearConverter

    float8 = Float8LinearConverter.Config(emulate=True)
    untouched = build(titan.on_cpu(registry("llama3")("debugmodel", converters=[float8]).model))
    x = tokens()
    y = untouched(x)
    y.square().mean().backward()
    grads = dict(untouched.named_parameters())
    for converters in ([float8, titan.AddNormConverter.Config()], [titan.AddNormConverter.Config(), float8]):
        fused = build(titan.on_cpu(registry("llama3")("debugmodel", converters=converters).model))
        assert type(fused.layers["0"].attention.wo).__name__ == "Float8Linear"
        y_fused = fused(x)
        assert (y_fused - y).abs().max().item() <= TOL
        y_fused.square().mean().backward()
        assert max((p.grad - grads[n].grad).abs().max().item() for n, p in fused.named_parameters()) <= TOL


def test_probe_observes_a_converted_model_without_changing_it(titan):
    import addnorm as an

    model = build(titan.convert(config()))
    x = tokens()
    plain = model(x)
    with an.Probe(model) as probe:
        probed = model(x)
        probed.square().mean().backward()
    assert torch.equal(plain, probed)
    assert len(probe) == 6  # its layers: the blocks with AddNorm children
    assert probe.sublayers[0][:2] == ["attention", "feed_forward"]
    assert all(g > 0 for g in probe.stream_grad_norms())


# --- re-placed: each placement's formula -----------------------------------------------------------------


def _rms(x, norm):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight


def _formula(model, x, placement: str) -> torch.Tensor:
    """The logits of ``placement``'s formula over the model's own modules, written out."""
    h = model.tok_embeddings(x)
    n_layers = len(model.layers)
    alpha = (2 * n_layers) ** 0.25  # DeepNet, decoder-only
    for i, block in enumerate(model.layers.values()):
        subs = ((lambda u, b=block: b.attention(u, None, None)), block.feed_forward)
        names = ("attention", "ffn")
        p = ("post" if i < math.ceil(0.25 * n_layers) else "pre") if placement == "mix" else placement
        layer_input = h
        for j, (f, s) in enumerate(zip(subs, names, strict=True)):
            n_in, n_branch, n_out = (
                getattr(block, f"{s}{suffix}", None) for suffix in ("_norm", "_branch_norm", "_out_norm")
            )
            if p == "pre":
                h = h + f(_rms(h, n_in))
            elif p == "post":
                h = _rms(h + f(h), n_out)
            elif p == "deepnorm":
                h = _rms(alpha * h + f(h), n_out)
            elif p == "sandwich":
                h = h + _rms(f(_rms(h, n_in)), n_branch)
            elif p == "pre_post":
                h = _rms(h + f(_rms(h, n_in)), n_out)
            elif p == "res_post":
                h = h + _rms(f(h), n_branch)
            elif p == "normed_residual":
                u = _rms(h, n_in)
                h = u + f(u)
            elif p == "layerscale":
                h = h + getattr(block, f"{s}_gate").weight * f(_rms(h, n_in))
            elif p == "rezero":
                h = h + block.gate.weight * f(h)
            elif p == "b2t":
                h = _rms(h + f(h) + (layer_input if j == 1 else 0), n_out)
    if placement in ("pre", "sandwich", "res_post", "normed_residual", "layerscale", "mix"):
        h = _rms(h, model.norm)
    return model.lm_head(h)


PLACEMENTS = [
    "sandwich",
    "post",
    "deepnorm",
    "mix",
    "pre_post",
    "res_post",
    "normed_residual",
    "layerscale",
    "rezero",
    "b2t",
]


@pytest.mark.parametrize("placement", PLACEMENTS)
def test_a_replaced_models_first_forward_is_its_placements_formula(titan, placement):
    model = build(titan.convert(config(), placement))
    if placement == "rezero":  # its gates start at 0: give them values the formula can see
        with torch.no_grad():
            for i, block in enumerate(model.layers.values()):
                block.gate.weight.fill_(0.1 * (i + 1))
    x = tokens()
    with torch.no_grad():
        assert (model(x) - _formula(model, x, placement)).abs().max().item() <= TOL


@pytest.mark.parametrize("placement", ["sandwich", "mix"])
def test_fused_and_unfused_replaced_models_agree(titan, placement):
    fused = build(titan.convert(config(), placement))
    unfused = build(titan.convert(config(), placement, fused=False))
    x = tokens()
    assert (fused(x) - unfused(x)).abs().max().item() <= TOL


def test_a_replaced_model_keeps_qwens_query_key_norms_and_moe(titan):
    model = build(titan.convert(config("qwen3"), "sandwich"))
    block = model.layers["0"]
    assert block.attention.q_norm is not None
    x = tokens()
    with torch.no_grad():
        assert (model(x) - _formula(model, x, "sandwich")).abs().max().item() <= TOL
    moe = titan.convert(registry("qwen3")("debugmodel_moe").model, "sandwich")
    assert moe.layers[0].moe is not None and moe.layers[0].wiring.norms.keys() == {
        "attention_branch_norm",
        "ffn_branch_norm",
    }


# --- initialisation through torchtitan's init_weights ---------------------------------------------------


def test_deepnorm_initialises_through_init_weights_with_deepnets_gains(titan):
    model = build(titan.convert(config(), "deepnorm"))
    n = len(model.layers)
    beta = (8 * n) ** -0.25
    state = model.state_dict()
    for i in range(n):
        for name, gain in [
            ("attention.qkv_linear.wq", 1.0),
            ("attention.qkv_linear.wk", 1.0),
            ("attention.qkv_linear.wv", beta),
            ("attention.wo", beta),
            ("feed_forward.w1", beta),
            ("feed_forward.w2", beta),
            ("feed_forward.w3", beta),
        ]:
            w = state[f"layers.{i}.{name}.weight"]
            expected = gain * math.sqrt(2.0 / (w.shape[0] + w.shape[1]))
            assert w.std().item() == pytest.approx(expected, rel=0.03), (i, name)
            assert abs(w.mean().item()) < 0.05 * expected
        assert model.layers[str(i)].attention_block.alpha == pytest.approx((2 * n) ** 0.25)
        assert torch.equal(state[f"layers.{i}.attention_out_norm.weight"], torch.ones(256))
    untouched = build(config()).state_dict()
    assert torch.equal(state["tok_embeddings.weight"], untouched["tok_embeddings.weight"])
    assert "norm.weight" not in state  # the stream leaves the last layer normalised: no final norm


def test_b2t_scales_torchtitans_initial_matrices_by_one_over_sqrt_depth(titan):
    model, untouched = build(titan.convert(config(), "b2t")).state_dict(), build(config()).state_dict()
    factor = 6**-0.5
    for name in ("attention.qkv_linear.wq", "attention.qkv_linear.wv", "attention.wo", "feed_forward.w2"):
        key = f"layers.3.{name}.weight"
        assert torch.allclose(model[key], untouched[key] * factor, rtol=1e-6, atol=0)
    plain = build(titan.convert(config(), "b2t", init=False)).state_dict()
    assert torch.equal(plain["layers.3.attention.wo.weight"], untouched["layers.3.attention.wo.weight"])


def test_gates_start_where_the_placement_says(titan):
    from addnorm.connection import layerscale_init

    layerscale = build(titan.convert(config(), "layerscale"))
    assert torch.equal(layerscale.layers["2"].ffn_gate.weight, torch.full((256,), layerscale_init(6)))
    rezero = build(titan.convert(config(), "rezero"))
    assert [n for n, _ in rezero.layers["0"].named_parameters() if "gate" in n] == ["gate.weight"]
    assert torch.equal(rezero.layers["0"].gate.weight, torch.zeros(1))


def test_init_weights_works_on_the_meta_device(titan):
    with torch.device("meta"):
        model = titan.convert(config(), "deepnorm").build()
        model.init_weights(buffer_device=None)
    assert all(p.is_meta for p in model.parameters())


# --- what is refused, in one line -----------------------------------------------------------------------


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_another_model_family_is_refused(titan):
    from torchtitan.models.deepseek_v3 import model_registry

    with pytest.raises(ValueError) as e:
        titan.convert(model_registry("debugmodel").model)
    assert re.fullmatch(
        r"model_config: addnorm\.titan converts Llama 3 \(Llama3Model\.Config\) and Qwen 3 "
        r"\(Qwen3Model\.Config\), got DeepSeekV3Model\.Config",
        _one_line(e),
    )
    with pytest.raises(ValueError, match="already converted by addnorm.titan"):
        titan.convert(titan.convert(config()))


@pytest.mark.parametrize(
    ("placement", "why"),
    [
        ("ngpt", "normalises queries/keys inside attention"),
        ("sub_ln", "puts a norm inside the attention and FFN modules"),
        ("resi_dual", r"changes the residual stream across layers \(resi_dual\)"),
        ("admin", "needs a profiling pass on data"),
        ("hybridnorm", "normalises queries/keys inside attention"),
    ],
)
def test_a_placement_the_blocks_cannot_take_is_refused(titan, placement, why):
    with pytest.raises(ValueError) as e:
        titan.convert(config(), placement)
    message = _one_line(e)
    assert re.match(rf"placement: '{placement}' {why}", message)
    assert message.endswith("supported: " + ", ".join(titan.supported_placements()))
    with pytest.raises(ValueError, match=rf"^placement: '{placement}'"):
        titan.AddNormConverter.Config(placement=placement).build()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"placement": "pree"}, r"^placement: unknown placement 'pree'; expected one of: post, pre,"),
        ({"placement": "pre", "mix_fraction": 0.5}, r"^mix_fraction: placement 'pre' does not use it"),
        (
            {"placement": "mix", "mix_fraction": 1.5},
            r"^mix_fraction: expected a fraction in \[0, 1\], got 1.5$",
        ),
        ({"fused": "yes"}, r"^fused: expected True or False, got 'yes' \(str\)$"),
    ],
)
def test_bad_options_are_one_line_errors(titan, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message) as e:
        titan.convert(config(), **kwargs)
    _one_line(e)


def test_a_placements_initialisation_that_a_config_cannot_express_is_refused(titan):
    with pytest.raises(ValueError) as e:
        titan.convert(registry("qwen3")("debugmodel_non_fused_qkv").model, "deepnorm")
    assert "initialises keys and values differently" in _one_line(e)
    with pytest.raises(ValueError) as e:
        titan.convert(registry("qwen3")("debugmodel_moe").model, "deepnorm")
    assert "layer 0 is a mixture of experts" in _one_line(e)
    assert titan.convert(registry("qwen3")("debugmodel_moe").model, "deepnorm", init=False).layers[0].moe


def test_mix_ln_puts_post_ln_in_the_bottom_fraction(titan):
    converted = titan.convert(config(), "mix", mix_fraction=0.5)
    assert [layer.wiring.placement for layer in converted.layers] == ["post"] * 3 + ["pre"] * 3
    assert converted.norm.identity is False  # the top (Pre-LN) layer leaves the stream to the final norm


# --- job configuration ------------------------------------------------------------------------------------


def test_job_configs_name_addnorm_on_torchtitans_command_line(titan):
    from torchtitan.config import ConfigManager

    job = ConfigManager().parse_args(
        ["--module", "addnorm.titan", "--config", "qwen3_debugmodel__layerscale", "--training.steps", "7"]
    )
    assert job.training.steps == 7
    assert job.model_spec.model.addnorm["placement"] == "layerscale"
    fused = ConfigManager().parse_args(["--module", "addnorm.titan", "--config", "llama3_debugmodel"])
    assert fused.model_spec.model.addnorm == {
        "placement": "pre",
        "mix_fraction": None,
        "fused": True,
        "init": True,
    }
    with pytest.raises(ValueError) as e:
        ConfigManager().parse_args(["--module", "addnorm.titan", "--config", "llama3_debugmodel__ngpt"])
    assert _one_line(e).startswith("placement: 'ngpt'")
    with pytest.raises(
        ValueError, match="Config function 'mistral_7b' not found in addnorm.titan.config_registry"
    ):
        ConfigManager().parse_args(["--module", "addnorm.titan", "--config", "mistral_7b"])


# --- the example of docs/torchtitan.md ----------------------------------------------------------------------


def _readme_example() -> str:
    page = (ROOT / "docs" / "torchtitan.md").read_text()
    found = re.findall(r"```python\n(.*?)```", page, flags=re.S)
    assert found, "docs/torchtitan.md has a Python example"
    return found[-1]


def test_the_readme_example_is_the_example_file_and_runs(titan):
    example = ROOT / "examples" / "titan_cpu.py"
    code = example.read_text().split('"""', 2)[2].strip()
    assert _readme_example().strip() == code
    env = {"PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(
        [sys.executable, str(example)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    match = re.search(
        r"largest logit difference ([0-9.e+-]+), largest gradient difference ([0-9.e+-]+)", proc.stdout
    )
    assert match, proc.stdout
    assert float(match.group(1)) <= TOL and float(match.group(2)) <= TOL
    assert "sandwich: loss" in proc.stdout
