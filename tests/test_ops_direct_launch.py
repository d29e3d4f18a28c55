"""The Triton launchers' direct launch (``addnorm.ops.triton.direct_launch``): after a first launch through
``kernel[grid](...)``, a call with the same specialisation launches the compiled kernel Triton returned
with exactly the arguments ``JITFunction.run`` passes it; a call that specialises otherwise (an
unaligned input, another row-count class, another dtype) goes through ``run`` again.

Without a GPU: the real ``JITFunction`` kernels (``TRITON_INTERPRET=0``, in a subprocess), their real
binder and kernel cache, with Triton's driver faked (device 0, a stream) and its compiler replaced by a
recorder of launches. On a GPU: the op with direct launches equals the op without them, bit for bit."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")

RECORDED = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch
from triton.backends.compiler import GPUTarget
from triton.runtime.driver import driver
from triton.runtime.jit import JITFunction
from triton import knobs

# before run() is counted: read from its source
from addnorm.ops.triton import direct_launch as triton_direct
from addnorm.ops.triton import launchers as L

class FakeDriver:
    def get_current_device(self): return 0
    def get_current_stream(self, device): return 1234
    def get_current_target(self): return GPUTarget("cuda", 90, 32)

class Compiled:  # what Triton's compiler would return: records each launch's arguments
    function, packed_metadata = "function", ("metadata",)
    def __init__(self, key): self.key, self.launches = key, []
    def launch_metadata(self, grid, stream, *args): return ("metadata of", tuple(grid), stream, len(args))
    def run(self, *args): self.launches.append(args)

compiled, runs = [], []
def fake_compile(self, key, signature, device, constexprs, options, attrs, warmup):
    ck = Compiled(key)
    compiled.append(ck)
    self.device_caches[device][0][key] = ck
    return ck
real_run = JITFunction.run
def counted_run(self, *args, **kwargs):
    runs.append(self.fn.__name__)
    return real_run(self, *args, **kwargs)
driver.set_active(FakeDriver())
JITFunction._do_compile = fake_compile
JITFunction.run = counted_run

assert triton_direct.SUPPORTED, "this Triton's run() does not launch as the direct path does"
f32, bf16 = torch.float32, torch.bfloat16
fwd = L.fwd_spec(64, "layernorm", 1e-5, 1.0, 0.0, True, True, 0, True, f32, f32, "none").launch
bwd = L.bwd_spec(64, "layernorm", 1.0, 0.0, True, True, 0, True, 0, f32, f32, f32, False, 1e-5).launch
g = torch.Generator().manual_seed(0)
x, r = torch.randn(8, 64, generator=g), torch.randn(8, 64, generator=g)
w, b = torch.randn(64, generator=g), torch.randn(64, generator=g)

def same(a, b):  # two launches' arguments: equal, tensors alike (outputs are new each call)
    assert len(a) == len(b), (len(a), len(b))
    for u, v in zip(a, b):
        if isinstance(u, torch.Tensor):
            assert isinstance(v, torch.Tensor) and (u.shape, u.dtype) == (v.shape, v.dtype)
        else:
            assert u == v, (u, v)

def same_launch(via_run, direct):
    # run() hands every launch the metadata and the hook knobs (an empty chain when no profiler adds to
    # it); the direct launch hands none where no hook would run (the launch then calls nothing more),
    # and otherwise the same arguments
    assert list(direct[6:9]) == [None, None, None] and via_run[6] is not None
    same(via_run[:6] + via_run[9:], direct[:6] + direct[9:])

out = {}
y, s, _, _ = fwd(None, x, r, w, b)  # through run(): Triton compiles (records) and launches
fwd(None, x, r, w, b)  # direct: no run()
(ck,) = compiled
assert runs == ["_add_norm_fwd_kernel"] and len(ck.launches) == 2
same_launch(ck.launches[0], ck.launches[1])
assert ck.launches[1][0] == 1 and ck.launches[1][3] == 1234  # one program; the current stream
assert ck.launches[1][9] is x and ck.launches[1][10] is r  # the inputs, the kernel's first arguments
seen = []
knobs.runtime.launch_enter_hook.add(hook := seen.append)  # a profiler's hook: metadata and hooks passed
fwd(None, x, r, w, b)
assert ck.launches[2][6] == ("metadata of", (1,), 1234, len(ck.launches[2]) - 9)
assert ck.launches[2][7] is knobs.runtime.launch_enter_hook
knobs.runtime.launch_enter_hook.remove(hook)
fwd(None, x[:1], r[:1], w, b)  # one row: another specialisation (an integer 1), through run() again
x_off = torch.randn(8 * 64 + 1, generator=g)[1:].view(8, 64)  # 4 bytes off 16-byte alignment
fwd(None, x_off, r, w, b)  # unaligned: run() every time
fwd(None, x_off, r, w, b)
fwd(None, x.to(bf16), r, w, b)  # another dtype of x: compiled anew, then direct
fwd(None, x.to(bf16), r, w, b)
out["fwd runs"] = len(runs)
out["fwd compiled"] = len(compiled)
dy = torch.randn(8, 64, generator=g)
bwd(dy, None, s, None, None, w, b, None, None, None, torch.empty(8))
bwd(dy, None, s, None, None, w, b, None, None, None, torch.empty(8))
same_launch(compiled[-1].launches[0], compiled[-1].launches[1])
out["bwd runs"] = len(runs) - out["fwd runs"]
out["bwd launches"] = len(compiled[-1].launches)
# dropout: a host seed is an i64 value the kernels do not specialise on (a multiple of 16 or not: one
# kernel), launched directly after the first call; a seed in a tensor is another specialisation, the
# same kernel whatever the tensor's alignment
drop = L.fwd_spec(64, "layernorm", 1e-5, 1.0, 0.1, True, True, 0, True, f32, f32, "none").launch
runs_before, compiled_before = len(runs), len(compiled)
for seed in ((1 << 61) | 16 * 12345, (1 << 61) | 7):
    drop(None, x, r, w, b, None, seed)
assert compiled[-1].launches[-1][9 + 5] == (1 << 61) | 7  # the value itself, the kernel's SEED
drop(None, x, r, w, b, None, torch.tensor(5))
drop(None, x, r, w, b, None, torch.tensor(6))
drop(None, x, r, w, b, None, torch.tensor([5, 6])[1])  # 8 bytes off 16: no specialisation on SEED either
out["seed runs"] = len(runs) - runs_before
out["seed compiled"] = len(compiled) - compiled_before
print(out)
"""


