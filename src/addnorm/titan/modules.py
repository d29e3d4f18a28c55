"""The modules of a converted torchtitan model: blocks whose Add & Norm runs through addnorm connections,
the stream from block to block, the final norm that ends it, and the gates some placements add.

A converted block keeps torchtitan's own attention and FFN (or MoE) modules and its own ``RMSNorm``
modules, one per norm slot of its placement (``attention_norm`` / ``ffn_norm`` are the input norms, as in
torchtitan; ``*_branch_norm`` and ``*_out_norm`` the branch and output norms). Its forward is the
placement's formula, one line per sublayer, over a :class:`~addnorm.model.stream.Stream`::

    x = attention_connection(x, attention)
    x = ffn_connection(x, ffn)

Each connection is an :class:`~addnorm.AddNorm`, registered beside its sublayer as ``attention_block`` /
``feed_forward_block`` (``moe_block``) with its ``connection_role``, which :class:`addnorm.Probe` reads, but
owning no tensors: its norms and gate are pointed at the block's ``RMSNorm`` and :class:`Gate` parameters at
every forward (FSDP2's unshard, ``to_empty`` and ``Module.parallelize`` replace those Parameters; the
connection reads whatever is there now), so parameters, state dict, initialisation, sharding plans and
checkpoints are torchtitan's, and a fused Pre-LN block's state dict is the untouched block's. torchtitan
walks past the connections (they are no torchtitan ``Module`` s, holding nothing to shard or initialise);
the model's ``verify_module_protocol`` leaves them out.

The stream crosses block boundaries as a ``Stream``: the add that ends a block is held back
(``HeldAdd``: branch, residual, the connection that owns alpha and gate) and done by the next block in
one :func:`addnorm.ops.add_norm` call with its input norm, which it owns, so no block reads another's
parameters (FSDP2 reshards a block after its forward); the last add meets the final norm
(:class:`FinalNorm`). A Pre-LN model of L layers makes 2L fused calls per forward. A model whose forward
ends without a final norm (a pipeline stage) returns the stream as a tensor.

Everything torchtitan does to modules applies unchanged: ``Module.parallelize`` (the norms' and gates'
weights are placed like torchtitan's norm weights, see :func:`share_shardings`), FSDP2, activation
checkpointing and ``torch.compile`` of each block, weight init through ``param_init``, DCP.
"""

from ..extras import require

require("torchtitan", "torchtitan", "addnorm.titan")

from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torchtitan.models.common import RMSNorm  # noqa: E402
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock  # noqa: E402
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402
from torchtitan.protocols.sharding import ShardingConfig  # noqa: E402

from ..connection import AddNorm, ConnectionRole  # noqa: E402
from ..model.stream import Connection, Stream  # noqa: E402
from ..norms import RMSNorm as OpRMSNorm  # noqa: E402
from ..placement_spec import Depth, connection_spec  # noqa: E402
from ..placements import get_placement  # noqa: E402
from .families import SLOT_NAMES, SUBLAYERS  # noqa: E402

__all__ = [
    "AddNormLlama3Block",
    "AddNormLlama3Model",
    "AddNormQwen3Block",
    "AddNormQwen3Model",
    "ConnectedBlock",
    "FinalNorm",
    "Gate",
    "Wiring",
    "share_shardings",
]


class Gate(Module):
    """The gate g of a residual branch, s = x + g * F(x): ReZero's scalar (``size`` 1, starting at 0),
    LayerScale's per-feature vector (``size`` d). One Parameter, ``weight``, that the connections read;
    its start is the config's ``param_init`` (the converter sets it)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        size: int

    def __init__(self, config: Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.size))


@dataclass(kw_only=True)
class Wiring:
    """How a converted block connects its sublayers: this layer's ``placement`` (a name; Mix-LN gives
    layers different ones) in a model of ``n_layers``, whether the adds may run in the fused op
    (``fused``), the configs of the norms beyond torchtitan's ``attention_norm`` / ``ffn_norm``
    (``norms``: block attribute -> ``RMSNorm.Config``) and of its gates (``gates``: ``attention_gate``,
    ``ffn_gate``, or ``gate`` for one gate per layer)."""

    placement: str
    n_layers: int
    fused: bool = True
    norms: dict = field(default_factory=dict)
    gates: dict = field(default_factory=dict)


def _reading(norm_config: RMSNorm.Config) -> OpRMSNorm:
    """addnorm's RMSNorm (which the fused op computes) holding no tensor: its ``weight`` is pointed at a
    torchtitan norm's at each call."""
    norm = OpRMSNorm(norm_config.normalized_shape, eps=norm_config.eps, bias=False, device="meta")
    del norm.weight
    return norm


