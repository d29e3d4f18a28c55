"""``add_norm``: the public fused Add & Norm, its argument checks, and the one place that decides how
a call runs.

Everything a call's options, dtypes, device and hidden size determine (the checks of those, the
backend, the dtypes of s and y, where the backward takes x_hat from, the composite's casts) is decided
once and cached as a :class:`Plan`, with the path its calls take (``Plan.run``); a call then checks
only what can differ between calls with the same plan (shapes, the gate, the seed). How it runs:

- eager, torch backend (the CPU; CUDA for float64 or rows wider than ``MAX_FUSED_HIDDEN``): the
  :class:`~addnorm.ops.torch_path.Composite` under torch's autograd, the dropout multiplier from the
  hashed mask of the given seed (NumPy on the CPU), or on the CPU without a seed ``nn.Dropout``'s
  Bernoulli draws;
- eager, Triton backend: :class:`~addnorm.ops.triton.eager.TritonAddNorm` (the kernels, no op
  dispatch, the launch specs cached on the plan);
- under ``torch.compile``: the composite (Inductor fuses it with its neighbours) or the registered op
  (the Triton kernels, launched by Inductor), as :func:`addnorm.ops.policy.compile_path` says;
- under ``torch.func`` transforms: the composite (every transform differentiates or batches it);
- traced by a dispatch mode (make_fx, fake tensors) or called with a tensor subclass: the registered op;
- x a DTensor: :func:`addnorm.ops.sharded.add_norm_dtensor` (the registered op under its sharding
  rules, or the tensor-parallel path where the hidden dimension is sharded).
"""

from __future__ import annotations

import math
import numbers
import sys

import numpy as np
import torch
from torch import Tensor
from torch.compiler import is_compiling

from . import native, policy, seeds
from .args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y, FwdArgs
from .library import add_norm_fwd
from .policy import BACKENDS, is_dtensor, resolve_backend
from .reference import _canonical_norm, dropout_keep_mask_numpy
from .torch_path import Composite, dropout_multiplier

if "torch.distributed.tensor" in sys.modules:  # DTensor already in use: its rules for the op now
    from . import sharded

    sharded.register_rules()

