"""Host work per training step, plain vs fused, with the GPU path's Python exactly as it runs on CUDA:
a CPU proxy for what the H200 measured (issue 38: the fused step slower than the plain one while its
kernels save GPU time).

Each model is built twice from one seed: untouched (``plain``: the HF model as transformers writes it,
addnorm's LM with ``fused=False``) and ``fused`` (``addnorm.hf.fuse``; addnorm's LM with the op wherever
it can fuse, whatever the device policy says). The fused one runs the op's CUDA path on CPU tensors:
Triton's driver faked, every kernel "compiled" to a launch that does no work
(:mod:`fake_launch`), so what is left of a fused call is the Python, autograd and allocations of
``add_norm``'s eager Triton path, its direct launch included, and its backward on several programs as
at the GPU's sizes (:func:`gpu_sized_backward`). The plain step's torch ops compute on
tensors so small (batch 1 x seq 16, hidden 64) that their compute is next to nothing. On a GPU each
kernel launch costs the host more than a CPU op's dispatch: the modelled host work per step is the CPU
time plus ``launches`` x L, the same L for every launch of either step, L taken from the H200's table
(:func:`modelled_launch_us`: what the H200's host spent on an eager add + LayerNorm beyond what this CPU
spends on the same call, per launch; ``--launch-us`` gives another).

Per step (one torch thread, AdamW fused as on a GPU, steps interleaved, medians, best of ``--rounds``):

- ``CPU ms``: this process's CPU time (what other work on a shared machine does not inflate);
- ``Python calls``: cProfile's count of function calls in one step (torch's Python included): host
  work that does not depend on the machine at all;
- ``launches``: kernels a GPU would launch: the aten ops that run a kernel (the torch profiler's
  top-level ops, views and allocations left out) plus the fused op's Triton launches;
- ``host work``: CPU ms + launches x L;
- round by round: fused / plain host work from each round's own medians, its spread over the rounds
  and in how many the target holds (what the machine's noise does to the ratio);
- the floor: the fused model with a do-nothing ``autograd.Function`` in the op's place (:func:`floored`),
  the least any Python op can cost the step, timed in the same rounds;
- with ``--instructions``, instructions per step as valgrind's callgrind counts them (each variant in
  a process of its own, only the steps counted): the same number whatever else the machine runs.

Targets (issue 38): fused / plain host work <= 0.9 for the HF family, <= 1.0 for addnorm's LM.

    python -m benchmarks.host.step_host [--models hf lm-gelu lm-llama] [--reps 40] [--launch-us L]
        [--out DIR | --record]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import functools
import json
import os
import pstats
import statistics
import sys
from collections.abc import Callable, Iterator

from benchmarks.host.fake_launch import faked_launches, require_jit

require_jit()  # the real JIT kernels, before anything imports triton
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import addnorm as an  # noqa: E402
from addnorm.ops import policy, seeds  # noqa: E402
from benchmarks.common.machine import machine_info, write_results  # noqa: E402
from benchmarks.common.results_path import RESULTS, ROOT, add_out_argument  # noqa: E402
from benchmarks.common.timing import interleaved, within  # noqa: E402
from benchmarks.common.variant_plans import BackwardVariant, SublayerCast  # noqa: E402
from benchmarks.host.step_host_tables import (  # noqa: E402
    AUTOCAST_FUSED,
    AUTOCAST_H,
    AUTOCAST_PLAIN,
    BATCH,
    FLOOR,
    HEADS,
    HIDDEN,
    KERNEL_SUMS,
    LAYERS,
    MODELS,
    PREVIOUS,
    SEEDED,
    SEQ,
    VOCAB,
    to_markdown,
)  # fmt: skip

# aten ops that launch no kernel on a GPU: views, metadata and allocations
_NO_KERNEL = frozenset(
    "view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as unsqueeze squeeze "
    "slice select as_strided detach alias split chunk unbind narrow flatten unflatten view_as empty "
    "empty_like empty_strided new_empty new_empty_strided resolve_conj resolve_neg contiguous lift_fresh "
    "_has_compatible_shallow_copy_type is_same_size size stride numel dim result_type to set_ "
    "_local_scalar_dense item promote_types".split()
)


H200_TABLE = "host_overhead_h200.json"
H200_WINDOW = RESULTS / "h200" / "2026-11-27-fb82146"  # the H200 window the launch cost L was read from
EAGER_CASES = {"layernorm fwd": 2, "layernorm prenorm fwd": 2}  # case: its kernels (the add, the norm)


def modelled_launch_us(samples: int = 5) -> tuple[float, str]:
    """L, the host cost of one kernel launch on the H200, from its table (``host_overhead_h200.json``):
    an eager add + LayerNorm forward (two launches, 8 x 64 fp32, inputs requiring grad) took e us a call
    there, the same call on CPU tensors takes c us of this process's CPU time here; L = min over the
    cases of (e - c) / 2: what the H200's host spent beyond this CPU's own work, per launch (an upper
    bound where the H200's host runs Python slower than this CPU). Returns L and how it was found."""
    from benchmarks.host import host_overhead as bho

    rows = json.loads((H200_WINDOW / H200_TABLE).read_text())["runs"]["gpu"]["ops"]
    there = {r["case"]: r["eager_us"] for r in rows if r["case"] in EAGER_CASES}
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(8, 64, generator=g).requires_grad_(True) for _ in range(2))
    w, b = (torch.randn(64, generator=g).requires_grad_(True) for _ in range(2))
    cases = bho.op_cases(64)
    fns = {case: (lambda eager=cases[case.removesuffix(" fwd")][1]: eager(x, r, w, b)) for case in there}
    here = bho.per_call_us(fns, 200, samples, clock="cpu")
    per_case = {c: (there[c] - here[c]) / EAGER_CASES[c] for c in there}
    case = min(per_case, key=per_case.get)
    how = (
        f"L = {per_case[case]:.1f} us: the H200 ran an eager `{case}` (8 x 64, {EAGER_CASES[case]} launches) "
        f"in {there[case]:.1f} us a call ({H200_TABLE}), this CPU in {here[case]:.1f} us"
    )
    return max(per_case[case], 0.0), how


