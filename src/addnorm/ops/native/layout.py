"""A compiled Triton kernel's parameter buffer, as the native call packs it: one entry per kernel
parameter (each non-constexpr argument of the JIT function, in order, then the two scratch pointers
Triton's launcher appends), each with its size and where its bytes come from: a tensor slot's data
pointer, the call's row count, the backward's tiles per program, the host seed, or a constant packed
here once.

The sizes and encodings are those of Triton's own launcher (``triton/backends/nvidia/driver.c``,
``extraction_map``), read from the compiled kernel's ``kernel_signature`` (one extractor index per
parameter): an fp32 scalar is 4 bytes of float (Triton's AOT tool, ``tools/compile.py``, emits
``double`` for it: a kernel would read garbage), i1 and i32 4 bytes, pointers 8. The tests compare the
bytes with those Triton's launcher hands the driver (a fake driver records both).
"""

from __future__ import annotations

import struct
from typing import NamedTuple

__all__ = ["CONST", "PER_PROGRAM", "ROWS", "SEED", "TENSOR", "Var", "layout", "pack"]

CONST, TENSOR, ROWS, PER_PROGRAM, SEED = 0, 1, 2, 3, 4

# driver.c's ExtractorTypeIndex -> (size, struct format or None)
_EXTRACTORS = {
    1: (8, None),  # pointer
    2: (1, "<b"), 3: (2, "<h"), 4: (4, "<i"), 5: (8, "<q"),
    6: (1, "<B"), 7: (2, "<H"), 8: (4, "<I"), 9: (8, "<Q"),
    10: (2, "<e"), 11: (2, "bf16"), 12: (4, "<f"), 13: (8, "<d"),
}  # fmt: skip
_MAX_SHARED = 228 * 1024  # above it Triton's launcher adds a launch attribute cuLaunchKernel has not


class Var(NamedTuple):
    """An argument whose bytes differ per call: ``kind`` (TENSOR, ROWS, PER_PROGRAM, SEED) and for
    TENSOR the slot of the native call's tensors."""

    kind: int
    slot: int = 0


def pack(extractor: int, value: object) -> int:
    """``value`` as Triton's launcher packs it for ``extractor``, as a little-endian unsigned int."""
    size, fmt = _EXTRACTORS[extractor]
    if fmt == "bf16":
        raw = struct.pack("<f", float(value))[2:]  # the float's high half, as driver.c's extractBF16
    elif fmt in ("<e", "<f", "<d"):
        raw = struct.pack(fmt, float(value))
    else:
        v = int(value)
        raw = (v & ((1 << (8 * size)) - 1)).to_bytes(size, "little")
    return int.from_bytes(raw, "little")


def layout(ck, args: tuple) -> tuple[list[tuple[int, int, int, int]], int, int] | str:
    """The native launch of compiled kernel ``ck`` given the JIT function's arguments ``args`` (every
    parameter, defaults included; :class:`Var` where they differ per call): (params, block threads,
    shared memory bytes), or a one-line refusal where the native launch cannot do what Triton's does."""
    run = getattr(ck, "run", None)
    sig = getattr(getattr(ck, "src", None), "signature", None)
    ksig = getattr(run, "kernel_signature", None)
    if sig is None or ksig is None or not hasattr(ck, "packed_metadata"):
        return "this Triton's compiled kernel has no launcher signature to pack from"
    num_warps, num_ctas, shared = ck.packed_metadata[:3]
    if num_ctas != 1 or getattr(run, "launch_cooperative_grid", False) or getattr(run, "launch_pdl", False):
        return "the kernel launches with clusters, a cooperative grid or PDL (cuLaunchKernelEx attributes)"
    if getattr(run, "global_scratch_size", 0) or getattr(run, "profile_scratch_size", 0):
        return "the kernel needs scratch memory from Triton's allocator"
    if getattr(run, "gsan_enabled", False) or shared > _MAX_SHARED:
        return "the kernel needs launch attributes (GSan, oversized shared memory)"
    types = list(sig.values())
    if len(types) != len(args):
        return f"the kernel has {len(types)} parameters, the launch {len(args)} arguments"
    ksig = bytes(ksig)
    params, j = [], 0
    for ty, arg in zip(types, args, strict=True):
        if ty == "constexpr":
            continue
        if isinstance(ty, tuple) or j >= len(ksig) or ksig[j] not in _EXTRACTORS:
            return f"a parameter of type {ty!r} is not packed natively"
        e = ksig[j]
        j += 1
        size = _EXTRACTORS[e][0]
        if isinstance(arg, Var):
            params.append((arg.kind, size, arg.slot, 0))
        elif e == 1 or arg is None:
            return "a pointer parameter without a tensor slot"
        else:
            params.append((CONST, size, 0, pack(e, arg)))
    if j != len(ksig):
        return "the kernel's signature and its launcher's disagree"
    params += [(CONST, 8, 0, 0), (CONST, 8, 0, 0)]  # the global and profile scratch: none
    return params, 32 * num_warps, shared
