"""The Hugging Face model families a run can train (``model: hf-llama``, ``hf-qwen3``, ...): a causal LM of
that family built from a config with random weights at the run's width, depth and heads, its Add & Norm
re-placed with :func:`addnorm.hf.with_placement`.

Sizes come from the run config: ``d_model`` -> ``hidden_size``, ``n_layers`` -> ``num_hidden_layers``,
``n_heads`` -> ``num_attention_heads``, ``d_ff`` -> ``intermediate_size`` (GPT-2: ``n_inner``),
``kv_heads`` -> ``num_key_value_heads`` (grouped-query attention: ``n_heads / kv_heads`` query heads
share one key/value head; families with key/value heads), ``rope_theta`` -> the RoPE base,
``dropout`` -> every dropout rate of the family, ``seq_len`` -> ``max_position_embeddings`` (the fields
are the family record's, :class:`addnorm.hf.ConfigSpec`). The family keeps its own
activation (SwiGLU, GeGLU, GELU), norm (RMSNorm or LayerNorm), positions (RoPE or learned) and biases;
addnorm's ``activation``, ``norm``, ``positional``, ``bias`` and ``init`` keys do not apply to it.
``fused`` is :func:`with_placement`'s (the connections run in the fused op; the function is the same).

``hf_init`` (:data:`HF_INITS`) is the initialisation before the placement's own (DeepNet's, B2T's, which
``with_placement`` applies on top, as addnorm's model applies them on top of its ``init``): ``own``, the
family's ``_init_weights`` (normal 0.02 on every matrix and embedding: scaled for widths in the
thousands; at d_model 64 the stream starts at RMS 0.02), or ``xavier``, what addnorm's transformer
starts from under the study's default ``init: xavier`` (:func:`xavier_init`).

``transformers`` is imported only when such a model is built (:func:`build_hf_model`); naming the
families and checking which placements apply (:func:`not_applicable`) need no import of it.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..hf.architectures import ARCHITECTURES
from ..placement_spec import why_not_around_sublayers
from ..placements import get_placement
from ..registry import Registry

__all__ = [
    "ADDNORM_MODEL",
    "HF_FAMILIES",
    "HFCausalLM",
    "HF_INITS",
    "build_hf_model",
    "not_applicable",
    "transformers_version",
]

ADDNORM_MODEL = "addnorm"


def study_name(model_type: str) -> str:
    """The run config's name of a family's model type: ``hf-<type>``, ``_text`` dropped (``hf-gemma3``)."""
    return "hf-" + model_type.removesuffix("_text")


# run config name -> transformers model_type: every type whose record says a study may train it
HF_FAMILIES: Registry = Registry("model")
for _type, _arch in ARCHITECTURES.items():
    if _arch.config.study:
        HF_FAMILIES.register(study_name(_type), _type)


def xavier_init(hf: nn.Module) -> None:
    """Initialise a freshly built causal LM ``hf`` as addnorm's own language model starts under
    ``init: xavier`` (:func:`addnorm.model.init.init_xavier`, Glorot & Bengio 2010), in this order:

    1. every matrix (2-D weight) of every layer, layer by layer in module order: Xavier-uniform; biases 0;
    2. the token embedding: rows whose entries have variance 1 as they enter the stream (addnorm's scaled
       embeddings): N(0, 1), or N(0, 1/d_model) where the family multiplies them by sqrt(d_model)
       (Gemma) or where the head is tied to them without that multiplier (GPT-2: unit-variance logits
       rather than a unit-variance stream);
    3. an untied head: ``torch.nn.Linear``'s own initialisation, as addnorm's head.

    Norm gains stay 1; learned position tables (GPT-2) keep the family's init."""
    import torch

    from ..hf.architectures import architecture_of

    arch = architecture_of(hf)
    with torch.no_grad():
        for layer in arch.layers_of(hf):
            for module in layer.modules():
                weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
                if isinstance(weight, nn.Parameter) and weight.ndim == 2:
                    nn.init.xavier_uniform_(weight)
                    if isinstance(bias, nn.Parameter):
                        nn.init.zeros_(bias)
        embed, head = hf.get_input_embeddings(), hf.get_output_embeddings()
        tied = head is not None and head.weight is embed.weight
        unit = not arch.config.scaled_embeddings and not tied
        nn.init.normal_(embed.weight, std=1.0 if unit else embed.weight.shape[1] ** -0.5)
        if head is not None and not tied:
            head.reset_parameters()


