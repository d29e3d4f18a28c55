"""addnorm's converter under torchtitan's own parallelisms, 2 ``gloo`` processes against 1.

torchtitan's debug-size Llama 3 and Qwen 3, converted (fused; Llama 3 also re-placed, LayerScale and
sandwich), run 3 AdamW steps in one process (the oracle: the untouched model, or the re-placed one, with
no parallelism) and in two processes through torchtitan's ``parallelize_llama`` / ``parallelize_qwen3``
(FSDP2 with data parallel 2; tensor parallel 2 with sequence parallel; selective activation
checkpointing; ``torch.compile`` of each block with ``aot_eager``, Dynamo and AOTAutograd without a C++
compiler) and ``pipeline_llm`` (pipeline parallel 2): losses and final parameters must be the oracle's
within 1e-5. Every 2-process model starts from the oracle's initial weights through a distributed
checkpoint (DCP), and the converted FSDP2 model's final state is saved with DCP, loaded into an
untouched tensor-parallel model and back. Each fused Add & Norm call runs no collective
(``CommDebugMode`` around each call), 2L of them per forward, and a converted forward runs the untouched
one's collectives.

torchtitan 0.3 on torch 2.13 parallelises with its ``partial_dtensor`` backend (its default,
``spmd_types``, hands FSDP2 plain parameters that torch 2.13's ``fully_shard`` refuses). Its trainer wants a
GPU, so its model, parallelize, pipeline and checkpoint functions are driven directly: meshes on the CPU
(its ``ParallelDims`` asks for CUDA), causal SDPA for FlexAttention (:func:`addnorm.titan.on_cpu`), float32
parameters (its FSDP2 default is bfloat16), FSDP2 reducing by sum (gloo has no PREMUL_SUM), and the
pipeline schedule stepped through torch 2.13's API. All runs share one spawn of 2 processes.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import warnings

import pytest
import torch
from procs import run_jobs

from tools.procs import run_spawned

pytestmark = pytest.mark.slow  # spawned ranks

pytest.importorskip("torchtitan", reason="needs the torchtitan extra")

WORLD = 2
STEPS = 3
BATCH, SEQ = 2, 32
VOCAB = 2048
TOL = 1e-5
BACKEND = "partial_dtensor"
# name -> (family, placement (None: the family's own), parallelism, converted?): one 2-process run.
# "fsdp": data parallel 2 (FSDP2); "tp": tensor parallel 2 with sequence parallel; "-ac": selective
# activation checkpointing; "-compile": each block compiled (aot_eager, fullgraph as torchtitan asks);
# "pp": pipeline parallel 2 (torchtitan's pipeline_llm split and 1F1B schedule, 2 microbatches)
RUNS = {
    "llama3-untouched-tp": ("llama3", None, "tp", False),
    "llama3-fused-fsdp": ("llama3", None, "fsdp", True),
    "llama3-fused-tp": ("llama3", None, "tp", True),
    "llama3-layerscale-fsdp": ("llama3", "layerscale", "fsdp", True),
    "llama3-sandwich-tp": ("llama3", "sandwich", "tp", True),
    "llama3-fused-tp-ac": ("llama3", None, "tp-ac", True),
    "llama3-fused-tp-compile": ("llama3", None, "tp-compile", True),
    "llama3-fused-fsdp-ac-compile": ("llama3", None, "fsdp-ac-compile", True),
    "llama3-fused-pp": ("llama3", None, "pp", True),
    "qwen3-untouched-tp": ("qwen3", None, "tp", False),
    "qwen3-fused-fsdp": ("qwen3", None, "fsdp", True),
    "qwen3-fused-tp": ("qwen3", None, "tp", True),
}
# the debug models' first 3 layers (torchtitan's have 6 and 8): every check holds per layer or across
# blocks (2L fused calls, each block's collectives, the per-layer init), 3 keep layer 2 for the init test
N_LAYERS = {"llama3": 3, "qwen3": 3}


# --- shared by the oracle (this process) and the ranks ------------------------------------------------


def model_config(family: str, placement: str | None, converted: bool):
    from torchtitan.models.llama3 import model_registry as llama3
    from torchtitan.models.qwen3 import model_registry as qwen3

    from addnorm.titan import convert, on_cpu

    config = on_cpu({"llama3": llama3, "qwen3": qwen3}[family]("debugmodel").model)
    config.layers = config.layers[: N_LAYERS[family]]  # before convert: DeepNorm's gains read the depth
    return convert(config, placement) if converted else config


def checkpoint_path(folder: str, family: str, placement: str | None) -> str:
    """Where the oracle of (family, placement) saves its initial state with DCP."""
    return os.path.join(folder, f"{family}-{placement or 'own'}")


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
            torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        )
        for _ in range(STEPS)
    ]


def optimizer(params):
    """AdamW with eps 1e-5 (torchtitan's is 1e-8): Adam's step g / (|g| + eps) turns a float32 rounding
    difference of a gradient near zero (2 ranks sum in another order than 1; 2.5e-9 here) into up to
    lr * error / eps, with 1e-8 a fifth of a step (2e-5 seen), with 1e-5 below 1e-6, while an error in
    the gradients themselves still moves parameters by up to lr (1e-3)."""
    return torch.optim.AdamW(params, lr=1e-3, eps=1e-5, weight_decay=0.1, foreach=False)


def full_state(model) -> dict[str, torch.Tensor]:
    """The model's state dict with whole tensors (DTensors gathered)."""
    return {
        k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
        for k, v in model.state_dict().items()
    }


def single_process(family: str, placement: str | None, converted: bool, checkpoint: str | None = None):
    """(losses, final state, initial state) of 3 steps in this process, no parallelism; ``checkpoint``:
    save the initial state there with DCP."""
    import torch.distributed.checkpoint as dcp

    with torch.device("meta"):
        model = model_config(family, placement, converted).build()
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    initial = full_state(model)
    if checkpoint is not None:
        dcp.save(model.state_dict(), checkpoint_id=checkpoint)
    opt, losses = optimizer(model.parameters()), []
    for tokens, labels in batches():
        loss = torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1).float(), labels.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, full_state(model), initial