def build(name: str, fused: bool, layers: int = LAYERS) -> torch.nn.Module:
    """Model ``name`` of ``layers`` layers from seed 0, plain or fused."""
    torch.manual_seed(0)
    if name == "hf":
        import addnorm.hf as anhf

        model = anhf.tiny_model(
            "llama", seed=0, layers=layers, hidden=HIDDEN, heads=HEADS, vocab=VOCAB,
            intermediate=4 * HIDDEN, positions=SEQ, num_key_value_heads=HEADS,
        )  # fmt: skip
        return anhf.fuse(model) if fused else model
    gelu = name == "lm-gelu"
    cfg = an.TransformerConfig(
        d_model=HIDDEN, n_heads=HEADS, d_ff=4 * HIDDEN, n_layers=layers, dropout=0.1 if gelu else 0.0,
        activation="gelu" if gelu else "swiglu", norm="layernorm" if gelu else "rmsnorm", bias=gelu,
        placement="pre", max_len=SEQ,
    )  # fmt: skip
    model = an.LanguageModel(cfg, VOCAB)
    for m in model.modules():
        if isinstance(m, an.AddNorm):
            m.fused = fused
    return model


class _Floor(torch.autograd.Function):
    """The least a Python autograd op in the fused op's place can cost: its outputs and its gradients
    allocated (``empty_like``), weight and bias saved, nothing computed or launched."""

    @staticmethod
    def forward(ctx, x, residual, weight, bias, prenorm):
        ctx.save_for_backward(weight, bias)
        ctx.set_materialize_grads(False)  # as the op: no zeros made for an unused output
        y = torch.empty_like(x)
        return (y, torch.empty_like(residual)) if prenorm else y

    @staticmethod
    def backward(ctx, dy, ds=None):
        weight, bias = ctx.saved_tensors
        dx = torch.empty_like(ds if dy is None else dy)
        dw = None if weight is None else torch.empty_like(weight)
        db = None if bias is None else torch.empty_like(bias)
        return dx, torch.empty_like(dx), dw, db, None


