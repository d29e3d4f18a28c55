"""``add_norm``: the public fused Add & Norm, with its argument checks."""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from .library import BACKENDS, add_norm_2d
from .reference import _canonical_norm

__all__ = ["add_norm"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SEED_HIGH = 2**62


def _check_float_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float32, float16, bfloat16 or float64 tensor, got {t.dtype}")
    return t


def _check_vector(name: str, t: object, hidden: int, device: torch.device) -> Tensor | None:
    if t is None:
        return None
    t = _check_float_tensor(name, t)
    if tuple(t.shape) != (hidden,):
        raise ValueError(
            f"{name}: expected shape ({hidden},) (the hidden size) or None, got {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like x, got one on {t.device}")
    return t


def add_norm(
    x: Tensor,
    residual: Tensor,
    weight: Tensor | None,
    bias: Tensor | None = None,
    *,
    norm: str = "layernorm",
    eps: float = 1e-5,
    prenorm: bool = False,
    alpha: float = 1.0,
    gate: Tensor | None = None,
    dropout_p: float = 0.0,
    training: bool = True,
    residual_in_fp32: bool = False,
    out_dtype: torch.dtype | None = None,
    backend: str = "auto",
    seed: int | Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Fused residual add and normalization over the last dimension.

        s = alpha * residual + gate * dropout(x)
        y = N(s)   N = "layernorm" (Ba et al. 2016): w * (s - mean) / sqrt(var + eps) + b
                   N = "rmsnorm" (Zhang & Sennrich 2019): w * s / sqrt(mean(s^2) + eps) (+ b)

    Returns ``(y, s)`` when ``prenorm`` (Pre-LN stacks carry s on as the residual stream) and ``y``
    otherwise (Post-LN, DeepNorm: ``alpha`` > 1). ``gate`` is None, a one-element tensor (ReZero) or a
    vector of the hidden size (LayerScale); ``weight`` None means no affine. Statistics are in fp32;
    s has residual's dtype (fp32 with ``residual_in_fp32``), y has ``out_dtype`` or x's dtype.

    Dropout (``dropout_p`` > 0 and ``training``) uses a counter-based hash of (seed, row, column)
    (:func:`addnorm.ops.dropout_keep_mask`), regenerated in backward, never stored; the same seed gives
    the same mask on every backend. ``seed=None`` draws one from torch's generator, so
    ``torch.manual_seed`` makes runs reproducible. The mask differs from ``nn.Dropout``'s.

    ``backend``: ``"auto"`` (Triton for CUDA tensors when triton is installed, else eager torch),
    ``"torch"`` or ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``); with ``"auto"`` the
    environment variable ``ADDNORM_BACKEND`` may choose. Hidden sizes above 65,536 use the torch path.
    """
    x = _check_float_tensor("x", x)
    residual = _check_float_tensor("residual", residual)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"x: expected at least one dimension with a non-empty last (hidden) one, got shape "
            f"{tuple(x.shape)}"
        )
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual: expected a tensor on {x.device} like x, got one on {residual.device}")
    hidden = x.shape[-1]
    weight = _check_vector("weight", weight, hidden, x.device)
    bias = _check_vector("bias", bias, hidden, x.device)
    if gate is not None:
        gate = _check_float_tensor("gate", gate)
        if gate.numel() != 1 and tuple(gate.shape) != (hidden,):
            raise ValueError(
                f"gate: expected None, a one-element tensor (ReZero) or shape ({hidden},) (LayerScale), "
                f"got shape {tuple(gate.shape)}"
            )
        if gate.device != x.device:
            raise ValueError(f"gate: expected a tensor on {x.device} like x, got one on {gate.device}")
    if not isinstance(norm, str):
        raise TypeError(f"norm: expected 'layernorm' or 'rmsnorm', got {type(norm).__name__}")
    norm = _canonical_norm(norm)
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps: expected a positive finite float, got {eps!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, numbers.Real) or not math.isfinite(alpha):
        raise TypeError(f"alpha: expected a finite Python float (the residual scale), got {alpha!r}")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real) or not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a probability in [0, 1), got {dropout_p!r}")
    if out_dtype is not None and out_dtype not in FLOAT_DTYPES:
        raise TypeError(f"out_dtype: expected None or one of {FLOAT_DTYPES}, got {out_dtype!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")

    seed_t = None
    if training and dropout_p > 0:
        if seed is None:
            seed_t = torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device=x.device)
        elif isinstance(seed, Tensor):
            if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex:
                raise ValueError(f"seed: expected an int or a one-element integer tensor, got {seed!r}")
            seed_t = seed.to(device=x.device, dtype=torch.int64).reshape(())
        elif isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and 0 <= seed < 2**63:
            seed_t = torch.tensor(int(seed), dtype=torch.int64, device=x.device)
        else:
            raise ValueError(f"seed: expected None, an int in [0, 2**63) or an integer tensor, got {seed!r}")
    p = float(dropout_p) if seed_t is not None else 0.0

    s_dtype = torch.float32 if residual_in_fp32 and residual.dtype != torch.float64 else residual.dtype
    y_dtype = out_dtype or x.dtype
    shape = x.shape
    y, s = add_norm_2d(
        x.reshape(-1, hidden),  # (rows, hidden): leading dimensions flattened
        residual.reshape(-1, hidden),
        weight,
        bias,
        gate,
        seed_t,
        norm,
        float(eps),
        float(alpha),
        p,
        s_dtype,
        y_dtype,
        bool(prenorm),
        x.device.type == "cuda" or backend == "triton",  # Post-LN: recompute x_hat from y, as on the GPU
        backend,
    )
    y = y.reshape(shape)
    return (y, s.reshape(shape)) if prenorm else y
