"""The op in torch ops: the registered ops' implementation off the Triton backend (explicit forward
and backward on 2-D tensors, the backward regenerating the dropout mask), and :class:`Composite`, the
same formula as plain differentiable ops, which eager CPU calls run under torch's autograd and which
``torch.compile`` receives to fuse with its neighbours.

    s = alpha * residual + gate * dropout(x)     y = N(s)   (LayerNorm or RMSNorm, statistics in fp32)
"""

from __future__ import annotations

import torch
from torch import Tensor

from .args import XHAT_FROM_XR, XHAT_FROM_Y, BwdArgs, FwdArgs
from .reference import dropout_keep_mask, xhat_from_y_ok

__all__ = ["Composite", "add_norm_bwd_torch", "add_norm_fwd_torch", "branch_grads", "compute_dtype"]


def compute_dtype(*dtypes: torch.dtype) -> torch.dtype:
    """Statistics and accumulation dtype: float32, or float64 when an input is float64."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


class Composite:
    """The op's formula as differentiable torch ops, for fixed dtypes and options (built once per call
    signature in eager mode, per trace under torch.compile):

        s = alpha * r + g * (x * mult)   in fp32 (float64 for float64 inputs), rounded to s's dtype
        y = layer_norm(s, w, b)  or  rms_norm(s, w) (+ b)

    ``mult`` is the dropout multiplier (keep / (1 - p), or None): the op's hashed mask, so the
    composite, the Triton kernels and the explicit torch path drop the same elements. ``__call__``
    returns (y, s)."""

    __slots__ = ("alpha", "b_dtype", "cdt", "cast_x", "cast_r", "eps", "rms", "round_s", "s_dtype", "shape")
    __slots__ += ("simple", "w_dtype", "y_dtype")

    def __init__(
        self,
        norm: str,
        eps: float,
        alpha: float,
        hidden: int,
        x_dtype: torch.dtype,
        res_dtype: torch.dtype,
        w_dtype: torch.dtype | None,
        b_dtype: torch.dtype | None,
        s_dtype: torch.dtype,
        y_dtype: torch.dtype,
    ) -> None:
        cdt = compute_dtype(x_dtype, res_dtype, s_dtype)
        self.rms, self.eps, self.alpha, self.shape = norm == "rmsnorm", eps, alpha, (hidden,)
        self.cdt, self.s_dtype = cdt, s_dtype
        self.cast_x, self.cast_r, self.round_s = x_dtype != cdt, res_dtype != cdt, s_dtype != cdt
        # a parameter in another dtype than the statistics is cast (None: no cast needed)
        self.w_dtype = cdt if w_dtype not in (None, cdt) else None
        self.b_dtype = cdt if b_dtype not in (None, cdt) else None
        self.y_dtype = y_dtype if y_dtype != cdt else None
        # s = x + r and the norm, nothing else: what the eager fast path of ``add_norm`` inlines
        self.simple = not (self.cast_x or self.cast_r or self.round_s or self.w_dtype or self.b_dtype)
        self.simple = self.simple and self.y_dtype is None and alpha == 1.0

    def __call__(
        self,
        x: Tensor,
        residual: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        gate: Tensor | None,
        mult: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        cdt = self.cdt
        if self.cast_x:
            x = x.to(cdt)
        if mult is not None:
            x = x * mult
        if gate is not None:
            x = x * gate.to(cdt)
        if self.cast_r:
            residual = residual.to(cdt)
        s = x + residual if self.alpha == 1.0 else torch.add(x, residual, alpha=self.alpha)
        s_out = s
        if self.round_s:  # the stream is normalised as stored
            s_out = s.to(self.s_dtype)
            s = s_out.to(cdt)
        if self.w_dtype is not None:
            weight = weight.to(cdt)
        if self.b_dtype is not None:
            bias = bias.to(cdt)
        if self.rms:
            y = torch.rms_norm(s, self.shape, weight, self.eps)
            if bias is not None:
                y = y + bias
        else:
            y = torch.layer_norm(s, self.shape, weight, bias, self.eps, False)
        if self.y_dtype is not None:
            y = y.to(self.y_dtype)
        return y, s_out


def dropout_multiplier(seed: Tensor, x: Tensor, p: float, cdt: torch.dtype) -> Tensor:
    """keep / (1 - p) over x's elements, as ``cdt``: the hashed mask over x flattened to rows, in torch
    ops (traceable; on any device)."""
    hidden = x.shape[-1]
    keep = dropout_keep_mask(seed, x.numel() // hidden, hidden, p, x.device)
    return (keep.to(cdt) * (1.0 / (1.0 - p))).reshape(x.shape)


# --- the registered ops' torch implementation (explicit backward) --------------------------------


def _stream(
    x: Tensor,
    residual: Tensor,
    gate: Tensor | None,
    keep: Tensor | None,
    alpha: float,
    dropout_p: float,
    cdt: torch.dtype,
    s_dtype: torch.dtype,
) -> tuple[Tensor, Tensor]:
    """s = alpha * residual + gate * dropout(x) in ``cdt`` (``keep``: the dropout keep mask or None):
    returns (s in s_dtype, s rounded to s_dtype and back in cdt). Forward and backward (recomputing s)
    both call this, so the two agree bit for bit."""
    xf = x if x.dtype == cdt else x.to(cdt)
    if keep is not None:
        xf = torch.where(keep, xf * (1.0 / (1.0 - dropout_p)), 0.0)
    if gate is not None:
        xf = xf * gate.to(cdt)
    rf = residual if residual.dtype == cdt else residual.to(cdt)
    s = torch.add(xf, rf, alpha=alpha) if alpha != 1.0 else xf + rf
    s_out = s.to(s_dtype)
    return s_out, s if s_dtype == cdt else s_out.to(cdt)  # the stream is rounded as stored


def _keep(
    seed: Tensor | None, rows: int, hidden: int, p: float, device: torch.device, row_ids: Tensor | None = None
) -> Tensor | None:
    """The dropout keep mask (rows numbered by ``row_ids`` where given), or None without dropout."""
    if seed is None or p <= 0:
        return None
    return dropout_keep_mask(seed, rows, hidden, p, device, row_ids=row_ids)


def _flat(t: Tensor | None, hidden: int) -> Tensor | None:
    """``t`` as (rows, hidden) (an empty placeholder stays empty)."""
    return None if t is None else t.reshape(-1, hidden)


def add_norm_fwd_torch(a: FwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forward on (..., hidden) inputs: returns (y, s or an empty tensor, mean or empty, rstd), the
    statistics of shape ``x.shape[:-1]``."""
    shape, hidden = a.x.shape, a.x.shape[-1]
    lead = shape[:-1]
    x, residual = _flat(a.x, hidden), _flat(a.residual, hidden)
    rows = x.shape[0]
    cdt = compute_dtype(a.x.dtype, a.residual.dtype, a.s_dtype)
    keep = _keep(a.seed, rows, hidden, a.dropout_p, a.x.device, a.rows)
    s_out, s = _stream(x, residual, a.gate, keep, a.alpha, a.dropout_p, cdt, a.s_dtype)
    w = None if a.weight is None else a.weight.to(cdt)
    b = None if a.bias is None else a.bias.to(cdt)
    if a.norm == "layernorm":
        y, mean, rstd = torch.native_layer_norm(s, [hidden], w, b, a.eps)
        mean = mean.reshape(lead)
    else:
        rstd = torch.rsqrt(s.square().mean(-1, keepdim=True) + a.eps)
        y = s * rstd
        if w is not None:
            y = y * w
        if b is not None:
            y = y + b
        mean = s.new_empty(0)
    s_out = s_out.reshape(shape) if a.store_s else s_out.new_empty(0)
    return y.to(a.y_dtype).reshape(shape), s_out, mean, rstd.reshape(lead)


