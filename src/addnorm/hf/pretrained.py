"""``from_pretrained(path)``: a model saved with ``save_pretrained`` after :func:`addnorm.hf.with_placement`,
rebuilt with its placement and loaded (an untouched model loads through ``transformers`` as usual)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .architectures import require_transformers
from .placement import CONFIG_KEY, with_placement

__all__ = ["from_pretrained"]

_SINGLE, _INDEX = "model.safetensors", "model.safetensors.index.json"


def _state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a ``save_pretrained`` directory (one safetensors file or an index of shards)."""
    from safetensors.torch import load_file

    if (path / _SINGLE).is_file():
        return load_file(path / _SINGLE)
    if (path / _INDEX).is_file():
        shards = sorted(set(json.loads((path / _INDEX).read_text())["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(path / shard).items()}
    raise ValueError(f"path: {str(path)!r} holds no {_SINGLE} or {_INDEX} (save with save_pretrained)")


def from_pretrained(path: str | Path, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The model saved at ``path``: its class from ``config.architectures``, re-placed as
    ``config.addnorm`` records (:func:`addnorm.hf.with_placement`, without re-initialising), then its
    saved weights loaded; in eval mode, like ``transformers``' own ``from_pretrained``. Without a
    recorded placement, ``transformers`` loads it. ``dtype`` converts the loaded model."""
    transformers = require_transformers()
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path: {str(path)!r} has no config.json (save the model with save_pretrained)")
    config = transformers.AutoConfig.from_pretrained(path)
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else None
    if cls is None:
        raise ValueError(f"path: config.json names no transformers model class (architectures={names!r})")
    record = getattr(config, CONFIG_KEY, None)
    if record is None:
        return cls.from_pretrained(path, dtype=dtype)
    model = cls(config)
    with_placement(model, **record, init=False)
    state = _state_dict(path)
    missing, unexpected = model.load_state_dict(state, strict=False)
    loaded = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if name in state}
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = [k for k in missing if k not in params or id(params[k]) not in loaded]  # tied weights
    if missing or unexpected:
        raise ValueError(
            f"path: the saved weights do not fit the re-placed {cls.__name__} (missing {missing[:5]}, "
            f"unexpected {unexpected[:5]})"
        )
    if dtype is not None:
        model.to(dtype)
    return model.eval()