# --- what each rank runs ------------------------------------------------------------------------------


def _parallel_dims(how: str):
    import torchtitan.distributed.parallel_dims as parallel_dims_module
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    parallel_dims_module.device_type = "cpu"  # torchtitan builds its meshes on CUDA when it finds no GPU
    dist_utils.set_spmd_backend(BACKEND)
    degrees = {
        "tp": {"tensor_parallel_degree": WORLD},
        "pp": {"pipeline_parallel_degree": WORLD, "pipeline_parallel_schedule": "1F1B"},
    }.get(how.split("-")[0], {})
    parallelism = ParallelismConfig(spmd_backend=BACKEND, **degrees)
    dims = ParallelDims.from_config(parallelism, WORLD)
    dims.build_mesh()
    return dims, parallelism


def _loss(pred, labels):
    """The batch's mean token loss, as a sum over this rank's tokens (vocabulary-parallel where the
    logits are sharded) divided by all of them."""
    from torchtitan.components.loss import cross_entropy_loss

    return cross_entropy_loss(pred, labels, global_vocab_size=VOCAB) / (BATCH * SEQ)


def build_parallel(family: str, placement: str | None, converted: bool, how: str):
    """(the model parts on this rank, the pipeline schedule or None): the model parallelised by
    torchtitan's own functions (``pipeline_llm`` for "pp"), its states on the CPU, the rope caches
    initialised (the weights come from a checkpoint)."""
    from torchtitan.config import CompileConfig, TrainingConfig
    from torchtitan.distributed.activation_checkpoint import SelectiveAC
    from torchtitan.distributed.fsdp import FSDPModule
    from torchtitan.distributed.pipeline_parallel import pipeline_llm
    from torchtitan.models.llama3 import parallelize_llama
    from torchtitan.models.qwen3 import parallelize_qwen3

    dims, parallelism = _parallel_dims(how)
    config = model_config(family, placement, converted)

    class JobConfig:  # what update_from_config reads outside a trainer
        pass

    JobConfig.parallelism = parallelism
    config.update_from_config(config=JobConfig())
    with torch.device("meta"):
        model = config.build()
    ac, compiled = "-ac" in how, "compile" in how
    options = {
        "parallel_dims": dims,
        "training": TrainingConfig(mixed_precision_param="float32", local_batch_size=BATCH),
        "parallelism": parallelism,
        "compile_config": CompileConfig(enable=compiled, backend="aot_eager"),
        "ac_config": SelectiveAC.Config() if ac else None,
        "dump_folder": "",
    }
    parallelize = {"llama3": parallelize_llama, "qwen3": parallelize_qwen3}[family]
    schedule = None
    if how == "pp":
        schedule, parts, _, _ = pipeline_llm(
            model, device=torch.device("cpu"), model_config=config, parallelize_fn=parallelize,
            loss_fn=lambda pred, labels: (_loss(pred, labels), None), **options,
        )  # fmt: skip
    else:
        parts = [parallelize(model, **options)]
    for part in parts:
        for module in part.modules():
            if isinstance(module, FSDPModule):  # reduce by sum (gloo has no PREMUL_SUM)
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        part.to_empty(device="cpu")
        with torch.no_grad():
            part.init_weights(buffer_device=None)
    return parts, schedule


