"""RunConfig: everything one training run depends on; its hash is the run's stable id.

The model's settings are a :class:`~addnorm.model.TransformerConfig` (validated and canonicalised
there, so "Post-LN" and "post" are the same run); RunConfig adds the task, the training budget and the
probing schedule. Both kinds of setting are given flat, as a study spec writes them:
``RunConfig(placement="post", n_layers=12, steps=300)``.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any

from ..model import TransformerConfig
from ..tasks import TASKS
from ..tasks.corpus import DEFAULT_CORPUS_BYTES
from .device import PRECISIONS
from .hf_model import ADDNORM_MODEL, HF_FAMILIES, HF_INITS, not_applicable
from .ranks import parse_distributed
from .schedules import SCHEDULES

HF_NAMES = tuple("hf-" + name[3:] for name in HF_FAMILIES)
# The study's small-model defaults where they differ from TransformerConfig's (torch.nn.Transformer's).
MODEL_DEFAULTS: dict[str, Any] = {
    "d_model": 64,
    "n_heads": 4,
    "d_ff": 256,
    "n_layers": 4,
    "dropout": 0.0,
    "placement": "pre",
    "init": "xavier",
}
# Model fields a run sets itself: the tasks feed (batch, seq) tensors, and positions cover seq_len.
_DERIVED = ("batch_first", "max_len")
MODEL_KEYS: tuple[str, ...] = tuple(f.name for f in fields(TransformerConfig) if f.name not in _DERIVED)


def _f(default: Any, help: str) -> Any:
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True, init=False)
class RunConfig:
    """One run: its model (``model``, built from the flat model keys, which also read as attributes:
    ``cfg.n_layers``) and task, optimisation, evaluation and probing settings. Two configs with the same
    settings have the same :attr:`run_id`.

    The spec key ``model`` names the architecture (``addnorm``, the default, or a Hugging Face family
    such as ``hf-llama``: :mod:`addnorm.train.hf_model`); it is held as :attr:`arch`, since
    :attr:`model` is the TransformerConfig of addnorm's own model (whose sizes an ``hf-`` model takes)."""

    model: TransformerConfig
    task: str = _f("lm", "lm (byte-level language modelling), copy, reverse or sort")
    corpus: str | None = _f(None, "text file or folder for lm (default: the Python standard library)")
    corpus_bytes: int = _f(
        DEFAULT_CORPUS_BYTES, "bytes of the corpus read for lm (at most; the rest is left)"
    )
    symbols: int = _f(10, "alphabet size of the copy/reverse/sort tasks")
    steps: int = _f(200, "optimiser steps")
    batch_size: int = _f(16, "sequences per step")
    seq_len: int = _f(64, "tokens per sequence")
    lr: float = _f(1e-3, "peak learning rate (AdamW, betas 0.9/0.98)")
    warmup: int = _f(0, "linear warmup steps (0: none); must be below steps")
    schedule: str = _f("constant", "learning-rate schedule after warmup: " + ", ".join(SCHEDULES))
    grad_clip: float = _f(0.0, "clip the gradient norm at this value (0: no clipping)")
    weight_decay: float = _f(0.01, "AdamW weight decay on matrices and embeddings")
    seed: int = _f(0, "seeds the initialisation and the training batches")
    eval_every: int = _f(50, "held-out evaluation every this many steps (0: only at the end); <= steps")
    eval_batches: int = _f(4, "batches per held-out evaluation")
    probe_every: int = _f(0, "per-layer statistics every this many steps (0: first and last step only)")
    diverge_factor: float = _f(3.0, "a loss above this multiple of the first one ends the run as diverged")
    precision: str = _f(
        "auto", "fp32; bf16 (autocast, on any device); auto: bf16 on a GPU that has it, else fp32"
    )
    compile: bool = _f(False, "torch.compile the model (probed steps run it uncompiled)")
    arch: str = _f(
        ADDNORM_MODEL,
        "the model: addnorm (addnorm's own transformer) or a Hugging Face family with random weights, "
        "re-placed by addnorm.hf.with_placement (lm task only): " + ", ".join(HF_NAMES),
    )
    kv_heads: int = _f(0, "hf- models: key/value heads (grouped-query attention); 0: n_heads")
    rope_theta: float = _f(10000.0, "hf- models: the RoPE base")
    fused: bool = _f(False, "hf- models: run each residual connection in addnorm's fused op")
    hf_init: str = _f(
        "own",
        "hf- models: the initialisation before the placement's own: own (the family's, normal 0.02 on every "
        "matrix and embedding) or xavier (Xavier-uniform layers, unit-variance embeddings, torch.nn.Linear's "
        "head: as addnorm's transformer starts)",
    )
    distributed: dict | None = _f(
        None,
        "train on N processes launched by torchrun, each on its shard of every batch: "
        "{strategy: ddp | fsdp2, nproc: N} (one process per GPU; gloo on the CPU); none: one process",
    )

    def __init__(self, model: TransformerConfig | str | None = None, **values: Any) -> None:
        if isinstance(model, str):  # the spec key ``model`` names the architecture (field ``arch``)
            values["arch"], model = model, None
        model_values = {k: values.pop(k) for k in list(values) if k in MODEL_KEYS}
        for key in values:
            if key not in TRAIN_KEYS and key != "arch":
                raise TypeError(f"{key}: unknown run setting; expected one of: {', '.join(RunConfig.keys())}")
        for f in fields(self):
            if f.name != "model":
                object.__setattr__(self, f.name, values.get(f.name, f.default))
        self._check()
        if model is None:
            model = TransformerConfig(**{**MODEL_DEFAULTS, **model_values})
        elif model_values:
            model = replace(model, **model_values)
        object.__setattr__(self, "model", replace(model, batch_first=True, max_len=max(self.seq_len, 16)))

    def _check(self) -> None:
        """Validate and canonicalise the training settings (the model validates its own)."""
        for name in ("symbols", "steps", "batch_size", "seq_len"):
            _integer(name, getattr(self, name), minimum=1)
        _integer("corpus_bytes", self.corpus_bytes, minimum=1024)
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision: expected one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if not isinstance(self.compile, bool):
            raise ValueError(f"compile: expected true or false, got {self.compile!r}")
        for name in ("warmup", "seed", "eval_every", "eval_batches", "probe_every"):
            _integer(name, getattr(self, name), minimum=0)
        for name, positive in (
            ("lr", True),
            ("diverge_factor", True),
            ("grad_clip", False),
            ("weight_decay", False),
        ):
            object.__setattr__(self, name, _float(name, getattr(self, name), positive))
        if not self.diverge_factor > 1:
            raise ValueError(
                f"diverge_factor: expected a number above 1 (a loss this many times the first one "
                f"counts as divergence), got {self.diverge_factor!r}"
            )
        if self.warmup and self.warmup >= self.steps:
            raise ValueError(
                f"warmup: {self.warmup} warmup steps need more than that many steps, got steps={self.steps}"
            )
        if self.eval_every > self.steps:
            raise ValueError(
                f"eval_every: {self.eval_every} is more than steps={self.steps}; the run would never evaluate"
            )
        corpus = self.corpus
        if corpus is not None and not isinstance(corpus, str):
            raise TypeError(f"corpus: expected a path (str), got {corpus!r}")
        object.__setattr__(self, "corpus", None if corpus in (None, "", "stdlib") else corpus)
        object.__setattr__(self, "task", TASKS.resolve(self.task))
        object.__setattr__(self, "schedule", SCHEDULES.resolve(self.schedule))
        object.__setattr__(self, "arch", _arch_name(self.arch))
        _integer("kv_heads", self.kv_heads, minimum=0)
        object.__setattr__(self, "rope_theta", _float("rope_theta", self.rope_theta, True))
        if not isinstance(self.fused, bool):
            raise ValueError(f"fused: expected true or false, got {self.fused!r}")
        hf_init = HF_INITS.resolve(self.hf_init)
        # addnorm's own model has no use for hf_init: one value, so the same run keeps one id
        object.__setattr__(self, "hf_init", hf_init if self.arch != ADDNORM_MODEL else "own")
        object.__setattr__(self, "distributed", parse_distributed(self.distributed, self.batch_size))
        if self.arch != ADDNORM_MODEL and self.task != "lm":
            raise ValueError(
                f"model: {self.arch} is a causal language model; it trains on task lm, not {self.task!r}"
            )

    @property
    def not_applicable(self) -> str | None:
        """Why this run cannot be built (a placement ``with_placement`` cannot apply to its Hugging Face
        family), or None: such runs are planned as "not applicable", not run."""
        return not_applicable(self.arch, _placement_names(self.model.placement))

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """Every setting a spec may give: the training settings, then the model's."""
        return TRAIN_KEYS + MODEL_KEYS

    @classmethod
    def defaults(cls) -> dict[str, Any]:
        """Each key's default value (the study's small-model defaults for the model keys)."""
        out = {_key(f.name): f.default for f in fields(cls) if f.name != "model"}
        for f in fields(TransformerConfig):
            if f.name in MODEL_KEYS:
                default = f.default_factory() if f.default is MISSING else f.default
                out[f.name] = MODEL_DEFAULTS.get(f.name, default)
        return out

    @classmethod
    def help(cls) -> dict[str, str]:
        """Each key's one-line description, read from the fields' metadata."""
        return {
            _key(f.name): f.metadata.get("help", "")
            for f in (*fields(cls), *fields(TransformerConfig))
            if _key(f.name) in cls.keys() and f.name != "model"
        }

    def to_dict(self) -> dict[str, Any]:
        """Every key flat, names canonical; ``RunConfig(**cfg.to_dict()) == cfg``."""
        out = {_key(f.name): getattr(self, f.name) for f in fields(self) if f.name != "model"}
        for name in MODEL_KEYS:
            value = getattr(self.model, name)
            if name == "placement":
                value = _placement_names(value)
            out[name] = value
        return out

    @property
    def run_id(self) -> str:
        """Stable id: the first 12 hex digits of the SHA-1 of the canonical config as sorted JSON,
        without the :data:`LATER_KEYS` that hold the value runs had before those keys existed."""
        values = {k: v for k, v in self.to_dict().items() if k not in LATER_KEYS or LATER_KEYS[k] != v}
        text = json.dumps(values, sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def __hash__(self) -> int:
        return hash(self.run_id)

    def __getattr__(self, name: str) -> Any:
        """Model keys read like training keys: ``cfg.n_layers`` is ``cfg.model.n_layers``."""
        if name in MODEL_KEYS and "model" in self.__dict__:
            return getattr(self.model, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


def _key(field_name: str) -> str:
    """A field's key in a spec: ``arch`` is given as ``model``."""
    return "model" if field_name == "arch" else field_name


def _arch_name(name: Any) -> str:
    """``addnorm`` or a Hugging Face family's name as ``hf-<family>`` (case and dashes as the registry's)."""
    if not isinstance(name, str):
        raise ValueError(f"model: expected addnorm or one of {', '.join(HF_NAMES)}, got {name!r}")
    if name.strip().lower() == ADDNORM_MODEL:
        return ADDNORM_MODEL
    try:
        return "hf-" + HF_FAMILIES.resolve(name)[3:]
    except ValueError:
        raise ValueError(f"model: expected addnorm or one of {', '.join(HF_NAMES)}, got {name!r}") from None


TRAIN_KEYS: tuple[str, ...] = tuple(_key(f.name) for f in fields(RunConfig) if f.name != "model")
# Settings added after studies were first stored, each with the value that does what runs did before
# it existed: at that value a key is left out of the run id, so stored studies keep their runs' ids.
LATER_KEYS: dict[str, Any] = {
    "corpus_bytes": DEFAULT_CORPUS_BYTES,
    "precision": "auto",
    "compile": False,
    "model": ADDNORM_MODEL,
    "kv_heads": 0,
    "rope_theta": 10000.0,
    "fused": False,
    "hf_init": "own",
    "distributed": None,
}


def _integer(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = {0: "a non-negative integer", 1: "a positive integer"}.get(minimum, f"an integer >= {minimum}")
        raise ValueError(f"{name}: expected {kind}, got {value!r}")


def _float(name: str, value: Any, positive: bool) -> float:
    """A number (YAML reads ``1e-3`` as a string, so numeric strings count) as a float."""
    kind = "a positive number" if positive else "a non-negative number"
    try:
        number = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or not (number > 0 if positive else number >= 0):
        raise ValueError(f"{name}: expected {kind}, got {value!r}")
    return number


def _placement_names(placement: Any) -> Any:
    if isinstance(placement, (list, tuple)):
        return [getattr(p, "name", p) for p in placement]
    return getattr(placement, "name", placement)
