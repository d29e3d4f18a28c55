"""The fused op's dropout: the hashed keep mask against its scalar Python definition and the int64 hash
composition, its keep rate and independence, seeds that reproduce and differ, kept elements scaled, the
backward using the forward's mask, no dropout in eval, and the torch and Triton paths' identical masks."""

from __future__ import annotations

import pytest
import torch
from _add_norm_cases import DEVICE, _triton_ready, make_case, needs_triton

from addnorm.ops import add_norm, add_norm_reference, dropout_keep_mask

# --- torch (CPU) path ---------------------------------------------------------------------------


def test_dropout_gradient_uses_the_forward_mask():
    """Finite differences through the float64 oracle with the same fixed seed agree with our backward."""
    x, r, w, b, _ = make_case(4, 9, torch.float64)
    x.requires_grad_(True)
    kw = {"norm": "layernorm", "prenorm": False, "dropout_p": 0.4}
    y = add_norm(x, r, w, b, seed=99, training=True, **kw)
    dy = torch.randn_like(y)
    (gx,) = torch.autograd.grad((y * dy).sum(), x)
    h = 1e-6
    num = torch.zeros_like(x)
    for i in range(x.shape[0]):
        for j in range(x.shape[1]):
            e = torch.zeros_like(x)
            e[i, j] = h
            f = lambda t: (add_norm_reference(t, r, w, b, seed=99, **kw) * dy).sum()  # noqa: E731
            num[i, j] = (f(x.detach() + e) - f(x.detach() - e)) / (2 * h)
    torch.testing.assert_close(gx, num, atol=1e-6, rtol=1e-5)
    dropped = ~dropout_keep_mask(99, 4, 9, 0.4)
    assert dropped.any() and (gx[dropped] == 0).all()


def test_no_dropout_in_eval_and_defaults():
    x, r, w, b, _ = make_case(3, 8)
    y_eval = add_norm(x, r, w, b, dropout_p=0.5, training=False)
    torch.testing.assert_close(y_eval, add_norm_reference(x, r, w, b, dtype=None))
    y_tr = add_norm(x, r, w, b, dropout_p=0.5, training=True, seed=1)
    assert not torch.allclose(y_tr, y_eval)


# --- dropout mask -------------------------------------------------------------------------------


def _py_hash(v: int) -> int:
    m = 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & m
    v ^= v >> 15
    v = (v * 0x1B873593) & m
    return v ^ (v >> 16)


def test_mask_matches_scalar_python_definition():
    seed, rows, cols, p = (123 << 32) + 456789, 5, 11, 0.3
    k0, k1 = seed & 0xFFFFFFFF, seed >> 32
    expected = torch.zeros(rows, cols, dtype=torch.bool)
    for i in range(rows):
        a = _py_hash(k0 ^ _py_hash((i * 0x632BE5AB + k1) & 0xFFFFFFFF))
        for j in range(cols):
            h = _py_hash(a ^ ((j * 0x2545F491) & 0xFFFFFFFF))
            expected[i, j] = (h >> 8) >= round(p * 2**24)
    assert torch.equal(dropout_keep_mask(seed, rows, cols, p), expected)
    assert torch.equal(dropout_keep_mask(torch.tensor(seed), rows, cols, p), expected)


@pytest.mark.parametrize("seed", [0, 5, 2**40 + 7, 2**63 - 1])
def test_fast_mask_equals_int64_hash_composition(seed):
    """dropout_keep_mask computes its (rows, cols) part in int32; the int64 hash32 spells the definition."""
    from addnorm.ops.reference import HASH_COL, HASH_ROW, hash32

    m = 0xFFFFFFFF
    for rows, cols in ((300, 257), (1, 1), (3, 65)):
        row, col = torch.arange(rows), torch.arange(cols)
        a = hash32((seed & m) ^ hash32((row * HASH_ROW + (seed >> 32)) & m))
        h = hash32(a[:, None] ^ ((col * HASH_COL) & m)[None, :])
        for p in (1e-4, 0.1, 0.5, 0.9):
            assert torch.equal(dropout_keep_mask(seed, rows, cols, p), (h >> 8) >= round(p * 2**24))


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_keep_rate_and_independence(p):
    rows, cols = 256, 512
    keep = dropout_keep_mask(2024, rows, cols, p).double()
    n = keep.numel()
    sigma = (p * (1 - p) / n) ** 0.5
    assert abs(keep.mean().item() - (1 - p)) < 5 * sigma
    # per-row rates stay within bounds too (no row is all kept / all dropped)
    row_sigma = (p * (1 - p) / cols) ** 0.5
    assert ((keep.mean(1) - (1 - p)).abs() < 6 * row_sigma).all()
    # neighbours (along columns, along rows) and another seed are uncorrelated
    c = keep - keep.mean()
    var = (c * c).mean()
    for a, bb in ((c[:, 1:], c[:, :-1]), (c[1:], c[:-1])):
        assert abs((a * bb).mean() / var) < 5 / n**0.5 * 2
    other = dropout_keep_mask(2025, rows, cols, p).double() - (1 - p)
    assert abs((c * other).mean() / var) < 10 / n**0.5


def test_seeds_reproduce_and_differ():
    x, r, w, b, _ = make_case(8, 64)
    kw = {"dropout_p": 0.3, "training": True}
    assert torch.equal(add_norm(x, r, w, b, seed=5, **kw), add_norm(x, r, w, b, seed=5, **kw))
    assert not torch.equal(add_norm(x, r, w, b, seed=5, **kw), add_norm(x, r, w, b, seed=6, **kw))
    torch.manual_seed(3)
    a = add_norm(x, r, w, b, **kw)
    torch.manual_seed(3)
    assert torch.equal(a, add_norm(x, r, w, b, **kw))
    assert not torch.equal(a, add_norm(x, r, w, b, **kw))


def test_dropout_scales_kept_elements():
    x = torch.ones(64, 256)
    _, s = add_norm(
        x, torch.zeros_like(x), None, prenorm=True, alpha=0.0, dropout_p=0.25, seed=8, training=True
    )
    keep = dropout_keep_mask(8, 64, 256, 0.25)
    torch.testing.assert_close(s, keep.float() / 0.75)


# --- Triton kernels (interpreter on CPU, or CUDA) -----------------------------------------------


@pytest.mark.triton
@needs_triton
def test_triton_and_torch_masks_are_identical():
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x = torch.ones(9, 300, device=DEVICE)
    zeros = torch.zeros_like(x)
    seed = (77 << 32) + 12345
    out = {}
    for backend in ("torch", "triton"):
        _, s = add_norm(x, zeros, None, prenorm=True, alpha=0.0, dropout_p=0.3, seed=seed, backend=backend)
        out[backend] = s
    assert torch.equal(out["torch"], out["triton"])
    keep = dropout_keep_mask(seed, 9, 300, 0.3, device=DEVICE)
    assert torch.equal(out["triton"] != 0, keep)
