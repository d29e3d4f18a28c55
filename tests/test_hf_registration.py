"""register_architecture checks itself: a record is validated by name, tried on a tiny random model of its
type (a fused copy against the untouched model, layer by layer: the oracle is transformers' own forward),
refused in one line naming the first layer that differs; norms without an epsilon attribute or without
weight and bias (OLMo 1) are described by the record; registering the same record again is a no-op, a
different one needs replace=True, and unregister_architecture takes one back."""

from __future__ import annotations

import copy

import hf_models
import pytest
import torch
from hf_models import step, tokens

import addnorm.hf as anhf

transformers = pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def registry(registries_restored):
    """Each test's registrations are undone after it."""


def _scaled_attention(layer, h, **kwargs):
    """Granite: what the layer adds is the attention output times its residual multiplier."""
    return layer.self_attn(hidden_states=h, **kwargs)[0] * layer.residual_multiplier


def _scaled_mlp(layer, h, **kwargs):
    return layer.mlp(h) * layer.residual_multiplier


def _assert_fused_is_the_model(plain):
    fused = anhf.fuse(copy.deepcopy(plain))
    expected = step(plain, tokens())
    hf_models.assert_same_step(step(fused, tokens()), expected)
    hf_models.assert_generates_the_same(fused, plain, seq=4, new=5)


def test_olmo_1_norms_without_weight_or_epsilon_are_described_by_the_record():
    """OLMo 1's OlmoLayerNorm has no weight, no bias and no epsilon attribute (its forward uses 1e-5):
    ``norm_eps=1e-5`` says so, and the fused model is the model (the norm computes without affine)."""
    olmo = hf_models.llama_like("olmo", norm="layernorm", norm_eps=1e-5)
    plain = hf_models.from_config("olmo")
    assert not any(hasattr(m, "eps") for m in plain.modules() if type(m).__name__ == "OlmoLayerNorm")
    anhf.register_architecture("olmo", olmo)
    _assert_fused_is_the_model(plain)
    placed = anhf.with_placement(copy.deepcopy(plain), "pre", fused=False)  # its own placement: itself
    torch.testing.assert_close(placed(tokens()).logits, plain(tokens()).logits)


def test_a_norm_without_epsilon_is_a_one_line_refusal_naming_norm_eps():
    with pytest.raises(ValueError, match=r"^norm_eps: OlmoLayerNorm has no epsilon attribute") as err:
        anhf.register_architecture("olmo", hf_models.llama_like("olmo", norm="layernorm"))
    assert "\n" not in str(err.value) and "olmo" not in anhf.ARCHITECTURES


def test_a_record_that_changes_the_model_is_refused_naming_the_first_layer():
    """Granite adds each sublayer's output times ``residual_multiplier``: a record whose calls forget it
    changes the model (the check's config sets the multiplier off 1), refused at layer 0; the record
    with the multiplier is the model."""
    with pytest.raises(ValueError, match=r"^architecture: the 'granite' record changes the 'granite' model: "
                       r"layer 0 \(model\.layers\.0\) output differs") as err:  # fmt: skip
        anhf.register_architecture("granite", hf_models.llama_like("granite"))
    assert "\n" not in str(err.value) and "granite" not in anhf.ARCHITECTURES
    anhf.register_architecture("granite", hf_models.llama_like("granite", _scaled_attention, _scaled_mlp))
    _assert_fused_is_the_model(
        hf_models.from_config("granite", residual_multiplier=0.22, embedding_multiplier=12.0)
    )


