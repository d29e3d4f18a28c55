"""Teaching addnorm.hf a family: :func:`register_architecture` validates a record, checks it on a tiny
random model of each type it names (the fused model must be the model), and registers it;
:func:`unregister_architecture` takes it back.

The check: a model built by ``transformers`` from the type's config class at tiny sizes (every float
config field whose name holds ``multiplier`` or ``_scaling`` and is 1.0 set to another value, so that a
sublayer call that forgets one shows; every 1-D parameter moved off its initial value, so that a norm in
the wrong slot shows), in eval mode, against a fused copy: each layer's output, the logits, and every
gradient of a fixed function of the logits, to float32 rounding. The first layer that differs is named.
Nothing of it changes torch's random state.
"""

from __future__ import annotations

import copy
import dataclasses
import types

import torch
from torch import nn

from ..norms import NORMS
from ..placements import PLACEMENTS, get_placement
from .architectures import ARCHITECTURES, SUBLAYER_KINDS, Architecture, ConfigSpec, Sublayer, resolve
from .fuse import fuse
from .tiny import config_fields, model_from_config

__all__ = ["register_architecture", "same_record", "unregister_architecture"]

_OP_NORMS = ("rmsnorm", "layernorm")
_TOLERANCE = 1e-4  # relative to the largest value compared: float32 rounding, far below a wrong record


def register_architecture(
    model_types: str | tuple[str, ...],
    architecture: Architecture,
    *,
    replace: bool = False,
    check: bool = True,
) -> Architecture:
    """Teach addnorm.hf a model family: ``architecture`` (one :class:`Architecture` record: where the
    layers and norms are, how each sublayer is called and what it returns, which weights play which
    role) under each ``config.model_type`` in ``model_types``. ``fuse``, ``with_placement``,
    ``from_pretrained``, ``Probe`` and ``tiny_model`` then take models of those types; no patch of
    addnorm is needed. Returns ``architecture``.

    The record is validated (placement and norm names, each connection's norm slots against the
    placement's) and, with ``check`` (needs ``transformers``), tried on a tiny random model of each new
    type: a record that changes the model is refused, naming the first layer that differs (see the
    module docstring). Registering the same record again is a no-op (a notebook cell run twice); a
    different record for a registered type needs ``replace=True``."""
    if not isinstance(architecture, Architecture):
        got = type(architecture).__name__
        raise TypeError(f"architecture: expected an addnorm.hf.Architecture, got {got}")
    types_ = (model_types,) if isinstance(model_types, str) else model_types
    if not isinstance(types_, tuple) or not types_ or not all(isinstance(t, str) and t for t in types_):
        raise ValueError(f"model_types: expected a model type name or a tuple of them, got {model_types!r}")
    if not isinstance(replace, bool) or not isinstance(check, bool):
        raise TypeError(f"replace, check: expected True or False, got {replace!r}, {check!r}")
    validate(architecture)
    new = []
    for model_type in types_:
        if model_type in ARCHITECTURES:
            if same_record(ARCHITECTURES[model_type], architecture):
                continue
            if not replace:
                name = ARCHITECTURES[model_type].name
                raise ValueError(
                    f"model_types: {model_type!r} is already registered (record {name!r}, a different one); "
                    "pass replace=True to replace it"
                )
        new.append(model_type)
    for model_type in new:
        if check:
            check_record(model_type, architecture)
        if model_type in ARCHITECTURES:
            ARCHITECTURES.unregister(model_type)
        ARCHITECTURES.register(model_type, architecture)
    return architecture


def unregister_architecture(model_types: str | tuple[str, ...]) -> None:
    """Forget the records of ``model_types`` (one-line error for a type that is not registered)."""
    for model_type in (model_types,) if isinstance(model_types, str) else tuple(model_types):
        if model_type not in ARCHITECTURES:
            raise ValueError(
                f"model_types: {model_type!r} is not registered; registered: {', '.join(ARCHITECTURES)}"
            )
        ARCHITECTURES.unregister(model_type)


