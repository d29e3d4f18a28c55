"""Probe: observe a model's residual stream and weight gradients per layer — never modify them.

``with Probe(model) as probe: loss = ...; loss.backward()`` records, for every layer and every
sublayer connection in it:

- forward statistics of the residual stream (the connection's output): mean, std (population,
  correction 0) and RMS = sqrt(mean(x^2));
- the L2 norm of the gradient of the loss with respect to that stream, ||dL/dx||, through a tensor
  hook registered during the forward (on the output, or on the tensor a point names, below);
- the L2 norms of each weight matrix and of its gradient ``p.grad`` (read at :meth:`Probe.snapshot`).

These are the quantities Xiong et al. 2020 ("On Layer Normalization in the Transformer
Architecture") use to show that Post-LN's gradients grow toward the top layers at initialisation
while Pre-LN's stay flat. The hooks return ``None``, so outputs and gradients are unchanged; they
are removed when the ``with`` block ends (the recorded values stay readable).

Depends only on ``torch.nn``: addnorm layers are recognised by duck typing — a module whose direct
children include connections (modules with a ``connection_role`` attribute and a ``stream_out`` point:
``addnorm.AddNorm``), each observed at its ``stream_out`` point and named by its role
(``addnorm.connection.ConnectionRole``: the sublayer's name, the layer attributes holding its weights), which
addnorm's layers and the Hugging Face rewiring set. A point may be called as ``point(s, grad_from=r,
grad_scale=a)``: then the stream's gradient is r's divided by a (the stream left a fused op together
with the next norm, so r, the op's residual input, carries it; see ``addnorm.connection.ObservationPoint``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

METRICS = ("grad_norm", "act_mean", "act_std", "act_rms", "weight_grad_norm", "weight_norm")

LayerSelector = str | Callable[[str, nn.Module], bool] | Sequence[nn.Module] | None


def _is_connection(module: nn.Module) -> bool:
    """Duck-typed connection check: a residual connection (``AddNorm`` or a subclass) says so by its
    ``connection_role`` attribute (None until a layer gives it one) beside its ``stream_out`` point."""
    return hasattr(module, "connection_role") and isinstance(getattr(module, "stream_out", None), nn.Module)


def _addnorm_children(module: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, child) for name, child in module.named_children() if _is_connection(child)]


def _role(name: str, conn: nn.Module) -> tuple[str, tuple[str, ...]]:
    """(sublayer name, attributes holding its weights) of a connection registered as ``name``: from its
    role; a connection without one is named ``name`` and owns no weights."""
    role = conn.connection_role
    return (name, ()) if role is None else (role.sublayer, tuple(role.weights))


def _layer_list(model: nn.Module) -> nn.ModuleList | None:
    """The longest ModuleList of modules of one class: a model's layers where they live elsewhere than
    ``model.layers`` (Hugging Face: ``model.layers``, ``transformer.h``, ``bert.encoder.layer``)."""
    best = None
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    return best


def _wide(t: Tensor) -> Tensor:
    """t whole (a DTensor, such as an FSDP2-sharded weight or its gradient, gathered from its ranks)
    and in at least float32 for statistics (float64 stays float64)."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    return t if t.dtype == torch.float64 else t.float()


def _first_tensor(output: object) -> Tensor | None:
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], Tensor):
        return output[0]
    return None


@dataclass
class _Site:
    """One observed point of the residual stream: a sublayer connection's output or a layer's output."""

    sublayer: str  # "" for the whole layer
    module: nn.Module | None  # the module whose forward hook records the site; None: not hooked
    params: dict[str, nn.Parameter]  # >= 2-D parameters owned by this site, names relative to the layer
    act: dict[str, Tensor] = field(default_factory=dict)  # act_mean/act_std/act_rms, 0-dim, detached
    grad_norm: Tensor | None = None


