"""What a machine can run, checked when a study is planned (``addnorm study``, ``--dry-run`` too),
before anything trains: each run's peak memory against the memory it may have, and evaluation
settings against what the task's held-out data holds. A refusal is one line naming the run, its
settings and the numbers (exit code 2), so a study never eats the machine or reads one byte a million
times before it fails.

**Memory** (:func:`estimate_memory`): the peak of one training run, in bytes, from its settings
alone (no model is built):

- the process: Python, torch and addnorm (and transformers for ``hf-*`` models), :data:`PROCESS_BYTES`;
- the corpus, as bytes;
- 20 bytes per parameter: the fp32 weights, their gradients, AdamW's two moments, and the copy of the
  weights a probed step takes to measure each update;
- one step's activations (what autograd keeps for the backward), per layer
  ``a·B·T·d + b·B·T·F + c·B·H·T²`` floats plus ``4·B·T·V + 4·B·T·d`` for the embedding and the
  head, B batch, T sequence, d width, F the FFN's width, H heads, V the vocabulary. The coefficients
  (:func:`activation_coefficients`) are upper bounds of what ``saved_tensors_hooks`` counted on
  addnorm's models (every placement, ReLU/GELU/SwiGLU, dropout, the encoder-decoder tasks) and the
  Hugging Face families: ``c`` is 0 where attention runs fused (no T² matrix kept) and counts the
  attention weights where it does not (attention dropout on the CPU, Gemma's eager attention); the
  backward's gradients add two layers' worth and the logits' gradient;
- times :data:`SAFETY` on the activations.

``benchmarks/study/memory_estimate.py`` checks it against the measured peak resident memory of
real runs (``benchmarks/results/cpu/2026-11-25-b9179c0/memory_estimate_cpu.md``): the estimate is above every
measured peak. On CUDA the same count is made in fp32 (bf16 autocast keeps many activations in half the bytes,
so it errs high there), with a CUDA context instead of the host process; it has not been checked
against a GPU's measured peak.

**The limit** (:func:`memory_limit`): on the CPU the memory available now (``MemAvailable``, or the
cgroup's limit less its use when lower) shared by the runs that train at once (the workers); on CUDA
the GPU's free memory shared the same way. ``--memory-limit SIZE`` (or ``ADDNORM_MEMORY_LIMIT``) sets
the memory per run instead, ``off`` skips the check. Runs on a Ray cluster are not checked here (its
nodes are not known when planning; Ray's own memory monitor stops a task that outgrows its node).

**Evaluation** (:func:`check_eval`): a language-modelling run's held-out split is 10% of its corpus;
``eval_batches`` that read more than :data:`EVAL_PASSES` times that many tokens per evaluation are
refused: windows drawn at random have by then covered every byte (all but e^-10 of them), so more
batches only repeat what was read and cost time.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from ..model.feedforward import GATED_ACTIVATIONS
from ..tasks import TASKS
from ..tasks.algorithmic import FIRST_SYMBOL
from ..tasks.corpus import HELD_OUT
from ..train import RunConfig
from .spec import PlannedRun, SpecError

GIB = 2**30
PROCESS_BYTES = 512 * 2**20  # Python + torch + addnorm imported: ~270 MiB resident measured
HF_PROCESS_BYTES = 1024 * 2**20  # with transformers and a model family's modules imported
CUDA_CONTEXT_BYTES = 1024 * 2**20  # a CUDA context and its kernels' workspace on the device
BYTES_PER_PARAMETER = 4 * (1 + 1 + 2 + 1)  # fp32 weight, gradient, AdamW's two moments, probed-step copy
SAFETY = 1.25  # on the activations: allocator slack and transients the coefficients leave out
EVAL_PASSES = 10  # eval tokens per evaluation at most this many times the held-out split
ENV = "ADDNORM_MEMORY_LIMIT"


@dataclass(frozen=True)
class MemoryEstimate:
    """One run's estimated peak memory in bytes, by part (see the module docstring)."""

    parameters: int
    state: int  # weights, gradients, optimizer state, probe copy
    activations: int
    process: int
    data: int

    @property
    def total(self) -> int:
        return self.state + self.activations + self.process + self.data

    def describe(self) -> str:
        return (
            f"{fmt_bytes(self.total)} ({self.parameters:,} parameters: {fmt_bytes(self.state)} with "
            f"gradients and optimizer state; activations {fmt_bytes(self.activations)}; process and "
            f"data {fmt_bytes(self.process + self.data)})"
        )