def add_norm_bwd_torch(a: BwdArgs) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Backward on (..., hidden) inputs. x_hat comes from ``saved`` = s (``xhat_from`` S), from s
    recomputed from x and residual exactly as the forward computed it (XR: same ops, dropout mask and
    rounding), or from the output y (Y): x_hat = (y - b) / w where w_j != 0 and |b_j| <= |w_j|
    (:func:`xhat_from_y_ok`), recomputed s elsewhere. Returns (dx or empty, dresidual, dweight or
    empty, dbias or empty, dgate or empty), dx and dresidual of dy's shape."""
    shape, hidden = a.dy.shape, a.dy.shape[-1]
    a = a._replace(
        dy=_flat(a.dy, hidden), ds=_flat(a.ds, hidden), saved=_flat(a.saved, hidden), x=_flat(a.x, hidden),
        residual=_flat(a.residual, hidden),
    )  # fmt: skip
    rows = a.dy.shape[0]
    cdt = a.rstd.dtype
    r = a.rstd.reshape(rows, 1)
    dyf = a.dy.to(cdt)
    weight, bias, gate = a.weight, a.bias, a.gate
    w = None if weight is None else weight.to(cdt)
    b = None if bias is None else bias.to(cdt)
    keep = _keep(a.seed, rows, hidden, a.dropout_p, a.dy.device, a.rows)
    saved = a.saved.to(cdt)
    if a.recompute_s and (a.x is None or a.residual is None):
        raise ValueError("add_norm_bwd: recomputing s needs x and residual")
    if a.xhat_from == XHAT_FROM_XR:
        saved = _stream(a.x, a.residual, gate, keep, a.alpha, a.dropout_p, cdt, a.s_dtype)[1]
    xhat = None
    if a.xhat_from == XHAT_FROM_Y:
        xhat = saved
        if b is not None:
            xhat = xhat - b
        if w is not None:
            xhat = xhat / w
        ok = xhat_from_y_ok(w, b)
        if ok is not None:  # pure ops, no sync: s is recomputed in every column, used where not ok
            s = _stream(a.x, a.residual, gate, keep, a.alpha, a.dropout_p, cdt, a.s_dtype)[1]
            xhat = torch.where(ok, xhat, (s - a.mean.reshape(rows, 1) if a.norm == "layernorm" else s) * r)
    if a.norm == "rmsnorm":
        # x_hat = s * rstd; d/ds = rstd * (w dy - x_hat * mean(x_hat * w dy))
        if xhat is None:
            xhat = saved * r
        wdy = dyf * w if w is not None else dyf
        c1 = (xhat * wdy).mean(-1, keepdim=True)
        dsum = torch.addcmul(wdy, xhat, c1, value=-1.0).mul_(r)
        dw = (dyf * xhat).sum(0) if w is not None else None
        db = dyf.sum(0) if b is not None else None
    else:
        mask = [True, w is not None, b is not None]
        if xhat is not None:
            # the native kernel sees x_hat with mean 0 and rstd 1 and returns the gradient with
            # respect to x_hat, which rstd turns into d/ds
            mu = torch.zeros(rows, 1, dtype=cdt, device=saved.device)
            one = torch.ones(rows, 1, dtype=cdt, device=saved.device)
            dsum, dw, db = torch.ops.aten.native_layer_norm_backward(dyf, xhat, [hidden], mu, one, w, b, mask)
            dsum = dsum * r
        else:
            dsum, dw, db = torch.ops.aten.native_layer_norm_backward(
                dyf, saved, [hidden], a.mean.reshape(rows, 1), r, w, b, mask
            )
    if a.ds is not None:
        dsum = dsum + a.ds.to(cdt)
    p = a.dropout_p
    dx, dres, dgate = branch_grads(dsum, a.x, gate, keep, a.alpha, p, a.x_dtype, a.res_dtype, a.need_dx)
    dw = dsum.new_empty(0) if w is None or dw is None else dw.to(weight.dtype)
    db = dsum.new_empty(0) if b is None or db is None else db.to(bias.dtype)
    return dx.reshape(shape) if a.need_dx else dx, dres.reshape(shape), dw, db, dgate


