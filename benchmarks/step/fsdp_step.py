"""A Hugging Face Llama's training step under FSDP2 (``fully_shard`` per layer and root), untouched vs
``addnorm.hf.fuse`` (fused after sharding): first that the fused model trains like the untouched one
(losses of 3 AdamW steps from the same weights), then tokens/s, variants interleaved step by step.

GPU (``--gpu``): world size 1 on ``nccl`` (the Triton op runs), bf16 ``MixedPrecisionPolicy`` (params
bf16, gradient reduction float32), the 134M Llama of ``benchmarks/step/hf_step.py`` (hidden 768, 12 layers,
batch 8 x seq 1024). Writes ``fsdp_step_gpu.{md,json}``. Under ``torchrun --nproc-per-node N`` it uses
the N processes it is given (rank 0 writes).

CPU (default, a dry run of the same code): world size 1 on ``gloo``, float32, a small Llama. Writes
``fsdp_step_cpu.{md,json}``.

    python -m benchmarks.step.fsdp_step [--gpu] [--reps 10] [--out benchmarks/results]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

import addnorm.hf as anhf
from benchmarks.common.machine import machine_info, machine_line, write_results
from benchmarks.common.results_path import add_out_argument
from benchmarks.common.timing import interleaved
from tools.procs import free_port

SIZES = {
    "gpu": {
        "hidden": 768,
        "layers": 12,
        "heads": 12,
        "intermediate": 2048,
        "vocab": 32000,
        "batch": 8,
        "seq": 1024,
    },
    "cpu": {
        "hidden": 128,
        "layers": 4,
        "heads": 4,
        "intermediate": 344,
        "vocab": 1024,
        "batch": 4,
        "seq": 64,
    },
}
STEPS_CHECKED = 3


def _init(gpu: bool) -> None:
    if "RANK" not in os.environ:  # not under torchrun: one process of its own
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if gpu else "gloo")
    if gpu:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))


def build(fused: bool, size: dict, gpu: bool) -> torch.nn.Module:
    """The same random Llama (seed 0), sharded per layer and root, then fused or not."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    model = anhf.tiny_model(
        "llama",
        seed=0,
        hidden=size["hidden"],
        layers=size["layers"],
        heads=size["heads"],
        intermediate=size["intermediate"],
        vocab=size["vocab"],
        dropout=0.0,
    )
    if gpu:
        model = model.cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if gpu else None
    kw = {"mp_policy": policy} if policy else {}
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return anhf.fuse(model) if fused else model.train()


def stepper(model: torch.nn.Module, ids: torch.Tensor, gpu: bool):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step() -> float:
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    def timed() -> float:
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()  # reads the loss: the device is done with the step when it returns
        return time.perf_counter() - t0

    return step, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true")
    parser.add_argument("--reps", type=int, default=10)
    add_out_argument(parser)
    args = parser.parse_args()
    torch.set_num_threads(1)
    _init(args.gpu)
    kind = "gpu" if args.gpu else "cpu"
    size = SIZES[kind]
    ids = torch.randint(
        3, size["vocab"], (size["batch"], size["seq"]), generator=torch.Generator().manual_seed(0)
    )
    if args.gpu:
        ids = ids.cuda()
    variants = {
        name: stepper(build(name == "fused", size, args.gpu), ids, args.gpu) for name in ("plain", "fused")
    }
    losses = {name: [step() for _ in range(STEPS_CHECKED)] for name, (step, _) in variants.items()}
    diff = max(abs(a - b) for a, b in zip(losses["plain"], losses["fused"], strict=True))
    wall, _ = interleaved({name: timed for name, (_, timed) in variants.items()}, args.reps, warmup=2)
    tokens = size["batch"] * size["seq"] * dist.get_world_size()
    rate = {name: tokens / statistics.median(times) for name, times in wall.items()}
    if dist.get_rank() == 0:
        m = machine_info("cuda" if args.gpu else "cpu")
        md = (
            f"# FSDP2 training step, {kind}: untouched vs fused (world size {dist.get_world_size()})\n\n"
            f"{machine_line(m)}\n\nLosses of {STEPS_CHECKED} steps, max |fused - untouched|: {diff:.3g}\n\n"
            "| variant | tokens/s | vs untouched |\n| --- | --- | --- |\n"
            + "".join(f"| {n} | {r:,.0f} | {r / rate['plain']:.3f}x |\n" for n, r in rate.items())
        )
        print(md)
        payload = {"machine": m, "size": size, "losses": losses, "max_loss_diff": diff, "tokens_per_s": rate}
        write_results(args.out, f"fsdp_step_{kind}", md, payload)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