def test_a_sublayer_call_that_does_not_fit_is_refused_in_one_line():
    def wrong(layer, h, **kwargs):
        return layer.self_attn(h)  # a tuple, and the call lacks the position embeddings

    with pytest.raises(ValueError, match=r"^architecture: the 'bad' record changes the 'llama' model") as err:
        anhf.register_architecture("llama", hf_models.llama_like("bad", attention=wrong), replace=True)
    assert "\n" not in str(err.value)
    assert anhf.ARCHITECTURES["llama"].name == "llama"  # the shipped record stays


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"placement": "prenorm"}, r"^architecture\.placement: unknown placement 'prenorm'; expected one of"),
        ({"norm": "scalenorm"}, r"^architecture\.norm: expected 'rmsnorm' or 'layernorm'"),
        (
            {"placement": "sandwich"},
            r"^architecture\.sublayers\['self_attn'\]: placement 'sandwich' has norm ",
        ),
        ({"stack": "middle"}, r"^architecture\.stack: expected 'decoder' or 'encoder'"),
        ({"norm_eps": [1e-5]}, r"^architecture\.norm_eps: expected None, an attribute name or a number"),
    ],
)
def test_a_record_is_validated_by_name_before_anything_is_built(fields, message):
    base = hf_models.llama_like("mine")
    record = anhf.Architecture(**{**{f: getattr(base, f) for f in base.__dataclass_fields__}, **fields})
    with pytest.raises(ValueError, match=message) as err:
        anhf.register_architecture("mine", record, check=False)
    assert "\n" not in str(err.value)


_NOTEBOOK_CELL = """
import addnorm.hf as anhf

def attention(layer, h, **kwargs):
    return layer.self_attn(hidden_states=h, **kwargs)[0] * layer.residual_multiplier

def mlp(layer, h, **kwargs):
    return layer.mlp(h) * layer.residual_multiplier

record = anhf.Architecture(
    "granite", placement="pre", norm="rmsnorm", layers="layers", final_norm="norm",
    sublayers=(
        anhf.Sublayer("self_attn", attention, input_norm="input_layernorm"),
        anhf.Sublayer("mlp", mlp, input_norm="post_attention_layernorm"),
    ),
)
anhf.register_architecture("granite", record)
"""


def test_running_the_same_registration_twice_is_a_no_op_and_a_different_one_needs_replace(monkeypatch):
    """A notebook cell run twice compiles new functions with the same code: the second registration is
    a no-op (not checked again); a record that differs is refused unless ``replace=True``."""
    exec(compile(_NOTEBOOK_CELL, "<cell>", "exec"), {})
    first = anhf.ARCHITECTURES["granite"]
    from addnorm.hf import registration

    monkeypatch.setattr(registration, "check_record", lambda *a: pytest.fail("checked again"))
    exec(compile(_NOTEBOOK_CELL, "<cell>", "exec"), {})
    assert anhf.ARCHITECTURES["granite"] is first
    other = hf_models.llama_like("granite", _scaled_attention, _scaled_mlp)
    with pytest.raises(ValueError, match=r"^model_types: 'granite' is already registered .*replace=True"):
        anhf.register_architecture("granite", other)
    anhf.register_architecture("granite", other, replace=True, check=False)
    assert anhf.ARCHITECTURES["granite"] is other
    anhf.unregister_architecture("granite")
    assert "granite" not in anhf.ARCHITECTURES
    with pytest.raises(ValueError, match=r"^model_types: 'granite' is not registered; registered: llama"):
        anhf.unregister_architecture("granite")
    with pytest.raises(ValueError, match="unsupported model type 'granite'"):
        anhf.fuse(hf_models.from_config("granite"))


def test_the_check_leaves_torch_s_random_state_alone():
    torch.manual_seed(3)
    expected = torch.rand(3)
    torch.manual_seed(3)
    anhf.register_architecture("granite", hf_models.llama_like("granite", _scaled_attention, _scaled_mlp))
    assert torch.equal(torch.rand(3), expected)


def test_the_readme_s_registration_runs_as_written_and_is_the_model():
    """The registration block of docs/huggingface.md, run as written: Granite's record
    passes the check, and the fused model is the model."""
    import re
    import textwrap
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "huggingface.md").read_text()
    blocks = [textwrap.dedent(b) for b in re.findall(r"```python\n(.*?)```", page, flags=re.S)]
    found = [b for b in blocks if "register_architecture(" in b]
    assert len(found) == 1, "docs/huggingface.md: one registration example"
    exec(compile(found[0], "docs/huggingface.md", "exec"), {})  # its own imports, as a user copies it
    assert anhf.ARCHITECTURES["granite"].name == "granite"
    _assert_fused_is_the_model(hf_models.from_config("granite", residual_multiplier=0.22))