class ConnectedBlock:
    """A torchtitan decoder block whose Add & Norm runs through addnorm connections (see the module
    docstring); mixed into each family's block class, before it. Called like the family's block, with
    a tensor or a :class:`Stream` from the block before; returns a ``Stream``."""

    def __init__(self, config) -> None:
        nn.Module.__init__(self)
        wiring = config.wiring
        p = get_placement(wiring.placement)
        depth = Depth("decoder", 0, wiring.n_layers)
        specs = (connection_spec(p, depth, attention=True), connection_spec(p, depth))
        # the sublayers first and the norms in torchtitan's order, so a Pre-LN block registers (and
        # initialises, and saves) its parameters as the untouched block does
        self.attention = config.attention.build()
        self.moe_enabled = config.moe is not None
        if self.moe_enabled:
            self.moe = config.moe.build()
        else:
            self.feed_forward = config.feed_forward.build()
        own = {"attention_norm": config.attention_norm, "ffn_norm": config.ffn_norm}
        reads, gates, steps = [], [], []
        b2t = p.stream == "b2t"
        for i, (sublayer, spec) in enumerate(zip(SUBLAYERS, specs, strict=True)):
            norm_config = own[f"{sublayer}_norm"]
            conn = AddNorm(
                norm_config.normalized_shape,
                spec.placement,
                "rmsnorm",
                alpha=spec.alpha,
                eps=norm_config.eps,
                gate_init=spec.gate_init,
                fused=wiring.fused,
                device="meta",
            )
            for slot in spec.norm_slots:
                attr = SLOT_NAMES[slot].format(sublayer=sublayer)
                cfg = own.get(attr) or wiring.norms[attr]
                self.add_module(attr, cfg.build())
                reading = getattr(conn, slot)
                del reading.weight  # read from the block's norm at each call
                reading.eps = cfg.eps
                reads.append((reading, attr))
            if conn.gate is not None:
                del conn.gate
                gates.append((conn, "gate" if "gate" in wiring.gates else f"{sublayer}_gate"))
            steps.append(Connection(conn, keeps_layer_input=b2t and i == 0, adds_layer_input=b2t and i == 1))
        for name, cfg in wiring.gates.items():
            self.add_module(name, cfg.build())
        # the connections last, beside their sublayers, each with the role observers read (Probe): they
        # own no tensors, so the parameters, their order and the state dict are the block's own
        ffn = "moe" if self.moe_enabled else "feed_forward"
        for name, kind, step in zip(("attention", ffn), ("attention", "ffn"), steps, strict=True):
            step.conn.connection_role = ConnectionRole(name, kind)
            self.add_module(f"{name}_block", step.conn)
        self._steps, self._reads, self._gates = tuple(steps), tuple(reads), tuple(gates)

    def forward(self, x, attention_masks, positions=None):
        self._point()
        stream = x if isinstance(x, Stream) else Stream(x)
        attention = self.attention
        stream = self._steps[0](stream, lambda h: attention(h, attention_masks, positions))
        stream = self._steps[1](stream, self.moe if self.moe_enabled else self.feed_forward)
        return stream.leaving()

    def _point(self) -> None:
        """Point each connection's norms and gate at this block's parameters as they are now."""
        for norm, attr in self._reads:
            object.__setattr__(norm, "weight", getattr(self, attr).weight)
        for conn, attr in self._gates:
            object.__setattr__(conn, "gate", getattr(self, attr).weight)


