"""The fused op's Triton kernels beyond one row in one pass: several rows per program (a ragged last
tile), rows in column chunks (small stand-in launch tables), the launch tables as they are around and
above the one-pass widths in each backward variant, the row-sums pre-pass, one program or partial sums
for the parameter gradients, and the eager Triton path against the registered op on the same kernels."""

from __future__ import annotations

import pytest
import torch
from _ops_paths_inputs import DEVICE, _inputs, needs_triton

from addnorm.ops import add_norm, add_norm_reference
from addnorm.ops import functional as fn
from addnorm.ops import library as lib
from addnorm.ops.args import XHAT_FROM_S, XHAT_FROM_XR, XHAT_FROM_Y


def _grads(f, leaves, prenorm, weights):
    leaves = [t.detach().clone().requires_grad_(True) if t is not None else None for t in leaves]
    out = f(*leaves)
    y, s = out if prenorm else (out, None)
    loss = (y.double() * weights).sum() + (s.double().square().sum() * 1e-2 if s is not None else 0)
    used = [t for t in leaves if t is not None]
    return [y.detach()] + ([s.detach()] if s is not None else []), list(torch.autograd.grad(loss, used))


# --- kernels: several rows per program, column chunks --------------------------------------------


def _check_triton_vs_oracle(rows, hidden, dtype, norm, prenorm, dropout, gate, xhat_from=None):
    x, r, w, b, g = _inputs(rows, hidden, dtype, gate=gate)
    weights = torch.linspace(-1, 1, rows * hidden, dtype=torch.float64, device=DEVICE).reshape(rows, hidden)
    kw = {"norm": norm, "prenorm": prenorm, "alpha": 0.9, "dropout_p": 0.25 if dropout else 0.0}
    if xhat_from is None:

        def ours(x, r, w, b, g):
            return add_norm(x, r, w, b, gate=g, seed=11, backend="triton", **kw)

    else:
        seed = torch.tensor(11, device=DEVICE) if dropout else None

        def ours(x, r, w, b, g):
            args = (seed, None, xhat_from, norm, 1e-5, 0.9, kw["dropout_p"], r.dtype, x.dtype, prenorm)
            args += ("triton",)
            y, s = lib.add_norm_fwd(x, r, w, b, g, *args)[:2]
            return (y, s) if prenorm else y

    def oracle(dt):
        return lambda x, r, w, b, g: add_norm_reference(
            x, r, w, b, gate=g, seed=11 if dropout else None, dtype=dt, **kw
        )

    out, grads = _grads(ours, (x, r, w, b, g), prenorm, weights)
    out_ref, grads_ref = _grads(oracle(torch.float64), (x, r, w, b, g), prenorm, weights)
    out_low, grads_low = _grads(oracle(dtype), (x, r, w, b, g), prenorm, weights)
    atol = {torch.float32: 1e-4, torch.bfloat16: 1.6e-2}[dtype]
    for name, o, lo, rf in zip(
        ["y", "s", "dx", "dr", "dw", "db", "dg"][: len(out)] + ["dx", "dr", "dw", "db", "dg"][: len(grads)],
        out + grads,
        out_low + grads_low,
        out_ref + grads_ref,
        strict=True,
    ):
        err = (o.double() - rf).abs().max().item()
        base = (lo.double() - rf).abs().max().item()
        assert err <= 2 * base + atol * max(1.0, rf.abs().max().item()), (name, err, base)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize(
    "prenorm, dropout, gate", [(True, True, True), (False, False, False), (False, True, True)]
)
def test_chunked_kernels_match_the_oracle(small_chunks, norm, prenorm, dropout, gate):
    """Rows of 75 columns in chunks of 32 (forward) and 16 (backward), two rows per program."""
    assert small_chunks.fwd_config(75).chunked and small_chunks.bwd_config(75).chunked
    _check_triton_vs_oracle(7, 75, torch.float32, norm, prenorm, dropout, gate)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("xhat_from", [XHAT_FROM_S, XHAT_FROM_Y, XHAT_FROM_XR])
def test_chunked_post_ln_backward_paths(small_chunks, xhat_from):
    _check_triton_vs_oracle(5, 75, torch.float32, "layernorm", False, True, True, xhat_from)


@pytest.mark.triton
@needs_triton
def test_several_rows_per_program_with_a_partial_last_tile():
    """The forward's multi-row tiles with a ragged last tile; the backward goes one row per step."""
    from addnorm.ops.launch_config import bwd_config, fwd_config

    assert fwd_config(24).block_m > 1 and bwd_config(24).block_m == 1
    _check_triton_vs_oracle(77, 24, torch.float32, "layernorm", True, True, True)  # 77 rows: a ragged tile
    _check_triton_vs_oracle(77, 24, torch.bfloat16, "rmsnorm", False, False, False)


