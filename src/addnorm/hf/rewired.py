"""A rewired Hugging Face model: each layer runs its sublayers through addnorm connections, and the add
that closes a layer runs in one fused op with the norm that next reads the stream.

Inside a layer, the stream is a :class:`~addnorm.model.stream.Stream` passed through one
:class:`~addnorm.model.stream.Connection` per sublayer, exactly as in addnorm's own layers (the decision
to fuse is :meth:`addnorm.AddNorm.add_fusion`'s). Between layers the model's own loop passes tensors, so
its masks, caches, hooks and ``output_hidden_states`` see what they always see. To fuse across that
loop, a layer whose stream ends in a held-back add does it at its end, in one
``add_norm(prenorm=True)`` call with the norm that reads the stream next (the next layer's input norm
or the model's final norm, known from the layer list), returns s and leaves N(s) in a
:class:`Handover`; the next reader takes N(s) when its input is that very s, unchanged since (same
object, same version counter: a forward pre-hook that edits it in place makes the reader compute its
norm itself), and otherwise computes its norm itself.

The rewiring is a view of the model: every norm reads the parameters of the model's own norm module
when it is called (:func:`addnorm.norms.reading`), never a copy taken earlier, so whatever replaces or
moves them (``load_state_dict(assign=True)``, ``to_empty``, FSDP2's unshard and reshard, offload hooks)
is seen.
A layer hands N(s) over only where it may read the next norm's parameters itself: neither it nor the
module owning that norm is managed by FSDP2 or an offload hook (each such module has its parameters
only inside its own forward), and the parameters are plain tensors on the stream's device.

Everything here is undone by :func:`uninstall`: the model's modules keep their classes, and a layer's
own ``forward`` comes back when the instance attribute that shadows it is deleted.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from ..connection import AddNorm, ConnectionRole
from ..model.stream import Connection, Stream
from .architectures import Architecture, Sublayer

__all__ = [
    "FinalNorm",
    "Handover",
    "LayerRun",
    "Reads",
    "Rewiring",
    "attach",
    "install",
    "rewiring_of",
    "role_of",
    "uninstall",
]

_ATTRIBUTE = "_addnorm_rewiring"
_CACHE_OFF = {"use_cache": False, "past_key_values": None}


class Reads:
    """The model's own norm modules (``sources``) whose parameters a rewired layer's norms compute with.
    The norms read them at each call (:func:`addnorm.norms.reading`), never a copy taken earlier, and
    nothing is assigned to the model's modules. A source that an offload hook manages itself
    (accelerate's ``_hf_hook`` on the norm module: its parameters on the meta device outside its own
    forward) is served by :meth:`hooked` and the hook's ``pre_forward`` / ``post_forward`` around the
    layer's run."""

    __slots__ = ("sources",)

    def __init__(self, sources: list[nn.Module] | None = None) -> None:
        self.sources = sources or []

    def hooked(self) -> list[nn.Module]:
        """The sources an offload hook manages now (accelerate sets ``_hf_hook`` on the instance)."""
        return [source for source in self.sources if "_hf_hook" in source.__dict__]


def role_of(arch: Architecture, index: int) -> ConnectionRole:
    """What connection ``index`` of a layer of ``arch`` is to observers: the sublayer it wraps (a parallel
    block's: named ``parallel``, owning every sublayer's weights)."""
    block, sublayers = arch.connections()[index]
    if arch.parallel:
        return ConnectionRole("parallel", "parallel", tuple(s.name for s in sublayers))
    return ConnectionRole(sublayers[0].name, arch.kind(index))


def attach(layer: nn.Module, block: str, conn: AddNorm, arch: Architecture, index: int) -> None:
    """Register ``conn`` as connection ``index`` of ``layer`` (a layer of ``arch``) under ``block``: its
    role for observers (:func:`role_of`), the HF models' recorded steps deciding its fusion
    (``fusion_model = "hf"``: :func:`addnorm.ops.fusion_decision`), the layer's train / eval mode."""
    conn.connection_role = role_of(arch, index)
    conn.fusion_model = "hf"
    conn.train(layer.training)
    layer.add_module(block, conn)


# per module class: whether FSDP2 manages it (``fully_shard`` gives a module a class of its own)
_FSDP_CLASSES: dict[type, bool] = {}


