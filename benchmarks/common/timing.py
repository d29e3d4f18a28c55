"""How the benchmarks time implementations against each other on a shared machine: interleaved, each
implementation a timer (a call returning the seconds it measured), such as a training step; their
speed ratios from the rounds' pairs; and the peak memory of each of several models built side by side,
as if it were alone."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager

__all__ = [
    "ORDER",
    "PREVIOUS_ORDER",
    "interleaved",
    "round_order",
    "paired_speedup",
    "peak_apart",
    "resident_bytes",
    "speedup",
    "speedup_cell",
    "training_step",
    "within",
]


# how :func:`interleaved` orders its rounds, as a report records and prints it
ORDER = "every other round the first column, then the rest reversed (no step right after itself)"
PREVIOUS_ORDER = "the order reversed every other round"  # until 2026-11-28: what earlier records used


def round_order(names: list[str], i: int) -> list[str]:
    """The order of round ``i`` of an interleaved timing: ``names``, and every other round the first
    name then the rest reversed. Rounds run back to back, so no name ever runs right after itself, and
    each runs after each of its neighbours in turn. (Reversing the whole order every other round, as
    the benchmarks did until 2026-11-28, ran the first and the last name twice in a row at every other
    round's boundary and the middle ones never: a step that runs after itself finds the host's caches
    warm with its own code, 10% faster for the fused LM's step on the 2-core CPU, a bias against the
    middle columns, which held the fused steps.)"""
    return names if i % 2 == 0 else names[:1] + names[:0:-1]


def interleaved(
    timers: dict[str, Callable[[], float]], reps: int, warmup: int = 0
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Call every timer (a call that returns the seconds it measured) ``warmup`` times, then ``reps``
    times in alternation (:func:`round_order`), so that drifts in machine load hit every implementation
    alike, and none ever runs right after itself. Returns the measured seconds per name, and the CPU
    seconds this process spent in each call (``time.process_time``: time the process waited while
    others ran is left out)."""
    for _ in range(warmup):
        for timer in timers.values():
            timer()
    names = list(timers)
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for i in range(reps):
        for name in round_order(names, i):
            t0 = time.process_time()
            wall[name].append(timers[name]())
            cpu[name].append(time.process_time() - t0)
    return wall, cpu


def training_step(model, loss_of: Callable[[], object], lr: float = 1e-4) -> Callable[[], float]:
    """A timer of one training step of ``model`` (put in training mode): gradients zeroed, ``loss_of()``
    computed and backpropagated, one AdamW step at ``lr``; it returns the step's wall seconds."""
    import torch

    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss_of().backward()
        opt.step()
        return time.perf_counter() - t0

    return step


def within(step: Callable[[], None], context: Callable[[], AbstractContextManager]) -> Callable[[], None]:
    """``step`` run inside ``context()``, entered anew for each call: a variant's step under the setting it
    is timed with (a switch object that returns itself when called, or a factory of one-shot contexts
    such as ``functools.partial(policy.fusion, "always")``)."""

    def run() -> None:
        with context():
            step()

    return run


def paired_speedup(wall: dict[str, list[float]], base: str, other: str) -> dict[str, float]:
    """``other``'s speed over ``base``'s from interleaved timings (:func:`interleaved`): per round,
    ``base``'s time / ``other``'s time in that round (the two steps ran next to each other, under the
    same load), then the median and the quartiles of those ratios (> 1: ``other`` faster)."""
    ratios = [b / o for b, o in zip(wall[base], wall[other], strict=True)]
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3  # one round: its own
    return {"median": statistics.median(ratios), "q1": q1, "q3": q3, "n": len(ratios)}


def speedup(paired: dict, tokens_per_s: dict, a: str, b: str) -> float:
    """``a``'s speed over ``b``'s: the median of the per-round ratios where ``paired`` has the pair
    (``"a/b"``: :func:`paired_speedup` of interleaved steps), else the ratio of the two medians'
    tokens/s (rows recorded without pairs)."""
    pair = paired.get(f"{a}/{b}")
    return pair["median"] if pair else tokens_per_s[a] / tokens_per_s[b]


def pair_cell(pair: dict) -> str:
    """A :func:`paired_speedup` record as a table shows it: its median, its quartiles in brackets
    (``1.031x [0.962-1.104]``)."""
    return f"{pair['median']:.3f}x [{pair['q1']:.3f}-{pair['q3']:.3f}]"


def speedup_cell(paired: dict, tokens_per_s: dict, a: str, b: str) -> str:
    """:func:`speedup` as a table shows it: ``1.031x``, with the per-round ratios' quartiles in brackets
    where ``paired`` has the pair (:func:`pair_cell`)."""
    pair = paired.get(f"{a}/{b}")
    return pair_cell(pair) if pair else f"{tokens_per_s[a] / tokens_per_s[b]:.3f}x"


def resident_bytes(*tensors_or_modules) -> int:
    """Bytes held by distinct storages among the tensors given, the parameters, gradients and buffers
    of the modules given, and the state tensors of the optimizers given: what a training step finds
    allocated for its own model before it starts."""
    import torch

    seen: dict[int, int] = {}

    def add(t) -> None:
        if isinstance(t, torch.Tensor) and t.device.type != "meta":
            st = t.untyped_storage()
            seen[st.data_ptr() or id(st)] = st.nbytes()

    for obj in tensors_or_modules:
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                add(p)
                add(p.grad)
            for b in obj.buffers():
                add(b)
        elif isinstance(obj, torch.optim.Optimizer):
            for state in obj.state.values():
                for t in state.values():
                    add(t)
        else:
            add(obj)
    return sum(seen.values())


def peak_apart(step: Callable[[], object], resident: int, memory=None) -> int:
    """The peak memory of one call of ``step`` as if its model were alone on the device: the allocator's
    peak during the call, less what was allocated before it (every model's resident memory, its own
    included), plus ``resident`` (its own model's: :func:`resident_bytes`). So variants built side by
    side for interleaved timing get the peak each would have had on its own. ``memory``: an object with
    ``allocated()``, ``reset_peak()`` and ``peak()`` (default: ``torch.cuda``'s counters)."""
    if memory is None:
        memory = _CudaMemory()
    before = memory.allocated()
    memory.reset_peak()
    step()
    return memory.peak() - before + resident


class _CudaMemory:
    def __init__(self) -> None:
        import torch

        self.cuda = torch.cuda

    def allocated(self) -> int:
        self.cuda.synchronize()
        return self.cuda.memory_allocated()

    def reset_peak(self) -> None:
        self.cuda.reset_peak_memory_stats()

    def peak(self) -> int:
        self.cuda.synchronize()
        return self.cuda.max_memory_allocated()