__all__ = ["Plan", "add_norm", "clear_plans"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_SEED_HIGH = 2**62
# looked up once: whether a torch dispatch mode (make_fx, fake tensors) or a torch.func transform is active
_dispatch_depth = torch._C._len_torch_dispatch_stack
_functorch_active = torch._C._are_functorch_transforms_active
_NP_DTYPES = {torch.float32: np.float32, torch.float64: np.float64}


class Plan:
    """What a call signature fixes, decided once: the backend (``triton``), the composite (torch
    backend), the effective dropout rate ``p`` (0 in eval), the op's dtypes, ``xhat_from``, the eager
    Triton path's launches (what each gate kind's backward reads: :func:`~addnorm.ops.args.bwd_plan`)
    and ``run``, the path a call takes: ``run(x, residual, weight, bias, gate, seed)`` checks what can
    differ between calls of one signature (shapes and devices against x's, the gate, the seed) and
    runs the call. ``traced`` is the path while torch.compile traces."""

    __slots__ = ("alpha", "apply", "backend", "composite", "device", "eps", "hidden", "launches", "norm")
    __slots__ += ("np_dtype", "p", "prenorm", "rms", "run", "s_dtype", "scale", "shape", "simple", "triton")
    __slots__ += ("xhat_from", "y_dtype")

    def __init__(self, x, residual, weight, bias, norm, eps, prenorm, alpha, p, s_dtype, y_dtype, backend):
        hidden = x.shape[-1]
        dtypes = (x.dtype, residual.dtype, s_dtype, y_dtype)
        self.backend, self.device = backend, x.device
        self.triton = resolve_backend(backend, x.device, hidden, dtypes, norm, prenorm, p > 0) == "triton"
        self.norm, self.eps, self.alpha, self.prenorm, self.p = norm, float(eps), float(alpha), prenorm, p
        self.hidden, self.s_dtype, self.y_dtype = hidden, s_dtype, y_dtype
        self.shape, self.rms = torch.Size([hidden]), norm == "rmsnorm"
        w_dtype = None if weight is None else weight.dtype
        b_dtype = None if bias is None else bias.dtype
        self.composite = Composite(
            norm, self.eps, self.alpha, hidden, x.dtype, residual.dtype, w_dtype, b_dtype, s_dtype, y_dtype
        )
        cdt = self.composite.cdt
        # eager's own ops (s = x + r, then the norm) cover the call: torch backend, no casts, no dropout
        self.simple = self.composite.simple and not self.triton and not p
        # the eager CPU path draws its dropout multiplier with NumPy, elsewhere in torch ops
        self.np_dtype = _NP_DTYPES[cdt] if x.device.type == "cpu" else None
        self.scale = 1.0 / (1.0 - p) if p else 1.0
        # Post-LN backward: from s on the torch path (the CPU: recomputing costs time), from y on the
        # Triton path where y is fp32, else from s recomputed from x and residual: a bf16/fp16 y is
        # coarser than the statistics, and dweight sums its rounding error over every row
        if prenorm or not self.triton:
            self.xhat_from = XHAT_FROM_S
        else:
            self.xhat_from = XHAT_FROM_Y if y_dtype == torch.float32 else XHAT_FROM_XR
        # the eager Triton path's launch specs, per gate kind (none, one element, a vector); not in a
        # plan made while torch.compile traces (never cached, never launched from: the graph takes the
        # composite or the registered op): Dynamo cannot trace their making (an autograd.Function
        # subclass per launch, made with type() and staticmethod) and would trace the specs' caches
        self.launches, self.apply, self.run = [None, None, None], None, None
        if is_compiling():
            return
        if self.triton:
            from .triton.eager import EagerLaunch

            self.launches = [
                EagerLaunch(self, x.dtype, residual.dtype, weight is not None, bias is not None, code)
                for code in (0, 1, 2)
            ]
            if native.call_path() == "native":  # opt-in: the C++ autograd node (ops/native)
                native.attach(self, self.launches)
            self.apply = self.launches[0].apply  # no gate: the common call
        self.run = self._triton_runner() if self.triton else self._run_torch  # the eager call's path

    def _triton_runner(self):
        """The Triton backend's call, made once per plan with its constants bound (no attribute reads
        per call): the eager launches (no op dispatch), or the composite under a torch.func transform,
        the registered op under a dispatch mode or for a tensor subclass."""
        dev, shape, hidden, p, apply = self.device, self.shape, self.hidden, self.p, self.apply
        launches = self.launches
        # no seed given: drawn on the host from the device's Philox state (no launch), else randint
        draw = seeds.seeder_for(dev) if p else None

        def run(x, residual, weight, bias, gate, seed):
            if type(x) is not Tensor and is_dtensor(x):
                return self._dtensor(x, residual, weight, bias, gate, seed)
            if (  # x's device is the plan's (it is keyed on it)
                residual.shape != x.shape
                or residual.device != dev
                or (weight is not None and (weight.shape != shape or weight.device != dev))
                or (bias is not None and (bias.shape != shape or bias.device != dev))
            ):
                _check_tensors(x, residual, weight, bias, gate)  # raises, naming the tensor
            # no dispatch mode, tensor subclass or torch.func transform
            plain = type(x) is Tensor and not (_dispatch_depth() or _functorch_active())
            if plain and gate is None and not p:
                return apply(x, residual, weight, bias)  # the common call: nothing else to check
            if gate is not None:
                _check_gate(gate, hidden, dev)
            seed_t = None
            if p:
                if seed is None and plain and draw is not None:
                    seed_t = draw()  # an int (the kernels take it as a value) or None
                if seed_t is None:
                    seed_t = _seed_value(seed, dev, False)
            if plain:
                if gate is None:
                    return apply(x, residual, weight, bias, None, seed_t)
                return launches[1 if gate.numel() == 1 else 2].apply(x, residual, weight, bias, gate, seed_t)
            if _functorch_active():
                return _composite(self, x, residual, weight, bias, gate, seed_t)
            return _via_op(self, x, residual, weight, bias, gate, seed_t)

        return run

    def _run_torch(self, x, residual, weight, bias, gate, seed):
        """The torch backend's call: eager's own ops (s = x + r, then the norm) where they cover it,
        else the composite with the dropout multiplier (NumPy's hashed mask on the CPU, or without a
        seed ``nn.Dropout``'s draws), the registered op under a dispatch mode or for a subclass."""
        if type(x) is not Tensor and is_dtensor(x):
            return self._dtensor(x, residual, weight, bias, gate, seed)
        xs = x.shape
        if residual.shape != xs:
            raise ValueError(f"residual: expected the shape of x {tuple(xs)}, got {tuple(residual.shape)}")
        traced = _dispatch_depth() > 0 or type(x) is not Tensor  # a dispatch mode or a subclass
        if self.simple and gate is None and not traced:  # s = x + r, then the norm: eager's own ops
            try:
                s = x + residual
                if self.rms:
                    y = torch.rms_norm(s, self.shape, weight, self.eps)
                    if bias is not None:
                        y = y + _bias_checked(bias, self.shape)
                else:
                    y = torch.layer_norm(s, self.shape, weight, bias, self.eps, False)
            except (RuntimeError, TypeError, ValueError, IndexError):
                _check_tensors(x, residual, weight, bias, gate)  # a clear error for what torch rejected
                raise
            return (y, s) if self.prenorm else y
        if gate is not None:
            _check_gate(gate, self.hidden, x.device)
        if traced:
            seed_t = _seed_value(seed, x.device, False) if self.p else None
            return _via_op(self, x, residual, weight, bias, gate, seed_t)
        if self.rms and bias is not None:
            _bias_checked(bias, self.shape)
        mult = None
        if self.p:
            if seed is None and self.np_dtype is not None:
                # the CPU with no seed given: torch's Bernoulli draws, exactly as nn.Dropout makes them
                # (a drawn seed's hashed mask costs ~2x a whole eager call here; no other backend draws
                # the same seed from the same generator, so no equality across backends is lost)
                mult = torch.empty(xs, dtype=self.composite.cdt).bernoulli_(1.0 - self.p).div_(1.0 - self.p)
            elif self.np_dtype is not None:  # the CPU, a given seed: the hashed mask in NumPy, kept
                rows = x.numel() // self.hidden
                keep = dropout_keep_mask_numpy(_seed_value(seed, x.device, True), rows, self.hidden, self.p)
                mult = torch.from_numpy((keep * self.np_dtype(self.scale)).reshape(xs))
            else:
                mult = dropout_multiplier(_seed_value(seed, x.device, False), x, self.p, self.composite.cdt)
        try:
            y, s = self.composite(x, residual, weight, bias, gate, mult)
        except (RuntimeError, TypeError, ValueError, IndexError):
            _check_tensors(x, residual, weight, bias, gate)  # a clear error for what torch rejected
            raise
        return (y, s) if self.prenorm else y

    def traced(self, x, residual, weight, bias, gate, seed):
        """The call while torch.compile traces (a plan made for this trace): the DTensor paths, or what
        :func:`addnorm.ops.policy.compile_path` says: the composite or the registered op."""
        if type(x) is not Tensor and is_dtensor(x):
            return self._dtensor(x, residual, weight, bias, gate, seed)
        seed_t = _seed_value(seed, x.device, False) if self.p else None
        if policy.compile_path() == "composite":
            return _composite(self, x, residual, weight, bias, gate, seed_t)
        return _via_op(self, x, residual, weight, bias, gate, seed_t)

    def _dtensor(self, x, residual, weight, bias, gate, seed):
        """The call on DTensors (:mod:`addnorm.ops.sharded`); without a seed, the dropout's seed is drawn
        from torch's generator on every rank (seeded alike, they draw the same)."""
        from . import sharded

        if residual.shape != x.shape:
            raise ValueError(
                f"residual: expected the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}"
            )
        if gate is not None:
            _check_gate(gate, self.hidden, x.device)
        seed_t = _seed_value(seed, x.device, False) if self.p else None
        return sharded.add_norm_dtensor(self, x, residual, weight, bias, gate, seed_t, _via_op)


# call plans, keyed on the policy's version and the call signature; and the last call's (key, plan):
# a model calls with one signature many times in a row, and a tuple comparison costs half a lookup
_PLANS: dict[tuple, Plan] = {}
_last: tuple = (None, None)


def clear_plans() -> None:
    """Forget the cached plans (a change of policy needs no call: plans are keyed on its version)."""
    global _last
    _PLANS.clear()
    _last = None, None


def _check_float_tensor(name: str, t: object) -> Tensor:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected a float32, float16, bfloat16 or float64 tensor, got {t.dtype}")
    return t


def _check_vector(name: str, t: object, hidden: int, device: torch.device) -> None:
    if t is None:
        return
    _check_float_tensor(name, t)
    if tuple(t.shape) != (hidden,):
        raise ValueError(
            f"{name}: expected shape ({hidden},) (the hidden size) or None, got {tuple(t.shape)}"
        )
    if t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device} like x, got one on {t.device}")


