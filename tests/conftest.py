import pytest
import torch
import torch._functorch.config
import torch._inductor.config

# No on-disk FX-graph / AOTAutograd cache in the tests: their keys miss a custom op's registered
# autograd (pytorch/pytorch#144344), so an entry compiled against an older add_norm_bwd could replay.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
