"""Shared helpers of the Hugging Face tests: tiny random models of every supported type, with norm
weights and biases moved off their initial values so that a norm in the wrong place shows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

pytest.importorskip("transformers")  # the hf extra; a test module importing this one skips without it

TYPES = ["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gpt2", "bert"]
TYPES += ["olmo2", "phi3", "mixtral", "qwen2_moe"]  # OLMo 2 (res_post), Phi-3 and the MoE families
VOCAB, LAYERS = 100, 2

# the config fields of each layout that a registered type's config resolves to another record, or another
# path through one (Architecture.variant): with each registered type's default config, every layout
VARIANTS = {
    "gpt_neox": ({"use_parallel_residual": False},),
    "falcon": (
        {"multi_query": False},
        {"new_decoder_architecture": True, "num_kv_heads": 2},
        {"parallel_attn": False},
        {"parallel_attn": False, "alibi": True, "multi_query": False},  # Falcon-RW: sequential, ALiBi
    ),
    "stablelm": ({"use_parallel_residual": True},),
}


def layouts() -> list[tuple[str, dict]]:
    """(model type, config fields) of every layout of every registered record: each registered type's
    default config, then its :data:`VARIANTS`."""
    import addnorm.hf as anhf

    return [(t, fields) for t in anhf.ARCHITECTURES for fields in ({}, *VARIANTS.get(t, ()))]


def layout_id(model_type: str, fields: dict) -> str:
    return "-".join([model_type, *(f"{k}={v}" for k, v in fields.items())])


def perturbed(model: nn.Module, scale: float = 0.3, seed: int = 1) -> nn.Module:
    """Add noise to every 1-D parameter (norm gains, biases), in place."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def tiny(model_type: str, *, dropout: bool = False, **sizes) -> nn.Module:
    """A tiny model of ``model_type`` in eval mode, every dropout off unless ``dropout``."""
    from addnorm.hf import tiny_model

    if not dropout:
        sizes.setdefault("dropout", 0.0)
    sizes.setdefault("vocab", VOCAB)
    sizes.setdefault("layers", LAYERS)
    return perturbed(tiny_model(model_type, **sizes)).eval()


def tokens(batch: int = 2, seq: int = 7, seed: int = 0) -> torch.Tensor:
    """Token ids that avoid the special ids 0, 1, 2."""
    return torch.randint(3, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def step(model: nn.Module, ids: torch.Tensor):
    """One forward and backward with the LM loss: (logits, loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), out.loss.detach(), grads


def add_norm_calls(monkeypatch) -> list[bool]:
    """From now on, each add_norm call's prenorm flag, in call order (the op used by every AddNorm): a
    test module's ``spy`` fixture."""
    import addnorm.connection as connection_module

    calls: list[bool] = []
    op = connection_module.add_norm

    def counted(*args, **kwargs):
        calls.append(kwargs["prenorm"])
        return op(*args, **kwargs)

    monkeypatch.setattr(connection_module, "add_norm", counted)
    return calls


def assert_generates_the_same(model: nn.Module, oracle: nn.Module, seq: int = 5, new: int = 6) -> None:
    """Greedy generation of ``new`` tokens after a prompt of ``seq`` gives ``oracle``'s tokens (and does
    generate)."""
    ids = tokens(seq=seq)
    kwargs = {"max_new_tokens": new, "do_sample": False, "attention_mask": torch.ones_like(ids)}
    expected = oracle.generate(ids, **kwargs)
    assert expected.shape[1] > ids.shape[1]
    assert torch.equal(model.generate(ids, **kwargs), expected)


def from_config(model_type: str, **fields) -> nn.Module:
    """A tiny random transformers causal LM of ``model_type`` from its config alone (for a type addnorm
    has no record of, which :func:`tiny` needs), norms perturbed, in eval mode."""
    import transformers

    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS,
        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, **fields,
    )  # fmt: skip
    torch.manual_seed(0)
    return perturbed(transformers.AutoModelForCausalLM.from_config(config)).eval()


def trained(model: nn.Module) -> nn.Module:
    """``model`` after one SGD step (learning rate 0.5) in train mode, so that no weight is at its initial
    value; returned in eval mode."""
    model.train()
    ids = tokens()
    model(input_ids=ids, labels=ids).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.sub_(0.5 * p.grad)
    return model.eval()


