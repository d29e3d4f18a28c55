"""The benchmarks' timing helpers (``timing``: paired ratios, resident bytes, peak memory apart) and the
LM step's rows, which step their columns in alternation and are judged by the paired rounds' ratios."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch


@pytest.fixture
def timing(bench_module):
    return bench_module("benchmarks.common.timing")


def test_paired_speedup_is_the_median_of_the_rounds_ratios(timing):
    wall = {"plain": [2.0, 4.0, 6.0, 8.0, 3.0], "fused": [1.0, 2.0, 3.0, 2.0, 6.0]}
    ratios = np.array(wall["plain"]) / np.array(wall["fused"])  # 2, 2, 2, 4, 0.5
    got = timing.paired_speedup(wall, "plain", "fused")
    assert got["median"] == pytest.approx(2.0) and got["n"] == 5
    # statistics.quantiles' default ("exclusive") is numpy's "weibull" method
    q1, q3 = np.percentile(ratios, [25, 75], method="weibull")
    assert (got["q1"], got["q3"]) == pytest.approx((q1, q3))
    # the medians of the two lists alone would say 4 / 2 = 2 as well, but not here: pairs, not medians
    drift = {"plain": [1.0, 1.0, 5.0], "fused": [0.5, 0.5, 10.0]}
    assert timing.paired_speedup(drift, "plain", "fused")["median"] == pytest.approx(2.0)
    assert timing.speedup({}, {"plain": 1.0, "fused": 1.0}, "fused", "plain") == 1.0
    with pytest.raises(ValueError):  # unequal lists cannot be pairs
        timing.paired_speedup({"a": [1.0], "b": [1.0, 2.0]}, "a", "b")


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6])
def test_interleaved_rounds_run_every_name_once_and_none_right_after_itself(timing, n):
    """Each round runs every name once; rounds run back to back, and no name runs twice in a row (the
    previous order, reversed every other round, ran the first and last names twice at every other
    boundary and the middle ones never). With three or more names each runs after two different ones
    in turn."""
    names = [f"v{k}" for k in range(n)]
    calls = []
    timers = {name: (lambda name=name: calls.append(name) or 0.001) for name in names}
    wall, cpu = timing.interleaved(timers, reps=8, warmup=1)
    calls = calls[n:]  # the warmup
    rounds = [calls[i * n : (i + 1) * n] for i in range(8)]
    assert all(sorted(r) == names for r in rounds)
    assert all(len(wall[name]) == len(cpu[name]) == 8 for name in names)
    if n > 1:
        assert all(a != b for a, b in zip(calls[:-1], calls[1:], strict=True))
    if n > 2:
        before = {name: {calls[i - 1] for i in range(1, len(calls)) if calls[i] == name} for name in names}
        assert all(len(p) == 2 for p in before.values()), before


def test_speedup_prefers_the_pairs_and_shows_their_quartiles(timing):
    paired = {"fused/plain": {"median": 1.031, "q1": 0.95, "q3": 1.10, "n": 20}}
    tokens = {"plain": 100.0, "fused": 80.0}
    assert timing.speedup(paired, tokens, "fused", "plain") == 1.031
    assert timing.speedup(paired, tokens, "plain", "fused") == pytest.approx(1.25)  # no such pair: medians
    assert timing.speedup_cell(paired, tokens, "fused", "plain") == "1.031x [0.950-1.100]"
    assert timing.speedup_cell(paired, tokens, "plain", "fused") == "1.250x"


def test_resident_bytes_counts_parameters_gradients_and_adam_state_once(timing):
    model = torch.nn.Linear(4, 3)  # 15 float32 parameters
    opt = torch.optim.AdamW(model.parameters())
    assert timing.resident_bytes(model, opt) == 15 * 4  # no gradients, no state yet
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    # parameters, gradients, exp_avg, exp_avg_sq: 4 x 15 floats; a float32 "step" per parameter tensor
    assert timing.resident_bytes(model, opt) == 4 * 15 * 4 + 2 * 4
    t = torch.zeros(10)
    assert timing.resident_bytes(t, t[2:], t.view(2, 5)) == 40  # one storage, counted once


def test_peak_apart_takes_away_what_the_other_models_hold(timing):
    """A fake allocator: 1000 bytes held by other models, 300 by this step's model; the step allocates
    500 more at its peak and frees them. Alone, its peak would have been 300 + 500."""

    class Memory:
        def __init__(self):
            self.now, self.top = 1300, 1300

        def allocated(self):
            return self.now

        def reset_peak(self):
            self.top = self.now

        def peak(self):
            return self.top

        def alloc(self, n):
            self.now += n
            self.top = max(self.top, self.now)

    mem = Memory()

    def step():
        mem.alloc(500)
        mem.alloc(-500)

    assert timing.peak_apart(step, resident=300, memory=mem) == 800
    mem.now = 5000  # a later step next to bigger neighbours: the same peak of its own
    assert timing.peak_apart(step, resident=300, memory=mem) == 800


def test_lm_row_pairs_its_columns_and_the_table_quotes_them(bench_module, tmp_path):
    """The LM step's rows carry the paired ratios of the columns the table compares, one ratio per timed
    round, and the targets read them."""
    lm = bench_module("benchmarks.step.lm_step")
    steps = 3
    lm.main(["--tiny", "--placements", "pre", "--modes", "eager", "--steps", str(steps), "--warmup", "1",
             "--out", str(tmp_path)])  # fmt: skip
    report = json.loads((tmp_path / "lm_step_cpu.json").read_text())
    (row,) = report["rows"]
    assert set(row["paired"]) == {f"{a}/{b}" for a, b in lm.RATIOS}
    assert all(p["n"] == steps for p in row["paired"].values())
    md = (tmp_path / "lm_step_cpu.md").read_text()
    fused = row["paired"]["fused/fused=False"]
    assert f"{fused['median']:.3f}x [{fused['q1']:.3f}-{fused['q3']:.3f}]" in md
    assert f"| fused / fused=False >= 1.0 | {fused['median']:.3f}x |" in md
    assert "timed step by step in alternation" in md
