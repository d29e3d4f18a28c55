"""Host-drawn dropout seeds (``addnorm.ops.seeds``): the value is SplitMix64's finaliser of the
generator's (seed, offset), the offset advances as one random op's would, restoring the generator's
state gives the same seed, a graph capture or ``set_seed_source("randint")`` falls back to a launched
``randint``; and the kernels given that seed as a value compute what they compute given it in a tensor,
forward and backward, bit for bit (Triton's CPU interpreter: the plan's path with a stand-in for the
CUDA generator)."""

from __future__ import annotations

import pytest
import torch

from addnorm.ops import functional, seeds
from benchmarks.host.fake_launch import FakePhilox


class Philox(FakePhilox):
    """The benchmarks' stand-in for a CUDA generator (its offsets refused unless multiples of 4, as
    CUDA's are), and whether a graph is being captured."""

    capturing = False


@pytest.fixture
def philox(monkeypatch):
    """The seeds of every device from a :class:`Philox` (seed 123, offset 40), no graph capturing
    unless the test says so (``philox.capturing``)."""
    gen = Philox(123, 40)
    monkeypatch.setattr(seeds, "generator_for", lambda device: gen)
    monkeypatch.setattr(seeds, "capture_check_for", lambda device: lambda: gen.capturing)
    functional.clear_plans()  # plans hold their seeder
    yield gen
    monkeypatch.undo()
    functional.clear_plans()


def test_mix_is_splitmix64s_published_sequence_kept_to_a_64_bit_argument():
    # SplitMix64 from state 0 (Steele, Lea and Flood 2014; Vigna's reference splitmix64.c) outputs
    # 0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, ...: the finaliser of k * 0x9E3779B97F4A7C15, k = 1, 2
    published = [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    for k, value in enumerate(published, start=1):
        assert seeds.mix(0, k) == (value & (2**61 - 1)) | 2**61
    drawn = [seeds.mix(s, o) for s in (0, 1, 2**63 - 1) for o in range(0, 4000, 4)]
    assert len(set(drawn)) == len(drawn)
    assert all(2**61 <= v < 2**62 for v in drawn)  # Triton passes it as an i64, never i32 or u64


def test_a_draw_advances_the_offset_and_a_restored_state_draws_it_again(philox):
    draw = seeds.seeder_for(torch.device("cpu"))
    first = draw()
    assert first == seeds.mix(123, 40) and philox.offset == 44
    assert draw() == seeds.mix(123, 44) and philox.offset == 48
    philox.offset = 40  # set_rng_state, or activation checkpointing's recomputation
    assert draw() == first


def test_randint_source_and_graph_capture_draw_no_host_seed(philox):
    draw = seeds.seeder_for(torch.device("cpu"))
    philox.capturing = True
    assert draw() is None and philox.offset == 40  # the capture's randint draws: the graph replays it
    philox.capturing = False
    previous = seeds.SEED_SOURCE
    with seeds.seed_source("randint"):
        assert draw() is None and philox.offset == 40
    assert seeds.SEED_SOURCE == previous and draw() is not None and philox.offset == 44
    with pytest.raises(ValueError, match="source: expected one of"):
        seeds.set_seed_source("numpy")
    with pytest.raises(ValueError, match="source: expected one of"), seeds.seed_source("numpy"):
        pass
    assert seeds.SEED_SOURCE == previous


def test_no_generator_no_seeder():
    assert seeds.seeder_for(torch.device("cpu")) is None  # the CPU draws with randint (or nn.Dropout)


@pytest.mark.triton
@pytest.mark.parametrize("prenorm", [False, True])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_kernels_given_the_seed_as_a_value_equal_them_given_a_tensor(triton_backend, philox, prenorm, norm):
    from addnorm.ops import add_norm

    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(2, 5, 40, generator=g, requires_grad=True) for _ in range(2))
    w, b = (torch.randn(40, generator=g, requires_grad=True) for _ in range(2))
    kw = dict(norm=norm, prenorm=prenorm, dropout_p=0.3, backend="triton")
    expected_seed = seeds.mix(123, 40)
    outs = []
    for seed in (None, expected_seed):  # drawn on the host (an int to the kernels), then given
        out = add_norm(x, r, w, b, seed=seed, **kw)
        out = list(out) if prenorm else [out]
        grads = torch.autograd.grad([o.square().sum() for o in out], [x, r, w, b])
        outs.append([o.detach() for o in out] + list(grads))
    assert philox.offset == 44  # one draw: the given seed drew none
    for a, c in zip(*outs, strict=True):
        assert torch.equal(a, c)
    dropped = (outs[0][-4] == 0).float().mean()  # dx: zero where dropped
    assert 0.15 < dropped < 0.45


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_seed_follows_the_cuda_generator_and_a_captured_graph_draws_anew():
    from addnorm.ops import add_norm

    g = torch.Generator(device="cuda").manual_seed(0)
    x, r = (torch.randn(64, 256, device="cuda", generator=g) for _ in range(2))
    w = torch.ones(256, device="cuda")
    functional.clear_plans()
    torch.cuda.manual_seed(5)
    state = torch.cuda.get_rng_state()
    offset = torch.cuda.default_generators[torch.cuda.current_device()].get_offset()

    def call(**kw):
        return add_norm(x, r, w, dropout_p=0.5, backend="triton", **kw)

    first, second = call(), call()
    torch.cuda.set_rng_state(state)  # what activation checkpointing does before recomputing
    assert torch.equal(call(), first) and not torch.equal(first, second)
    assert torch.equal(call(seed=seeds.mix(5, offset)), first)
    # a captured graph: the seed is a launched randint, so each replay drops other elements
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    replayed = out.clone()
    graph.replay()
    assert not torch.equal(replayed, out)
