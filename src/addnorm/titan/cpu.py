"""``on_cpu(model_config)``: a torchtitan Llama 3 / Qwen 3 config that trains on the CPU.

torchtitan's language models attend with FlexAttention (or varlen), whose backward has no CPU
implementation. On the CPU each block's inner attention becomes torchtitan's
``ScaledDotProductAttention`` with a causal mask, the same function for a batch of whole sequences
(one document per row, the model called without ``attention_masks``). Used by the tests and the README's
example; a GPU job keeps its config as it is.
"""

from ..extras import require

require("torchtitan", "torchtitan", "addnorm.titan")

import copy  # noqa: E402

from torchtitan.models.common import ScaledDotProductAttention  # noqa: E402

__all__ = ["on_cpu"]


def on_cpu(model_config):
    """A copy of ``model_config`` whose blocks attend with causal SDPA (see the module docstring)."""
    config = copy.deepcopy(model_config)
    for layer in config.layers:
        attention = getattr(layer, "attention", None)
        if attention is not None:
            attention.inner_attention = ScaledDotProductAttention.Config()
    return config
