"""Runs side by side on one device: how many runs shared the device while each ran (``packed``), the
slowdown and gain of a packing as measured (no gain assumed until measured), the choice of how many at
once (memory, cores, budget, measured gain), the windows a study needs, and on the CPU (standing in
for a GPU: the same processes, the same code path) k runs at once giving the results of one at a time."""

from __future__ import annotations

import io

import pytest
from tiny_runs import TINY_SIZES

from addnorm.study import Store, parse_spec, run_study
from addnorm.study.cost_model import MEASURED_MARGIN, SCALED_MARGIN, Estimator, Timing
from addnorm.study.limits import CUDA_CONTEXT_BYTES, estimate_memory
from addnorm.study.packing import MEMORY_SHARE, Sharing, choose, memory_need, plan_windows
from addnorm.study.spec import PlannedRun
from addnorm.train import RunConfig

pytestmark = pytest.mark.slow  # process pools

TINY = dict(TINY_SIZES, steps=3, eval_every=0)
GPU = "NVIDIA H200"


def cfg(**changes) -> RunConfig:
    return RunConfig(**{**TINY, **changes})


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_sharing_is_the_mean_number_of_runs_in_flight_over_each_run():
    """a and b start at 0, b ends at 5 and c starts, a and c end at 10: each had 2 in flight all along; d
    alone from 10 to 20; e from 20 to 30 with f from 25 to 30: e (5 x 1 + 5 x 2) / 10 = 1.5, f 2."""
    clock = Clock()
    sharing = Sharing(clock)
    sharing.start("a")
    sharing.start("b")
    clock.now = 5.0
    assert sharing.finish("b") == 2.0
    sharing.start("c")
    clock.now = 10.0
    assert sharing.finish("a") == 2.0
    assert sharing.finish("c") == 2.0
    sharing.start("d")
    clock.now = 20.0
    assert sharing.finish("d") == 1.0
    sharing.start("e")
    clock.now = 25.0
    sharing.start("f")
    clock.now = 30.0
    assert sharing.finish("e") == 1.5 and sharing.finish("f") == 2.0


def measured(times: dict[float, list[float]], device: str = GPU, **changes) -> list[Timing]:
    """Runs of one size (other seeds) measured at packings: packed -> wall times."""
    config = cfg(**changes).to_dict()
    return [
        Timing({**config, "seed": 100 + i}, device, t, True, packed=k)
        for k, ts in times.items()
        for i, t in enumerate(ts)
    ]


def test_a_packing_is_measured_interpolated_between_and_assumed_to_gain_nothing_beyond():
    """Alone 10 s, 4 at once 12.5 s a run (measured: a gain of x 3.2), 8 at once 30 s (x 2.7): the slowdown
    at 6 is interpolated (2.25), at 16 it is 8's times 16/8 on a GPU (one device, time-shared) and 8's on
    the CPU while the cores hold the runs; the same cost's estimate at a packing is its measured time
    there, converted from another packing where it was not measured."""
    history = measured({1: [10.0], 4: [12.5, 12.5], 8: [30.0]})
    est = Estimator(GPU, gpu=True, history=history, packed=4)
    alone = est.rates().seconds(cfg())
    assert alone == pytest.approx(10.0)  # the model is fitted to the run measured alone
    assert est.levels() == pytest.approx({1: 1.0, 4: 1.25, 8: 3.0})
    assert est.gains() == pytest.approx({4: 3.2, 8: 8 / 3})
    assert est.slowdown(6) == pytest.approx(1.25 + (3.0 - 1.25) / 2)
    assert est.slowdown(16) == pytest.approx(6.0)
    assert est.seconds(cfg(seed=1)) == pytest.approx(12.5)  # measured at 4: the estimator's packing
    assert est.needs(cfg(seed=1)) == pytest.approx(12.5 * MEASURED_MARGIN)
    assert est.seconds(cfg(seed=1), 2) == pytest.approx(10.0 * (1.0 + 0.25 / 3))
    cpu = Estimator("AMD EPYC", gpu=False, history=measured({1: [10.0], 8: [30.0]}, "AMD EPYC"), slots=32)
    assert cpu.slowdown(16) == pytest.approx(3.0)  # 32 cores: 16 runs lose nothing more than 8 did
    nothing = Estimator(GPU, gpu=True, history=measured({1: [10.0]}))
    assert nothing.slowdown(7) == pytest.approx(7.0) and nothing.gains() == {}
    assert nothing.seconds(cfg(seed=3), 7) == pytest.approx(70.0)
    assert nothing.needs(cfg(seed=3), 7) == pytest.approx(70.0 * MEASURED_MARGIN)


def runs_of(*configs: RunConfig) -> list[PlannedRun]:
    return [PlannedRun("main", f"run {i}", c) for i, c in enumerate(configs)]


