"""The fused Add & Norm op: torch (CPU) and Triton (interpreted on CPU, or CUDA) paths against a float64
oracle, torch.library registration, torch.compile, errors. Its dropout: ``test_ops_add_norm_dropout.py``;
where the Post-LN backward takes x_hat: ``test_ops_add_norm_post_ln.py``; the helpers they share:
``_add_norm_cases.py``."""

from __future__ import annotations

import os

import pytest
import torch
from _add_norm_cases import (  # sets TRITON_INTERPRET=1 without CUDA, before the kernels are imported
    CASES,
    DEVICE,
    HAS_CUDA,
    HAS_TRITON,
    _case_id,
    _triton_ready,
    check_against_oracle,
    make_case,
    needs_gpu,
    needs_triton,
)

from addnorm.ops import MAX_FUSED_HIDDEN, add_norm, add_norm_reference, policy, resolve_backend

# --- torch (CPU) path ---------------------------------------------------------------------------


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_torch_path_matches_float64_oracle(case):
    check_against_oracle("torch", **case)


def test_float64_gradcheck_through_cpu_path():
    x, r, w, b, g = make_case(3, 6, torch.float64, gate="vector")
    for norm in ("layernorm", "rmsnorm"):
        for prenorm in (True, False):

            def f(x, r, w, b, g, norm=norm, prenorm=prenorm):
                return add_norm(
                    x,
                    r,
                    w,
                    b,
                    norm=norm,
                    prenorm=prenorm,
                    alpha=0.8,
                    gate=g,
                    dropout_p=0.3,
                    seed=11,
                    training=True,
                )

            args = [t.clone().requires_grad_(True) for t in (x, r, w, b, g)]
            assert torch.autograd.gradcheck(f, args)
    gs = torch.tensor(0.6, dtype=torch.float64, requires_grad=True)
    args = [t.clone().requires_grad_(True) for t in (x, r, w)]
    assert torch.autograd.gradcheck(lambda x, r, w, g: add_norm(x, r, w, norm="rmsnorm", gate=g), (*args, gs))


def test_out_dtype_and_mixed_dtypes():
    x, _, w, b, _ = make_case(4, 16, torch.bfloat16)
    r = torch.randn(4, 16, dtype=torch.float32)
    y, s = add_norm(x, r, w, b, prenorm=True, out_dtype=torch.float32)
    assert y.dtype == torch.float32 and s.dtype == torch.float32
    ref_y, ref_s = add_norm_reference(x, r, w, b, prenorm=True)
    torch.testing.assert_close(s.double(), ref_s, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(y.double(), ref_y, atol=1e-4, rtol=1e-4)
    y2, s2 = add_norm(x, x, w, b, prenorm=True, residual_in_fp32=True)
    assert y2.dtype == torch.bfloat16 and s2.dtype == torch.float32


def test_hidden_beyond_one_pass_falls_back_to_torch():
    hidden = MAX_FUSED_HIDDEN + 8
    x, r = torch.randn(2, hidden), torch.randn(2, hidden)
    policy._warned.clear()
    if HAS_TRITON and os.environ.get("TRITON_INTERPRET") == "1":
        with pytest.warns(RuntimeWarning, match="torch path"):
            assert resolve_backend("triton", x.device, hidden, (torch.float32,)) == "torch"
    assert resolve_backend("auto", torch.device("cuda"), hidden, (torch.float32,)) == "torch"
    y = add_norm(x, r, None, norm="rmsnorm")
    torch.testing.assert_close(y, add_norm_reference(x, r, norm="rmsnorm", dtype=None))


class _TwoSublayers(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.f1, self.f2 = torch.nn.Linear(d, d), torch.nn.Linear(d, d)
        self.w1, self.b1 = torch.nn.Parameter(torch.ones(d)), torch.nn.Parameter(torch.zeros(d))
        self.w2 = torch.nn.Parameter(torch.ones(d))
        self.gate = torch.nn.Parameter(torch.full((d,), 0.1))

    def forward(self, x, dropout_p=0.0):
        # Pre-LN boundary (y, s), then a Post-LN add & norm with LayerScale
        h, s = add_norm(
            self.f1(x), x, self.w1, self.b1, prenorm=True, dropout_p=dropout_p, training=self.training
        )
        return add_norm(self.f2(h), s, self.w2, norm="rmsnorm", gate=self.gate, alpha=1.2)


# --- backend choice and errors ------------------------------------------------------------------


def test_backend_resolution(backend_env):
    cpu = torch.device("cpu")
    backend_env(None)
    assert resolve_backend("auto", cpu, 64, (torch.float32,)) == "torch"
    assert resolve_backend("torch", cpu, 64, (torch.float32,)) == "torch"
    if HAS_TRITON:
        assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float32,)) == "triton"
        assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float64,)) == "torch"
    backend_env("torch")
    assert resolve_backend("auto", torch.device("cuda"), 64, (torch.float32,)) == "torch"
    backend_env("cuda-please")
    with pytest.raises(ValueError, match="ADDNORM_BACKEND"):
        resolve_backend("auto", cpu, 64, (torch.float32,))
    with pytest.raises(ValueError, match="ADDNORM_BACKEND"):
        add_norm(torch.randn(2, 4), torch.randn(2, 4), None)


