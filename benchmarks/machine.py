"""What the benchmarks record about the machine they ran on (the study's provenance reads it the same way)."""

from __future__ import annotations

from addnorm.study.provenance import cpu_model

__all__ = ["cpu_model"]