def floored(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (fused) with each connection's fused add & norm (``AddNorm.add_then_norm``, which every
    fused call goes through) replaced by :class:`_Floor`: the model's own Python, and the least any
    Python op could add to it. What the fused step costs beyond this is the op's own host code."""
    for m in model.modules():
        if isinstance(m, an.AddNorm):

            def add_then_norm(f, base, norm, *, prenorm=False, gate=None, y_dtype=None):
                return _Floor.apply(f, base, getattr(norm, "gain", norm.weight), norm.bias, prenorm)

            m.add_then_norm = add_then_norm
    return model


def make_step(name: str, model: torch.nn.Module, tokens: torch.Tensor) -> Callable[[], None]:
    """One training step: forward (the HF model's own loss), backward, fused AdamW (as on a GPU)."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    inp, tgt = tokens[:, :-1], tokens[:, 1:].reshape(-1)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        if name == "hf":
            loss = model(input_ids=inp, labels=inp, use_cache=False).loss
        else:
            loss = F.cross_entropy(model(inp).reshape(-1, VOCAB), tgt)
        loss.backward()
        opt.step()

    return step


def python_calls(step: Callable[[], None]) -> int:
    profile = cProfile.Profile()
    profile.runcall(step)
    return pstats.Stats(profile).total_calls


# the ops autocast casts the inputs of (their casts, ``aten::_to_copy`` inside them, launch kernels)
_AUTOCAST_OPS = frozenset(
    "aten::linear aten::matmul aten::mm aten::addmm aten::bmm aten::baddbmm "
    "aten::scaled_dot_product_attention".split()
)


def aten_launches(step: Callable[[], None]) -> int:
    """The aten ops of one step that would run a kernel on a GPU: the profiler's outermost aten ops
    (an op inside another is part of its kernel or its decomposition; views, allocations and
    ``aten::to``, which launch none, are looked through), and autocast's casts, which run inside the op
    they cast for (``aten::_to_copy`` in ``aten::linear``)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    count = 0
    for e in prof.events():
        if not e.name.startswith("aten::") or e.name[len("aten::") :] in _NO_KERNEL:
            continue
        parent = e.cpu_parent
        while parent is not None and (
            not parent.name.startswith("aten::") or parent.name[len("aten::") :] in _NO_KERNEL
        ):
            parent = parent.cpu_parent
        if parent is None or (e.name == "aten::_to_copy" and parent.name in _AUTOCAST_OPS):
            count += 1
    return count


@contextlib.contextmanager
def gpu_sized_backward() -> Iterator[None]:
    """The op's backward on several programs, as the H200's steps run it (8 x 1024 rows a call: more
    than ``launch_config.BWD_ONE_PROGRAM_TILES`` row tiles), each program writing partial parameter
    gradients that one aten sum each (weight, bias) adds up after the kernel; the proxy's 16 rows would
    otherwise take the one-program backward, which writes the sums itself and launches none (the H200's
    trace at 7722722: 48 more ``aten::sum`` a step in the fused LM, two per add & norm)."""
    from addnorm.ops import launch_config as lc
    from addnorm.ops.triton import launchers as tl

    def use(tiles: int) -> None:  # as launch_config asks after a change: its caches, specs and plans
        lc.BWD_ONE_PROGRAM_TILES = tiles
        tl.clear_caches()
        policy.invalidate()

    previous = lc.BWD_ONE_PROGRAM_TILES
    use(0)
    try:
        yield
    finally:
        use(previous)


