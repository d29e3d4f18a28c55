"""Run as a script (TRITON_INTERPRET=0, a process of its own): every kind of call signature through
today's eager path and through the native call, Triton's real launcher and the native launch both onto
the fake driver (``addnorm.ops.native.fake_driver``), the second call's launches compared: function,
grid, block, shared memory, stream, and every parameter's bytes (pointers by which tensor they are).
Prints one JSON line: {"cases": n, "native_launches": n, "mismatches": [...]}."""

from __future__ import annotations

import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"
STREAM = 0x5EED

from addnorm.ops.native import build, fake_driver  # noqa: E402

fake_driver.install(STREAM)
import torch  # noqa: E402

from addnorm import ops  # noqa: E402
from addnorm.ops import functional, seeds  # noqa: E402
from addnorm.ops.native.layout import _EXTRACTORS  # noqa: E402
from addnorm.ops.triton import kernels as tk  # noqa: E402

ext = build.extension()
assert ext is not None, build.failure()
ext.install_fake_cuda_guard(STREAM)
f32, bf16 = torch.float32, torch.bfloat16

CASES = {  # name -> (add_norm keywords, x dtype, residual dtype, weight, bias, gate kind, seed kind)
    "ln post": ({}, f32, f32, True, True, None, None),
    "ln pre": ({"prenorm": True}, f32, f32, True, True, None, None),
    "rms post no bias": ({"norm": "rmsnorm"}, f32, f32, True, False, None, None),
    "rms pre": ({"norm": "rmsnorm", "prenorm": True}, f32, f32, True, False, None, None),
    "ln no affine": ({}, f32, f32, False, False, None, None),
    "ln dropout host seed": ({"dropout_p": 0.1}, f32, f32, True, True, None, None),
    "ln pre dropout seed tensor": ({"dropout_p": 0.1, "prenorm": True}, f32, f32, True, True, None, "tensor"),
    "rms dropout seed int": ({"norm": "rmsnorm", "dropout_p": 0.2}, f32, f32, True, False, None, "int"),
    "ln rezero gate": ({}, f32, f32, True, True, "one", None),
    "ln pre layerscale gate": ({"prenorm": True}, f32, f32, True, True, "vector", None),
    "deepnorm alpha": ({"alpha": 2.5}, f32, f32, True, True, None, None),
    "pre residual_in_fp32 bf16": (
        {"prenorm": True, "residual_in_fp32": True},
        bf16,
        bf16,
        True,
        True,
        None,
        None,
    ),
    "autocast mixed: bf16 x, fp32 residual": ({"prenorm": True}, bf16, f32, True, True, None, None),
    "post bf16 (y from x, r)": ({}, bf16, bf16, True, True, None, None),
}


def functions() -> dict[int, list[int]]:
    """Every compiled kernel's function -> its parameters' extractor indices (2 scratch pointers)."""
    out = {}
    for k in (tk.fwd_kernel, tk.bwd_kernel, tk.bwd_sums_kernel):
        for cache in k.device_caches.values():
            for ck in cache[0].values():
                if hasattr(ck, "function") and ck.function:
                    ck._init_handles() if getattr(ck, "module", None) is None else None
                    out[int(ck.function)] = [*bytes(ck.run.kernel_signature), 1, 1]
    return out


def canonical(launches, kinds, known):
    """The launches with each pointer named: an input's name, 'new k' by first use, or 0."""
    fresh: dict[bytes, str] = {}
    out = []
    for la in launches:
        params = []
        for e, raw in zip(kinds[la.function], la.params, strict=True):
            if e == 1 and raw != bytes(8):
                ptr = int.from_bytes(raw, "little")
                params.append(known.get(ptr) or fresh.setdefault(raw, f"new {len(fresh)}"))
            else:
                params.append(raw.hex())
        out.append((la.name, la.grid, la.block, la.smem, la.stream, tuple(params)))
    return out


def native_count() -> int:
    return sum(
        launch.native.plan.native_launches for plan in functional._PLANS.values()
        for launch in plan.launches if launch is not None and launch.native is not None
    )  # fmt: skip


def run_case(kw, xd, rd, has_w, has_b, gate_kind, seed_kind, rows=8, n=64):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, n, generator=g).to(xd).requires_grad_()
    r = torch.randn(rows, n, generator=g).to(rd).requires_grad_()
    w = torch.randn(n, generator=g).requires_grad_() if has_w else None
    b = torch.randn(n, generator=g).requires_grad_() if has_b else None
    gate = {None: None, "one": torch.full((1,), 0.5), "vector": torch.rand(n, generator=g)}[gate_kind]
    if gate is not None:
        gate.requires_grad_()
    seed = {None: None, "int": 12345, "tensor": torch.tensor(777)}[seed_kind]
    dy = torch.randn(rows, n, generator=g)
    known = {
        t.data_ptr(): name
        for name, t in (
            ("x", x),
            ("r", r),
            ("w", w),
            ("b", b),
            ("gate", gate),
            ("seed", seed if isinstance(seed, torch.Tensor) else None),
            ("dy", dy),
        )
        if t is not None
    }

    def call():
        out = ops.add_norm(x, r, w, b, gate=gate, seed=seed, **kw)
        y = out[0] if isinstance(out, tuple) else out
        loss = (y.float() * dy).sum() + (out[1].float().sum() if isinstance(out, tuple) else 0)
        loss.backward()
        return out

    results = {}
    for path in ("python", "native"):
        ops.set_call_path(path)
        functional.clear_plans()
        call()  # compiles (today's launchers), the native call registers its kernels
        fake_driver.record(True)
        out = call()
        fake_driver.record(False)
        results[path] = fake_driver.launches(), out
    kinds = functions()
    for fn, ks in kinds.items():
        fake_driver.set_param_sizes(fn, [_EXTRACTORS[e][0] for e in ks])
    # sizes are known now: record both again
    got = {}
    for path in ("python", "native"):
        ops.set_call_path(path)  # a new plan: its first call registers the native call's kernels
        call()
        before = native_count()
        seeds.generator_for(None).set_offset(0)  # the same host seed drawn for both
        fake_driver.record(True)
        out = call()
        fake_driver.record(False)
        count = native_count() - before  # the recorded call's native launches
        y = out[0] if isinstance(out, tuple) else out
        known_out = {**known, y.data_ptr(): "y"}
        if isinstance(out, tuple):
            known_out[out[1].data_ptr()] = "s"
        got[path] = canonical(fake_driver.launches(), kinds, known_out)
    out = ops.add_norm(x, r, w, b, gate=gate, seed=seed, **kw)
    return got, type((out[0] if isinstance(out, tuple) else out).grad_fn).__name__, count


mismatches, nodes, native_launches = [], set(), 0
with fake_driver.cpu_as_cuda():
    for name, case in CASES.items():
        got, node, count = run_case(*case)
        nodes.add(node)
        if (
            got["python"] != got["native"] or not got["native"] or count < 2
        ):  # the recorded call's fwd and bwd, natively
            mismatches.append(
                {"case": name, "native launches": count, "python": got["python"], "native": got["native"]}
            )
        native_launches += count
print(
    json.dumps(
        {
            "cases": len(CASES),
            "native_launches": native_launches,
            "grad_fns": sorted(nodes),
            "mismatches": mismatches,
        }
    )
)
sys.stdout.flush()
