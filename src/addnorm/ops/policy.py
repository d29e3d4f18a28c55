"""Where a model's Add & Norm runs through the fused op and where through the unfused modules.

The one rule that a model's fusion decision (the residual stream's held-back adds, a Post-LN
connection's add and norm) asks about the device and the mode; the op itself picks its backend.
"""

from __future__ import annotations

import torch

__all__ = ["fused_op_preferred"]


def fused_op_preferred(device: torch.device, *, dropout: bool) -> bool:
    """Whether :func:`addnorm.ops.add_norm` should compute a model's add + norm on ``device`` (True) or
    the unfused modules should (False), with branch dropout active (``dropout``) or not.

    Today: always the op. To be decided from measurements (issue 10: host cost per call on the CPU,
    the hashed dropout mask's cost against ``nn.Dropout``)."""
    return True