def measure(name: str, reps: int, warmup: int, rounds: int, layers: int = LAYERS) -> dict:
    """Plain and fused (the op forced wherever the model can fuse), interleaved: CPU ms per step (the
    median of ``reps``, best of ``rounds``), Python calls and kernel launches of one step."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=gen)
    with policy.fusion("always"), faked_launches() as launches, gpu_sized_backward():
        steps = {"plain": make_step(name, build(name, False, layers), tokens)}
        steps["fused"] = make_step(name, build(name, True, layers), tokens)
        steps[FLOOR] = make_step(name, floored(build(name, True, layers)), tokens)
        # the backward's partial sums added up in its kernel (a candidate variant), beside the default
        steps[KERNEL_SUMS] = with_variant(make_step(name, build(name, True, layers), tokens), "kernel_sums")
        if name in SEEDED:  # the dropout seeds' previous source (a randint launch per call), beside
            steps[PREVIOUS] = with_seed_source(make_step(name, build(name, True, layers), tokens), "randint")
        if name != "hf":  # under autocast, as on the GPU, and the candidate sublayer input dtype
            for key, fused, cast in ((AUTOCAST_PLAIN, False, False), (AUTOCAST_FUSED, True, False),
                                     (AUTOCAST_H, True, True)):  # fmt: skip
                steps[key] = with_autocast(make_step(name, build(name, fused, layers), tokens), cast)
        for step in steps.values():
            step()
        launches.count = 0
        steps["fused"]()
        triton_launches = launches.count
        calls = {k: python_calls(s) for k, s in steps.items()}
        aten = {k: aten_launches(s) for k, s in steps.items()}
        timers = {k: _timer(s) for k, s in steps.items()}
        cpu_rounds: dict[str, list[float]] = {k: [] for k in steps}
        for _ in range(rounds):
            _, cpu = interleaved(timers, reps, warmup)
            for k, v in cpu.items():
                cpu_rounds[k].append(statistics.median(v) * 1e3)
    launched = {k: aten[k] + (0 if k.startswith("plain") else triton_launches) for k in steps}
    launched[FLOOR] = launched["fused"]  # the floor stands in for the fused op: its launches counted
    return {
        "model": name,
        "cpu_ms": {k: min(v) for k, v in cpu_rounds.items()},
        "cpu_rounds_ms": cpu_rounds,
        "python_calls": calls,
        "aten_launches": aten,
        "launches": launched,
        "triton_launches": triton_launches,
        "layers": layers,
    }


def instructions(name: str, layers: int, steps: int = 5) -> dict[str, float]:
    """Instructions per step (plain, fused, the floor, the fused step with the backward variant
    "kernel_sums") as valgrind's callgrind counts them: each variant in a process of its own under
    callgrind (as many at once as the machine has cores: a count does not depend on the load), its
    counters zeroed after the warmup steps and dumped after ``steps`` more (``callgrind_control``), so
    imports and building are not counted. The same count for the same code and inputs whatever else
    the machine is doing: the host work that CPU time measures only as well as the machine is quiet."""
    import shutil
    import subprocess
    import tempfile

    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        raise SystemExit("--instructions: needs valgrind (callgrind and callgrind_control)")
    variants = ["plain", "fused", FLOOR, KERNEL_SUMS]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        while variants:
            batch, variants = variants[: os.cpu_count() or 1], variants[os.cpu_count() or 1 :]
            procs = {}
            for i, variant in enumerate(batch):
                folder = f"{tmp}/{i}-{len(variants)}"
                os.mkdir(folder)
                env = {**os.environ, "TRITON_INTERPRET": "0", "OMP_NUM_THREADS": "1"}
                argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={folder}/cg.%p",
                        sys.executable, "-m", __spec__.name, "--child", name, variant, str(layers),
                        str(steps), folder]  # fmt: skip
                procs[variant] = (
                    folder,
                    subprocess.Popen(
                        argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                    ),
                )
            for variant, (folder, proc) in procs.items():
                _reached(proc, f"{folder}/warm", variant)
                subprocess.run(["callgrind_control", "-z", str(proc.pid)], check=True, capture_output=True)
                open(f"{folder}/go", "w").close()
            for variant, (folder, proc) in procs.items():
                _reached(proc, f"{folder}/done", variant)
                subprocess.run(["callgrind_control", "-d", str(proc.pid)], check=True, capture_output=True)
                open(f"{folder}/exit", "w").close()
                proc.wait()
                (dump,) = [f for f in os.listdir(folder) if f.startswith("cg.") and f.endswith(".1")]
                with open(f"{folder}/{dump}") as f:
                    summary = next(line for line in f if line.startswith("summary:"))
                out[variant] = int(summary.split()[1]) / steps
    return out


def _reached(proc, mark: str, variant: str) -> None:
    """Wait until the child under callgrind writes ``mark`` (a clear error if it died first)."""
    import time

    while not os.path.exists(mark):
        if proc.poll() is not None:
            raise RuntimeError(f"--instructions: the {variant} child exited ({proc.returncode})")
        time.sleep(0.5)


def _child(name: str, variant: str, layers: int, steps: int, folder: str) -> None:
    """``--instructions``' child: build, warm up, then ``steps`` steps between the files that tell the
    controller to zero and to dump callgrind's counters."""
    import time

    def wait(mark: str) -> None:
        while not os.path.exists(f"{folder}/{mark}"):
            time.sleep(0.2)

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(3, VOCAB, (BATCH, SEQ + 1), generator=gen)
    if variant == KERNEL_SUMS:
        from addnorm.ops import launch_config as lc

        lc.use_bwd_variant("kernel_sums")
    with policy.fusion("always"), faked_launches(), gpu_sized_backward():
        model = build(name, variant != "plain", layers)
        step = make_step(name, floored(model) if variant == FLOOR else model, tokens)
        for _ in range(3):
            step()
        open(f"{folder}/warm", "w").close()
        wait("go")
        for _ in range(steps):
            step()
        open(f"{folder}/done", "w").close()
        wait("exit")