def test_the_packing_is_the_most_runs_the_bounds_allow_unless_a_measured_one_does_better():
    """Nothing measured but alone (10 s): every packing ties under 'no gain', so the most that the
    bounds allow: cores, memory (free x MEMORY_SHARE over a run's need), runs left, and the budget (the
    runs left must fit at k, x MEASURED_MARGIN, plus a worker's start). Measured: 4 at once gains
    x 3.2, 8 at once x 2.7: 4 wins (the packings between are interpolated below it)."""
    todo = runs_of(*(cfg(seed=s) for s in range(20)))
    alone = Estimator(GPU, gpu=True, history=measured({1: [10.0]}))
    assert choose(todo, alone, cores=15).k == 15
    assert choose(todo[:3], alone, cores=15).k == 3
    need = estimate_memory(cfg(), cuda=True).total
    packing = choose(todo, alone, cores=15, free_bytes=5 * need)
    assert packing.k == int(MEMORY_SHARE * 5) and "memory 4" in packing.line()
    room, start = 100.0, 5.0
    packing = choose(todo, alone, cores=15, room=room, start_s=start)
    assert packing.k == int((room - start) / (10.0 * MEASURED_MARGIN))  # 8: 8 x 11 + 5 = 93 <= 100
    assert "budget 8" in packing.line() and "no gain assumed" in packing.line()
    both = Estimator(GPU, gpu=True, history=measured({1: [10.0], 4: [12.5], 8: [30.0]}))
    packing = choose(todo, both, cores=15)
    assert packing.k == 4 and "measured gain x 3.2 at 4, x 2.7 at 8" in packing.line()
    rising = Estimator(GPU, gpu=True, history=measured({1: [10.0], 4: [10.0]}))
    assert choose(todo, rising, cores=15).k == 15  # 4 at once lost nothing: try the most the bounds allow


def test_a_runs_memory_is_what_its_size_measured_on_the_gpu_else_the_estimate_scaled_by_what_others_did():
    small, big = cfg(), cfg(d_model=64, d_ff=128, n_layers=4)
    est = Estimator(GPU, gpu=True)
    assert memory_need(big, est) == (estimate_memory(big, cuda=True).total, "estimated")
    peak = 200 * 2**20
    est.add(Timing(cfg(seed=9).to_dict(), GPU, 10.0, True, peak_memory=peak))
    assert memory_need(small, est) == (peak + CUDA_CONTEXT_BYTES, "measured")
    ratio = (peak + CUDA_CONTEXT_BYTES) / estimate_memory(small, cuda=True).total
    bytes_, how = memory_need(big, est)
    assert bytes_ == int(estimate_memory(big, cuda=True).total * ratio * SCALED_MARGIN)
    assert how == "estimated, scaled by 1 measured"


def test_the_windows_a_study_needs_at_the_estimates():
    """Runs of 10 s measured alone in windows of 35 s: one at a time 3 a window, so 7 runs take 3 windows;
    packed by choice with no gain measured, a window holds no more (each packing's runs take k times as
    long); a run that fits in no window makes the plan None."""
    est = Estimator(GPU, gpu=True, history=measured({1: [10.0]}))
    todo = runs_of(*(cfg(seed=s) for s in range(7)))
    room = 3 * 10.0 * MEASURED_MARGIN + 1
    assert plan_windows(todo, est, room, workers=1) == [(1, 3), (1, 3), (1, 1)]
    assert sum(n for _, n in plan_windows(todo, est, room)) == 7 and len(plan_windows(todo, est, room)) == 3
    assert plan_windows(todo, est, 5.0, workers=1) is None


def test_k_runs_at_once_give_the_results_of_one_at_a_time_and_record_how_many_shared(tmp_path):
    """The CPU standing in for a GPU: 2 processes train at once through the same code path as runs packed
    on a GPU (a pool of processes, each run started when a worker is free); every run's losses, final
    values and per-layer rows equal the one-at-a-time study's, and each run's provenance says how many
    runs shared the device while it ran (1.0 alone; 2.0 for the first two, in flight together)."""
    spec = parse_spec(
        {
            "name": "pack",
            "base": {**TINY, "probe_every": 1},
            "experiments": {"main": {"sweep": {"placement": ["post", "pre"], "seed": [0, 1]}}},
        }
    )
    one, two = tmp_path / "one", tmp_path / "two"
    run_study(spec, one, workers=1, progress=False, report=False)
    run_study(spec, two, workers=2, progress=False, report=False)
    with Store(one / "study.sqlite") as a, Store(two / "study.sqlite") as b:
        runs_a, runs_b = {r["id"]: r for r in a.runs()}, {r["id"]: r for r in b.runs()}
        assert set(runs_a) == set(runs_b) and len(runs_a) == 4
        for run_id, ra in runs_a.items():
            rb = runs_b[run_id]
            assert (ra["status"], ra["final_val_loss"], ra["final_train_loss"]) == (
                rb["status"],
                rb["final_val_loss"],
                rb["final_train_loss"],
            )
            assert a.metric(run_id, "train_loss") == b.metric(run_id, "train_loss")
            assert a.layer_rows(run_id) == b.layer_rows(run_id)
        assert {r["provenance"]["packed"] for r in runs_a.values()} == {1.0}
        packed = sorted(r["provenance"]["packed"] for r in runs_b.values())
        assert all(1.0 <= p <= 2.0 for p in packed) and packed[-1] >= 1.9