def fmt_bytes(n: float) -> str:
    for unit, scale in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def parse_size(text: str, what: str = "--memory-limit") -> int | None:
    """A size such as ``8G``, ``512MiB``, ``1.5GB`` or a number of bytes (binary units: G = GiB);
    ``off`` (or ``none``) is None: no check."""
    value = str(text).strip().lower()
    if value in ("off", "none", "no"):
        return None
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?", value)
    if not match:
        raise ValueError(
            f"{what}: expected a size such as 8G, 512M or a number of bytes, or off; got {text!r}"
        )
    number = float(match[1]) * 1024 ** " kmgt".index(match[2] or " ")
    if number < 1:
        raise ValueError(f"{what}: expected a positive size, got {text!r}")
    return int(number)


def parameter_count(cfg: RunConfig) -> int:
    """The run's model's parameters, counted from its sizes (an upper bound of ``sum(p.numel())``:
    the matrices exactly, norms, biases and gates generously)."""
    m = cfg.model
    d, f, vocab = m.d_model, m.d_ff, _vocab(cfg)
    small = 16 * d + 2 * f  # biases, up to three norms, gates, per-head query/key norms
    if cfg.arch != "addnorm":
        head_dim = d // m.n_heads
        kv = (cfg.kv_heads or m.n_heads) * head_dim
        ffn = 2 * d * f if cfg.arch == "hf-gpt2" else 3 * d * f
        layer = 2 * d * d + 2 * d * kv + ffn + small
        return m.n_layers * layer + 2 * vocab * d + max(cfg.seq_len, 16) * d + 4 * d
    ffn = (3 if m.activation in GATED_ACTIVATIONS else 2) * d * f
    self_attn = 4 * d * d + ffn + small
    embed = vocab * d + (m.max_len * d if m.positional == "learned" else 0)
    if cfg.task == "lm":
        return m.n_layers * self_attn + embed + vocab * d + 4 * d
    cross = 4 * d * d + 8 * d
    return (
        m.encoder_layers * self_attn + m.decoder_layers * (self_attn + cross) + 2 * embed + vocab * d + 8 * d
    )


def activation_coefficients(cfg: RunConfig, cuda: bool = False) -> tuple[float, float, float]:
    """(a, b, c): floats kept per layer per B·T·d, per B·T·F and per B·H·T² (see the module
    docstring); for an encoder-decoder task, per encoder + decoder layer pair."""
    m = cfg.model
    hf = cfg.arch != "addnorm"
    attn_dropout, act_dropout = m.attn_dropout, m.act_dropout
    a = 24.0 if _placement_names(m.placement) & {"ngpt"} else 16.0
    b = 5.5 if hf else 4.5 if m.activation in GATED_ACTIVATIONS else 1.5 if m.activation == "relu" else 2.5
    b += 2.0 if act_dropout > 0 and not hf else 0.0
    c = 3.0 if attn_dropout > 0 and not cuda else 0.0  # the math path keeps the attention weights
    if cfg.arch in ("hf-gemma2", "hf-gemma3"):
        c += 2.0  # eager attention (logit soft-capping) keeps them always
    if cfg.task != "lm" and not hf:
        a, b, c = 2 * a, 2 * b, 3 * c  # encoder and decoder layer; self- and cross-attention
    return a, b, c