def test_triton_on_cpu_without_interpreter_is_a_clear_error(monkeypatch):
    if HAS_CUDA:
        pytest.skip("interpreter setting irrelevant with CUDA")
    monkeypatch.setattr(policy, "interpreting", lambda: False)
    policy.invalidate()  # no plan cached under the real interpreter setting
    x = torch.randn(2, 4)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET|not installed"):
        add_norm(x, x, None, backend="triton")


@pytest.mark.parametrize(
    "kwargs, exc, match",
    [
        ({"residual": torch.randn(3, 5)}, ValueError, "residual: expected the shape"),
        ({"weight": torch.ones(7)}, ValueError, r"weight: expected shape \(8,\)"),
        ({"bias": torch.ones(8, 1)}, ValueError, "bias"),
        ({"gate": torch.ones(3)}, ValueError, "gate: expected None, a one-element"),
        ({"norm": "batchnorm"}, ValueError, "norm: expected 'layernorm' or 'rmsnorm', got 'batchnorm'"),
        ({"dropout_p": 1.0}, ValueError, r"dropout_p: expected a probability in \[0, 1\), got 1.0"),
        ({"dropout_p": -0.1}, ValueError, "dropout_p"),
        ({"eps": 0.0}, ValueError, "eps"),
        ({"backend": "cuda"}, ValueError, "backend: expected one of"),
        ({"x": torch.ones(3, 8, dtype=torch.int64)}, TypeError, "x: expected a float32"),
        ({"residual": [1.0]}, TypeError, "residual: expected a Tensor"),
        ({"x": torch.ones(3, 0), "residual": torch.ones(3, 0), "weight": None}, ValueError, "x: expected"),
        ({"out_dtype": torch.int32}, TypeError, "out_dtype"),
        ({"alpha": torch.tensor(1.0)}, TypeError, "alpha"),
        ({"seed": -1, "dropout_p": 0.1}, ValueError, "seed"),
    ],
)
def test_errors_name_the_argument(kwargs, exc, match):
    args = {"x": torch.randn(3, 8), "residual": torch.randn(3, 8), "weight": torch.ones(8), **kwargs}
    x, r, w = args.pop("x"), args.pop("residual"), args.pop("weight")
    with pytest.raises(exc, match=match):
        add_norm(x, r, w, **args, training=True)


# --- Triton kernels (interpreter on CPU, or CUDA) -----------------------------------------------


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_triton_matches_float64_oracle(case):
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    check_against_oracle("triton", device=DEVICE, **case)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("case", [c for c in CASES if c.get("hidden", 123) <= 200], ids=_case_id)
def test_triton_backward_in_column_slices_matches_float64_oracle(small_chunks, case):
    """Every case up to 200 columns (wider rows in the stand-ins' 16-column slices take the interpreter
    minutes: each slice's program reads every other) with rows from 16 columns in column slices (the
    launch tables' small stand-ins), in each backward variant: the slices reading each other's columns
    for the row sums, and the row-sums pre-pass before the slices."""
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    check_against_oracle("triton", device=DEVICE, **case)