HF_INITS: Registry = Registry("hf_init")
HF_INITS.register("own", lambda hf: None)
HF_INITS.register("xavier", xavier_init)


def not_applicable(model: str, placement) -> str | None:
    """Why ``placement`` cannot be applied to the family ``model`` by ``with_placement`` (a one-line
    reason), or None when it can (always None for addnorm's own model)."""
    if model == ADDNORM_MODEL:
        return None
    if isinstance(placement, (list, tuple)):
        return "per-layer placement lists are not supported for Hugging Face models"
    why = why_not_around_sublayers(get_placement(placement))
    return None if why is None else f"{get_placement(placement).name} {why}"


class HFCausalLM(nn.Module):
    """A Hugging Face causal LM seen as addnorm's tasks see a model: ``forward(tokens) -> logits``."""

    def __init__(self, hf: nn.Module) -> None:
        super().__init__()
        self.hf = hf

    def forward(self, tokens: Tensor) -> Tensor:
        return self.hf(input_ids=tokens, use_cache=False).logits


def hf_config(model: str, model_cfg, vocab: int, *, kv_heads: int, rope_theta: float, max_len: int):
    """The ``transformers`` config of family ``model`` at the run's sizes (see the module docstring)."""
    from ..hf.tiny import tiny_config

    model_type = HF_FAMILIES[model]
    spec = ARCHITECTURES[model_type].config
    overrides = {}
    if spec.kv_heads:
        kv = kv_heads or model_cfg.n_heads
        if model_cfg.n_heads % kv:
            raise ValueError(f"kv_heads: {kv} does not divide n_heads={model_cfg.n_heads}")
        overrides[spec.kv_heads] = kv
    if spec.rope:
        overrides[spec.rope] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    return tiny_config(
        model_type,
        layers=model_cfg.n_layers,
        hidden=model_cfg.d_model,
        heads=model_cfg.n_heads,
        vocab=vocab,
        intermediate=model_cfg.d_ff,
        positions=max_len,
        dropout=model_cfg.dropout,
        **overrides,
    )


def build_hf_model(cfg, vocab: int) -> HFCausalLM:
    """The run's Hugging Face model: ``torch.manual_seed(cfg.seed)``, a random-weight causal LM of the
    family ``cfg.arch`` from :func:`hf_config`, its ``cfg.hf_init`` initialisation (:data:`HF_INITS`),
    then ``with_placement(model, cfg.placement, mix_fraction=cfg.mix_fraction, fused=cfg.fused)``."""
    import torch

    from ..hf import with_placement
    from ..hf.architectures import require_transformers

    transformers = require_transformers()
    m = cfg.model
    why = not_applicable(cfg.arch, m.placement)
    if why is not None:
        raise ValueError(f"placement: not applicable to {cfg.arch}: {why}")
    config = hf_config(
        cfg.arch, m, vocab, kv_heads=cfg.kv_heads, rope_theta=cfg.rope_theta, max_len=max(cfg.seq_len, 16)
    )
    torch.manual_seed(cfg.seed)
    hf = transformers.AutoModelForCausalLM.from_config(config)
    HF_INITS[cfg.hf_init](hf)
    placement = get_placement(m.placement).name
    with_placement(hf, placement, mix_fraction=m.mix_fraction, fused=cfg.fused)
    return HFCausalLM(hf)


def transformers_version() -> str:
    from ..hf.architectures import require_transformers

    return require_transformers().__version__
