"""RunConfig: everything one training run depends on; its hash is the run's stable id."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, fields

from ..norms import NORMS
from ..placements import PLACEMENTS

DROPOUT_SITES = ("branch", "after_add", "none")


@dataclass(frozen=True)
class RunConfig:
    """One run: task, model, optimisation and probing. ``dropout_at="none"`` turns dropout off."""

    task: str = "lm"
    corpus: str | None = None
    symbols: int = 10
    d_model: int = 64
    n_heads: int = 4
    d_ff: int = 256
    n_layers: int = 4
    placement: str = "pre"
    norm: str = "layernorm"
    final_norm: str | bool = "auto"
    residual: bool = True
    dropout: float = 0.0
    dropout_at: str = "branch"
    activation: str = "relu"
    init: str = "xavier"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 64
    lr: float = 1e-3
    warmup: int = 0
    schedule: str = "constant"
    grad_clip: float = 0.0
    weight_decay: float = 0.01
    seed: int = 0
    eval_every: int = 50
    eval_batches: int = 4
    probe_every: int = 0
    diverge_factor: float = 3.0

    def __post_init__(self) -> None:
        from ..tasks import TASKS
        from .schedules import SCHEDULES

        positive = ("symbols", "d_model", "n_heads", "d_ff", "n_layers", "steps", "batch_size", "seq_len")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name}: expected a positive integer, got {value!r}")
        for name in ("warmup", "seed", "eval_every", "eval_batches", "probe_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}: expected a non-negative integer, got {value!r}")
        for name in ("lr", "diverge_factor"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"{name}: expected a positive number, got {value!r}")
        if not self.diverge_factor > 1:
            raise ValueError(
                f"diverge_factor: expected a number above 1 (a loss this many times the first one "
                f"counts as divergence), got {self.diverge_factor!r}"
            )
        for name in ("grad_clip", "weight_decay"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"{name}: expected a non-negative number, got {value!r}")
        if not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout: expected a rate in [0, 1), got {self.dropout!r}")
        if self.dropout_at not in DROPOUT_SITES:
            raise ValueError(
                f"dropout_at: expected one of {', '.join(DROPOUT_SITES)}, got {self.dropout_at!r}"
            )
        if not isinstance(self.residual, bool):
            raise ValueError(f"residual: expected true or false, got {self.residual!r}")
        if self.final_norm not in ("auto", True, False):
            raise ValueError(f"final_norm: expected auto, true or false, got {self.final_norm!r}")
        TASKS.resolve(self.task)
        PLACEMENTS.resolve(self.placement)
        NORMS.resolve(self.norm)
        SCHEDULES.resolve(self.schedule)
        self.model_config()  # validates the model dimensions, activation and init

    @classmethod
    def keys(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def run_id(self) -> str:
        """Stable id: the first 12 hex digits of the SHA-1 of the resolved config as sorted JSON."""
        text = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha1(text.encode()).hexdigest()[:12]

    def model_config(self):
        from ..model import TransformerConfig

        return TransformerConfig(
            d_model=self.d_model,
            n_heads=self.n_heads,
            d_ff=self.d_ff,
            n_layers=self.n_layers,
            dropout=0.0 if self.dropout_at == "none" else float(self.dropout),
            activation=self.activation,
            placement=self.placement,
            norm=self.norm,
            final_norm=self.final_norm,
            residual=self.residual,
            dropout_at="branch" if self.dropout_at == "none" else self.dropout_at,
            init=self.init,
            max_len=max(self.seq_len, 16),
        )