def estimate_memory(cfg: RunConfig, cuda: bool = False) -> MemoryEstimate:
    """The run's estimated peak memory (see the module docstring); ``cuda``: of a run on a GPU, on
    that GPU (its process and corpus stay on the host, and are not counted)."""
    m = cfg.model
    params = parameter_count(cfg)
    a, b, c = activation_coefficients(cfg, cuda)
    bt = cfg.batch_size * cfg.seq_len
    per_layer = a * bt * m.d_model + b * bt * m.d_ff + c * cfg.batch_size * m.n_heads * cfg.seq_len**2
    layers = (
        m.n_layers if cfg.task == "lm" or cfg.arch != "addnorm" else max(m.encoder_layers, m.decoder_layers)
    )
    head = 4 * bt * _vocab(cfg) + 4 * bt * m.d_model
    floats = (layers + 2) * per_layer + 2 * head  # + the backward's gradients in flight
    activations = int(4 * floats * SAFETY)
    if cuda:
        return MemoryEstimate(params, BYTES_PER_PARAMETER * params, activations, CUDA_CONTEXT_BYTES, 0)
    process = PROCESS_BYTES if cfg.arch == "addnorm" else HF_PROCESS_BYTES
    data = 2 * cfg.corpus_bytes if cfg.task == "lm" else 0
    return MemoryEstimate(params, BYTES_PER_PARAMETER * params, activations, process, data)


def available_memory() -> int | None:
    """Bytes this process could still allocate on the host: ``MemAvailable``, or the cgroup's limit
    less its use when that is lower; None where neither can be read."""
    found = []
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    found.append(int(line.split()[1]) * 1024)
    except (OSError, ValueError, IndexError):
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            if limit != "max" and int(limit) < 2**60:
                found.append(int(limit) - int(Path(usage_file).read_text().strip()))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def memory_limit(workers: int, cuda: bool, override: str | None = None) -> tuple[int | None, str]:
    """(bytes one run may use, that limit in words); None: no check. ``override`` (default
    ``$ADDNORM_MEMORY_LIMIT``): a size per run (:func:`parse_size`) or ``off``."""
    if override is None:
        override = os.environ.get(ENV)
    if override is not None:
        size = parse_size(override)
        return size, f"{fmt_bytes(size or 0)} (set by --memory-limit or {ENV})"
    if cuda:
        import torch

        total, where = torch.cuda.mem_get_info()[0], "free on the GPU"
    else:
        total, where = available_memory(), "available"
        if total is None:
            return None, "unknown"
    if workers > 1:
        share = total // workers
        return (
            share,
            f"{fmt_bytes(share)}, each of {workers} workers' share of the {fmt_bytes(total)} {where}",
        )
    return total, f"the {fmt_bytes(total)} {where}"