def _managed(module: nn.Module | None) -> bool:
    """Whether ``module`` has its parameters only inside its own forward: FSDP2 (``fully_shard``) or an
    offload hook (accelerate's ``_hf_hook``, set on the instance, as ``from_pretrained(device_map=...)``
    installs)."""
    if module is None:
        return False
    if "_hf_hook" in module.__dict__:
        return True
    cls = type(module)
    found = _FSDP_CLASSES.get(cls)
    if found is None:
        found = False
        if torch.distributed.is_available():
            from torch.distributed.fsdp import FSDPModule

            found = issubclass(cls, FSDPModule)
        _FSDP_CLASSES[cls] = found
    return found


def _plain_on(norm: nn.Module, device: torch.device) -> bool:
    """Whether ``norm``'s parameters are plain tensors (not DTensor shards) on ``device``."""
    for p in (getattr(norm, "weight", None), getattr(norm, "bias", None)):
        if p is None:
            continue
        if p.device != device:
            return False
        kind = type(p)
        if kind is not nn.Parameter and kind is not Tensor and type(p.data) is not Tensor:
            return False  # a tensor subclass (a DTensor shard) under its Parameter
    return True


class Handover:
    """The stream between two rewired layers: s and N(s), computed by the op that did the layer's last
    add, for the norm N that reads s next. Taken once, by that norm's reader, for that very s, unchanged
    since (its version counter: an in-place edit by a hook in between voids it)."""

    __slots__ = ("s", "version", "normed", "norm")

    def __init__(self) -> None:
        self.s = self.version = self.normed = self.norm = None

    def put(self, s: Tensor, normed: Tensor, norm: nn.Module) -> None:
        # compiled, the graph is traced as a whole (no version to read); an inference tensor has no
        # version counter: nothing to check an edit against, so no handover
        if torch.compiler.is_compiling():
            version = None
        elif s.is_inference():
            return
        else:
            version = s._version
        self.s, self.version, self.normed, self.norm = s, version, normed, norm

    def take(self, x: Tensor, norm: nn.Module | None) -> Tensor | None:
        """N(x) if the last layer left it for ``norm`` and this ``x``, not edited since, else None;
        forgets it either way (it holds the autograd graph)."""
        same = x is self.s and norm is self.norm and norm is not None
        same = same and (self.version is None or x._version == self.version)
        normed = self.normed if same else None
        self.s = self.version = self.normed = self.norm = None
        return normed


