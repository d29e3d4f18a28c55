"""What a run costs in seconds, and a study in a time window (``addnorm study --budget SECONDS``).

**The cost model** (:func:`estimate_seconds`): seconds per run = its work in training steps
(:func:`run_work`: its steps and its held-out batches) x the seconds of one step, plus a start cost on a
GPU. On the CPU a step is per-layer host time plus training FLOPs at a FLOP rate, both fitted on a 2-core
AMD EPYC with one torch thread per run. On a GPU the host queues kernels while the device computes, so a
step takes the longer of the two: host time per layer measured on an H100's host (a 4-layer LM step,
AdamW included, took 8.2 ms: ``benchmarks/results/h100/2026-11-24-fcabca7/host_overhead_cuda.md``), and the
FLOPs at the share of the H100's dense bf16 peak measured eager (``benchmarks/results/``): 25% for addnorm's
LM at d_model 1024 (``lm_step_cuda.md``), 9.5% for a Hugging Face family (Llama at hidden 768,
``hf_step_gpu.md``). Models of d_model 512 at 8k tokens a step are host-bound there or nearly.

**What was measured wins** (:class:`Estimator`): the runs already stored for *this device* (the run's
``provenance.device``, a CPU model or a GPU name) are the estimate for the runs still to train, at the
packing they will train at (``packed``: how many runs share the device, :mod:`.packing`):

- a stored run of the same cost (:func:`cost_key`: every setting but the seed, learning rate, schedule,
  warmup, initialisation) gives its measured time: the median of those measured at the same packing as
  the estimate, the longest of them times :data:`MEASURED_MARGIN` as what a window must hold;
- otherwise the cost model *fitted to this device* (:func:`fit_rates`): the host's and the device's time
  per step scaled to what its runs measured (tokens per second: the time of a training step, evaluation
  left out), plus the seconds a run measured besides its steps; so the first runs on a new GPU set the
  host and device rates of the rest (an H200 measured 41-55 s a run where the H100's constants gave 27 s),
  times :data:`SCALED_MARGIN` for what a window must hold; with no run of this device stored, the cost
  model alone;
- runs packed k at once take the measured slowdown of that packing on this device (interpolated between
  measured packings); beyond the largest packing measured, no gain is assumed on a GPU (k runs at once
  each take k times as long) until one is measured, and on the CPU none is lost up to the cores (each
  run has its own).

Runs finished during an invocation join the history at once, so the first run on a new GPU calibrates the
rest of its window. Only runs that trained every step count (a diverged run stopped early; a failed one
is no measurement).

**The window** (:class:`Budget`): ``--budget SECONDS`` is the wall-clock of the whole invocation (from the
process's start, the imports included, :func:`invocation_start`; with ``--workers``, all workers
together). A run starts only when
its estimate, plus a worker's start-up for a new process, fits in what is left of the budget after
:func:`report_reserve` (the report written at the end); runs that do not fit are left for the next
invocation, which resumes from the database. A budget in which not even the cheapest run left fits is
refused before anything starts (:class:`BudgetTooSmall`, one line, exit 2).
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ..train import RunConfig
from ..train.loop import eval_batches_total

# --- the cost model ------------------------------------------------------------------------------------
HOST_S_PER_LAYER_STEP = 3.4e-3  # CPU: per-layer host time of a step, one torch thread (2-core AMD EPYC)
FLOPS_PER_S = 5.7e10  # CPU: training FLOP rate of one core
H100_BF16_PEAK = 989e12  # dense bf16 FLOP/s of an H100 SXM
GPU_EFFICIENCY = 0.25  # of that peak: addnorm's LM at d_model 1024, eager (lm_step_cuda.md)
GPU_EFFICIENCY_HF = 0.095  # a Hugging Face family: Llama at hidden 768, eager (hf_step_gpu.md)
GPU_FLOPS_PER_S = H100_BF16_PEAK * GPU_EFFICIENCY
GPU_HOST_S_PER_LAYER_STEP = 2e-3  # 8.2 ms for a 4-layer LM step with AdamW on the H100's host
GPU_START_S = 3.0  # per run: build the model, move it to the device, probe and evaluate
EVAL_BATCH_COST = 1 / 3  # a held-out batch (forward only) in training steps (forward and backward)


def run_flops(config: RunConfig) -> float:
    """Training FLOPs per step: 6 x tokens x (matmul weights per token) plus attention scores."""
    m = config.model
    tokens = config.batch_size * config.seq_len
    gated = config.arch.startswith("hf-") and config.arch != "hf-gpt2"  # the families' SwiGLU and GeGLU
    ffn = 3 if m.activation == "swiglu" or gated else 2
    kv = config.kv_heads or m.n_heads
    attention = 2 * m.d_model**2 + 2 * m.d_model * (m.d_model * kv // m.n_heads)  # q, o; k, v (GQA)
    per_layer = attention + ffn * m.d_model * m.d_ff + 2 * config.seq_len * m.d_model
    layers = m.n_layers
    if config.task != "lm":  # encoder-decoder: encoder and decoder stacks, cross-attention
        layers = m.encoder_layers + m.decoder_layers * 1.5
    return 6.0 * tokens * (layers * per_layer + m.d_model * 256)


def run_work(config: RunConfig) -> float:
    """A run's work in training steps: its steps, and its held-out batches (a forward pass each, at
    :data:`EVAL_BATCH_COST` of a step). The time estimate and the progress display both count it."""
    return config.steps + EVAL_BATCH_COST * eval_batches_total(config)


def _layers(config: RunConfig) -> int:
    m = config.model
    return m.n_layers if config.task == "lm" else m.encoder_layers + m.decoder_layers


def step_sides(config: RunConfig, gpu: bool = False) -> tuple[float, float]:
    """The cost model's seconds of one training step on the host (per-layer host time) and on the device
    (its FLOPs at the device's rate): on one core (:data:`FLOPS_PER_S`), where the two add up, or on a
    GPU (:data:`GPU_FLOPS_PER_S`; a Hugging Face family at :data:`GPU_EFFICIENCY_HF`), where they
    overlap and the longer one is the step."""
    if gpu:
        rate = GPU_FLOPS_PER_S if config.arch == "addnorm" else H100_BF16_PEAK * GPU_EFFICIENCY_HF
        return GPU_HOST_S_PER_LAYER_STEP * _layers(config), run_flops(config) / rate
    return HOST_S_PER_LAYER_STEP * _layers(config), run_flops(config) / FLOPS_PER_S


def estimate_seconds(config: RunConfig, gpu: bool = False) -> float:
    """The cost model's wall time of one run on one core or on one GPU (:func:`step_sides`), its work
    (:func:`run_work`) included, and a GPU's start."""
    host, device = step_sides(config, gpu)
    per_step = max(host, device) if gpu else host + device
    return per_step * run_work(config) + (GPU_START_S if gpu else 0.0)


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# --- what was measured ---------------------------------------------------------------------------------
# Settings that change what a run learns but not what it costs.
COST_FREE = ("seed", "lr", "warmup", "schedule", "init", "hf_init", "weight_decay", "grad_clip")
MEASURED_MARGIN = 1.1  # on the longest stored run of the same cost
SCALED_MARGIN = 1.25  # on the cost model fitted to this device's runs


def cost_key(config: dict) -> str:
    """The settings that decide a run's cost (all but :data:`COST_FREE`), as one comparable string."""
    return repr(sorted((k, repr(v)) for k, v in config.items() if k not in COST_FREE))


@dataclass
class Timing:
    """A stored run as a measurement: its config, the device it trained on, its wall time, whether it
    trained every step (``complete``: done, not diverged or failed), how many runs shared the device
    while it ran (``packed``: the mean number in flight, itself included; 1 alone), its training tokens
    per second (after the first step, evaluation left out) and a GPU's peak memory (bytes reserved)."""

    config: dict
    device: str
    seconds: float
    complete: bool
    packed: float = 1.0
    tokens_per_s: float | None = None
    peak_memory: int | None = None

    @property
    def level(self) -> int:
        """The packing this run measured: ``packed`` to the nearest whole number of runs."""
        return max(1, round(self.packed))


@dataclass
class Rates:
    """A device's cost model fitted to its runs (:func:`fit_rates`): the measured over the modelled time
    per step on the host (``host``) and on the device (``device``), and the seconds a run takes besides
    its steps (``start``: building the model, the first step, evaluation beyond its modelled share)."""

    gpu: bool
    host: float = 1.0
    device: float = 1.0
    start: float = 0.0
    host_runs: int = 0  # runs whose step the cost model finds host-bound (on a GPU), that fitted ``host``
    device_runs: int = 0

    def step(self, config: RunConfig) -> float:
        host, device = step_sides(config, self.gpu)
        return (
            max(host * self.host, device * self.device)
            if self.gpu
            else host * self.host + device * self.device
        )

    def seconds(self, config: RunConfig) -> float:
        """A run's wall time when it has the device to itself."""
        return self.step(config) * run_work(config) + self.start

    def describe(self) -> str:
        if not self.host_runs + self.device_runs:
            return "the cost model"
        if not self.gpu:
            return f"the cost model x {self.host:.2f} per step, {self.start:.1f} s a run besides its steps"
        host = f"host {GPU_HOST_S_PER_LAYER_STEP * self.host * 1e3:.2f} ms per layer and step"
        host += (
            f" (x {self.host:.2f}, {self.host_runs} runs)" if self.host_runs else " (scaled as the device)"
        )
        device = f"device time x {self.device:.2f} the cost model's"
        device += (
            f" ({self.device_runs} runs)"
            if self.device_runs
            else " (no run device-bound: scaled as the host)"
        )
        return f"{host}, {device}, {self.start:.1f} s a run besides its steps"


def fit_rates(timings: Iterable[Timing], gpu: bool) -> Rates:
    """The cost model of :func:`step_sides` fitted to ``timings`` (complete runs of one device, at one
    packing): each run's time per step is its tokens per step over its measured tokens per second (or,
    for a run without, its wall time less the model's start over its work); on a GPU a run whose modelled
    step is host-bound fits the host's scale and one that is device-bound the device's (the median of
    measured over modelled; a side no run measured takes the other's); on the CPU one scale fits both.
    The start is the median of what the runs took beyond their steps (at least 0)."""
    prior_start = GPU_START_S if gpu else 0.0
    host, device, starts = [], [], []
    for timing in timings:
        config = RunConfig(**timing.config)
        work = run_work(config)
        if timing.tokens_per_s:
            step = config.batch_size * config.seq_len / timing.tokens_per_s
        else:
            step = max(timing.seconds - prior_start, 0.0) / work
        h, d = step_sides(config, gpu)
        modelled = max(h, d) if gpu else h + d
        (host if not gpu or h >= d else device).append(step / modelled)
        starts.append(timing.seconds - step * work)
    if not starts:
        return Rates(gpu, start=prior_start)
    h_scale = statistics.median(host) if host else statistics.median(device)
    d_scale = statistics.median(device) if device else h_scale
    start = max(0.0, statistics.median(starts))
    return Rates(gpu, h_scale, d_scale, start, len(host), len(device))


class Estimator:
    """Seconds a run will take on ``device`` (see the module docstring) when ``packed`` runs share it:
    from the complete runs of ``history`` measured on ``device``, else the cost model (``gpu``: its GPU
    side). ``slots``: how many runs the device holds side by side without slowing each other (the cores
    for one-thread CPU runs; 1 for a GPU, which runs one context at a time) beyond which, until measured,
    packing is assumed to gain nothing."""

    def __init__(
        self, device: str, gpu: bool, history: Iterable[Timing] = (), packed: int = 1, slots: int = 1
    ) -> None:
        self.device, self.gpu, self.packed, self.slots = device, gpu, max(1, int(packed)), max(1, slots)
        self.timings: list[Timing] = []
        self._by_cost: dict[str, list[Timing]] = {}
        self._rates: Rates | None = None
        self._levels: dict[int, float] | None = None
        for timing in history:
            self.add(timing)

    def add(self, timing: Timing) -> None:
        """One more measurement (ignored unless complete, on this device and with a positive time)."""
        if not timing.complete or timing.device != self.device or not timing.seconds > 0:
            return
        try:
            RunConfig(**timing.config)
        except (TypeError, ValueError):  # a config of another version of the settings
            return
        self.timings.append(timing)
        self._by_cost.setdefault(cost_key(timing.config), []).append(timing)
        self._rates = self._levels = None

    @property
    def measured(self) -> int:
        """How many runs of this device the estimates rest on."""
        return len(self.timings)

    @property
    def base(self) -> int:
        """The fewest runs at once measured on this device (1 once a run trained alone)."""
        return min((t.level for t in self.timings), default=1)

    def rates(self) -> Rates:
        """This device's cost model, fitted to its runs at :attr:`base` packing (:func:`fit_rates`)."""
        if self._rates is None:
            self._rates = fit_rates([t for t in self.timings if t.level == self.base], self.gpu)
        return self._rates

    def levels(self) -> dict[int, float]:
        """Packing -> the measured slowdown of a run at it: the median over its runs of wall time over
        :meth:`rates`' time alone (1 at :attr:`base`, by construction)."""
        if self._levels is None:
            rates, found = self.rates(), {}
            for timing in self.timings:
                if timing.level != self.base:
                    alone = rates.seconds(RunConfig(**timing.config))
                    found.setdefault(timing.level, []).append(timing.seconds / alone)
            self._levels = {self.base: 1.0, **{k: statistics.median(v) for k, v in sorted(found.items())}}
        return self._levels

    def slowdown(self, packed: int) -> float:
        """How much longer a run takes when ``packed`` runs share the device than at :attr:`base`:
        measured where that packing was, interpolated between measured packings, and beyond the largest
        measured one scaled by the gain it assumes (none beyond :attr:`slots`: ``packed / slots``)."""
        levels = self.levels()
        if packed in levels:
            return levels[packed]
        below = max((k for k in levels if k < packed), default=None)
        above = min((k for k in levels if k > packed), default=None)
        if below is None:
            return levels[above]  # fewer runs at once are not slower
        if above is None:
            share = lambda k: max(1.0, k / self.slots)  # noqa: E731
            return levels[below] * share(packed) / share(below)
        w = (packed - below) / (above - below)
        return levels[below] * (1 - w) + levels[above] * w

    def gains(self) -> dict[int, float]:
        """Packing -> its measured gain in throughput over :attr:`base`: runs at once over the slowdown."""
        return {k: k / self.base / s for k, s in self.levels().items() if k != self.base}

    def same_cost(self, config: RunConfig) -> list[Timing]:
        """The runs of this device measured at ``config``'s cost (:func:`cost_key`)."""
        return self._by_cost.get(cost_key(config.to_dict()), [])

    def _times(self, config: RunConfig, packed: int) -> tuple[list[float], bool]:
        """The measured times of ``config``'s cost at ``packed`` (those at other packings converted by
        :meth:`slowdown`), and whether any exist."""
        same = self.same_cost(config)
        at = [t.seconds for t in same if t.level == packed]
        if at or not same:
            return at, bool(at)
        factor = self.slowdown(packed)
        return [t.seconds / self.slowdown(t.level) * factor for t in same], True

    def seconds(self, config: RunConfig, packed: int | None = None) -> float:
        """The expected wall time: the median of the same cost's measured times, else the fitted cost
        model, at ``packed`` runs at once (default: this estimator's)."""
        packed = packed or self.packed
        times, measured = self._times(config, packed)
        if measured:
            return statistics.median(times)
        return self.rates().seconds(config) * self.slowdown(packed)

    def needs(self, config: RunConfig, packed: int | None = None) -> float:
        """What a window must hold for the run to start: the longest measured time of its cost x
        :data:`MEASURED_MARGIN`, else the fitted model x :data:`SCALED_MARGIN` (the model alone while
        nothing is measured on this device)."""
        packed = packed or self.packed
        times, measured = self._times(config, packed)
        if measured:
            return max(times) * MEASURED_MARGIN
        return self.seconds(config, packed) * (SCALED_MARGIN if self.timings else 1.0)

    def source(self, config: RunConfig | None = None) -> str:
        """Where an estimate comes from, in words (of ``config``'s, or of this estimator's in general)."""
        if config is not None and self.same_cost(config):
            return f"measured: stored runs of the same size on {self.device}"
        if self.timings:
            return f"the cost model fitted to {self.measured} run(s) stored for {self.device}"
        side = "GPU" if self.gpu else "single-core"
        return f"the cost model ({side}; no run stored for {self.device} yet)"

    def describe(self) -> str:
        """This device's fitted rates and measured packings, in words."""
        if not self.timings:
            return self.source()
        gains = ", ".join(f"x {g:.1f} at {k}" for k, g in self.gains().items())
        packing = f"packing gains {gains}" if gains else "packing not measured (no gain assumed)"
        at = f" at {self.base} at once" if self.base > 1 else ""
        return f"{self.device}, {self.measured} run(s){at}: {self.rates().describe()}; {packing}"


# --- the window ------------------------------------------------------------------------------------------
POOL_START_S = 10.0  # a new worker process: spawn, import torch and addnorm (a loaded 2-core machine)
# The report at the end: findings, figures, the page, and per run of the plan its curves and profiles.
# Measured on the 2-core EPYC at a load of 6: 14 s for 48 runs (7 s CPU), 30 s for 195 (13 s CPU).
REPORT_BASE_S = 10.0
REPORT_S_PER_RUN = 0.2


def report_reserve(runs: int) -> float:
    """Seconds kept at the end of a budget for the report of a study of ``runs`` runs."""
    return REPORT_BASE_S + REPORT_S_PER_RUN * runs


class BudgetTooSmall(ValueError):
    """``--budget`` leaves no time for even the cheapest run still to train (nothing was started)."""


def process_age() -> float:
    """Seconds since this process started (Linux ``/proc``; 0 where it cannot be read)."""
    try:
        with open("/proc/self/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
        return max(0.0, uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return 0.0


def invocation_start(command: str = "study") -> float:
    """The ``time.monotonic()`` value at which this invocation began: the process's start where the
    process was started as this command (``addnorm study ...``, ``python -m addnorm study ...``: its
    imports count), else now (the command called inside a running process: a test, a notebook)."""
    if len(sys.argv) > 1 and sys.argv[1] == command:
        return time.monotonic() - process_age()
    return time.monotonic()


@dataclass
class Budget:
    """``seconds`` of wall-clock from ``started`` (a ``clock()`` value; default: the invocation's start on
    ``time.monotonic``, :func:`invocation_start`), of which :func:`report_reserve` is kept for the
    report."""

    seconds: float
    started: float = field(default_factory=invocation_start)
    clock: Callable[[], float] = time.monotonic

    def __post_init__(self) -> None:
        if isinstance(self.seconds, bool) or not (
            isinstance(self.seconds, (int, float)) and math.isfinite(self.seconds) and self.seconds > 0
        ):
            raise ValueError(f"--budget: expected a number of seconds > 0, got {self.seconds!r}")

    def left(self) -> float:
        """Seconds of the budget not yet spent."""
        return self.started + self.seconds - self.clock()

    def spent(self) -> float:
        return self.clock() - self.started


def window(runs: list, estimate, left: float, workers: int = 1, start_s: float = 0.0) -> tuple[list, float]:
    """Which of ``runs`` (in order) start in a window of ``left`` seconds on ``workers`` slots when each
    run starts at the earliest free slot and only if ``estimate(run)`` (plus ``start_s`` for a slot's
    first run) ends inside the window; a run that does not fit is passed over for the next. Returns (the
    runs that start, when the last of them is estimated to end). The runner decides the same way as
    runs finish, on measured time; ``--dry-run --budget`` shows this plan."""
    free = [0.0] * max(1, workers)
    used = [False] * len(free)
    chosen = []
    for run in runs:
        slot = min(range(len(free)), key=lambda i: free[i])
        end = free[slot] + estimate(run) + (0.0 if used[slot] else start_s)
        if end <= left:
            free[slot], used[slot] = end, True
            chosen.append(run)
    return chosen, max((f for f, u in zip(free, used, strict=True) if u), default=0.0)