def test_a_repeated_launch_skips_run_with_the_arguments_run_passes():
    env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
    res = subprocess.run(
        [sys.executable, "-c", RECORDED], capture_output=True, text=True, env=env, timeout=600
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = eval(res.stdout.strip().splitlines()[-1])
    # fwd: the first call and the one-row call compile; the unaligned calls go through run() each
    # time (the aligned kernel's specialisation is not theirs: compiled once more); bf16 compiles once
    # dropout: an int seed and a tensor seed compile once each, the second call of each is direct
    expected = {"fwd runs": 5, "fwd compiled": 4, "bwd runs": 1, "bwd launches": 2}
    assert out == {**expected, "seed runs": 2, "seed compiled": 2}, out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("prenorm, dropout", [(True, 0.0), (False, 0.1)])
def test_direct_launches_equal_launches_through_run(monkeypatch, prenorm, dropout):
    from addnorm.ops import add_norm, functional, policy
    from addnorm.ops.triton import launchers as triton_launch

    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(64, 4096, device="cuda", generator=g, requires_grad=True) for _ in range(2))
    w = torch.randn(4096, device="cuda", generator=g, requires_grad=True)
    results = []
    for direct in (True, False, True):
        monkeypatch.setattr(triton_launch, "DIRECT", direct)
        functional.clear_plans()
        policy.invalidate()
        out = add_norm(x, r, w, prenorm=prenorm, dropout_p=dropout, seed=3, backend="triton")
        outs = list(out) if prenorm else [out]
        grads = torch.autograd.grad(outs, [x, r, w], [torch.ones_like(o) for o in outs])
        results.append([o.detach() for o in outs] + list(grads))
    for a, b in zip(results[0] + results[2], results[1] + results[1], strict=True):
        assert torch.equal(a, b)


def test_the_launch_path_benchmark_times_both_launches_on_the_cpu():
    """benchmarks/host/host_overhead.py --jit-launch (Triton's launch path with the driver faked) times the
    forward and backward launchers through kernel[grid](...) and launched directly."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = [sys.executable, "-m", "benchmarks.host.host_overhead", "--jit-launch", "--calls", "2"]
    res = subprocess.run(
        [*argv, "--samples", "1"], capture_output=True, text=True, env=env, timeout=600, cwd=root
    )
    assert res.returncode == 0, res.stderr[-3000:]
    cases = [line.rsplit("  ", 1)[0].strip() for line in res.stdout.splitlines() if line.endswith(" us")]
    assert cases == [
        "forward launcher, kernel[grid](...)", "forward launcher, direct",
        "backward launcher, kernel[grid](...)", "backward launcher, direct",
    ]  # fmt: skip
