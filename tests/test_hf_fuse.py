"""addnorm.hf.fuse on tiny random Hugging Face models of every supported type: the fused model is the
model (logits, loss, every gradient, generated tokens, state dict, saved files), each add a norm reads
is one add_norm call, and dropout matches the unfused model driven with the op's hashed mask."""

from __future__ import annotations

import copy
import filecmp
import types
import warnings

import hf_models
import pytest
import torch
from hf_models import LAYERS, TYPES, step, tiny, tokens
from torch import nn

import addnorm as an
import addnorm.connection as connection_module
import addnorm.hf as anhf
from addnorm.ops import dropout_keep_mask, policy


@pytest.fixture
def spy(monkeypatch):
    return hf_models.add_norm_calls(monkeypatch)


@pytest.mark.parametrize("model_type", TYPES)
def test_fused_model_is_the_model(model_type, spy):
    plain = tiny(model_type)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    expected = step(plain, ids)
    assert spy == []
    got = step(fused, ids)
    # every add meets a norm: 2 per layer; Pre-LN and sandwich hold the add for the next norm (the
    # last one: the final norm), BERT's Post-LN adds meet their own; OLMo 2's res_post adds meet no
    # norm but the last, which meets the final norm
    if model_type == "olmo2":
        assert spy == [True]
    else:
        assert spy == [model_type != "bert"] * (2 * LAYERS)
    hf_models.assert_same_step(
        got, expected
    )  # norms' gradients included: the op reads the model's own Parameters
    assert list(fused.state_dict()) == list(plain.state_dict())
    assert [n for n, _ in fused.named_parameters()] == [n for n, _ in plain.named_parameters()]


def _exact_rms_forward(self, x):
    """The Llama-family / Gemma RMSNorm formula in the input's dtype (theirs computes in float32)."""
    gain = (1.0 + self.weight) if "Gemma" in type(self).__name__ else self.weight
    eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
    return gain * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("model_type", TYPES)
def test_fused_float64_equals_the_float64_model(model_type, monkeypatch):
    plain = tiny(model_type).double()
    if model_type in ("mixtral", "qwen2_moe"):  # their default grouped_mm experts take no float64
        plain.set_experts_implementation("eager")
    for module in plain.modules():
        if "RMSNorm" in type(module).__name__:  # the model's formula in float64 (the oracle)
            monkeypatch.setattr(type(module), "forward", _exact_rms_forward)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    expected = step(plain, ids)
    hf_models.assert_same_step(step(fused, ids), expected, rtol=1e-12, atol=1e-12)