def load(model, checkpoint: str) -> None:
    """``model``'s state from a DCP checkpoint, as torchtitan's checkpointer loads it."""
    import torch.distributed.checkpoint as dcp

    state = model.state_dict()
    dcp.load(state, checkpoint_id=checkpoint)
    model.load_state_dict(state)


@contextlib.contextmanager
def counting_add_norm(record: list):
    """Each fused Add & Norm call of the connections, run under ``CommDebugMode``: its collectives."""
    from torch.distributed.tensor.debug import CommDebugMode

    import addnorm.connection as connection_module

    op = connection_module.add_norm

    def counted(*args, **kwargs):
        with CommDebugMode() as comm:
            out = op(*args, **kwargs)
        record.append(comm.get_total_counts())
        return out

    connection_module.add_norm = counted
    try:
        yield
    finally:
        connection_module.add_norm = op


def _by_name(counts: dict) -> dict[str, int]:
    """CommDebugMode's counts keyed by the collective's name (its op objects do not pickle)."""
    return {str(op): n for op, n in counts.items()}


def train_parallel(parts, schedule, how: str) -> dict:
    """3 steps of the batch's mean token loss: each data-parallel rank on its half, each pipeline stage
    through torchtitan's schedule (its loss summed over the microbatches; torch 2.13's ``step`` API).
    Counts the collectives of each fused call in the first step (not in a compiled block: CommDebugMode
    cannot be entered there, nor in a pipeline schedule's threads) and, by kind, of the second step's
    forward and of its forward and backward."""
    import torch.distributed as dist
    from torch.distributed.tensor.debug import CommDebugMode

    rank = dist.get_rank()
    count = not ("compile" in how or how == "pp")
    opt = optimizer([p for part in parts for p in part.parameters()])
    losses, fused_calls, comms = [], [], []
    for step, (tokens, labels) in enumerate(batches()):
        if how.startswith("fsdp"):
            tokens, labels = tokens.chunk(WORLD)[rank], labels.chunk(WORLD)[rank]
        if schedule is not None:
            stage_losses = []
            first, last = rank == 0, rank == WORLD - 1
            schedule.step(*([tokens] if first else []), target=labels if last else None, losses=stage_losses)
            loss = torch.stack(stage_losses).sum() if last else torch.zeros(())
        elif not count or step > 1:
            loss = _loss(parts[0](tokens), labels)
            loss.backward()
        elif step == 0:
            with counting_add_norm(fused_calls):
                loss = _loss(parts[0](tokens), labels)
            loss.backward()
        else:
            with CommDebugMode() as comm:
                loss = _loss(parts[0](tokens), labels)
                forward = _by_name(comm.get_comm_counts())
                loss.backward()
            comms.append((forward, _by_name(comm.get_comm_counts())))
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        if how.startswith("fsdp") or how == "pp":
            dist.all_reduce(total)
        losses.append(total.item())
    return {"losses": losses, "fused_calls": fused_calls, "collectives": comms[0] if comms else None}


def run(name: str, checkpoint: str, out_dir: str) -> dict:
    import torch.distributed as dist

    family, placement, how, converted = RUNS[name]
    parts, schedule = build_parallel(family, placement, converted, how)
    for part in parts:
        load(part, checkpoint_path(checkpoint, family, placement))
    result = train_parallel(parts, schedule, how)
    state = {k: v for part in parts for k, v in full_state(part).items()}
    if how == "pp":  # each stage holds its part of the model
        stages = [None] * WORLD
        dist.all_gather_object(stages, state)
        state = {k: v for stage in stages for k, v in stage.items()}
    result["state"] = state
    if name == "llama3-fused-fsdp":
        result.update(round_trip(parts[0], out_dir))
    return result


def round_trip(model, out_dir: str) -> dict:
    """The converted FSDP2 model's state saved with DCP, loaded into an untouched tensor-parallel model,
    saved again and loaded into a fresh converted FSDP2 model."""
    import torch.distributed.checkpoint as dcp

    first, second = os.path.join(out_dir, "converted"), os.path.join(out_dir, "untouched")
    dcp.save(model.state_dict(), checkpoint_id=first)
    (untouched,), _ = build_parallel("llama3", None, False, "tp")
    load(untouched, first)
    dcp.save(untouched.state_dict(), checkpoint_id=second)
    (converted,), _ = build_parallel("llama3", None, True, "fsdp")
    load(converted, second)
    return {"untouched_loaded": full_state(untouched), "converted_reloaded": full_state(converted)}


