"""Runs side by side on one device: how many at once (``--workers auto`` on a GPU), and how many shared
it while each ran (``packed``, stored in its provenance).

A small model leaves a GPU mostly idle: its step is bound by the host, one core queueing kernels (an
H200 trained ``gpu-literature``'s d_model 512 runs at 170-200k tokens/s, one at a time, a small share of
its FLOP rate). Several runs at once, each a process of its own with its own CUDA context (the
:class:`~.executors.ProcessExecutor`), fill it. Whether they gain, and how much, is measured, not
assumed: every run stores ``packed``, the mean number of runs in flight on the device while it ran
(:class:`Sharing`, counted in the driver), and the :class:`~.cost_model.Estimator` reads the wall time of
runs packed the same way on the same device (no gain is assumed for a packing not yet measured).

:func:`choose` picks k, the most runs at once that every bound allows:

- **memory**: k runs' peaks within :data:`MEMORY_SHARE` of the GPU's free memory; a run's peak is the
  measured peak of a run of its size on this GPU (``peak_memory``, bytes reserved, plus a CUDA context)
  where one is stored, else :func:`~.limits.estimate_memory` scaled by the largest measured/estimated
  ratio of this GPU's runs (x :data:`~.cost_model.SCALED_MARGIN`: the small runs that trained first teach
  the others), else the estimate;
- **cores**: one per run (each trains with one torch thread), one left for the driver;
- **runs left**, and with ``--budget`` the **budget**: k of the runs left must fit in it at k at once
  (what a run needs at a packing not measured yet assumes no gain, see below);
- **the measured gain**: among those, the packing whose estimated throughput (k runs over one run's
  estimated time at k, :meth:`~.cost_model.Estimator.seconds`) is within :data:`GAIN_TOLERANCE` of the
  best, the largest such. An unmeasured packing is estimated with no gain over the largest measured one
  below it, so it ties with it and is tried (and measured) as long as nothing says it loses; once a
  larger packing has measured a lower throughput, the smaller one wins (the packings between them are
  interpolated).

The results do not depend on it: each run draws from its own seed in its own process.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..train import RunConfig
from .cost_model import SCALED_MARGIN, Estimator, window
from .limits import CUDA_CONTEXT_BYTES, estimate_memory, fmt_bytes
from .spec import PlannedRun

MEMORY_SHARE = 0.9  # of a GPU's free memory that k runs' peaks may fill (fragmentation, the driver's context)
GAIN_TOLERANCE = 0.02  # a larger packing is taken while its estimated throughput is within 2% of the best


def memory_need(config: RunConfig, estimator: Estimator) -> tuple[int, str]:
    """(bytes one run of ``config`` needs on the GPU of ``estimator``, how that was found): see the
    module docstring."""
    same = [t.peak_memory for t in estimator.same_cost(config) if t.peak_memory]
    if same:
        return max(same) + CUDA_CONTEXT_BYTES, "measured"
    estimate = estimate_memory(config, cuda=True).total
    ratios = [
        (t.peak_memory + CUDA_CONTEXT_BYTES) / estimate_memory(RunConfig(**t.config), cuda=True).total
        for t in estimator.timings
        if t.peak_memory
    ]
    if ratios:
        return int(estimate * max(ratios) * SCALED_MARGIN), f"estimated, scaled by {len(ratios)} measured"
    return estimate, "estimated"


@dataclass
class Packing:
    """How many runs train at once (``k``) on ``device``, each bound (name -> (runs, why)) and the
    measured gain (or that none is measured yet), as :meth:`line` says it."""

    k: int
    device: str
    bounds: dict[str, tuple[int, str]] = field(default_factory=dict)
    gain: str = ""
    free_bytes: int | None = None  # the bounds it was chosen under, to choose again as runs are measured
    cores: int | None = None
    start_s: float = 0.0

    @property
    def most(self) -> int:
        """The most runs at once it may grow to as measurements come in: the cores' bound and the runs
        left (memory and the gain are measured as runs finish)."""
        return min(n for name, (n, _) in self.bounds.items() if name in ("cores", "runs left"))

    def again(
        self, todo: list[PlannedRun], estimator: Estimator, room: float | None, running: int = 0
    ) -> Packing:
        """The packing for the runs still ``todo`` (``running`` more in flight) under the same bounds, now
        that ``estimator`` holds the runs measured since (their peak memory, the gain of the packing they
        ran at)."""
        bounds = {"free_bytes": self.free_bytes, "cores": self.cores, "start_s": self.start_s}
        return choose(todo, estimator, room=room, running=running, **bounds)

    def line(self) -> str:
        limits = "; ".join(
            f"{name} {n}" + (f" ({why})" if why else "") for name, (n, why) in self.bounds.items()
        )
        return f"packing: {self.k} run(s) at once on {self.device} ({limits}; {self.gain})"


def choose(
    todo: list[PlannedRun],
    estimator: Estimator,
    *,
    free_bytes: int | None = None,
    cores: int | None = None,
    room: float | None = None,
    start_s: float = 0.0,
    running: int = 0,
) -> Packing:
    """The packing for the runs ``todo`` on ``estimator``'s device (see the module docstring): bounded by
    ``free_bytes`` of GPU memory (None: not bounded here), ``cores`` for the workers (None: not bounded
    here) and, with ``room`` seconds of budget for runs (a worker's ``start_s`` included), by k of the
    runs fitting in it at k at once (``running``: runs already in flight, which count as runs left that
    fit)."""
    bounds: dict[str, tuple[int, str]] = {"runs left": (max(1, len(todo) + running), "")}
    if free_bytes is not None and todo:
        needs = [(memory_need(r.config, estimator), r) for r in todo]
        (need, how), _ = max(needs, key=lambda x: x[0][0])
        fit = max(1, int(MEMORY_SHARE * free_bytes // max(need, 1)))
        bounds["memory"] = (fit, f"{fmt_bytes(need)} a run, {how}, in {fmt_bytes(free_bytes)} free")
    if cores is not None:
        bounds["cores"] = (max(1, cores), "one per run, one for the driver")
    top = min(n for n, _ in bounds.values())
    gains = estimator.gains()
    gain = (
        "measured gain " + ", ".join(f"x {g:.1f} at {k}" for k, g in gains.items())
        if gains
        else f"packing not measured on {estimator.device} yet: no gain assumed until it is"
    )
    chosen = {"free_bytes": free_bytes, "cores": cores, "start_s": start_s}
    if not todo:
        return Packing(1, estimator.device, bounds, gain, **chosen)

    def full(k: int) -> bool:  # k of the runs left fit in the budget at k at once
        fit = sum(estimator.needs(r.config, k) + start_s <= room for r in todo) if room is not None else k
        return fit + running >= k

    fits = [k for k in range(1, top + 1) if full(k)]
    if room is not None and len(fits) < top:
        most = max(fits, default=1)
        bounds["budget"] = (most, f"fewer than {most + 1} runs left fit in it at {most + 1} at once")
    ref = min(todo, key=lambda r: estimator.needs(r.config, 1)).config
    throughput = {k: k / estimator.seconds(ref, k) for k in fits or [1]}
    best = max(throughput.values())
    k = max(k for k, t in throughput.items() if t >= (1 - GAIN_TOLERANCE) * best)
    return Packing(k, estimator.device, bounds, gain, **chosen)


def plan_windows(
    todo: list[PlannedRun],
    estimator: Estimator,
    room: float,
    start_s: float = 0.0,
    workers: int | None = None,
    **bounds,
) -> list[tuple[int, int]] | None:
    """The windows of ``room`` seconds that the runs ``todo`` need at ``estimator``'s estimates (nothing
    learnt in between): per window (runs at once, runs started), each packing ``workers`` runs at once or
    choosing (:func:`choose`, with ``bounds``) for the runs it has left, each starting what fits
    (:func:`~.cost_model.window`, a new worker's ``start_s`` included) and the next taking the rest. None
    if a run fits in no window."""
    left, plan = list(todo), []
    while left:
        k = workers or choose(left, estimator, room=room, start_s=start_s, **bounds).k
        start = start_s if k > 1 else 0.0
        chosen, _ = window(left, lambda r, k=k: estimator.needs(r.config, k), room, k, start)
        if not chosen:
            return None
        started = {r.run_id for r in chosen}
        left = [r for r in left if r.run_id not in started]
        plan.append((k, len(chosen)))
    return plan


class Sharing:
    """How many runs share the device while each runs: the driver calls :meth:`start` when it hands a
    run to a free worker and :meth:`finish` when its result is back, which returns the mean number of
    runs in flight over that interval (itself included: 1.0 for a run alone), on ``clock``."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._since = clock()
        self._flight: dict[str, list[float]] = {}  # run id -> [started, runs-in-flight x seconds so far]

    def _advance(self) -> float:
        now = self.clock()
        count = len(self._flight)
        for state in self._flight.values():
            state[1] += count * (now - self._since)
        self._since = now
        return now

    def start(self, run_id: str) -> None:
        now = self._advance()
        self._flight[run_id] = [now, 0.0]

    def finish(self, run_id: str) -> float:
        now = self._advance()
        started, area = self._flight.pop(run_id, [now, 0.0])
        span = now - started
        return round(area / span, 2) if span > 0 else 1.0


__all__ = ["GAIN_TOLERANCE", "MEMORY_SHARE", "Packing", "Sharing", "choose", "memory_need", "plan_windows"]