@pytest.mark.triton
@needs_triton
def test_triton_dweight_is_deterministic_and_env_selects_triton(backend_env):
    if not _triton_ready():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    x, r, w, b, _ = make_case(40, 24, device=DEVICE)  # 40 rows: several programs' partial sums
    backend_env("triton")
    grads = []
    for _ in range(2):
        wl, bl = w.clone().requires_grad_(True), b.clone().requires_grad_(True)
        y = add_norm(x, r, wl, bl, norm="layernorm")
        grads.append(torch.autograd.grad(y.square().sum(), (wl, bl)))
    assert all(torch.equal(a, c) for a, c in zip(grads[0], grads[1], strict=True))


# --- GPU ----------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.triton
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [4096, 65536])
def test_gpu_triton_matches_oracle_on_large_shapes(dtype, hidden):
    rows = max(1, 2**20 // hidden)
    for norm, prenorm in (("layernorm", False), ("rmsnorm", True)):
        check_against_oracle(
            "triton",
            dtype=dtype,
            norm=norm,
            prenorm=prenorm,
            rows=rows,
            hidden=hidden,
            dropout_p=0.1,
            device="cuda",
        )


@pytest.mark.gpu
@pytest.mark.triton
@needs_gpu
@pytest.mark.parametrize("variant", ["slices", "row_sums"])
def test_gpu_backward_variants_match_oracle_on_wide_rows(variant):
    """Each backward variant (launch_config.BWD_VARIANTS) as compiled for the GPU, on rows in column
    slices: Pre-LN and Post-LN (s recomputed from x and residual in bf16), dropout and a gate."""
    from addnorm.ops import launch_config as lc

    previous = lc.use_bwd_variant(variant)
    try:
        for dtype, norm, prenorm in ((torch.bfloat16, "layernorm", False), (torch.float32, "rmsnorm", True)):
            kw = {"rows": 64, "hidden": 8192, "dropout_p": 0.1, "gate": "vector", "device": "cuda"}
            check_against_oracle("triton", dtype=dtype, norm=norm, prenorm=prenorm, **kw)
    finally:
        lc.use_bwd_variant(previous)


@pytest.mark.gpu
@needs_gpu
def test_gpu_compile_fullgraph():
    model = _TwoSublayers(256).cuda()
    x = torch.randn(4, 8, 256, device="cuda")
    torch.testing.assert_close(torch.compile(model, fullgraph=True)(x), model(x), atol=1e-4, rtol=1e-4)


def test_no_triton_import_from_addnorm():
    code = "import sys, addnorm, addnorm.ops; print('triton' in sys.modules)"
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dropout_p", [0.2, 0.0])
@pytest.mark.parametrize("prenorm", [True, False])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_eager_path_equals_the_registered_op(norm, prenorm, dropout_p):
    """In eager mode a CPU call runs the composite of torch ops under torch's autograd (its dropout
    multiplier from the NumPy mask); the registered custom op (what make_fx and dispatch modes record)
    runs the explicit torch path: same outputs bit for bit, same gradients to rounding."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, r, w, b, g = make_case(6, 40, gate="vector")
    kw = {"norm": norm, "prenorm": prenorm, "alpha": 1.3, "dropout_p": dropout_p, "seed": 9}

    def f(x, r, w, b, g):
        return add_norm(x, r, w, b, gate=g, **kw)

    traced = make_fx(f)(x, r, w, b, g)
    assert "addnorm.add_norm_fwd.default" in [str(n.target) for n in traced.graph.nodes]
    results = []
    for fn in (f, traced):
        leaves = [t.clone().requires_grad_(True) for t in (x, r, w, b, g)]
        out = fn(*leaves)
        y, s = out if prenorm else (out, out)
        loss = (y * torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum() + s.square().sum()
        results.append((y.detach(), s.detach(), torch.autograd.grad(loss, leaves)))
    (y0, s0, g0), (y1, s1, g1) = results
    assert torch.equal(s0, s1)
    torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-6)
    for a, c in zip(g0, g1, strict=True):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5)


def test_tracing_sees_the_registered_op():
    """make_fx (a dispatch mode) records addnorm::add_norm_fwd, not the eager path's torch ops."""
    from torch.fx.experimental.proxy_tensor import make_fx

    x, r, w, b, _ = make_case(4, 16)
    gm = make_fx(lambda x, r, w, b: add_norm(x, r, w, b, norm="rmsnorm"))(x, r, w, b)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert "addnorm.add_norm_fwd.default" in targets
    torch.testing.assert_close(gm(x, r, w, b), add_norm(x, r, w, b, norm="rmsnorm"))