@pytest.fixture(params=["slices", "row_sums"])
def bwd_variant(request):
    """Each backward variant (``launch_config.BWD_VARIANTS``) selected for the test, with the launch
    tables as they are; the previous one restored afterwards."""
    from addnorm.ops import launch_config as k

    previous = k.use_bwd_variant(request.param)
    yield request.param
    k.use_bwd_variant(previous)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("hidden", [2048, 2049, 4096, 4100, 4112, 8192, 16384])
@pytest.mark.parametrize(
    "norm, prenorm, dropout, gate, dtype",
    [
        ("layernorm", True, True, True, torch.float32),  # register-heavy, x_hat from s
        ("rmsnorm", False, False, False, torch.float32),  # Post-LN, fp32 y: x_hat from y
        ("layernorm", False, True, True, torch.bfloat16),  # Post-LN, bf16 y: s recomputed from x, residual
    ],
)
def test_the_launch_tables_at_and_above_the_one_pass_widths_match_the_oracle(
    bwd_variant, hidden, norm, prenorm, dropout, gate, dtype
):
    """The launch configurations as they are (no small stand-ins) around and above the widths where the
    backward stops going in one pass, in each variant. "slices": one pass, slices of 2048 (the heavy
    variants, from 2049 columns, and widths not a multiple of 16) or 4096 (each program reading the
    row's other slices for the row sums); "row_sums": the pre-pass (the forward's tiles) and slices of
    2048 from 2048 columns (heavy) or 4096; the forward's column chunks above 8192; 3 rows (one program
    per slice), float64 oracle."""
    from addnorm.ops import launch_config as k

    heavy = k.bwd_register_heavy(dtype, dropout, 2 if gate else 0)
    cfg = k.bwd_config(hidden, heavy, bwd_variant)
    if bwd_variant == "slices":
        assert cfg.chunked == (hidden > (k.BWD_MAX_ONE_PASS_HEAVY if heavy else k.BWD_MAX_ONE_PASS))
    else:
        assert cfg.chunked == (hidden >= (k.BWD_ROW_SUMS_MIN_HEAVY if heavy else k.BWD_ROW_SUMS_MIN))
    _check_triton_vs_oracle(3, hidden, dtype, norm, prenorm, dropout, gate)


@pytest.mark.triton
@needs_triton
def test_a_row_in_slices_over_several_programs_sums_their_partials(bwd_variant):
    """8192 columns in slices, 20 rows: several programs per slice, each writing its slice's row of
    the partial sums once."""
    from addnorm.ops.launch_config import BWD_ONE_PROGRAM_TILES, bwd_config

    assert bwd_config(8192, True, bwd_variant).chunked and 20 > BWD_ONE_PROGRAM_TILES
    _check_triton_vs_oracle(20, 8192, torch.float32, "layernorm", True, True, True)