class _SeededDropouts:
    """Stands in for the fused op's seed draws: each add_norm call with dropout gets the next seed of a
    fixed list (so torch's generator is not consumed), and the unfused model's residual dropouts apply
    the hashed keep mask of the same seeds, in the same order: the oracle of the op's dropout."""

    def __init__(self, monkeypatch, n: int) -> None:
        self.seeds = [1000 + 17 * i for i in range(n)]
        self.monkeypatch = monkeypatch

    def drive_op(self) -> None:
        op, seeds = connection_module.add_norm, iter(self.seeds)

        def seeded(*args, **kwargs):
            if kwargs["training"] and kwargs["dropout_p"] > 0:
                kwargs["seed"] = next(seeds)
            return op(*args, **kwargs)

        self.monkeypatch.setattr(connection_module, "add_norm", seeded)

    def drive_dropouts(self, modules: list[nn.Dropout]) -> None:
        seeds = iter(self.seeds)

        def hashed(module, x):
            if not module.training or module.p == 0:
                return x
            keep = dropout_keep_mask(next(seeds), x.numel() // x.shape[-1], x.shape[-1], module.p)
            return x * keep.reshape(x.shape).to(x.dtype) / (1.0 - module.p)

        for module in modules:
            module.forward = types.MethodType(hashed, module)


_RESIDUAL_DROPOUTS = {
    "gpt2": lambda layer: [layer.attn.resid_dropout, layer.mlp.dropout],
    "bert": lambda layer: [layer.attention.output.dropout, layer.output.dropout],
    "phi3": lambda layer: [layer.resid_attn_dropout, layer.resid_mlp_dropout],
}
_DROPOUT_ON = {"gpt2": {}, "bert": {}, "phi3": {"resid_pdrop": 0.1, "embd_pdrop": 0.1}}  # Phi-3's: 0


@pytest.mark.parametrize("model_type", list(_RESIDUAL_DROPOUTS))
def test_fused_dropout_is_the_op_s_hashed_mask(model_type, monkeypatch):
    """Train mode with every dropout on (attention and embedding dropout draw from torch's generator in
    both models alike): equal logits, loss and gradients. The op runs wherever the model fuses (on the
    CPU the policy would give dropout to the unfused modules)."""
    monkeypatch.setattr(policy, "fused_op_preferred", lambda device, **call: True)
    plain = tiny(model_type, dropout=True, **_DROPOUT_ON[model_type]).train()
    fused = anhf.fuse(copy.deepcopy(plain))
    layers = plain.base_model.get_submodule(anhf.architecture_of(plain).layers)
    seeded = _SeededDropouts(monkeypatch, 2 * LAYERS)
    seeded.drive_dropouts([d for layer in layers for d in _RESIDUAL_DROPOUTS[model_type](layer)])
    ids = tokens()
    torch.manual_seed(5)
    logits, loss, grads = step(plain, ids)
    seeded.drive_op()
    torch.manual_seed(5)
    f_logits, f_loss, f_grads = step(fused, ids)
    hf_models.assert_same_step((f_logits, f_loss, f_grads), (logits, loss, grads))
    # and the residual dropout did drop: in eval mode the same model gives other logits
    assert not torch.allclose(fused.eval()(ids).logits, f_logits)


@pytest.mark.parametrize("model_type", list(_RESIDUAL_DROPOUTS))
def test_on_the_cpu_fused_dropout_is_nn_dropout_s_mask(model_type):
    """README: "on the CPU in eager mode the op leaves residual dropout to nn.Dropout: the same mask for
    the same seed". Train mode, every dropout on, the same torch seed: the fused model's logits, loss and
    gradients are the untouched model's, bit for bit, and dropout did drop."""
    plain = tiny(model_type, dropout=True, **_DROPOUT_ON[model_type])
    hf_models.assert_dropout_is_the_model_s(plain, anhf.fuse(copy.deepcopy(plain)))


@pytest.mark.parametrize("model_type", TYPES)
def test_generate_gives_the_same_tokens(model_type):
    plain = tiny(model_type, causal=True)
    fused = anhf.fuse(copy.deepcopy(plain))
    hf_models.assert_generates_the_same(fused, plain)


@pytest.mark.parametrize("model_type", TYPES)
def test_save_pretrained_writes_the_same_files(model_type, tmp_path):
    plain = tiny(model_type)
    fused = anhf.fuse(copy.deepcopy(plain))
    plain.save_pretrained(tmp_path / "plain")
    fused.save_pretrained(tmp_path / "fused")
    files = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "fused").iterdir())
    match, mismatch, errors = filecmp.cmpfiles(tmp_path / "plain", tmp_path / "fused", files, shallow=False)
    assert (mismatch, errors) == ([], [])


def test_unfuse_restores_the_model_s_own_forward():
    plain = tiny("gpt2")
    model = copy.deepcopy(plain)
    with anhf.fused(model) as same:
        assert same is model
        assert "forward" in model.transformer.h[0].__dict__ and hasattr(model.transformer.h[0], "attn_block")
        assert model.transformer.h[0].attn.resid_dropout.forward is not nn.Dropout.forward
    for module in model.modules():
        assert "forward" not in module.__dict__
    assert not any(name.endswith("_block") for name, _ in model.named_modules())
    ids = tokens()
    assert torch.equal(model(ids).logits, plain(ids).logits)
    anhf.fuse(model)  # and it fuses again
    torch.testing.assert_close(model(ids).logits, plain(ids).logits)


def test_fused_model_still_returns_hidden_states_and_checkpoints():
    """output_hidden_states sees each layer's stream; gradient checkpointing runs each fused layer
    checkpointed (fused within the layer), with the unfused model's gradients."""
    plain = tiny("llama")
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    expected = plain(ids, output_hidden_states=True).hidden_states
    got = fused(ids, output_hidden_states=True).hidden_states
    assert len(got) == LAYERS + 1
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e)
    for model in (plain, fused):
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.23
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
        model.train()
    expected = step(plain, ids)
    hf_models.assert_same_step(step(fused, ids), expected)


