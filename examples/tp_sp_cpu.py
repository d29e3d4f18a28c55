"""Tensor + sequence parallel training of an addnorm language model, on the CPU.

    torchrun --nproc-per-node 2 examples/tp_sp_cpu.py

Each rank holds its half of every attention head group, feed-forward matrix, embedding and head, and
between the sublayers its half of the sequence, where every Add & Norm runs on its own rows. Both
ranks feed the whole batch. Rank 0 then trains the same model on one process and prints the largest
difference between the two runs' losses (0 up to float32 rounding).
"""

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import addnorm as an

STEPS = 5


def build() -> an.LanguageModel:
    torch.manual_seed(0)  # the same model on every rank (parallelize keeps rank 0's weights anyway)
    cfg = an.TransformerConfig(
        d_model=64, n_heads=4, d_ff=256, n_layers=4, placement="pre", norm="rmsnorm", dropout=0.0, max_len=64
    )
    return an.LanguageModel(cfg, vocab=256)


def train(model: torch.nn.Module, data: torch.Tensor) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(STEPS):
        logits = model(data[:, :-1])  # (batch, seq, vocab): gathered from the head's vocabulary shards
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # "nccl" with one GPU per rank
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    data = torch.randint(0, 256, (8, 33), generator=torch.Generator().manual_seed(0))

    model = an.parallelize(build(), mesh, tp=True, sp=True)
    losses = train(model, data)
    if rank == 0:
        reference = train(build(), data)
        print("tensor+sequence parallel losses:", [f"{x:.6f}" for x in losses])
        print("one-process losses:             ", [f"{x:.6f}" for x in reference])
        worst = max(abs(a - b) for a, b in zip(losses, reference, strict=True))
        print(f"largest loss difference from one process: {worst:.3e}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
