"""What a run costs in seconds, and a study in a time window (``addnorm study --budget SECONDS``).

**The cost model** (:func:`estimate_seconds`): seconds per run = its work in training steps
(:func:`run_work`: its steps and its held-out batches) x the seconds of one step, plus a start cost on a
GPU. On the CPU a step is per-layer host time plus training FLOPs at a FLOP rate, both fitted on a 2-core
AMD EPYC with one torch thread per run. On a GPU the host queues kernels while the device computes, so a
step takes the longer of the two: host time per layer measured on an H100's host (a 4-layer LM step,
AdamW included, took 8.2 ms: ``benchmarks/results/host_overhead_cuda.md``), and the FLOPs at the share
of the H100's dense bf16 peak measured eager (``benchmarks/results/``): 25% for addnorm's LM at d_model
1024 (``lm_step_cuda.md``), 9.5% for a Hugging Face family (Llama at hidden 768, ``hf_step_gpu.md``).
Models of d_model 512 at 8k tokens a step are host-bound there or nearly.

**What was measured wins** (:class:`Estimator`): the runs already stored for *this device* (the run's
``provenance.device``, a CPU model or a GPU name) are the estimate for the runs still to train: a stored
run of the same cost (:func:`cost_key`: every setting but the seed, learning rate, schedule, warmup,
initialisation) gives its measured time (the longest of them, times :data:`MEASURED_MARGIN`); otherwise
the cost model is scaled by the median measured / modelled ratio of this device's runs (times
:data:`SCALED_MARGIN`); with no run of this device stored, the cost model alone. Runs finished during an
invocation join the history at once, so the first run on a new GPU calibrates the rest of its window. Only
runs that trained every step count (a diverged run stopped early; a failed one is no measurement).

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


def estimate_seconds(config: RunConfig, gpu: bool = False) -> float:
    """The cost model's wall time of one run on one core (see :data:`FLOPS_PER_S`) or on one GPU
    (``gpu``: the longer of host and device time per step, see :data:`GPU_FLOPS_PER_S`)."""
    layers = (
        config.model.n_layers
        if config.task == "lm"
        else config.model.encoder_layers + config.model.decoder_layers
    )
    if gpu:
        rate = GPU_FLOPS_PER_S if config.arch == "addnorm" else H100_BF16_PEAK * GPU_EFFICIENCY_HF
        per_step = max(GPU_HOST_S_PER_LAYER_STEP * layers, run_flops(config) / rate)
    else:
        per_step = HOST_S_PER_LAYER_STEP * layers + run_flops(config) / FLOPS_PER_S
    return per_step * run_work(config) + (GPU_START_S if gpu else 0.0)


def fmt_time(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


# --- what was measured ---------------------------------------------------------------------------------
# Settings that change what a run learns but not what it costs.
COST_FREE = ("seed", "lr", "warmup", "schedule", "init", "hf_init", "weight_decay", "grad_clip")
MEASURED_MARGIN = 1.1  # on the longest stored run of the same cost
SCALED_MARGIN = 1.25  # on the cost model scaled by this device's median measured / modelled ratio


def cost_key(config: dict) -> str:
    """The settings that decide a run's cost (all but :data:`COST_FREE`), as one comparable string."""
    return repr(sorted((k, repr(v)) for k, v in config.items() if k not in COST_FREE))


@dataclass
class Timing:
    """A stored run as a measurement: its config, the device it trained on, its wall time, and whether it
    trained every step (``complete``: done, not diverged or failed)."""

    config: dict
    device: str
    seconds: float
    complete: bool


class Estimator:
    """Seconds a run will take on ``device`` (see the module docstring): from the complete runs of
    ``history`` measured on ``device``, else the cost model (``gpu``: its GPU side)."""

    def __init__(self, device: str, gpu: bool, history: Iterable[Timing] = ()) -> None:
        self.device, self.gpu = device, gpu
        self.same: dict[str, list[float]] = {}
        self.ratios: list[float] = []
        for timing in history:
            self.add(timing)

    def add(self, timing: Timing) -> None:
        """One more measurement (ignored unless complete, on this device and with a positive time)."""
        if not timing.complete or timing.device != self.device or not timing.seconds > 0:
            return
        try:
            modelled = estimate_seconds(RunConfig(**timing.config), self.gpu)
        except (TypeError, ValueError):  # a config of another version of the settings
            return
        self.same.setdefault(cost_key(timing.config), []).append(timing.seconds)
        self.ratios.append(timing.seconds / modelled)

    @property
    def measured(self) -> int:
        """How many runs of this device the estimates rest on."""
        return len(self.ratios)

    def seconds(self, config: RunConfig) -> float:
        same = self.same.get(cost_key(config.to_dict()))
        if same:
            return max(same) * MEASURED_MARGIN
        modelled = estimate_seconds(config, self.gpu)
        if self.ratios:
            return modelled * statistics.median(self.ratios) * SCALED_MARGIN
        return modelled

    def source(self, config: RunConfig | None = None) -> str:
        """Where an estimate comes from, in words (of ``config``'s, or of this estimator's in general)."""
        if config is not None and self.same.get(cost_key(config.to_dict())):
            return f"measured: stored runs of the same size on {self.device}"
        if self.ratios:
            return f"the cost model scaled by {self.measured} run(s) stored for {self.device}"
        side = "GPU" if self.gpu else "single-core"
        return f"the cost model ({side}; no run stored for {self.device} yet)"


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