def with_variant(step: Callable[[], None], variant: str) -> Callable[[], None]:
    """``step`` with the op's backward variant ``variant``, its call plans kept apart from the default's
    (:class:`variant_plans.BackwardVariant`: no plan rebuilt in a timed step)."""
    return within(step, BackwardVariant(variant))


def with_autocast(step: Callable[[], None], cast: bool) -> Callable[[], None]:
    """``step`` under autocast to bfloat16 (the CPU's, for the CPU tensors that stand in for CUDA ones),
    the candidate ``stream.AUTOCAST_SUBLAYER_INPUT`` set to ``cast`` (:class:`variant_plans.SublayerCast`)."""
    return within(
        within(step, functools.partial(torch.autocast, "cpu", dtype=torch.bfloat16)), SublayerCast(cast)
    )


def with_seed_source(step: Callable[[], None], source: str) -> Callable[[], None]:
    """``step`` with the fused op's dropout seeds from ``source`` (:mod:`addnorm.ops.seeds`)."""
    return within(step, functools.partial(seeds.seed_source, source))


def _timer(step: Callable[[], None]) -> Callable[[], float]:
    import time

    def timer() -> float:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0

    return timer


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--reps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--launch-us", type=float, default=None, help="host cost of one launch (default: H200's)"
    )
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument(
        "--instructions",
        action="store_true",
        help="also count instructions per step under valgrind (minutes)",
    )
    parser.add_argument("--child", nargs=5, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--label", default=None, help="a note recorded with the run")
    add_out_argument(parser)
    args = parser.parse_args(argv)
    if args.child:
        name, variant, layers, steps, folder = args.child
        _child(name, variant, int(layers), int(steps), folder)
        return []
    torch.set_num_threads(1)
    rows = []
    for name in args.models:
        rows.append(measure(name, args.reps, args.warmup, args.rounds, args.layers))
        if args.instructions:
            rows[-1]["instructions"] = instructions(name, args.layers)
        r = rows[-1]
        print(name, {k: round(v, 2) for k, v in r["cpu_ms"].items()}, r["python_calls"], r["launches"],
              file=sys.stderr, flush=True)  # fmt: skip
    machine = machine_info("cpu")
    if args.launch_us is None:
        launch_us, how = modelled_launch_us()
    else:
        launch_us, how = args.launch_us, "given"
    text = to_markdown(rows, machine, args.reps, args.rounds, launch_us, how)
    if args.label:
        text += f"\n{args.label}\n"
    print(text)
    payload = {
        "machine": machine,
        "results": rows,
        "launch_us": launch_us,
        "launch_how": how,
        "label": args.label,
    }
    write_results(args.out, "step_host_cpu", text, payload)
    return rows


if __name__ == "__main__":
    main()