def _check_gate(gate: Tensor, hidden: int, device: torch.device) -> None:
    _check_float_tensor("gate", gate)
    if gate.numel() != 1 and tuple(gate.shape) != (hidden,):
        raise ValueError(
            f"gate: expected None, a one-element tensor (ReZero) or shape ({hidden},) (LayerScale), "
            f"got shape {tuple(gate.shape)}"
        )
    if gate.device != device:
        raise ValueError(f"gate: expected a tensor on {device} like x, got one on {gate.device}")


def _check_dtensors(x, residual, weight, bias, gate) -> None:
    """A DTensor argument beside a plain x: the DTensor path needs x and residual as DTensors."""
    if is_dtensor(x):
        return
    for name, t in (("residual", residual), ("weight", weight), ("bias", bias), ("gate", gate)):
        if is_dtensor(t):
            raise ValueError(
                f"{name}: a DTensor while x is a plain tensor: pass x and residual as DTensors on its mesh "
                "(or every argument as a plain tensor)"
            )


def _check_tensors(x, residual, weight, bias, gate) -> int:
    """Every tensor argument's type, dtype, shape and device against x's; returns the hidden size."""
    _check_dtensors(x, residual, weight, bias, gate)
    x = _check_float_tensor("x", x)
    residual = _check_float_tensor("residual", residual)
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(
            "x: expected at least one dimension with a non-empty last (hidden) one, got shape "
            f"{tuple(x.shape)}"
        )
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected the shape of x {tuple(x.shape)}, got {tuple(residual.shape)}")
    if residual.device != x.device:
        raise ValueError(f"residual: expected a tensor on {x.device} like x, got one on {residual.device}")
    hidden = x.shape[-1]
    _check_vector("weight", weight, hidden, x.device)
    _check_vector("bias", bias, hidden, x.device)
    if gate is not None:
        _check_gate(gate, hidden, x.device)
    return hidden