@pytest.mark.parametrize("model_type", ["llama", "qwen3", "gemma2", "gpt2", "bert", "olmo2"])
def test_fused_model_on_the_triton_backend_is_the_model(model_type, request):
    """What a GPU runs, through the Triton interpreter: the fused model with every add on the Triton
    kernels (the hand-over of a normalised stream between layers included) gives the model's logits,
    loss and gradients."""
    plain = tiny(model_type)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    expected = step(plain, ids)
    got = hf_models.on_the_triton_backend(request, lambda: step(fused, ids))
    hf_models.assert_same_step(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_fused_model_compiles_fullgraph_where_the_model_does(model_type, dynamo_cache_warnings):
    """torch.compile(fullgraph=True) traces the fused model as it traces the model: with the op's kernel
    compile path one add_norm node per add (none in the model's graph), the same logits and gradients.
    (The loss is computed outside: the models' own loss functions log a warning, which breaks the graph
    of either.) Dynamo has no cache of addnorm's to warn about tracing through."""
    plain = tiny(model_type)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    results = {}
    for name, model in (("plain", plain), ("fused", fused)):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs, graphs=graphs):
            graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
            return gm

        with policy.using_compile_path("kernel"), dynamo_cache_warnings() as cached:
            compiled = torch.compile(model, fullgraph=True, backend=backend)
            logits = compiled(input_ids=ids, use_cache=False).logits
        ours = [m for m in cached if "addnorm" in m]
        assert not ours, "\n".join(ours)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), ids.flatten())
        loss.backward()
        assert len(graphs) == 1
        grads = {n: p.grad for n, p in model.named_parameters()}
        results[name] = (sum("add_norm_fwd" in t for t in graphs[0]), logits, loss, grads)
    assert results["plain"][0] == 0 and results["fused"][0] == 2 * LAYERS
    hf_models.assert_same_step(results["fused"][1:], results["plain"][1:])


class _NotSupported(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(model_type="opt")
        self.base_model = self


def test_bad_models_get_one_line_errors():
    with pytest.raises(ValueError, match=r"unsupported model type 'opt'.*llama, mistral.*gpt2, bert") as err:
        anhf.fuse(_NotSupported())
    assert "\n" not in str(err.value)
    with pytest.raises(TypeError, match="expected a Hugging Face transformers PreTrainedModel"):
        anhf.fuse(nn.Linear(2, 2))
    model = anhf.fuse(tiny("llama"))
    with pytest.raises(ValueError, match="already rewired"):
        anhf.fuse(model)
    with pytest.raises(ValueError, match="not fused"):
        anhf.unfuse(tiny("llama"))
    with pytest.raises(ValueError, match="cross-attention"):
        anhf.fuse(tiny("gpt2", add_cross_attention=True))


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt2", "bert", "gpt_neox"])
def test_export_of_a_fused_model_is_the_untouched_model_s(model_type):
    """torch.export of the fused model warns about nothing the untouched model's export does not (its
    norms' parameters were once reassigned during the call: "must be registered as buffers"), lifts the
    same parameters, buffers and constants under the same names (the norms read the model's own
    Parameters, not copies baked into the graph), and its program computes the model's logits; the norms
    hold what they held before the export."""
    plain = tiny(model_type)
    fused = anhf.fuse(copy.deepcopy(plain))
    ids = tokens()
    kwargs = {"input_ids": ids} if model_type == "bert" else {"input_ids": ids, "use_cache": False}
    layer = fused.base_model.get_submodule(anhf.architecture_of(plain).layers)[0]
    block = next(m for m in layer.children() if isinstance(m, an.AddNorm))
    before = [
        getattr(n, "weight", None) for n in block.children() if isinstance(n, (an.LayerNorm, an.RMSNorm))
    ]
    programs, warned = {}, {}
    for name, model in (("plain", plain), ("fused", fused)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            programs[name] = torch.export.export(model, (), kwargs)
        warned[name] = sorted(str(w.message) for w in caught)
    assert warned["fused"] == warned["plain"] == []
    specs = {k: [(s.kind, s.target) for s in p.graph_signature.input_specs] for k, p in programs.items()}
    assert specs["fused"] == specs["plain"]
    assert programs["fused"].constants.keys() == programs["plain"].constants.keys()
    assert programs["fused"].state_dict.keys() == programs["plain"].state_dict.keys()
    expected = plain(**kwargs).logits
    torch.testing.assert_close(programs["fused"].module()(**kwargs).logits, expected)
    after = [
        getattr(n, "weight", None) for n in block.children() if isinstance(n, (an.LayerNorm, an.RMSNorm))
    ]
    assert all(a is b for a, b in zip(after, before, strict=True))
