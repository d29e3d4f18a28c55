"""The torchtitan model families addnorm converts, as data: where torchtitan defines each one, and the
names of its block's parts.

Both families build their decoder blocks from torchtitan's ``TransformerBlock.Config`` (``attention``,
``feed_forward`` or ``moe``, ``attention_norm``, ``ffn_norm``) and compute Pre-LN with RMSNorm::

    h = x + attention(attention_norm(x));  out = h + ffn(ffn_norm(h))

Nothing here imports torchtitan: the converter resolves the class names when it runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..registry import Registry

__all__ = ["FAMILIES", "Family", "SLOT_NAMES", "SUBLAYERS"]

# the two sublayers of a block, in order, and the attribute prefix of their norms and gates
SUBLAYERS = ("attention", "ffn")
# a connection's norm slots and the block attribute that holds each (``{sublayer}`` = attention / ffn);
# the input norms keep torchtitan's own names, so a fused block's state dict is the untouched one's
SLOT_NAMES = {
    "input_norm": "{sublayer}_norm",
    "branch_norm": "{sublayer}_branch_norm",
    "output_norm": "{sublayer}_out_norm",
}


@dataclass(frozen=True)
class Family:
    """A torchtitan model family: ``package`` holds its ``model_registry``, its model and block classes
    (``package.model``; the converter and :mod:`addnorm.titan.modules` name them) and its job configs
    (``package.config_registry``); ``placement`` is the Add & Norm its blocks compute."""

    name: str
    title: str
    package: str
    placement: str = "pre"


FAMILIES: Registry[Family] = Registry("family")
FAMILIES.register("llama3", Family("llama3", "Llama 3", "torchtitan.models.llama3"))
FAMILIES.register("qwen3", Family("qwen3", "Qwen 3", "torchtitan.models.qwen3"))
