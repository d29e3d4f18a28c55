"""``from_pretrained(name_or_path, ...)``: transformers' ``from_pretrained`` for models re-placed by
:func:`addnorm.hf.with_placement`, and for any other model exactly transformers' own."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from .architectures import require_transformers
from .placement import CONFIG_KEY, ORIGINAL_TYPE, with_placement

__all__ = ["from_pretrained"]

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"
_HUB = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder", "proxies")
_LOADING = ("dtype", "torch_dtype", "attn_implementation", "experts_implementation", "quantization_config")


def _file(transformers, name_or_path, filename: str, hub: dict) -> str | None:
    """The local path of ``filename`` in a directory or hub repository (downloaded if need be), or None."""
    return transformers.utils.cached_file(
        name_or_path, filename, _raise_exceptions_for_missing_entries=False, **hub
    )


def _state_dict(transformers, name_or_path, hub: dict) -> dict[str, torch.Tensor]:
    """The tensors of a ``save_pretrained`` checkpoint (one safetensors file or an index of shards)."""
    from safetensors.torch import load_file

    single = _file(transformers, name_or_path, _SINGLE, hub)
    if single is not None:
        return load_file(single)
    index = _file(transformers, name_or_path, _INDEX, hub)
    if index is None:
        where = f"pretrained_model_name_or_path: {str(name_or_path)!r}"
        raise ValueError(f"{where} holds no {_SINGLE} or {_INDEX}")
    shards = sorted(set(json.loads(Path(index).read_text())["weight_map"].values()))
    return {k: v for s in shards for k, v in load_file(_file(transformers, name_or_path, s, hub)).items()}


def _saved_names(model: nn.Module, keys: list[str]) -> dict[str, str]:
    """The name each of ``keys`` has in the checkpoint: ``save_pretrained`` renames keys by the family's
    checkpoint conversion (Mixtral's ``.mlp`` is saved as ``.block_sparse_moe``), the connections' too."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    return {k: next(iter(revert_weight_conversion(model, {k: state[k]}))) for k in keys}


@contextmanager
def _quiet(transformers):
    """transformers' load report off: the re-placed model's norms are loaded after it, by addnorm."""
    logging = transformers.utils.logging
    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def from_pretrained(pretrained_model_name_or_path: str | Path, *model_args, **kwargs) -> nn.Module:
    """A saved model, loaded as ``transformers``' ``from_pretrained`` loads it (every argument it takes
    passes through: ``dtype="bfloat16"``, ``device_map``, ``attn_implementation``, ``revision``, ``token``,
    ``trust_remote_code``, a hub id, ...), its class from ``config.architectures``.

    A checkpoint re-placed by :func:`addnorm.hf.with_placement` (``config.addnorm`` records its placement
    and original model type) is loaded by transformers as its original architecture, re-placed as
    recorded (without re-initialising) and its connections' norms loaded; in eval mode. Anything else is
    exactly ``transformers``' own load."""
    transformers = require_transformers()
    hub = {k: kwargs[k] for k in _HUB if k in kwargs}
    config_file = _file(transformers, pretrained_model_name_or_path, "config.json", hub)
    if config_file is None:
        raise ValueError(
            f"pretrained_model_name_or_path: {str(pretrained_model_name_or_path)!r} has no config.json "
            "(save the model with save_pretrained)"
        )
    data = json.loads(Path(config_file).read_text())
    names = data.get("architectures") or []
    cls = getattr(transformers, names[0], None) if names else None
    record = data.get(CONFIG_KEY)
    if record is None:
        loader = cls or transformers.AutoModel
        return loader.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
    if cls is None:
        raise ValueError(f"config.json: names no transformers model class (architectures={names!r})")
    record = dict(record)
    model_type = record.pop(ORIGINAL_TYPE, data.get("model_type"))
    config = kwargs.pop("config", None)
    if config is None:
        config = transformers.CONFIG_MAPPING[model_type].from_dict({**data, "model_type": model_type})
        for key in [k for k in kwargs if k not in _LOADING and k not in _HUB and hasattr(config, k)]:
            setattr(config, key, kwargs.pop(key))
    with _quiet(transformers):
        model = cls.from_pretrained(pretrained_model_name_or_path, *model_args, config=config, **kwargs)
    before = set(model.state_dict())
    with_placement(model, **record, init=False)
    ours = [k for k in model.state_dict() if k not in before]  # the connections' norms and gates
    state = _state_dict(transformers, pretrained_model_name_or_path, hub)
    saved = _saved_names(model, ours)
    missing = [k for k in ours if saved[k] not in state]
    unexpected = sorted(set(k for k in state if "_block." in k) - set(saved.values()))
    if missing or unexpected:
        raise ValueError(
            f"pretrained_model_name_or_path: the saved weights do not fit the re-placed {cls.__name__} "
            f"(missing {missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict({k: state[saved[k]] for k in ours}, strict=False)
    return model.eval()