def check_memory(
    runs: Iterable[PlannedRun],
    workers: int,
    cuda: bool = False,
    override: str | None = None,
    need: Callable[[RunConfig], tuple[int, str]] | None = None,
):
    """Refuse (:class:`SpecError`, one line) when a run's estimated peak memory is above
    :func:`memory_limit`; the line names the largest such run, its size settings, the estimate and the
    limit, and how many more runs are over it. ``need(config)``: (bytes, how they were found) instead of
    :func:`estimate_memory` (on a GPU, what runs of this GPU measured: :func:`~.packing.memory_need`)."""
    runs = list(runs)
    if not runs:
        return
    limit, words = memory_limit(workers, cuda, override)
    if limit is None:
        return
    # a run on N processes (distributed): on the CPU N copies share the worker's memory; on CUDA
    # each process has a GPU of its own
    copies = lambda run: 1 if cuda or not run.config.distributed else run.config.distributed["nproc"]  # noqa: E731

    def bytes_of(run: PlannedRun) -> tuple[int, str]:
        if need is not None:
            return need(run.config)
        estimate = estimate_memory(run.config, cuda)
        return estimate.total, estimate.describe()

    sizes = [(bytes_of(r), r) for r in runs]
    over = sorted(
        ((b, r) for b, r in sizes if b[0] * copies(r) > limit), key=lambda x: -x[0][0] * copies(x[1])
    )
    if not over:
        return
    (total, described), run = over[0]
    if need is not None:
        described = f"{fmt_bytes(total)} ({described})"
    m = run.config.model
    settings = f"d_model={m.d_model}, d_ff={m.d_ff}, n_layers={m.n_layers}, "
    settings += f"batch_size={run.config.batch_size}, seq_len={run.config.seq_len}"
    each = f" in each of its {copies(run)} processes" if copies(run) > 1 else ""
    more = f"; {len(over) - 1} more run(s) too" if len(over) > 1 else ""
    fewer = "use fewer --workers, " if workers > 1 else ""
    raise SpecError(
        f"memory: experiments.{run.experiment} ({run.label}; {settings}) needs about {described}"
        f"{each}, more than {words}{more}. Make it smaller, {fewer}or pass --memory-limit SIZE|off if "
        "you know better"
    )


def check_eval(runs: Iterable[PlannedRun]) -> None:
    """Refuse (:class:`SpecError`) a language-modelling run whose ``eval_batches`` read more than
    :data:`EVAL_PASSES` times its held-out split per evaluation (see the module docstring)."""
    for run in runs:
        cfg = run.config
        if cfg.task != "lm":
            continue
        held_out = int(HELD_OUT * _corpus_size(cfg))
        tokens = max(cfg.eval_batches, 1) * cfg.batch_size * cfg.seq_len
        if tokens > EVAL_PASSES * held_out:
            most = max(1, EVAL_PASSES * held_out // (cfg.batch_size * cfg.seq_len))
            raise SpecError(
                f"eval_batches: experiments.{run.experiment} ({run.label}) evaluates {cfg.eval_batches:,} "
                f"batches x {cfg.batch_size} x {cfg.seq_len} = {tokens:,} tokens, {tokens / held_out:,.0f} "
                f"times its held-out split ({held_out:,} bytes, {HELD_OUT:.0%} of the corpus); beyond "
                f"{EVAL_PASSES} times every byte has been read, more batches only repeat it: at most {most}"
            )


def check_plan(
    runs: Iterable[PlannedRun],
    workers: int,
    cuda: bool = False,
    memory: str | None = None,
    need: Callable[[RunConfig], tuple[int, str]] | None = None,
) -> None:
    """Every plan-time check of this module (evaluation, then memory) on the runs still to train."""
    runs = list(runs)
    check_eval(runs)
    check_memory(runs, workers, cuda, memory, need)


def _vocab(cfg: RunConfig) -> int:
    return TASKS["lm"].vocab if cfg.task == "lm" else cfg.symbols + FIRST_SYMBOL


def _placement_names(placement) -> set[str]:
    names = placement if isinstance(placement, (list, tuple)) else [placement]
    return {getattr(p, "name", p) for p in names}


def _corpus_size(cfg: RunConfig) -> int:
    """Bytes the run's corpus gives: at most ``corpus_bytes``; for a path, its size (not read). The
    standard library corpus holds more than the default ``corpus_bytes``."""
    if cfg.corpus is None:
        return cfg.corpus_bytes
    path = Path(cfg.corpus)
    try:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        size = sum(p.stat().st_size for p in files)
    except OSError:
        size = 0
    return min(size, cfg.corpus_bytes) if size else cfg.corpus_bytes  # a missing one: the run says so


__all__ = [
    "MemoryEstimate",
    "activation_coefficients",
    "available_memory",
    "check_eval",
    "check_memory",
    "check_plan",
    "estimate_memory",
    "memory_limit",
    "parameter_count",
    "parse_size",
]