def _new_plan(
    x,
    residual,
    weight,
    bias,
    gate,
    norm,
    eps,
    prenorm,
    alpha,
    dropout_p,
    training,
    in_fp32,
    out_dtype,
    backend,
):
    """Check every argument (a clear error naming the first bad one) and build the call's plan."""
    _check_tensors(x, residual, weight, bias, gate)
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
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    s_dtype = torch.float32 if in_fp32 and residual.dtype != torch.float64 else residual.dtype
    y_dtype = out_dtype or x.dtype
    p = float(dropout_p) if training else 0.0
    return Plan(x, residual, weight, bias, norm, eps, bool(prenorm), alpha, p, s_dtype, y_dtype, backend)


def _seed_value(seed: object, device: torch.device, as_int: bool) -> int | Tensor:
    """The dropout seed: drawn from torch's generator when None (so ``torch.manual_seed`` makes runs
    reproducible), as a Python int (``as_int``: the NumPy mask) or an int64 tensor on ``device``."""
    if seed is None:
        t = torch.randint(0, _SEED_HIGH, (), dtype=torch.int64, device=device)
        return int(t) if as_int else t
    if isinstance(seed, Tensor):
        if seed.numel() != 1 or seed.dtype.is_floating_point or seed.dtype.is_complex:
            raise ValueError(f"seed: expected an int or a one-element integer tensor, got {seed!r}")
        return int(seed) & (2**64 - 1) if as_int else seed.to(device=device, dtype=torch.int64).reshape(())
    if isinstance(seed, numbers.Integral) and not isinstance(seed, bool) and 0 <= seed < 2**63:
        return int(seed) if as_int else torch.tensor(int(seed), dtype=torch.int64, device=device)
    raise ValueError(f"seed: expected None, an int in [0, 2**63) or an integer tensor, got {seed!r}")


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

    Dropout (``dropout_p`` > 0 and ``training``) with a ``seed`` uses a counter-based hash of (seed,
    row, column) (:func:`addnorm.ops.dropout_keep_mask`, rows = x flattened to (-1, hidden)); the same
    seed gives the same mask on every backend, in eager mode and under torch.compile (not
    ``nn.Dropout``'s mask). ``seed=None`` draws a seed from torch's generator for the hashed mask (on
    the eager CUDA path on the host, from the generator's Philox seed and offset, with no launch:
    :mod:`addnorm.ops.seeds`), except in eager mode on the CPU, where the mask is ``nn.Dropout``'s own
    (torch's Bernoulli draws, element for element what ``F.dropout`` would drop). Either way
    ``torch.manual_seed`` makes runs reproducible. The Triton path regenerates the mask in backward;
    the eager CPU path keeps the multiplier for backward (as ``nn.Dropout`` keeps its mask).

    ``backend``: ``"auto"`` (Triton for CUDA tensors when triton is installed, else eager torch),
    ``"torch"`` or ``"triton"`` (CUDA, or CPU under ``TRITON_INTERPRET=1``); with ``"auto"`` the
    environment variable ``ADDNORM_BACKEND`` (read at import) may choose. Hidden sizes above 65,536
    use the torch path. Works under ``torch.compile`` (see :mod:`addnorm.ops.policy`) and
    ``torch.func`` transforms (grad, vmap, ...: the composite of torch ops; under vmap every example
    gets the same mask, drawn from the per-example shape).

    DTensors (tensor, sequence and context parallel): x and residual placed alike on one mesh, any
    mix of Shard and Replicate; returns DTensors placed like x, the one-process op's values without
    gathering, the dropout mask the whole tensor's (hashed, also with ``seed=None``: seed every rank
    alike). Weight, bias and gate Replicate, or Shard(0) where x's hidden dimension is sharded; their
    gradients come out ``Partial()`` where x's rows are sharded. See :mod:`addnorm.ops.sharded`.

    Args:
        x: the branch output F(...), shape (..., hidden).
        residual: the residual stream, the shape of ``x``.
        weight: the norm's gain w, shape (hidden,), or None for no affine.
        bias: the norm's shift b, shape (hidden,), or None.
        norm: ``"layernorm"`` or ``"rmsnorm"``.
        eps: added to the variance (mean square) before the square root.
        prenorm: also return the sum s (the stream a Pre-LN stack carries on).
        alpha: the residual scale (DeepNorm's alpha > 1).
        gate: None, a one-element tensor (ReZero) or a (hidden,) vector (LayerScale).
        dropout_p: the dropout probability on ``x``.
        training: dropout applies only when True.
        residual_in_fp32: keep s in float32 whatever the inputs' dtype.
        out_dtype: the dtype of y (default x's).
        backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        seed: the dropout mask's seed (an int or a one-element tensor); None draws one.

    Returns:
        y, or ``(y, s)`` when ``prenorm``.

    Raises:
        ValueError: inputs of different shapes or devices, or an argument out of its range.
        RuntimeError: ``backend="triton"`` without Triton, or where it cannot run.
        TypeError: ``backend="triton"`` for a dtype other than float32, float16 and bfloat16.
    """
    global _last
    compiling, key, plan = is_compiling(), None, None
    if not compiling:
        try:  # the call signature: everything the plan depends on
            key = (
                policy.VERSION, x.dtype, residual.dtype, x.device, x.shape[-1],
                weight is None or weight.dtype, bias is None or bias.dtype, norm, eps, prenorm, alpha,
                dropout_p if training else 0.0, residual_in_fp32, out_dtype, backend,
            )  # fmt: skip
            last_key, plan = _last
            if key != last_key:  # another signature than the last call's (equal: compared, not hashed)
                plan = _PLANS.get(key)
                if plan is not None:
                    _last = key, plan
        except Exception:  # arguments that cannot be keyed: the checks below name the bad one
            key = plan = None
    if plan is None:  # a new call signature (or under torch.compile: once per trace): checked in full
        plan = _new_plan(
            x, residual, weight, bias, gate, norm, eps, prenorm, alpha, dropout_p, training, residual_in_fp32,
            out_dtype, backend,
        )  # fmt: skip
        if key is not None:
            _PLANS[key] = plan
            _last = key, plan
    if compiling:
        return plan.traced(x, residual, weight, bias, gate, seed)
    return plan.run(x, residual, weight, bias, gate, seed)


def _bias_checked(bias: Tensor, shape: torch.Size) -> Tensor:
    """RMSNorm's bias, added after ``torch.rms_norm``: checked, since an add would broadcast it."""
    if bias.shape != shape:
        raise ValueError(
            f"bias: expected shape ({shape[0]},) (the hidden size) or None, got {tuple(bias.shape)}"
        )
    return bias


def _composite(plan: Plan, x, residual, weight, bias, gate, seed_t) -> Tensor | tuple[Tensor, Tensor]:
    """The call as the composite of torch ops, the multiplier from the hashed mask in torch ops."""
    mult = dropout_multiplier(seed_t, x, plan.p, plan.composite.cdt) if plan.p else None
    y, s = plan.composite(x, residual, weight, bias, gate, mult)
    return (y, s) if plan.prenorm else y


def _via_op(plan: Plan, x, residual, weight, bias, gate, seed_t, rows=None) -> Tensor | tuple[Tensor, Tensor]:
    """The call through the registered op ``addnorm::add_norm_fwd`` (on x's own shape, so a DTensor
    sharded on a leading dimension stays sharded; ``rows``: the dropout's row indices of a shard)."""
    a = FwdArgs(
        x, residual, weight, bias, gate, seed_t, rows, plan.xhat_from, plan.norm, plan.eps, plan.alpha,
        plan.p, plan.s_dtype, plan.y_dtype, plan.prenorm, plan.backend,
    )  # fmt: skip
    y, s = add_norm_fwd(*a)[:2]
    return (y, s) if plan.prenorm else y