def fused_and_unfused(model: nn.Module, placement: str) -> tuple[nn.Module, nn.Module]:
    """Copies of ``model`` re-placed with ``placement``, with fused connections and with unfused ones,
    holding the same weights."""
    import copy

    from addnorm.hf import with_placement

    fused = with_placement(copy.deepcopy(model), placement)
    unfused = with_placement(copy.deepcopy(model), placement, fused=False)
    unfused.load_state_dict(fused.state_dict())
    return fused, unfused


def on_the_triton_backend(request, run):
    """``run()`` with every add_norm call on the Triton kernels, as a GPU runs them (the ``triton_backend``
    fixture: Triton's CPU interpreter; skips where it cannot), checking that some call took them."""
    from addnorm.ops import functional as fn

    request.getfixturevalue("triton_backend")
    fn.clear_plans()
    result = run()
    assert any(plan.triton for plan in fn._PLANS.values()), "no call took the Triton kernels"
    return result


def causal_mask(seq: int) -> torch.Tensor:
    """The additive causal mask a transformers attention takes: (1, 1, seq, seq), -inf above the diagonal."""
    return torch.full((seq, seq), float("-inf")).triu(1)[None, None]


def assert_same_step(got, expected, **tol) -> None:
    """Two :func:`step` results agree: logits, loss, and a gradient for the same parameters, each close
    (``tol``: ``torch.testing.assert_close``'s rtol and atol)."""
    (g_logits, g_loss, g_grads), (logits, loss, grads) = got, expected
    torch.testing.assert_close(g_logits, logits, **tol)
    torch.testing.assert_close(g_loss, loss, **tol)
    assert g_grads.keys() == grads.keys()
    for name in grads:
        torch.testing.assert_close(g_grads[name], grads[name], msg=name, **tol)


def assert_dropout_is_the_model_s(plain: nn.Module, fused: nn.Module) -> None:
    """Train mode, every dropout as configured, the same torch seed: the fused model's logits, loss and
    gradients are the untouched model's, bit for bit, and dropout did drop (in eval mode the fused model
    gives other logits)."""
    plain.train()
    fused.train()
    ids = tokens()
    torch.manual_seed(5)
    logits, loss, grads = step(plain, ids)
    torch.manual_seed(5)
    f_logits, f_loss, f_grads = step(fused, ids)
    assert torch.equal(f_logits, logits) and torch.equal(f_loss, loss)
    assert all(torch.equal(f_grads[n], grads[n]) for n in grads)
    assert not torch.allclose(fused.eval()(ids).logits, f_logits)


def attention_output(layer, h, **kwargs):
    """A Llama-shaped layer's attention as a user's record calls it: every keyword goes on."""
    return layer.self_attn(hidden_states=h, **kwargs)[0]


def mlp_output(layer, h, **kwargs):
    return layer.mlp(h)


def llama_like(
    name: str,
    attention=attention_output,
    mlp=mlp_output,
    *,
    placement: str = "pre",
    role: str = "input_norm",
    norms: tuple[str, str] = ("input_layernorm", "post_attention_layernorm"),
    **fields,
):
    """The record a user writes for a Llama-shaped family from ``addnorm.hf``'s public pieces (no patch of
    addnorm): attention ``self_attn`` (q, k, v, o projections), then MLP ``mlp`` (gate, up, down), whose
    ``norms`` are each sublayer's ``role`` (``input_norm`` for Pre-LN, ``branch_norm`` for res_post)."""
    import addnorm.hf as anhf

    w = lambda *names: tuple(anhf.Weight(f"{n}.weight") for n in names)  # noqa: E731
    return anhf.Architecture(
        name,
        placement=placement,
        norm=fields.pop("norm", "rmsnorm"),
        layers="layers",
        final_norm="norm",
        sublayers=(
            anhf.Sublayer(
                "self_attn",
                attention,
                **{role: norms[0]},
                init_unit=w("self_attn.q_proj", "self_attn.k_proj"),
                init_scaled=w("self_attn.v_proj", "self_attn.o_proj"),
            ),
            anhf.Sublayer(
                "mlp", mlp, **{role: norms[1]}, init_scaled=w("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
            ),
        ),
        config=anhf.ConfigSpec(kv_heads="num_key_value_heads"),
        **fields,
    )