# --- validation -----------------------------------------------------------------------------------------
def validate(arch: Architecture) -> None:
    """One-line ``ValueError``s for a record addnorm cannot use, naming the field."""
    if arch.placement not in PLACEMENTS:
        raise ValueError(
            f"architecture.placement: unknown placement {arch.placement!r}; expected one of: "
            f"{', '.join(PLACEMENTS)}"
        )
    if arch.norm not in NORMS or NORMS.resolve(arch.norm) not in _OP_NORMS:
        raise ValueError(
            f"architecture.norm: expected 'rmsnorm' or 'layernorm' (the norms the fused op computes), "
            f"got {arch.norm!r}"
        )
    if arch.stack not in ("decoder", "encoder"):
        raise ValueError(f"architecture.stack: expected 'decoder' or 'encoder', got {arch.stack!r}")
    eps = arch.norm_eps
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (str, int, float))):
        raise ValueError(f"architecture.norm_eps: expected None, an attribute name or a number, got {eps!r}")
    if not isinstance(arch.config, ConfigSpec) or arch.config.lm not in ("causal", "masked"):
        raise ValueError(
            "architecture.config: expected an addnorm.hf.ConfigSpec (lm 'causal' or 'masked'), "
            f"got {arch.config!r}"
        )
    if not isinstance(arch.sublayers, tuple) or not arch.sublayers:
        raise ValueError(
            f"architecture.sublayers: expected a non-empty tuple of Sublayer, got {arch.sublayers!r}"
        )
    if arch.parallel and len(arch.sublayers) != 2:
        raise ValueError(
            f"architecture.sublayers: a parallel block has two sublayers, got {len(arch.sublayers)}"
        )
    slots = set(get_placement(arch.placement).norm_slots)
    for sublayer in arch.sublayers:
        if not isinstance(sublayer, Sublayer):
            raise ValueError(
                f"architecture.sublayers: expected Sublayer records, got {type(sublayer).__name__}"
            )
        where = f"architecture.sublayers[{sublayer.name!r}]"
        if not callable(sublayer.call):
            raise ValueError(f"{where}.call: expected a callable (layer, h, **kwargs) -> tensor")
        if sublayer.kind is not None and sublayer.kind not in SUBLAYER_KINDS:
            raise ValueError(f"{where}.kind: expected one of {SUBLAYER_KINDS}, got {sublayer.kind!r}")
        have = set(sublayer.norm_paths())
        if arch.parallel and sublayer is not arch.sublayers[0]:
            have -= {"input_norm"}  # a parallel block's second input norm is a branch's own
            want = slots - {"input_norm"}
        else:
            want = slots
        if have != want:
            raise ValueError(
                f"{where}: placement {arch.placement!r} has norm slots {sorted(want)}, the record names "
                f"{sorted(have)}"
            )