class FinalNorm(RMSNorm):
    """The model's final norm (``norm``, torchtitan's ``RMSNorm`` with its parameter and sharding), taking
    the stream from the last block: a held add is done in one fused op with this norm. ``identity``: the
    placement leaves the stream normalised (Post-LN, DeepNorm), so the norm is the identity (no weight)."""

    @dataclass(kw_only=True, slots=True)
    class Config(RMSNorm.Config):
        identity: bool = False

    def __init__(self, config: Config):
        super().__init__(config)
        self.identity = config.identity
        self.op_norm = _reading(config)

    def forward(self, x):
        if self.identity:
            return x.tensor() if isinstance(x, Stream) else x
        if isinstance(x, Stream):
            object.__setattr__(self.op_norm, "weight", self.weight)
            return x.output(self.op_norm)
        return super().forward(x)


class _StreamModel:
    """The family model's forward, with the stream ended as a tensor where no final norm ends it (a
    pipeline stage without the model's norm), and its check that every submodule is a torchtitan
    ``Module``, leaving out addnorm's connections and norms (they hold no tensors: see the module
    docstring)."""

    def forward(self, tokens, positions=None, attention_masks=None):
        out = super().forward(tokens, positions, attention_masks)
        return out.tensor() if isinstance(out, Stream) else out

    def verify_module_protocol(self) -> None:
        ours: list[str] = []
        failures = []
        for fqn, module in self.named_modules():
            if any(fqn.startswith(f"{prefix}.") for prefix in ours):
                continue
            if isinstance(module, (AddNorm, OpRMSNorm)):
                ours.append(fqn)
            elif not isinstance(module, Module):
                failures.append(f"'{fqn}' ({type(module).__name__})")
        if failures:
            raise RuntimeError(
                f"The following modules do not satisfy the Module protocol: {', '.join(failures)}"
            )


def share_shardings(config) -> None:
    """Give the norms and gates a converted model adds the sharding that torchtitan's sharding function
    gave the block's own norms (weights replicated over TP; with sequence parallel, activations
    sequence-sharded); called after the family's ``update_from_config``."""
    for layer in config.layers:
        norm = layer.attention_norm.sharding_config
        for cfg in layer.wiring.norms.values():
            cfg.sharding_config = norm
        for cfg in layer.wiring.gates.values():
            cfg.sharding_config = (
                None if norm is None else ShardingConfig(state_shardings=norm.state_shardings)
            )


class _ConvertedConfig:
    """What a converted model's ``Config`` adds to the family's (before it in the bases): after the
    family's ``update_from_config``, :func:`share_shardings`."""

    __slots__ = ()

    def update_from_config(self, *, config, **kwargs) -> None:
        super().update_from_config(config=config, **kwargs)
        share_shardings(self)


class AddNormLlama3Block(ConnectedBlock, Llama3TransformerBlock):
    """torchtitan's Llama 3 block with addnorm connections."""

    @dataclass(kw_only=True, slots=True)
    class Config(Llama3TransformerBlock.Config):
        wiring: Wiring


class AddNormQwen3Block(ConnectedBlock, Qwen3TransformerBlock):
    """torchtitan's Qwen 3 block (dense or MoE) with addnorm connections."""

    @dataclass(kw_only=True, slots=True)
    class Config(Qwen3TransformerBlock.Config):
        wiring: Wiring


class AddNormLlama3Model(_StreamModel, Llama3Model):
    """torchtitan's Llama 3 with converted blocks; ``addnorm`` records what the converter did."""

    @dataclass(kw_only=True, slots=True)
    class Config(_ConvertedConfig, Llama3Model.Config):
        addnorm: dict = field(default_factory=dict)


class AddNormQwen3Model(_StreamModel, Qwen3Model):
    """torchtitan's Qwen 3 with converted blocks; ``addnorm`` records what the converter did."""

    @dataclass(kw_only=True, slots=True)
    class Config(_ConvertedConfig, Qwen3Model.Config):
        addnorm: dict = field(default_factory=dict)
