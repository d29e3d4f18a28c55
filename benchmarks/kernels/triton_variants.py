"""The Triton kernel variants the dispatcher launches, compiled for NVIDIA targets without a GPU.

``triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))`` builds the real cubin with the
``ptxas`` in triton's wheel; ``ptxas -v`` on its PTX (same flags) reports registers, spill stores and
loads, stack frame and shared memory. Used by the spill test and by
``benchmarks/kernels/kernel_compile.py``, which writes the table.

Which variants: the launchers map every hidden size to one of a few launch configurations
(:func:`addnorm.ops.launch_config.fwd_config` / ``bwd_config``: row tiles, or for wide rows column
chunks, which a forward program loops over and the backward gives a program each, "chunked" in the
table). For each configuration and each path (forward storing s or not; backward from s with a gradient
arriving at s, from y recomputing s in some columns, from s recomputed from x and residual) the variant
with every optional input (LayerNorm, weight, bias, a vector gate, dropout, fp32 tensors) holds the most
values live, so it bounds the registers of the others (the backward gives the register-heavy variants,
with dropout or a gate, narrower one-pass rows and 2048-column slices: the configurations
only the lighter ones launch are compiled with the heaviest of those); ``full=True`` adds RMSNorm, bf16
and the autocast mix (bf16 branch, fp32 stream), fp16, without-dropout and without-affine variants, the
registered op's statistics (mean and rstd apart, where the eager path packs them in one buffer, or for a
one-pass backward from s keeps none and recomputes them) and hidden sizes that are not multiples of 16
(no aligned-vector specialisation). The widest configuration also compiles with dropout on given row
indices (a DTensor's row shard) and with the seed an i64 value (a host seed, ``ops/seeds.py``). The
backward's variant "row_sums" (``launch_config.BWD_VARIANTS``, the default; the backward's
configurations above are those of "slices", which stays selectable, and of the narrower rows either
takes in one pass) joins with its slices (kernel ``bwd`` given the pre-pass's sums) and its pre-pass
(kernel ``bwd_sums``, the forward's tiles) at every configuration the heavy variants launch it with,
every path with every option (``full``: the same additions as the others). The tensor-parallel
kernels (``ops/triton/tp_kernels.py``:
statistics, normalise, row sums, gradients of a column shard) join with every option and row indices, at
the widest tile and the column-chunk configuration (``full``: every configuration).

This module does not import triton at import time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import NamedTuple

__all__ = ["ARCHS", "HIDDEN_SIZES", "Variant", "compile_all", "compile_variant", "variants"]

ARCHS = (80, 90)
# the issue's range, 64 .. 65,536, with non-powers of two; below 64 the tests' tiny rows
HIDDEN_SIZES = (16, 33, 64, 100, 128, 256, 384, 512, 768, 1000, 1024, 1536, 2048, 3000, 4096, 5120)
HIDDEN_SIZES += (5000, 6144, 8192, 10000, 12288, 16384, 24576, 32768, 50000, 65536)


class Variant(NamedTuple):
    """One compiled specialisation of a kernel: its launch configuration, options and dtypes."""

    kernel: str  # "fwd" | "bwd" | "bwd_sums" (the row-sums pre-pass) | one of TP_KERNELS
    block_m: int
    block_n: int
    chunked: bool
    num_warps: int
    norm: str
    path: str  # fwd: "store_s" | "no_s"; bwd: "from_s" | "from_y" | "from_xr"
    dtypes: str  # "fp32" | "bf16" | "fp16" | "mixed" (bf16 x, fp32 residual / s / y)
    weight: bool
    bias: bool
    gate: int  # 0 none, 1 scalar, 2 vector
    dropout: bool
    aligned: bool  # hidden size (and so row strides) a multiple of 16
    hidden: tuple[int, ...]  # the hidden sizes (of HIDDEN_SIZES) that launch this configuration
    row_ids: bool = False  # dropout hashes given row indices (a DTensor shard: ``ops/sharded.py``)
    # the statistics as the registered op passes them (mean and rstd apart), not as the eager path
    # does (forward: one buffer, LayerNorm's means after the rstds, MEAN None; backward from s in one
    # pass: none, recomputed from s, RSTD None too)
    op_stats: bool = False
    row_sums: bool = False  # the backward's slices given the pre-pass's row sums (variant "row_sums")
    seed_value: bool = False  # the dropout seed an i64 value (a host seed: ``ops/seeds.py``), not a pointer
    kernel_sums: bool = False  # the partial sums added up in the kernel (variant "kernel_sums")

    @property
    def recomputes_stats(self) -> bool:
        """A backward given no statistics (the eager path's, from s saved or recomputed, one pass)."""
        return self.kernel == "bwd" and not self.op_stats and self.path != "from_y" and not self.chunked

    @property
    def maxnreg(self) -> int:
        from addnorm.ops.launch_config import Launch

        return Launch(self.block_m, self.block_n, self.chunked, self.num_warps).maxnreg

    @property
    def launch(self) -> str:
        chunks = ", chunked" if self.chunked else ""
        return f"{self.block_m} x {self.block_n}{chunks}, {self.num_warps} warps"

    @property
    def options(self) -> str:
        parts = [self.norm, self.path, self.dtypes]
        parts += [
            n for n, on in (("weight", self.weight), ("bias", self.bias), ("dropout", self.dropout)) if on
        ]
        parts += [("", "scalar gate", "vector gate")[self.gate]] if self.gate else []
        parts += ["op statistics"] if self.op_stats else []
        parts += ["pre-pass row sums"] if self.row_sums and self.kernel == "bwd" else []
        parts += ["statistics recomputed"] if self.recomputes_stats else []
        parts += ["row ids"] if self.row_ids else []
        parts += ["host seed"] if self.seed_value else []
        parts += ["in-kernel sums"] if self.kernel_sums else []
        return ", ".join(parts + ([] if self.aligned else ["unaligned"]))


def _configs(kind: str, heavy: bool = True) -> dict:
    """{launch configuration: hidden sizes} over HIDDEN_SIZES (the backward's for register-heavy
    variants, ``launch_config.bwd_register_heavy``, or for the others)."""
    from addnorm.ops.launch_config import bwd_config, fwd_config

    out: dict = {}
    for h in HIDDEN_SIZES:
        out.setdefault(fwd_config(h) if kind == "fwd" else bwd_config(h, heavy), []).append(h)
    return out


def _takes_unaligned(kind: str, cfg) -> bool:
    """Whether a row width that is not a multiple of 16 can get launch configuration ``cfg`` (the
    backward gives such widths its narrow slices only)."""
    from addnorm.ops.launch_config import bwd_config, fwd_config

    widths = range(8, 65537, 16)
    if kind == "fwd":
        return any(fwd_config(h) == cfg for h in widths)
    return any(bwd_config(h, heavy) == cfg for h in widths for heavy in (False, True))


def _other_options(base: Variant) -> list[Variant]:
    """``full``'s other options of a variant with every one: RMSNorm, the autocast mix, bf16, fp16 (with
    a scalar gate), no dropout nor gate, no affine, the registered op's statistics."""
    return [
        base._replace(norm="rmsnorm", bias=False), base._replace(dtypes="mixed"),
        base._replace(dtypes="bf16"), base._replace(dtypes="fp16", gate=1),
        base._replace(dropout=False, gate=0), base._replace(weight=False, bias=False),
        base._replace(op_stats=True),
    ]  # fmt: skip


def _light(base: Variant) -> list[Variant]:
    """The heaviest backward variant that is not register-heavy (no dropout, no gate): it runs the
    one-pass configurations the heavy ones do not."""
    return [base._replace(gate=0, dropout=False)]


def variants(full: bool = False) -> list[Variant]:
    """The variants to compile (see the module docstring); ``full`` adds the other options."""
    out = []
    for kind, paths in (("fwd", ("store_s", "no_s")), ("bwd", ("from_s", "from_y", "from_xr"))):
        configs = _configs(kind)
        widest = max(configs, key=lambda c: (c.chunked, c.block_n * c.block_m, c.block_n))
        for cfg, hidden in configs.items():
            for path in paths:
                base = Variant(
                    kind, *cfg, "layernorm", path, "fp32", True, True, 2, True, True, tuple(hidden)
                )
                out.append(base)
                if full or cfg == widest:
                    out += [base._replace(row_ids=True), base._replace(seed_value=True)]
                    if _takes_unaligned(kind, cfg):
                        out.append(base._replace(aligned=False))
                if full:
                    out += _other_options(base)
        if kind == "bwd":  # the configurations only the lighter variants launch
            light = {c: h for c, h in _configs(kind, heavy=False).items() if c not in configs}
            widest = max(light, key=lambda c: (c.chunked, c.block_n), default=None)
            for cfg, hidden in light.items():
                unaligned = (full or cfg == widest) and _takes_unaligned(kind, cfg)
                aligned = (True, False) if unaligned else (True,)
                for path in paths:
                    base = Variant(
                        kind, *cfg, "layernorm", path, "fp32", True, True, 2, True, True, tuple(hidden)
                    )
                    out += [v._replace(aligned=a) for v in _light(base) for a in aligned]
    out += _row_sums_variants(full)
    out += _kernel_sums_variants(full)
    out += _tensor_parallel_variants(full)
    return out


def _kernel_sums_variants(full: bool) -> list[Variant]:
    """The backward's variant "kernel_sums" (the partial sums added up in the kernel): at the widest
    one-pass configuration the heavy variants launch it with and at their slices given the pre-pass's
    row sums (``full``: every configuration), from s and from x and residual with every option;
    ``full``: every path, and the other options."""
    from addnorm.ops.launch_config import bwd_config

    out = []
    configs: dict = {}
    for h in HIDDEN_SIZES:
        configs.setdefault(bwd_config(h, True, "kernel_sums"), []).append(h)
    widest = max((c for c in configs if not c.chunked), key=lambda c: c.block_n)
    for cfg, hidden in configs.items():
        if not (full or cfg.chunked or cfg == widest):
            continue
        for path in ("from_s", "from_y", "from_xr") if full else ("from_s", "from_xr"):
            base = Variant(
                "bwd", *cfg, "layernorm", path, "fp32", True, True, 2, True, True, tuple(hidden),
                row_sums=cfg.chunked, kernel_sums=True,
            )  # fmt: skip
            out += [base, *(_other_options(base) if full else [])]
    return out


def _row_sums_variants(full: bool) -> list[Variant]:
    """The backward's variant "row_sums": its slices (``bwd``, the sums given) and its pre-pass
    (``bwd_sums``) at each configuration the widths from which the heavy variants take it launch, each
    path with every option; the widest configuration (``full``: every one) also on row ids and, where
    such widths reach it, unaligned; ``full`` adds the other options as :func:`variants` does."""
    from addnorm.ops.launch_config import bwd_config, bwd_sums_config

    out = []
    for kernel, rule in (("bwd", lambda h: bwd_config(h, True, "row_sums")), ("bwd_sums", bwd_sums_config)):
        configs: dict = {}
        for h in HIDDEN_SIZES:
            if bwd_config(h, True, "row_sums").chunked:  # the widths that take the row-sums path
                configs.setdefault(rule(h), []).append(h)
        widest = max(configs, key=lambda c: (c.chunked, c.block_n * c.block_m, c.block_n))
        for cfg, hidden in configs.items():
            unaligned = kernel == "bwd" or _takes_unaligned("fwd", cfg)
            for path in ("from_s", "from_y", "from_xr"):
                base = Variant(
                    kernel, *cfg, "layernorm", path, "fp32", True, True, 2, True, True, tuple(hidden),
                    row_sums=True,
                )  # fmt: skip
                out.append(base)
                if full or cfg == widest:
                    out.append(base._replace(row_ids=True))
                    out += [base._replace(aligned=False)] if unaligned else []
                if full:
                    out += [*_other_options(base), base._replace(seed_value=True)]
    return out


# the tensor-parallel kernels (``ops/triton/tp_kernels.py``) and the configurations they launch with
TP_KERNELS = {"tp_stats": "fwd", "tp_norm": "fwd", "tp_sums": "fwd", "tp_bwd": "bwd"}


def _tensor_parallel_variants(full: bool) -> list[Variant]:
    """The TP kernels (always a loop over column chunks) with every option, dropout on row ids: at
    the widest tile and the column-chunk configuration, or (``full``) at every configuration."""
    out = []
    for kernel, kind in TP_KERNELS.items():
        configs = _configs(kind)
        widest = max(configs, key=lambda c: (c.block_n * c.block_m, c.block_n))
        path = "store_s" if kernel == "tp_stats" else "from_s"  # the stats pass stores s, the others read it
        for cfg, hidden in configs.items():
            if full or cfg == widest or cfg.chunked:
                out.append(
                    Variant(kernel, *cfg, "layernorm", path, "fp32", True, True, 2, True, True, tuple(hidden))
                )
    return out


def _dtypes(v: Variant) -> dict:
    x = {"mixed": "bf16"}.get(v.dtypes, v.dtypes)
    stream = "fp32" if v.dtypes == "mixed" else x
    return {"x": x, "r": stream, "s": stream, "y": stream, "w": stream}


def _signature(v: Variant, arg_names: list[str]) -> tuple[dict, dict, dict]:
    """(signature, constexprs, attrs) of the ASTSource for ``v``, as a launch would specialise it."""
    from addnorm.ops import launch_config

    d = _dtypes(v)
    fwd = v.kernel in ("fwd", "tp_stats")  # reads x and residual
    tp = v.kernel in TP_KERNELS
    ln = v.norm == "layernorm"
    store_s = v.path == "store_s" or tp  # the TP kernels write or read s
    recompute = v.path in ("from_y", "from_xr")
    ptr = {
        "X": d["x"],
        "R": d["r"],
        "W": d["w"] if v.weight else None,
        "B": d["w"] if v.bias else None,
        "G": d["w"] if v.gate else None,
        "SEED": "i64" if v.dropout else None,
        "Y": d["y"],
        "S": d["s"] if store_s else None,
        "MEAN": "fp32" if ln and (v.op_stats or tp) else None,  # the TP kernels take mean and rstd apart
        "RSTD": None if v.recomputes_stats else "fp32",
        "DY": d["y"],
        "DS": d["s"] if v.path == "from_s" else None,
        "SAVED": None if v.path == "from_xr" else (d["s"] if v.path == "from_s" else d["y"]),
        "DX": d["x"],
        "DRES": d["r"],
        "DW_PART": "fp32" if v.weight else None,
        "DB_PART": "fp32" if v.bias else None,
        "DG_PART": "fp32" if v.gate else None,
        "ROWS": "i64" if v.row_ids and v.dropout else None,  # the rows' global indices (dropout on a shard)
        "STATS": "fp32",
        "SUMS": "fp32" if v.kernel != "bwd" or v.row_sums else None,  # the row sums (TP, row-sums pre-pass)
        # the in-kernel sums' gradients and counters (variant "kernel_sums")
        "DW": d["w"] if v.kernel_sums and v.weight else None,
        "DB": d["w"] if v.kernel_sums and v.bias else None,
        "DG": "fp32" if v.kernel_sums and v.gate else None,
        "COUNT": "i32" if v.kernel_sums else None,
    }
    if not fwd and not (recompute or v.gate):
        ptr["X"] = None
    if not fwd and v.path != "from_xr" and not (v.path == "from_y" and (v.weight or v.bias)):
        ptr["R"] = None
    const = {
        "IS_RMS": not ln,
        "HAS_W": v.weight,
        "HAS_B": v.bias,
        "GATE": v.gate,
        "DROPOUT": v.dropout,
        "STORE_S": store_s,
        "S_CODE": {"fp32": 0, "fp16": 1, "bf16": 2}[d["s"]],
        "BLOCK_M": v.block_m,
        "BLOCK_N": v.block_n,
        "CHUNKED": v.chunked,
        "SPLIT": v.chunked,  # the backward: rows in column slices
        "HAS_DS": v.path == "from_s",
        "XHAT_FROM": {"from_s": 0, "from_y": 1, "from_xr": 2}.get(v.path, 0),
        "RECOMPUTE": v.path == "from_y" and (v.weight or v.bias),
        "WRITE_DX": True,
        "ROW_IDS": v.row_ids and v.dropout,
        "FINISH_GROUP": launch_config.BWD_FINISH_GROUP if v.kernel_sums else 0,
    }
    floats = {"eps", "alpha", "drop_scale", "inv_hidden"}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(arg_names):
        if name in const:
            signature[name] = "constexpr"
            constexprs[name] = const[name]
        elif name == "SEED" and v.seed_value and v.dropout:
            signature[name] = "i64"  # a value the kernels do not specialise on (``do_not_specialize``)
        elif name in ptr:
            if ptr[name] is None:
                signature[name] = "constexpr"
                constexprs[name] = None
            else:
                signature[name] = "*" + ptr[name]
                if name != "SEED":  # do_not_specialize: no alignment on the seed's pointer either
                    attrs[(i,)] = [["tt.divisibility", 16]]  # torch allocations are 16-byte aligned
        elif name in floats:
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if v.aligned and (name == "N" or name.startswith("stride")):
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


def _ptxas(arch: int) -> str:
    """The ptxas triton compiles for ``arch`` with (its wheel ships one per architecture range)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return get_ptxas(arch).path
    except (ImportError, AttributeError, TypeError):  # another triton layout: the wheel's, or PATH's
        import triton

        path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        return path if os.path.exists(path) else shutil.which("ptxas")


def _resource_usage(kernel, arch: int) -> dict:
    """Registers, spill bytes (stores + loads) and stack frame per thread of a compiled kernel: ``ptxas
    -v`` on its PTX with the flags triton compiles it with (the ptxas in triton's wheel)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(kernel.asm["ptx"])
        sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
        cmd = [_ptxas(arch), "-lineinfo", "-v", "--regAllocOptLevel=2", f"--gpu-name={sm}", path]
        out = subprocess.run(
            [*cmd, "-o", os.path.join(tmp, "k.o")], capture_output=True, text=True, check=True
        )
    log = out.stderr
    stack, stores, loads = map(
        int,
        re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", log
        ).groups(),
    )
    smem = re.search(r"(\d+) bytes smem", log)
    return {
        "regs": int(re.search(r"Used (\d+) registers", log).group(1)),
        "spill_bytes": stores + loads,
        "stack_bytes": stack,
        "static_shared": int(smem.group(1)) if smem else 0,
    }


def _kernel_fn(v: Variant):
    """The JIT function that ``v`` compiles (built for the compiler, not the interpreter)."""
    from addnorm.ops.triton import kernels as k
    from addnorm.ops.triton import tp_kernels as ts

    fn = {
        "fwd": k.fwd_kernel, "bwd": k.bwd_kernel, "bwd_sums": k.bwd_sums_kernel,
        "tp_stats": ts.tp_stats_kernel, "tp_norm": ts.tp_norm_kernel, "tp_sums": ts.tp_sums_kernel,
        "tp_bwd": ts.tp_bwd_kernel,
    }[v.kernel]  # fmt: skip
    if not hasattr(fn, "arg_names"):
        raise RuntimeError("compile_variant: the kernels were built for the interpreter (TRITON_INTERPRET=1)")
    return fn


def usage_key(v: Variant, arch: int) -> str:
    """What a compiled variant's resource usage depends on, hashed: the kernel's source with every
    function and global it reads (``JITFunction.cache_key``), its specialisation (signature,
    constexprs, alignment) and options, the target, and Triton's version (whose wheel ships the
    ptxas that allocates the registers)."""
    import hashlib

    import triton

    fn = _kernel_fn(v)
    signature, constexprs, attrs = _signature(v, fn.arg_names)
    text = repr(
        (
            fn.cache_key,
            sorted(signature.items()),
            sorted((name, repr(c)) for name, c in constexprs.items()),
            sorted((str(i), repr(a)) for i, a in attrs.items()),
            v.num_warps,
            v.maxnreg,
            arch,
            triton.__version__,
            os.environ.get("TRITON_DEFAULT_FP_FUSION"),
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def compile_variant(v: Variant, arch: int) -> dict:
    """Compile ``v`` for sm_``arch`` (needs no GPU) and return its resource usage."""
    import time

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = _kernel_fn(v)
    signature, constexprs, attrs = _signature(v, fn.arg_names)
    t0 = time.perf_counter()
    kernel = triton.compile(
        ASTSource(fn, signature, constexprs, attrs),
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": v.num_warps, "maxnreg": v.maxnreg},
    )
    seconds = time.perf_counter() - t0
    usage = _resource_usage(kernel, arch)
    return {"arch": arch, **usage, "dynamic_shared": int(kernel.metadata.shared), "compile_s": seconds}


def _worker_init(cache_dir: str | None) -> None:
    os.environ["TRITON_INTERPRET"] = "0"  # the real compiler, not the interpreter
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    if cache_dir is not None:
        os.environ["TRITON_CACHE_DIR"] = cache_dir


def _compile_one(job: tuple[Variant, int]) -> dict:
    v, arch = job
    return {"variant": v, **compile_variant(v, arch)}


def _key_one(job: tuple[Variant, int]) -> str:
    return usage_key(*job)


def compile_all(
    vs: list[Variant],
    archs=ARCHS,
    workers: int | None = None,
    cache_dir: str | None = None,
    usage_cache: Path | None = None,
) -> list[dict]:
    """Compile every variant for every arch in worker processes (spawned with TRITON_INTERPRET=0, so
    this works from a process that runs the kernels in the interpreter), with triton's cache in
    ``cache_dir`` (None: its default).

    With ``usage_cache`` (a JSON file of earlier compiles' resource usage by :func:`usage_key`), a
    variant whose kernel source, specialisation, target and Triton are unchanged takes its recorded
    usage (marked ``"cached": True``) and only the others compile; the file is rewritten with the keys
    of this call (what a changed kernel no longer needs is dropped)."""
    import multiprocessing

    jobs = [(v, a) for v in vs for a in archs]
    ctx = multiprocessing.get_context("spawn")
    n = workers or os.cpu_count() or 1
    with ProcessPoolExecutor(n, mp_context=ctx, initializer=_worker_init, initargs=(cache_dir,)) as pool:
        if usage_cache is None:
            return list(pool.map(_compile_one, jobs))
        keys = list(pool.map(_key_one, jobs))
        known = json.loads(usage_cache.read_text()) if usage_cache.exists() else {}
        todo = [(job, key) for job, key in zip(jobs, keys, strict=True) if key not in known]
        compiled = pool.map(_compile_one, [job for job, _ in todo])
        fresh = dict(zip((key for _, key in todo), compiled, strict=True))
    results, kept = [], {}
    for (v, _), key in zip(jobs, keys, strict=True):
        if key in fresh:
            results.append(fresh[key])
            kept[key] = {f: x for f, x in fresh[key].items() if f not in ("variant", "compile_s")}
        else:
            results.append({"variant": v, **known[key], "cached": True})
            kept[key] = known[key]
    if kept != known:
        usage_cache.write_text(json.dumps(dict(sorted(kept.items())), indent=0) + "\n")
    return results