@dataclass
class _Layer:
    index: int
    name: str
    module: nn.Module
    sites: dict[str, _Site]  # sublayer name -> site; always has "" (the layer's output)
    last: _Site | None = None  # the connection that ran last: its output is the layer's output

    def values(self, site: _Site) -> tuple[dict[str, Tensor], Tensor | None]:
        """(activation stats, stream grad norm) recorded for a site; a layer with AddNorm connections
        has as its own output that of the connection that ran last."""
        if site.module is None:
            site = self.last or site
        return site.act, site.grad_norm


class Probe:
    """Per-layer gradient norms and activation statistics through hooks (observe, never modify).

    Args:
        model: any ``nn.Module``.
        layers: which modules are the layers.

            - ``None``: for addnorm models (and models rewired by ``addnorm.hf``), the modules of
              ``model.layers`` or else every submodule with ``AddNorm`` children; for other models,
              ``model.layers`` if it is a ModuleList (e.g. ``torch.nn.TransformerEncoder``), else the
              longest ModuleList of modules of one class (a Hugging Face model's ``model.layers``,
              ``transformer.h``, ``bert.encoder.layer``).
            - a string attribute path such as ``"layers"`` or ``"encoder.layers"`` (a ModuleList or
              Sequential gives its children; another module is one layer);
            - a callable ``(name, module) -> bool`` over ``model.named_modules()``;
            - an explicit sequence of modules.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.

    Within a layer, each ``AddNorm`` child is a sublayer named by its ``connection_role`` (``self_attn``,
    ``ff``; a child without a role by its attribute name) whose weight matrices are the >= 2-D
    parameters of the layer's children the role names (e.g. ``ff.w1.weight``).
    The layer's own output is sublayer ``""``, and owns the layer's remaining >= 2-D parameters
    (all of them for a layer without AddNorm children). Each parameter belongs to one site only.
    A layer with AddNorm children is observed at its connections' ``stream_out`` points (inside a
    stack, a layer passes the stream on as an ``addnorm.model.stream.Stream``, not a tensor), and its
    ``""`` values are those of the connection that ran last.

    Recorded values are from the most recent forward/backward through each site.
    """

    def __init__(self, model: nn.Module, layers: LayerSelector = None) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        self.model = model
        self._layers = [self._build_layer(i, name, m) for i, (name, m) in enumerate(self._select(layers))]
        self._handles: list = []

    # --- layer selection ----------------------------------------------------------------------------
    def _names(self) -> dict[int, str]:
        return {id(m): name for name, m in self.model.named_modules()}

    def _select(self, layers: LayerSelector) -> list[tuple[str, nn.Module]]:
        model = self.model
        names = self._names()

        def named(mods: Iterable[nn.Module]) -> list[tuple[str, nn.Module]]:
            return [(names.get(id(m), f"layer{i}"), m) for i, m in enumerate(mods)]

        if layers is None:
            stack = getattr(model, "layers", None)
            if isinstance(stack, (nn.ModuleList, nn.Sequential)) and any(_addnorm_children(m) for m in stack):
                return named(stack)
            found = [(n, m) for n, m in model.named_modules() if _addnorm_children(m)]
            if found:
                return found
            if isinstance(stack, (nn.ModuleList, nn.Sequential)) and len(stack):
                return named(stack)
            stack = _layer_list(model)
            if stack is not None:
                return named(stack)
            raise ValueError(
                f"layers: found no layers in {type(model).__name__} (no AddNorm connections and no "
                "ModuleList of layers); pass layers= as an attribute path, a (name, module) -> bool "
                "callable, or a list of modules"
            )
        if isinstance(layers, str):
            try:
                target = model.get_submodule(layers) if layers else model
            except AttributeError as err:
                raise ValueError(
                    f"layers: {layers!r} is not a submodule path of {type(model).__name__} ({err})"
                ) from None
            if isinstance(target, (nn.ModuleList, nn.Sequential)):
                selected = named(target)
            else:
                selected = [(layers, target)]
        elif callable(layers) and not isinstance(layers, nn.Module):
            selected = [(n, m) for n, m in model.named_modules() if layers(n, m)]
        elif isinstance(layers, Sequence) and all(isinstance(m, nn.Module) for m in layers):
            selected = named(layers)
        else:
            raise TypeError(
                "layers: expected None, an attribute path (str), a callable (name, module) -> bool "
                f"or a sequence of nn.Module, got {type(layers).__name__}"
            )
        if not selected:
            raise ValueError(f"layers: selector {layers!r} matched no module of {type(model).__name__}")
        return selected

    @staticmethod
    def _build_layer(index: int, name: str, layer: nn.Module) -> _Layer:
        sites: dict[str, _Site] = {}
        owned: set[int] = set()
        for child_name, conn in _addnorm_children(layer):
            sub, holders = _role(child_name, conn)
            params: dict[str, nn.Parameter] = {}
            for holder in holders:
                owner = getattr(layer, holder, None)
                if isinstance(owner, nn.Module) and owner is not conn:
                    for pname, p in owner.named_parameters():
                        if p.ndim >= 2 and id(p) not in owned:
                            params[f"{holder}.{pname}"] = p
                            owned.add(id(p))
            sites[sub] = _Site(sub, conn.stream_out, params)
        rest = {n: p for n, p in layer.named_parameters() if p.ndim >= 2 and id(p) not in owned}
        sites[""] = _Site("", None if sites else layer, rest)
        return _Layer(index, name or type(layer).__name__, layer, sites)

    # --- hooks ----------------------------------------------------------------------------------------
    @staticmethod
    def _forward_hook(layer: _Layer, site: _Site) -> Callable:
        def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if torch._C._current_graph_task_id() != -1:
                # inside backward: activation checkpointing recomputing the forward, which the forward
                # pass already observed (and which may stop before the layer's last connection)
                return None
            out = _first_tensor(output)
            if out is None or out.is_nested:
                return None
            if site.sublayer:
                layer.last = site
            with torch.no_grad():
                x = _wide(out.detach())
                site.act = {
                    "act_mean": x.mean(),
                    "act_std": x.std(correction=0) if x.numel() else x.sum(),
                    "act_rms": x.square().mean().sqrt(),
                }
            carrier = kwargs.get("grad_from")
            carrier, scale = (out, 1.0) if carrier is None else (carrier, kwargs.get("grad_scale", 1.0))

            def grad_hook(grad: Tensor) -> None:
                site.grad_norm = torch.linalg.vector_norm(_wide(grad.detach())) / abs(scale)
                return None

            if torch.is_grad_enabled() and carrier.requires_grad:
                carrier.register_hook(grad_hook)
            return None

        return hook

    def attach(self) -> Probe:
        """Register the forward hooks (idempotent). ``with Probe(...)`` calls it."""
        if not self._handles:
            for layer in self._layers:
                for site in layer.sites.values():
                    if site.module is not None:
                        hook = self._forward_hook(layer, site)
                        self._handles.append(site.module.register_forward_hook(hook, with_kwargs=True))
        return self

    def detach(self) -> None:
        """Remove every hook; the recorded values stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> Probe:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def clear(self) -> None:
        """Forget recorded stream statistics and gradient norms (never touches ``p.grad``)."""
        for layer in self._layers:
            layer.last = None
            for site in layer.sites.values():
                site.act = {}
                site.grad_norm = None

    # --- reading --------------------------------------------------------------------------------------
    @property
    def layer_names(self) -> list[str]:
        return [layer.name for layer in self._layers]

    @property
    def sublayers(self) -> list[list[str]]:
        """Per layer, its sublayer names ("" is the layer's output)."""
        return [list(layer.sites) for layer in self._layers]

    def __len__(self) -> int:
        return len(self._layers)

    def snapshot(self, step: int | None = None) -> list[dict]:
        """Every recorded value as rows ``{step, layer, layer_name, sublayer, metric, param, value}``.

        ``metric`` is one of :data:`METRICS`; ``param`` names the weight (relative to the layer) for
        ``weight_grad_norm``/``weight_norm`` and is ``None`` for stream metrics. Weight gradients are
        read from ``p.grad`` now (absent when ``p.grad`` is None).

        Args:
            step: the training step the rows are tagged with.

        Returns:
            One dict per recorded value.
        """
        rows: list[dict] = []

        def row(layer: _Layer, site: _Site, metric: str, value: Tensor, param: str | None = None) -> None:
            rows.append(
                {
                    "step": step,
                    "layer": layer.index,
                    "layer_name": layer.name,
                    "sublayer": site.sublayer,
                    "metric": metric,
                    "param": param,
                    "value": float(value),
                }
            )

        with torch.no_grad():
            for layer in self._layers:
                for site in layer.sites.values():
                    act, grad_norm = layer.values(site)
                    if grad_norm is not None:
                        row(layer, site, "grad_norm", grad_norm)
                    for metric, value in act.items():
                        row(layer, site, metric, value)
                    for pname, p in site.params.items():
                        if p.grad is not None:
                            row(
                                layer,
                                site,
                                "weight_grad_norm",
                                torch.linalg.vector_norm(_wide(p.grad)),
                                pname,
                            )
                        row(layer, site, "weight_norm", torch.linalg.vector_norm(_wide(p.detach())), pname)
        return rows

    def _site(self, layer: _Layer, sublayer: str) -> _Site:
        if sublayer not in layer.sites:
            raise ValueError(
                f"sublayer: layer {layer.name!r} has no sublayer {sublayer!r}; "
                f"expected one of {list(layer.sites)}"
            )
        return layer.sites[sublayer]

    def weight_grad_norms(self, sublayer: str | None = "ff", param: str | None = None) -> list[float]:
        """Per layer, the gradient norm of a sublayer's weight matrices: sqrt(sum_p ||grad p||^2).

        ``sublayer=None`` takes every >= 2-D parameter of the layer; ``param`` picks one matrix by its
        name relative to the layer (``"ff.w1.weight"``) or to the sublayer (``"w1"``, ``"w1.weight"``).
        A layer with no gradient yet gives ``nan``.
        """
        out: list[float] = []
        for layer in self._layers:
            params = self._params_of(layer, sublayer)
            if param is not None:
                prefix = f"{sublayer}." if sublayer else ""
                wanted = {param, f"{param}.weight", f"{prefix}{param}", f"{prefix}{param}.weight"}
                params = {n: p for n, p in params.items() if n in wanted}
                if not params:
                    raise ValueError(
                        f"param: no weight matrix {param!r} in sublayer {sublayer!r} of layer "
                        f"{layer.name!r}; expected one of {list(self._params_of(layer, sublayer))}"
                    )
            grads = [p.grad for p in params.values() if p.grad is not None]
            if not grads:
                out.append(math.nan)
                continue
            with torch.no_grad():
                total = sum(torch.linalg.vector_norm(_wide(g)).square() for g in grads)
            out.append(float(total) ** 0.5)
        return out

    def _params_of(self, layer: _Layer, sublayer: str | None) -> dict[str, nn.Parameter]:
        if sublayer is None:
            return {n: p for s in layer.sites.values() for n, p in s.params.items()}
        return self._site(layer, sublayer).params

    def stream_grad_norms(self, sublayer: str | None = None) -> list[float]:
        """Per layer, ||dL/d(stream)|| at a sublayer's output (``None``/``""``: the layer's output)."""
        values = [layer.values(self._site(layer, sublayer or "")) for layer in self._layers]
        return [math.nan if grad is None else float(grad) for _, grad in values]

    def activation_rms(self, sublayer: str | None = None) -> list[float]:
        """Per layer, RMS of the stream at a sublayer's output (``None``/``""``: the layer's output)."""
        values = [layer.values(self._site(layer, sublayer or "")) for layer in self._layers]
        return [float(act["act_rms"]) if act else math.nan for act, _ in values]

    def __repr__(self) -> str:
        state = "attached" if self._handles else "detached"
        return f"Probe({type(self.model).__name__}, {len(self._layers)} layers, {state})"