def sharded_init(how: str) -> dict[str, torch.Tensor]:
    """A DeepNorm Llama 3 initialised by torchtitan's ``init_weights`` after ``parallelize`` (its
    matrices sharded), gathered."""
    (model,), _ = build_parallel("llama3", "deepnorm", True, how)
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    return full_state(model)


def _worker(rank: int, port: int, names: list[str], checkpoint: str, out: str) -> None:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    jobs = {
        name: (lambda n=name: run(n, checkpoint, os.path.join(os.path.dirname(out), n))) for name in names
    }
    jobs.update({f"deepnorm-init-{how}": (lambda h=how: sharded_init(h)) for how in ("fsdp", "tp")})
    run_jobs(jobs, rank, out)
    dist.destroy_process_group()


# --- the tests ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def runs():
    """(the 2-process results by run, the one-process oracles by (family, placement))."""
    with tempfile.TemporaryDirectory() as tmp:
        oracles = {}
        for family, placement in {(f, p) for f, p, _, _ in RUNS.values()}:
            path = checkpoint_path(tmp, family, placement)
            oracles[family, placement] = single_process(family, placement, placement is not None, path)
        out = os.path.join(tmp, "results.pt")
        run_spawned(_worker, list(RUNS), tmp, out, nprocs=WORLD, deadline=900.0)
        yield torch.load(out, weights_only=False), oracles


def _got(results, name):
    got = results[name]
    assert not isinstance(got, str), f"{name}: {got}"
    return got


def _max_difference(a: dict, b: dict) -> float:
    assert list(a) == list(b)
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("name", list(RUNS))
def test_two_processes_train_as_one(runs, name):
    """Losses and final parameters of 3 steps on 2 processes: the one-process run's within 1e-5."""
    results, oracles = runs
    got = _got(results, name)
    family, placement, _, _ = RUNS[name]
    losses, state, _ = oracles[family, placement]
    assert got["losses"] == pytest.approx(losses, abs=TOL, rel=0)
    assert _max_difference(got["state"], state) <= TOL


COUNTED = [n for n, (_, _, how, c) in RUNS.items() if c and "compile" not in how and how != "pp"]


@pytest.mark.parametrize("name", COUNTED)
def test_every_add_and_norm_is_one_fused_call_without_collectives(runs, name):
    """2L fused calls per forward (each add meets the next norm, across blocks, into the final norm),
    under FSDP2 as under tensor parallel, and none of them communicates: under sequence parallel each
    runs on its rank's rows (addnorm's DTensor rules), so no Add & Norm gathers."""
    got = _got(runs[0], name)
    assert got["fused_calls"] == [0] * (2 * N_LAYERS[RUNS[name][0]])


@pytest.mark.parametrize("family", ["llama3", "qwen3"])
def test_a_converted_model_communicates_what_the_untouched_one_does(runs, family):
    """Under TP + SP, forward and backward: the same collectives, kind by kind (the sublayers' gathers
    and reduce-scatters, the loss's all-reduces), none added by an Add & Norm."""
    results = runs[0]
    untouched = _got(results, f"{family}-untouched-tp")["collectives"]
    assert sum(untouched[0].values()) > 0
    assert _got(results, f"{family}-fused-tp")["collectives"] == untouched


def test_a_converted_checkpoint_loads_into_an_untouched_model_and_back(runs):
    """DCP: the converted FSDP2 model's final state into an untouched tensor-parallel model (another
    sharding), saved again, into a fresh converted FSDP2 model: the same tensors each time (every run
    above also started from the untouched one-process model's checkpoint)."""
    got = _got(runs[0], "llama3-fused-fsdp")
    assert _max_difference(got["untouched_loaded"], got["state"]) == 0.0
    assert _max_difference(got["converted_reloaded"], got["state"]) == 0.0


@pytest.mark.parametrize("how", ["fsdp", "tp"])
def test_deepnorm_initialises_sharded_matrices_with_deepnets_gains(runs, how):
    """torchtitan's init_weights on a DeepNorm model already sharded by FSDP2 or TP (the fused wqkv drawn
    per q/k/v part, then laid out into each rank's shard): each role's std is Xavier's times its gain."""
    state = _got(runs[0], f"deepnorm-init-{how}")
    beta = (8 * N_LAYERS["llama3"]) ** -0.25
    for name, gain in [("wq", 1.0), ("wk", 1.0), ("wv", beta)]:
        w = state[f"layers.2.attention.qkv_linear.{name}.weight"]
        assert w.std().item() == pytest.approx(gain * (2.0 / sum(w.shape)) ** 0.5, rel=0.03), name
    w = state["layers.2.feed_forward.w2.weight"]
    assert w.std().item() == pytest.approx(beta * (2.0 / sum(w.shape)) ** 0.5, rel=0.03)