def test_a_window_packs_more_runs_once_the_packing_it_ran_at_is_measured():
    """A GPU simulated on a fake clock where runs take 10 s however many share it (a perfect gain), a
    pool of 4, starting at 2 at once (nothing measured but alone): when the first two come back measured
    at 2 at once (2.0 each) with no slowdown, packing 4 costs no more per unit of work under 'no gain
    beyond what was measured', so the window grows to 4 at once and says so in one line; every run's
    ``packed`` says how many shared the device while it ran (a run is in flight for its 10 s)."""
    from test_study_budget import FakeClock, SimulatedExecutor

    from addnorm.study.cost_model import Budget, report_reserve
    from addnorm.study.packing import Packing
    from addnorm.study.runner import _Window

    class OnTheGpu(SimulatedExecutor):
        def results(self, on_step=None, on_progress=None):
            for run, result in super().results(on_step, on_progress):
                result.provenance = {"device": GPU}
                yield run, result

    clock = FakeClock()
    runs = runs_of(*(cfg(seed=s) for s in range(10)))
    executor = OnTheGpu(clock, 4, {r.label: 10.0 for r in runs})
    executor.packing = Packing(2, GPU, {"runs left": (10, ""), "cores": (4, "")}, cores=4)
    estimator = Estimator(GPU, gpu=True, history=measured({1: [10.0]}), packed=2)
    lines: list[str] = []
    packed: dict[str, float] = {}
    starter = _Window(
        executor, runs, Budget(1000.0 + report_reserve(10), 0.0, clock), estimator, 10, lines.append
    )
    starter.fill()
    for run, result in executor.results():
        starter.finished(run, result)
        packed[run.label] = result.provenance["packed"]
        starter.fill()
    starts = [(start, flying) for _, start, flying in executor.log]
    assert starts[:2] == [(0.0, 1), (0.0, 2)] and max(n for s, n in starts if s == 0.0) == 2
    assert max(n for _, n in starts) == 4 and starter.target == 4 and not starter.queue
    assert packed == {"run 0": 2.0, "run 1": 2.0, **{f"run {i}": 4.0 for i in range(2, 10)}}
    assert len(lines) == 1 and lines[0].startswith(f"packing: 4 run(s) at once on {GPU}")
    assert "measured gain x 2.0 at 2" in lines[0]


def test_workers_auto_on_a_gpu_machine_packs_through_the_study_the_cpu_standing_in(tmp_path, monkeypatch):
    """The path ``--workers auto`` takes on a CUDA machine, with this CPU standing in for the GPU (the
    packing's device is this CPU, whose cores each hold a run): it starts at the packing chosen (1 at a
    time, in a pool that may grow to 2), says so in one line, measures, packs 2 at once once nothing says
    it loses, says that too, and stores what one at a time stores."""
    from addnorm.study import runner
    from addnorm.study.packing import Packing
    from addnorm.train.device import device_name

    spec = parse_spec(
        {"name": "auto", "base": dict(TINY), "experiments": {"main": {"sweep": {"seed": [0, 1, 2, 3]}}}}
    )
    alone = tmp_path / "alone"
    run_study(spec, alone, workers=1, progress=False, report=False)
    start = Packing(
        1, device_name(), {"runs left": (4, ""), "cores": (2, "one per run")}, "nothing measured", cores=2
    )
    monkeypatch.setattr(runner, "cuda_available", lambda: True)
    monkeypatch.setattr(runner, "pack_this_gpu", lambda *args: start)
    said = io.StringIO()
    outcome = run_study(spec, tmp_path / "auto", workers="auto", progress=False, report=False, stream=said)
    assert outcome.ran == 4 and not outcome.failed
    lines = said.getvalue().splitlines()
    assert lines[0] == start.line() and lines[1].startswith(f"packing: 2 run(s) at once on {device_name()}")
    with Store(alone / "study.sqlite") as a, Store(tmp_path / "auto" / "study.sqlite") as b:
        for ra in a.runs():
            rb = b.run_record(ra["id"])
            assert (ra["final_val_loss"], ra["final_train_loss"]) == (
                rb["final_val_loss"],
                rb["final_train_loss"],
            )
            assert a.metric(ra["id"], "train_loss") == b.metric(ra["id"], "train_loss")
        packed = sorted(r["provenance"]["packed"] for r in b.runs())
        assert packed[0] == 1.0 and packed[-1] > 1.5
