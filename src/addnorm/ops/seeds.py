"""The eager Triton path's dropout seed when the caller gives none: drawn on the host from the device's
Philox generator, with no kernel launch.

A seed drawn with ``torch.randint(..., device="cuda")`` is one more kernel launch (and its host time)
per dropout call. torch's own fused dropout (``native_dropout``) launches none for its randomness: it
passes the generator's (seed, offset) to its kernel by value and advances the offset. The seed here is
drawn the same way: ``v = mix(initial_seed, offset)`` of the device's default CUDA generator, whose
offset then advances by 4 (as one random op's would), handed to the kernels as a 64-bit integer
argument (:func:`addnorm.ops.triton.tiles.keep_mask` reads a pointer or a value). So:

- ``torch.manual_seed``/``torch.cuda.manual_seed`` make runs reproducible, and restoring the generator's
  state (``torch.cuda.set_rng_state``, activation checkpointing's recomputation) gives the same mask;
- the other random ops see the same offsets as when a one-element ``randint`` drew the seed;
- ``mix`` is SplitMix64's finaliser (Steele, Lea and Flood 2014) of ``initial_seed xor offset *
  0x9E3779B97F4A7C15``, kept to [2**61, 2**62), so that Triton always passes it as an ``i64`` (the
  kernels do not specialise on its value: ``do_not_specialize``);
- while a CUDA graph is being captured the host value would be replayed unchanged, so the seed is then
  drawn with ``randint`` as before (the graph replays the generator's offsets);
- reading and advancing the offset are two calls, not one atomic step: threads that share one device's
  generator can draw the same seed (torch's own ops lock the generator; DataParallel's threads each
  use another device).

:data:`SEED_SOURCE` is ``"generator"`` (the default) or ``"randint"`` (the previous way, kept selectable:
the GPU suite's host-time step times both); ``ADDNORM_SEED_SOURCE`` sets it at import,
:func:`set_seed_source` later (:func:`seed_source` for a block). Seeds given by the caller, the CPU's
eager path (``nn.Dropout``'s own draws), torch.compile and DTensors are unchanged: they take seeds as
tensors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from .choices import one_of, scoped

__all__ = ["SEED_SOURCES", "mix", "seed_source", "seeder_for", "set_seed_source"]

SEED_SOURCES = ("generator", "randint")
_M64 = (1 << 64) - 1
_LOW61 = (1 << 61) - 1
_TOP = 1 << 61


SEED_SOURCE = one_of("ADDNORM_SEED_SOURCE", os.environ.get("ADDNORM_SEED_SOURCE", "generator"), SEED_SOURCES)


def set_seed_source(source: str) -> None:
    """Where a dropout call without a seed takes its seed on a GPU: ``"generator"`` (the host, from the
    CUDA generator's state) or ``"randint"`` (a one-element ``torch.randint`` on the device)."""
    global SEED_SOURCE
    SEED_SOURCE = one_of("source", source, SEED_SOURCES)


def seed_source(source: str) -> AbstractContextManager[None]:
    """``set_seed_source(source)`` for a block, then the previous source again."""
    return scoped(set_seed_source, lambda: SEED_SOURCE, source)


def mix(seed: int, offset: int) -> int:
    """The kernels' 64-bit seed for a generator at (``seed``, ``offset``): SplitMix64's finaliser of
    ``seed ^ offset * 0x9E3779B97F4A7C15`` (mod 2**64), its low 61 bits with bit 61 set."""
    v = (seed ^ (offset * 0x9E3779B97F4A7C15)) & _M64
    v = ((v ^ (v >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    v = ((v ^ (v >> 27)) * 0x94D049BB133111EB) & _M64
    return ((v ^ (v >> 31)) & _LOW61) | _TOP


def generator_for(device: torch.device):
    """The generator whose Philox state the seeds of ``device`` come from (CUDA's default generator of
    that device), or None: another device draws with ``randint``."""
    if device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.default_generators[index]


def capture_check_for(device: torch.device) -> Callable[[], bool]:
    """A call that says whether the current stream of ``device`` is capturing a CUDA graph."""
    return torch._C._cuda_isCurrentStreamCapturing


def seeder_for(device: torch.device) -> Callable[[], int | None] | None:
    """``draw()`` for a call plan on ``device``: the next host seed (an int), or None where this call
    must draw it with ``randint`` (:data:`SEED_SOURCE` ``"randint"``, or a graph being captured); None
    for a device without a Philox generator. Made once per plan."""
    gen = generator_for(device)
    if gen is None:
        return None
    capturing = capture_check_for(device)
    get_offset, set_offset, initial_seed = gen.get_offset, gen.set_offset, gen.initial_seed

    def draw() -> int | None:
        if SEED_SOURCE != "generator" or capturing():
            return None
        offset = get_offset()
        set_offset(offset + 4)
        return mix(initial_seed(), offset)

    return draw