class _Launches:
    """A kernel stand-in that records each launch (grid, arguments) and runs the kernel it wraps."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **options):
            self.calls.append((grid, args))
            return self.kernel[grid](*args, **options)

        return launch


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("norm, xhat_from", [("layernorm", XHAT_FROM_S), ("rmsnorm", XHAT_FROM_XR)])
def test_the_row_sums_pre_pass_leaves_the_rows_sums_for_the_slices(monkeypatch, norm, xhat_from):
    """Variant "row_sums": one pre-pass launch per backward (one program per row tile) before the
    slices, its buffer each row's sum(x_hat * w dy) (and LayerNorm's sum(w dy)) as float64 gives
    them; the default variant launches none."""
    from addnorm.ops.triton import launchers as tl_

    f32, rows, n, rms = torch.float32, 5, 4100, norm == "rmsnorm"
    x, r, w, b, _ = _inputs(rows, n)
    b = None if rms else b
    fwd = tl_.fwd_spec(n, norm, 1e-5, 1.0, 0.0, True, not rms, 0, True, f32, f32)
    y, s, mean, rstd = tl_.launch_fwd(fwd, x, r, w, b, None, None)
    dy = torch.randn(rows, n, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).to(f32)
    spy = _Launches(tl_.bwd_sums_kernel)
    monkeypatch.setattr(tl_, "bwd_sums_kernel", spy)
    for variant, launches in (("slices", 0), ("row_sums", 1)):
        sp = tl_.bwd_spec(
            n, norm, 1.0, 0.0, True, not rms, 0, False, xhat_from, f32, f32, f32, False, 1e-5, variant
        )
        assert (sp.sums is not None) == (variant == "row_sums")
        saved = s if xhat_from == XHAT_FROM_S else None
        tl_.launch_bwd(sp, dy, None, saved, x, r, w, b, None, None, mean, rstd)
        assert len(spy.calls) == launches
    grid, args = spy.calls[0]
    assert grid == (-(-rows // sp.sums.block_m),)
    s64 = x.double() + r.double()
    xhat = (s64 if rms else s64 - s64.mean(1, keepdim=True)) * rstd.double()[:, None]
    wdy = w.double() * dy.double()
    want = torch.stack([(xhat * wdy).sum(1)] + ([] if rms else [wdy.sum(1)]), 1).reshape(-1)
    torch.testing.assert_close(args[10].double(), want, rtol=1e-4, atol=1e-3)


def test_a_small_backward_is_one_program_and_a_larger_one_sums_partials():
    """Up to BWD_ONE_PROGRAM_TILES row tiles one program writes dweight / dbias itself (no torch
    reduction after the kernel); beyond, several programs write partial sums."""
    from addnorm.ops.launch_config import BWD_ONE_PROGRAM_TILES, bwd_grid

    cpu = torch.device("cpu")
    assert bwd_grid(0, 64, cpu, (1, 64)) == (0, 0)
    assert bwd_grid(8, 64, cpu, (1, 64)) == (1, 8)
    assert bwd_grid(BWD_ONE_PROGRAM_TILES, 64, cpu, (1, 64)) == (1, BWD_ONE_PROGRAM_TILES)
    programs, per_program = bwd_grid(BWD_ONE_PROGRAM_TILES + 1, 64, cpu, (1, 64))
    assert programs > 1 and programs * per_program >= BWD_ONE_PROGRAM_TILES + 1
    assert bwd_grid(2 * BWD_ONE_PROGRAM_TILES, 64, cpu, (2, 64)) == (1, BWD_ONE_PROGRAM_TILES)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("rows", [5, 40])  # one program; several, with partial sums
@pytest.mark.parametrize(
    "norm, prenorm, dtype",
    [
        ("layernorm", True, torch.float32),  # s saved: the backward recomputes the statistics
        ("layernorm", False, torch.float32),  # x_hat from y: the statistics in one buffer
        ("rmsnorm", False, torch.bfloat16),  # s recomputed from x and residual: no statistics kept
        ("rmsnorm", True, torch.float32),
    ],
)
def test_eager_triton_path_equals_the_registered_op(rows, norm, prenorm, dtype):
    """The eager path (statistics in one buffer, or none and recomputed in backward; one program for
    few rows) against the registered op on the same kernels (mean and rstd apart, as its schema
    returns them): the same outputs bit for bit, the same gradients to fp32 rounding."""
    x, r, w, b, g = _inputs(rows, 48, dtype, gate=True)
    kw = {"norm": norm, "prenorm": prenorm, "alpha": 0.9, "dropout_p": 0.25}
    weights = torch.linspace(-1, 1, rows * 48, dtype=torch.float64, device=DEVICE).reshape(rows, 48)

    def eager(x, r, w, b, g):
        return add_norm(x, r, w, b, gate=g, seed=5, backend="triton", **kw)

    fn.clear_plans()
    out, grads = _grads(eager, (x, r, w, b, g), prenorm, weights)
    (plan,) = fn._PLANS.values()
    xhat_from = XHAT_FROM_S if prenorm else plan.xhat_from  # the eager path's own choice

    def op(x, r, w, b, g):
        seed = torch.tensor(5, device=DEVICE)
        args = (seed, None, xhat_from, norm, 1e-5, 0.9, 0.25, r.dtype, x.dtype, prenorm, "triton")
        y, s = lib.add_norm_fwd(x, r, w, b, g, *args)[:2]
        return (y, s) if prenorm else y

    out_op, grads_op = _grads(op, (x, r, w, b, g), prenorm, weights)
    for a, c in zip(out, out_op, strict=True):
        assert torch.equal(a, c)
    for a, c in zip(grads, grads_op, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.triton
@needs_triton
def test_eager_triton_path_keeps_the_statistics_only_where_backward_reads_them(small_chunks):
    """Where the backward has s and goes in one pass it recomputes the statistics: the forward
    allocates none. x_hat from y, or rows in column chunks, read the forward's: one buffer, the rstds
    then LayerNorm's means (one allocation, not two)."""
    x, r, w, b, _ = _inputs(6, 12)
    leaves = [t.requires_grad_(True) for t in (x, r, w, b)]
    y, _ = add_norm(*leaves, prenorm=True, backend="triton")
    assert y.grad_fn.saved_tensors[-1] is None  # s saved, 12 columns: one pass
    y = add_norm(*leaves, backend="triton")  # Post-LN, fp32 y: x_hat from y
    assert tuple(y.grad_fn.saved_tensors[-1].shape) == (2 * 6,)
    y = add_norm(*leaves, norm="rmsnorm", backend="triton")
    assert tuple(y.grad_fn.saved_tensors[-1].shape) == (6,)
    x, r, w, b, _ = _inputs(3, 40)  # wider than the fixture's 16-column backward chunks
    y, s = add_norm(x, r, w.requires_grad_(True), b, prenorm=True, backend="triton")
    assert tuple(y.grad_fn.saved_tensors[-1].shape) == (2 * 3,)
    _check_triton_vs_oracle(3, 40, torch.float32, "layernorm", True, False, False)