class _Entering(Stream):
    """The stream entering a layer: s, with N(s) already computed for the layer's first input norm."""

    __slots__ = ("normed", "norm")

    def __init__(self, s: Tensor, normed: Tensor, norm: nn.Module) -> None:
        super().__init__(s)
        self.normed, self.norm = normed, norm

    def read(self, norm: nn.Module | None, y_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
        if norm is self.norm:
            return self.value, self.normed
        return super().read(norm, y_dtype)


class LayerRun:
    """A rewired layer's ``forward``: its sublayers through their connections, over the stream.

    Called like the layer's own forward (the model's loop does not change); positional arguments after
    the hidden states are named as the layer's own forward names them. ``next_norm``: the norm that reads
    this layer's output (None: none that can take it from here); ``final_norm``: a norm this layer applies
    to its output itself (the last layer of a model that has no final norm but whose placement needs one).
    A step whose connection goes around several sublayers (a parallel block) runs F(h) = F_1(h) +
    F_2(h'), h' = ``second_norm`` of the layer's input where the block has one, else h. ``returns_tuple``:
    the layer gives ``(hidden_states, attention weights)`` as the family's own forward does (GPT-J,
    CodeGen, Falcon): the weights when the call asks for them (``output_attentions``), else None.
    Under the model's gradient checkpointing the layer runs checkpointed, fused within itself only.
    """

    def __init__(
        self,
        layer: nn.Module,
        steps: list[tuple[tuple[Sublayer, ...], Connection]],
        handover: Handover,
        *,
        next_norm: nn.Module | None = None,
        next_owner: nn.Module | None = None,
        final_norm: nn.Module | None = None,
        reads: Reads | None = None,
        second_norm: nn.Module | None = None,
        returns_tuple: bool = False,
    ) -> None:
        self.layer, self.steps, self.handover = layer, steps, handover
        self.second_norm, self.returns_tuple = second_norm, returns_tuple
        self.first_norm = steps[0][1].conn.input_norm
        self.next_norm, self.next_owner, self.final_norm = next_norm, next_owner, final_norm
        self.reads = reads or Reads()
        params = list(inspect.signature(type(layer).forward).parameters.values())[2:]
        self.arg_names = tuple(p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD)

    def __call__(self, *args, **kwargs) -> Tensor:
        if args:
            hidden_states, rest = args[0], args[1:]
            if len(rest) > len(self.arg_names):
                raise TypeError(f"{type(self.layer).__name__}: too many positional arguments ({len(args)})")
            kwargs.update(zip(self.arg_names, rest, strict=False))
        else:
            hidden_states = kwargs.pop("hidden_states")
        layer = self.layer
        weights = self.returns_tuple and kwargs.get("output_attentions")
        run = self._run_keeping_weights if weights else self._run
        if getattr(layer, "gradient_checkpointing", False) and layer.training:
            kwargs.update((k, v) for k, v in _CACHE_OFF.items() if k in kwargs)
            out = layer._gradient_checkpointing_func(
                functools.partial(run, local=True, **kwargs), hidden_states
            )
        else:
            out = run(hidden_states, **kwargs)
        return (out, None) if self.returns_tuple and not weights else out

    def _run(self, x: Tensor, local: bool = False, **kwargs) -> Tensor:
        hooked = self.reads.hooked()
        if not hooked:
            return self._through(x, local, **kwargs)
        for source in hooked:
            source._hf_hook.pre_forward(source)
        try:
            return self._through(x, local, **kwargs)
        finally:
            for source in hooked:
                source._hf_hook.post_forward(source, None)

    def _run_keeping_weights(self, x: Tensor, local: bool = False, **kwargs) -> tuple[Tensor, Tensor | None]:
        """:meth:`_run` and the attention weights the layer returns: the second output of its first
        sublayer's module (``Sublayer.name``), read by a forward hook held for this call only."""
        kept = []
        module = self.layer.get_submodule(self.steps[0][0][0].name)
        handle = module.register_forward_hook(
            lambda module, args, output: kept.append(output[1] if isinstance(output, tuple) else None)
        )
        try:
            out = self._run(x, local, **kwargs)
        finally:
            handle.remove()
        return out, kept[-1] if kept else None

    def _through(self, x: Tensor, local: bool, **kwargs) -> Tensor:
        normed = None if local else self.handover.take(x, self.first_norm)
        stream = Stream(x) if normed is None else _Entering(x, normed, self.first_norm)
        for sublayers, connection in self.steps:
            stream = connection(stream, self._sublayer(sublayers, x, kwargs))
        if self.final_norm is not None:
            return stream.output(self.final_norm)
        if (
            local
            or stream.held is None
            or not self._may_read_next()
            or not _plain_on(self.next_norm, stream.held.residual.device)
        ):
            return stream.tensor()
        s, normed = stream.read(self.next_norm)
        self.handover.put(s, normed, self.next_norm)
        return s

    def _sublayer(self, sublayers: tuple[Sublayer, ...], x: Tensor, kwargs: dict):
        """F for one connection: the sublayer's call, or a parallel block's sum of its sublayers' calls,
        the second reading its own norm of the layer's input ``x`` where it has one."""
        layer = self.layer
        if len(sublayers) == 1:
            return functools.partial(sublayers[0].call, layer, **kwargs)
        first, second = sublayers

        def parallel(h: Tensor) -> Tensor:
            h2 = h if self.second_norm is None else self.second_norm(x)
            return first.call(layer, h, **kwargs) + second.call(layer, h2, **kwargs)

        return parallel

    def _may_read_next(self) -> bool:
        """Whether this layer may compute the next norm (see the module docstring): it and the norm's
        owner unmanaged (and then the norm's parameters, read at the call, plain tensors on the stream's
        device)."""
        return self.next_norm is not None and not _managed(self.layer) and not _managed(self.next_owner)


class FinalNorm:
    """The ``forward`` of the model's final norm module: N(x) left by the last layer, or its own
    ``forward`` (``own``: the one it had before)."""

    def __init__(self, module: nn.Module, norm: nn.Module, handover: Handover, own) -> None:
        self.module, self.norm, self.handover, self.own = module, norm, handover, own

    def __call__(self, x: Tensor) -> Tensor:
        normed = self.handover.take(x, self.norm)
        return self.own(x) if normed is None else normed


def _forward_slot(module: nn.Module) -> str:
    """Where a module's forward is replaced: under an accelerate hook its ``_old_forward`` (which the
    hook calls after moving the parameters in), else ``forward``."""
    return "_old_forward" if hasattr(module, "_hf_hook") and hasattr(module, "_old_forward") else "forward"


def _replace_forward(module: nn.Module, fn, rewiring: Rewiring) -> None:
    slot = _forward_slot(module)
    rewiring.replaced.append((module, slot, module.__dict__.get(slot)))
    setattr(module, slot, fn)


def _identity(x: Tensor) -> Tensor:
    """The forward of a residual dropout whose work the fused op's dropout does."""
    return x


@dataclass
class Rewiring:
    """What addnorm changed in a model (kept on its base model), so that it can be undone: ``kind``
    ``"fused"`` (:func:`addnorm.hf.fuse`) or ``"placement"`` (:func:`addnorm.hf.with_placement`)."""

    kind: str
    arch: Architecture
    layers: list[nn.Module]
    connections: list[list[AddNorm]]
    handover: Handover = field(default_factory=Handover)
    final_module: nn.Module | None = None
    silenced: list[nn.Module] = field(default_factory=list)
    reads: list[Reads] | None = None
    replaced: list[tuple[nn.Module, str, object]] = field(default_factory=list)
    second_norms: list[nn.Module | None] | None = None


def rewiring_of(model: nn.Module) -> Rewiring | None:
    """The rewiring of a (base) Hugging Face model, or None for an untouched one."""
    return getattr(model.base_model, _ATTRIBUTE, None)


def install(
    model: nn.Module,
    rewiring: Rewiring,
    *,
    final_norm: nn.Module | None = None,
    applied_final_norm: nn.Module | None = None,
    b2t: bool = False,
) -> None:
    """Give each layer of ``rewiring`` its :class:`LayerRun` over its connections (one per sublayer, in
    order; a B2T layer's first keeps its input for the last), silence the residual dropouts the op
    replaces, and let the model's final norm module take its input's norm from the last layer.
    ``final_norm``: the norm (computed by the op) that the model's final norm module applies;
    ``applied_final_norm``: a final norm the last layer applies itself."""
    arch, layers, conns = rewiring.arch, rewiring.layers, rewiring.connections
    groups = [sublayers for _, sublayers in arch.connections()]
    steps = []
    for blocks in conns:
        last = len(blocks) - 1
        connections = [
            Connection(c, keeps_layer_input=b2t and i == 0, adds_layer_input=b2t and i == last)
            for i, c in enumerate(blocks)
        ]
        steps.append(list(zip(groups, connections, strict=True)))
    second_norms = rewiring.second_norms or [None] * len(layers)
    nexts = [blocks[0].input_norm for blocks in conns[1:]] + [final_norm]
    owners = [*layers[1:], rewiring.final_module]
    reads = rewiring.reads or [Reads() for _ in layers]
    for i, layer in enumerate(layers):
        run = LayerRun(
            layer,
            steps[i],
            rewiring.handover,
            next_norm=nexts[i],
            next_owner=owners[i],
            final_norm=applied_final_norm if i == len(layers) - 1 else None,
            reads=reads[i],
            second_norm=second_norms[i],
            returns_tuple=arch.returns_tuple,
        )
        _replace_forward(layer, run, rewiring)
        for sublayer in arch.sublayers:
            for path in sublayer.silenced:
                dropout = layer.get_submodule(path)
                dropout.forward = _identity
                rewiring.silenced.append(dropout)
    module = rewiring.final_module
    if module is not None and final_norm is not None:
        own = getattr(module, _forward_slot(module))
        _replace_forward(module, FinalNorm(module, final_norm, rewiring.handover, own), rewiring)
    setattr(model.base_model, _ATTRIBUTE, rewiring)


def uninstall(model: nn.Module) -> Rewiring:
    """Undo :func:`install`: every shadowing ``forward`` deleted; returns the rewiring removed."""
    rewiring = rewiring_of(model)
    if rewiring is None:
        raise ValueError(f"model: {type(model).__name__} is not rewired by addnorm.hf")
    for module in rewiring.silenced:
        module.__dict__.pop("forward", None)
    for module, slot, before in reversed(rewiring.replaced):
        if before is None:
            module.__dict__.pop(slot, None)
        else:
            setattr(module, slot, before)
    rewiring.silenced.clear()
    rewiring.replaced.clear()
    delattr(model.base_model, _ATTRIBUTE)
    return rewiring
