import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (dist.get_world_size(),))
dist.all_reduce(torch.ones(1000))
dist.destroy_process_group()