def branch_grads(
    dsum: Tensor,
    x: Tensor | None,
    gate: Tensor | None,
    keep: Tensor | None,
    alpha: float,
    dropout_p: float,
    x_dtype: torch.dtype,
    res_dtype: torch.dtype,
    need_dx: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """From dsum = dL/ds (rows, hidden) to the inputs of s = alpha * residual + gate * dropout(x):
    (dx or empty, dresidual, dgate or empty). dgate sums over the rows (and, for a one-element gate,
    the columns) given; dx is never dresidual's tensor (outputs of an op may not alias)."""
    dres = (dsum * alpha if alpha != 1.0 else dsum).to(res_dtype)
    dgate = dsum.new_empty(0)
    if not need_dx:
        return dsum.new_empty(0), dres, dgate
    cdt, dx = dsum.dtype, dsum
    if gate is not None:
        xd = x.to(cdt)
        if keep is not None:
            xd = torch.where(keep, xd * (1.0 / (1.0 - dropout_p)), 0.0)
        gsum = (dsum * xd).sum(0)
        dgate = (gsum.sum() if gate.numel() == 1 else gsum).reshape(gate.shape).to(gate.dtype)
        dx = dx * gate.to(cdt)
    if keep is not None:
        dx = torch.where(keep, dx * (1.0 / (1.0 - dropout_p)), 0.0)
    dx = dx.to(x_dtype)
    return (dx.clone() if dx is dres else dx), dres, dgate
