"""Multi-head attention through ``F.scaled_dot_product_attention``, with torch.nn's mask conventions."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

NORMALIZE = (None, "qk", "qkv", "ngpt")


def _check_mask_dtype(mask: Tensor, name: str) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name}: expected a Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(
            f"{name}: expected a bool mask (True = not allowed to attend) or a float mask (added to the "
            f"attention scores), got dtype {mask.dtype}"
        )


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """A bool mask (True = masked out, torch.nn's convention) as -inf/0; a float mask as it is."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def causal_mask(size: int, device=None, dtype: torch.dtype = torch.float32) -> Tensor:
    """The (size, size) additive causal mask: 0 on and below the diagonal, -inf above it.

    Same values as ``torch.nn.Transformer.generate_square_subsequent_mask``.
    """
    return torch.triu(torch.full((size, size), float("-inf"), device=device, dtype=dtype), diagonal=1)


def merge_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    *,
    batch: int,
    heads: int,
    tgt_len: int,
    src_len: int,
    dtype: torch.dtype,
    is_causal: bool = False,
    names: tuple[str, str] = ("attn_mask", "key_padding_mask"),
) -> tuple[Tensor | None, bool]:
    """Validate torch.nn-style masks and merge them into one additive (B|1, H|1, L, S) mask.

    ``attn_mask``: (L, S) or (B*H, L, S), bool (True = masked out) or float (added).
    ``key_padding_mask``: (B, S), bool (True = padding, ignored) or float (added).
    ``is_causal`` without ``attn_mask`` means the causal mask; with one, it is only a hint and the
    given mask is used (torch.nn's rule). Returns (mask or None, whether SDPA should apply causality).
    """
    a_name, k_name = names
    merged: Tensor | None = None
    if attn_mask is not None:
        _check_mask_dtype(attn_mask, a_name)
        if attn_mask.shape == (tgt_len, src_len):
            merged = _additive(attn_mask, dtype).view(1, 1, tgt_len, src_len)
        elif attn_mask.shape == (batch * heads, tgt_len, src_len):
            merged = _additive(attn_mask, dtype).view(batch, heads, tgt_len, src_len)
        else:
            raise ValueError(
                f"{a_name}: expected shape ({tgt_len}, {src_len}) or ({batch * heads}, {tgt_len}, {src_len}) "
                f"(target length, source length; batch * heads first), got {tuple(attn_mask.shape)}"
            )
    elif is_causal and key_padding_mask is None:
        return None, True
    elif is_causal:
        if tgt_len != src_len:
            raise ValueError(f"is_causal: needs equal target and source lengths, got {tgt_len} and {src_len}")
        merged = causal_mask(tgt_len, device=key_padding_mask.device, dtype=dtype).view(
            1, 1, tgt_len, src_len
        )
    if key_padding_mask is not None:
        _check_mask_dtype(key_padding_mask, k_name)
        if key_padding_mask.shape != (batch, src_len):
            raise ValueError(
                f"{k_name}: expected shape ({batch}, {src_len}) (batch, source length), "
                f"got {tuple(key_padding_mask.shape)}"
            )
        kpm = _additive(key_padding_mask, dtype).view(batch, 1, 1, src_len)
        merged = kpm if merged is None else merged + kpm
    return merged, False


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention (Vaswani et al. 2017), batch-first.

    softmax(Q K^T / sqrt(d_head) + mask) V per head; Q, K, V from one packed ``in_proj`` (d, 3d) like
    ``nn.MultiheadAttention``'s ``in_proj_weight``, so weights convert one-to-one.

    ``qkv_norm`` (a callable building a norm of a given size, or None) with ``normalize="qk"``
    normalises queries and keys per head over the head dimension (QK-norm, Dehghani et al. 2023), with
    ``"qkv"`` values too (HybridNorm, Zhuo et al. 2025); ``inner_norm`` is a norm applied to the
    concatenated heads before ``out_proj`` (Sub-LN, Wang et al. 2022).

    ``normalize="ngpt"`` (Loshchilov et al. 2024): q = s_qk * q / ||q||, k = s_qk * k / ||k|| per head,
    and softmax(q k^T * sqrt(d_head)) V, the scale sqrt(d_head) replacing 1/sqrt(d_head). s_qk is one
    learned vector of d_model = heads * d_head entries shared by queries and keys, initialised to 1 and
    stored at scale 1/sqrt(d_model) (the parameter ``s_qk`` starts at 1/sqrt(d_model) and is used times
    sqrt(d_model)), so that Adam moves it at the pace of a parameter of that size.
    """

    # x is read by one linear layer only (``in_proj``; with memory, its query rows): under autocast a
    # connection may hand it over in autocast's dtype (addnorm.model.stream.sublayer_dtype)
    autocast_input = True

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        device=None,
        dtype=None,
        *,
        normalize: str | None = None,
        qkv_norm: Callable[[int], nn.Module] | None = None,
        inner_norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        if d_model % n_heads:
            raise ValueError(f"d_model: {d_model} is not divisible by n_heads={n_heads}")
        if normalize not in NORMALIZE:
            raise ValueError(f"normalize: expected one of {NORMALIZE}, got {normalize!r}")
        self.d_model, self.n_heads, self.head_dim = d_model, n_heads, d_model // n_heads
        self.dropout = float(dropout)
        kw = {"device": device, "dtype": dtype}
        self.in_proj = nn.Linear(d_model, 3 * d_model, bias=bias, **kw)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias, **kw)
        self.normalize = normalize
        self.q_norm = self.k_norm = self.v_norm = None
        self.s_qk: nn.Parameter | None = None
        if normalize == "ngpt":
            self.s_qk_scale = d_model**-0.5  # stored at 1/sqrt(d), used as s_qk / scale (init 1)
            self.s_qk = nn.Parameter(torch.full((d_model,), self.s_qk_scale, **kw))
        elif normalize is not None:
            if qkv_norm is None:
                raise ValueError("qkv_norm: a norm factory is needed when normalize is set")
            self.q_norm, self.k_norm = qkv_norm(self.head_dim), qkv_norm(self.head_dim)
            self.v_norm = qkv_norm(self.head_dim) if normalize == "qkv" else None
        self.inner_norm = inner_norm

    def forward(
        self,
        x: Tensor,
        memory: Tensor | None = None,
        attn_mask: Tensor | None = None,
        key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
        mask_names: tuple[str, str] = ("attn_mask", "key_padding_mask"),
    ) -> Tensor:
        """Self-attention over ``x`` (B, L, d), or cross-attention from ``x`` to ``memory`` (B, S, d)."""
        b, tgt_len, d = x.shape
        hd = self.head_dim
        if memory is None:
            # (B, L, 3 h hd) -> 3 x (B, h, L, hd); h: the heads this process computes, all of them or,
            # under tensor parallelism (addnorm.parallelize), its shard of them
            qkv = self.in_proj(x)
            h = qkv.shape[-1] // (3 * hd)
            q, k, v = qkv.view(b, tgt_len, 3, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
            src_len = tgt_len
        else:
            if memory.ndim != 3 or memory.shape[0] != b or memory.shape[2] != d:
                raise ValueError(
                    f"memory: expected shape ({b}, S, {d}) (batch first), got {tuple(memory.shape)}"
                )
            src_len, h = memory.shape[1], self.n_heads
            w, bias = self.in_proj.weight, self.in_proj.bias
            q = F.linear(x, w[:d], None if bias is None else bias[:d])
            kv = F.linear(memory, w[d:], None if bias is None else bias[d:])
            q = q.view(b, tgt_len, h, hd).transpose(1, 2)
            k, v = kv.view(b, src_len, 2, h, hd).permute(2, 0, 3, 1, 4).unbind(0)
        scale = None  # SDPA's default 1/sqrt(d_head)
        if self.s_qk is not None:  # nGPT: unit q, k per head, times s_qk; logits scaled by sqrt(d_head)
            s_qk = (self.s_qk / self.s_qk_scale).view(h, 1, hd)
            q, k = s_qk * F.normalize(q, dim=-1), s_qk * F.normalize(k, dim=-1)
            scale = hd**0.5
        elif self.normalize is not None:  # per head, over the head dimension
            q, k = self.q_norm(q), self.k_norm(k)
            if self.v_norm is not None:
                v = self.v_norm(v)
        mask, causal = merge_masks(
            attn_mask,
            key_padding_mask,
            batch=b,
            heads=self.n_heads,
            tgt_len=tgt_len,
            src_len=src_len,
            dtype=q.dtype,
            is_causal=is_causal,
            names=mask_names,
        )
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=causal,
            scale=scale,
        )
        out = out.transpose(1, 2).reshape(b, tgt_len, h * hd)  # (B, h, L, hd) -> (B, L, h hd)
        if self.inner_norm is not None:
            out = self.inner_norm(out)
        return self.out_proj(out)

    def extra_repr(self) -> str:
        return f"d_model={self.d_model}, n_heads={self.n_heads}, dropout={self.dropout}"