def _key(value: object) -> object:
    """What two records are compared by: fields, with functions compared by their code (a notebook cell
    run twice defines new function objects with the same code)."""
    if isinstance(value, types.FunctionType):
        cells = tuple(_key(c.cell_contents) for c in value.__closure__ or ())
        return ("function", value.__module__, value.__qualname__, value.__code__, cells)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__qualname__, *(_key(getattr(value, f.name)) for f in dataclasses.fields(value)))
    if isinstance(value, (tuple, list)):
        return tuple(_key(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    return value


def same_record(a: Architecture, b: Architecture) -> bool:
    """Whether two records describe the same thing (functions compared by their code)."""
    return a is b or _key(a) == _key(b)


def _line(err: BaseException) -> str:
    """An exception as one line: its type and the first line of its message."""
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__


# --- the self-check --------------------------------------------------------------------------------------
def _check_config(transformers, model_type: str, arch: Architecture):
    fields = config_fields(arch, layers=2, hidden=32, heads=4, vocab=64, positions=64, dropout=0.0)
    try:
        config = transformers.AutoConfig.for_model(model_type, **fields)
    except Exception as err:  # noqa: BLE001 (transformers' own errors, many kinds): named in one line
        raise ValueError(
            f"model_types: cannot build a {model_type!r} config to check the record ({_line(err)}); "
            "pass check=False to skip the check"
        ) from None
    for name, value in config.to_dict().items():
        if isinstance(value, float) and value == 1.0 and ("multiplier" in name or name.endswith("_scaling")):
            setattr(config, name, 0.5 + 0.125 * (len(name) % 4))
    return config


def _layer_outputs(model: nn.Module, layers: list[nn.Module], ids: torch.Tensor):
    outs: list[torch.Tensor] = []

    def keep(module, args, output):
        outs.append((output[0] if isinstance(output, tuple) else output).detach().clone())

    handles = [layer.register_forward_hook(keep) for layer in layers]
    try:
        model.zero_grad(set_to_none=True)
        logits = model(input_ids=ids).logits
        weights = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
        (logits.float() * weights).sum().backward()
    finally:
        for h in handles:
            h.remove()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return outs, logits.detach(), grads


def _differs(a: torch.Tensor, b: torch.Tensor) -> float | None:
    """The largest difference of ``a`` from ``b`` if it is beyond float32 rounding, else None."""
    if a.shape != b.shape:
        return float("inf")
    diff = (a.double() - b.double()).abs().max().item()
    return diff if diff > _TOLERANCE * (1.0 + b.double().abs().max().item()) else None


def check_record(model_type: str, arch: Architecture) -> None:
    """Fuse a copy of a tiny random ``model_type`` model under ``arch`` and compare it with the model (see
    the module docstring); a one-line ``ValueError`` naming the first layer that differs."""
    from .architectures import require_transformers

    transformers = require_transformers()
    before = ARCHITECTURES[model_type] if model_type in ARCHITECTURES else None
    with torch.random.fork_rng(devices=[]):
        config = _check_config(transformers, model_type, arch)
        torch.manual_seed(0)
        try:
            plain = model_from_config(config, arch).eval()
        except Exception as err:  # noqa: BLE001
            raise ValueError(
                f"model_types: transformers cannot build a tiny {model_type!r} model to check the record "
                f"({_line(err)}); pass check=False to skip the check"
            ) from None
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for p in plain.parameters():
                if p.ndim == 1:
                    p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        ids = torch.randint(3, config.vocab_size, (2, 7), generator=gen)
        if before is not None:
            ARCHITECTURES.unregister(model_type)
        ARCHITECTURES.register(model_type, arch)
        try:
            _compare(model_type, arch, plain, ids)
        finally:
            ARCHITECTURES.unregister(model_type)
            if before is not None:
                ARCHITECTURES.register(model_type, before)


def _compare(model_type: str, arch: Architecture, plain: nn.Module, ids: torch.Tensor) -> None:
    refuse = f"architecture: the {arch.name!r} record changes the {model_type!r} model"
    resolved = resolve(arch, plain.config)
    try:
        for layer in resolved.layers_of(plain):
            resolved.weights(layer, plain.config)  # every weight path it names exists
        fused = fuse(copy.deepcopy(plain))
    except (AttributeError, KeyError, IndexError, TypeError) as err:
        raise ValueError(
            f"architecture: the {arch.name!r} record does not fit a {model_type!r} model: {err}"
        ) from None
    prefix = f"{plain.base_model_prefix}.{resolved.layers}" if plain.base_model_prefix else resolved.layers
    try:
        expected, logits, grads = _layer_outputs(plain, resolved.layers_of(plain), ids)
        got, f_logits, f_grads = _layer_outputs(fused, resolved.layers_of(fused), ids)
    except Exception as err:  # noqa: BLE001 (a sublayer call that does not fit the layer: one line)
        raise ValueError(f"{refuse}: the fused model fails ({_line(err)})") from None
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        diff = _differs(a, b)
        if diff is not None:
            raise ValueError(
                f"{refuse}: layer {i} ({prefix}.{i}) output differs by {diff:.3g}; each sublayer call must "
                "return what the layer adds to its stream (residual multipliers included)"
            )
    diff = _differs(f_logits, logits)
    if diff is not None:
        raise ValueError(f"{refuse}: the logits differ by {diff:.3g} (after the last layer: the final norm?)")
    for name, grad in grads.items():
        diff = _differs(f_grads[name], grad) if name in f_grads else float("inf")
        if diff is not None:
            where = name.removeprefix(prefix + ".").split(".", 1)[0]
            layer = f"layer {where} ({prefix}.{where})" if where.isdigit() else name
            raise ValueError(f"{refuse}: the gradient of {name} ({layer}) differs by {diff:.3g}")
