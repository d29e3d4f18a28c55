"""A fused Hugging Face model is a view of the model: whatever replaces, moves or edits its parameters or
its stream after ``fuse`` (offload hooks, ``load_state_dict(assign=True)``, meta + ``to_empty``,
parameter replacement, forward pre-hooks that edit the stream in place, gradient checkpointing with a
Probe) gives the unfused model's numbers. Oracle: the same model object with ``unfuse`` (or an
untouched twin given the same treatment). One process."""

from __future__ import annotations

import copy

import pytest
import torch
from hf_models import LAYERS, step, tiny, tokens
from torch import nn

import addnorm as an
import addnorm.hf as anhf

TOL = 1e-5


def logits(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def fused_and_unfused(model: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits fused, logits of the same model unfused)."""
    with anhf.fused(model):
        got = logits(model, ids)
    return got, logits(model, ids)


def _offloaded(tmp_path, how: str) -> nn.Module:
    accelerate = pytest.importorskip("accelerate")
    plain = tiny("llama")
    plain.save_pretrained(tmp_path / "model")
    from transformers import AutoModelForCausalLM

    if how == "disk":
        device_map = {"model.embed_tokens": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
        device_map |= {f"model.layers.{i}": "disk" for i in range(LAYERS)}
        device_map["model.norm"] = "disk"
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path / "model", device_map=device_map, offload_folder=str(tmp_path / "offload")
        )
    else:  # cpu offload: weights on meta, brought in from a cpu copy at each forward
        model = accelerate.cpu_offload(plain, execution_device="cpu")
    return model.eval()


@pytest.mark.parametrize("how", ["disk", "cpu"])
def test_offloaded_model_fused_after_loading_gives_the_unfused_logits(tmp_path, how):
    model = _offloaded(tmp_path, how)
    assert any(p.is_meta for p in model.model.layers[0].parameters())  # really offloaded
    ids = tokens()
    got, expected = fused_and_unfused(model, ids)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_load_state_dict_assign_after_fuse_is_read_by_the_fused_model():
    ids = tokens()
    model, twin = anhf.fuse(tiny("llama")), tiny("llama")
    new = {k: v + 0.1 * torch.randn_like(v) for k, v in twin.state_dict().items()}
    model.load_state_dict(new, assign=True)
    twin.load_state_dict(new, assign=True)
    torch.testing.assert_close(logits(model, ids), logits(twin, ids), atol=TOL, rtol=0)


def test_meta_built_fused_model_runs_after_to_empty_and_init_weights():
    from transformers import AutoModelForCausalLM

    from addnorm.hf import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab=100, layers=LAYERS))
    anhf.fuse(model)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    with torch.no_grad():  # norm gains off 1, so reading the wrong (or a stale) one shows
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(0.3 * torch.randn_like(p))
    got, expected = fused_and_unfused(anhf.unfuse(model.eval()), tokens())
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


def test_replaced_norm_parameters_are_read_by_the_fused_model():
    ids = tokens()
    model = anhf.fuse(tiny("llama"))
    for layer in model.model.layers:
        layer.post_attention_layernorm.weight = nn.Parameter(torch.rand_like(layer.input_layernorm.weight))
    model.model.norm.weight = nn.Parameter(torch.rand_like(model.model.norm.weight))
    got = logits(model, ids)
    torch.testing.assert_close(got, logits(anhf.unfuse(model), ids), atol=TOL, rtol=0)


@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_a_pre_hook_editing_the_stream_in_place_is_seen(model_type):
    ids = tokens()
    model = tiny(model_type)
    steer = 0.5 * torch.randn(model.config.hidden_size, generator=torch.Generator().manual_seed(2))

    def add_in_place(_module, args, kwargs):
        (args[0] if args else kwargs["hidden_states"]).add_(steer)

    model.model.layers[1].register_forward_pre_hook(add_in_place, with_kwargs=True)
    got, expected = fused_and_unfused(model, ids)
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)
    assert (got - logits(tiny(model_type), ids)).abs().max() > 1e-2  # the hook does change the result


def test_probe_with_gradient_checkpointing_reports_the_layer_stream_gradients():
    ids = tokens()
    plain = tiny("llama")
    seen = {}
    models = {"plain": copy.deepcopy(plain), "untouched": plain, "fused": anhf.fuse(copy.deepcopy(plain))}
    for name, model in models.items():
        if name != "plain":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        with an.Probe(model) as probe:
            step(model, ids)
        seen[name] = probe.stream_grad_norms()
    assert seen["untouched"] == pytest.approx(seen["plain"], rel=1e-5)
    assert seen["fused"] == pytest.approx(seen["plain"], rel=1e-5)
