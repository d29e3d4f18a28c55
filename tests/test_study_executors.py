"""Executors: submit / results, in-process and in a process pool, threads per worker, failures returned as
results, progress back in the driver."""

from __future__ import annotations

import pytest
import torch

from addnorm.study import LocalExecutor, ProcessExecutor, Store, make_executor, parse_spec, run_study
from addnorm.study import executors as ex

pytestmark = pytest.mark.slow  # process pools

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)


def spec(**sweep):
    return parse_spec({"name": "ex", "base": dict(TINY), "experiments": {"main": {"sweep": sweep}}})


def losses(result):
    return [v for _, n, v in result.metrics if n == "train_loss"]


@pytest.mark.parametrize("cores", [1, 2, 3, 8])
def test_auto_never_oversubscribes_the_cores(monkeypatch, cores):
    monkeypatch.setattr(ex, "usable_cores", lambda: cores)
    for runs in (None, 1, 2, 100):
        workers, threads = ex.plan_workers("auto", runs=runs)
        assert workers * threads <= cores and workers == min(cores, runs or cores)
    assert ex.plan_workers(2) == (2, 1) and ex.plan_workers(1, threads=2) == (1, 2)
    with pytest.raises(ValueError, match="workers: expected a positive integer or 'auto', got 0"):
        ex.plan_workers(0)
    with pytest.raises(ValueError, match="threads: expected a positive integer, got 0"):
        ex.plan_workers(1, threads=0)


def test_make_executor(monkeypatch):
    monkeypatch.setattr(ex, "usable_cores", lambda: 2)
    assert isinstance(make_executor(1), LocalExecutor)
    assert isinstance(make_executor(2), ProcessExecutor)
    assert isinstance(make_executor("auto", runs=1), LocalExecutor)
    pool = make_executor("auto", runs=5)
    assert isinstance(pool, ProcessExecutor) and (pool.workers, pool.threads) == (2, 1)


def test_local_executor_sets_its_threads_for_the_runs_and_restores_them():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        local = LocalExecutor(threads=1)
        seen = []
        (run,) = spec(placement=["pre"]).expand()
        for _, result in local.map([run], on_step=lambda r, step, loss: seen.append(torch.get_num_threads())):
            assert result.provenance["threads"] == 1
        assert seen and set(seen) == {1}  # every step ran with one thread
        assert torch.get_num_threads() == 2  # and the caller's setting is back
    finally:
        torch.set_num_threads(before)


def test_process_pool_matches_in_process_and_returns_failures(tmp_path):
    runs = spec(placement=["post", "pre"]).expand()
    broken = parse_spec(
        {"name": "b", "base": {**TINY, "corpus": str(tmp_path / "missing")}, "experiments": {"x": None}}
    ).expand()
    local = LocalExecutor()
    for run in runs:
        local.submit(run)
    here = {run.run_id: result for run, result in local.results()}
    pool = ProcessExecutor(2)
    steps = []
    there = {
        run.run_id: result
        for run, result in pool.map(runs + broken, on_step=lambda r, step, loss: steps.append(r.run_id))
    }
    assert set(there) == set(here) | {broken[0].run_id}
    for run_id, result in here.items():
        assert result.status == there[run_id].status == "done"
        assert losses(result) == losses(there[run_id])  # same seed, same numbers in another process
        assert there[run_id].provenance["threads"] == 1  # the worker's own torch threads
    assert {r.run_id for r in runs} <= set(steps)  # progress came back from the workers
    failed = there[broken[0].run_id]
    assert failed.status == "failed" and "is neither a file nor a folder" in failed.error
    assert pool._pool is None  # results() shut the pool down once everything came back


def test_study_with_a_pool_writes_every_run_and_its_failure(tmp_path):
    study = parse_spec({"name": "ex", "base": dict(TINY), "experiments": {
        "main": {"sweep": {"seed": [0, 1, 2]}},
        "broken": {"set": {"corpus": str(tmp_path / "missing")}},
    }})  # fmt: skip
    outcome = run_study(study, tmp_path, workers=2, progress=False, report=False)
    assert outcome.ran == 4 and len(outcome.failed) == 1
    with Store(tmp_path / "study.sqlite") as store:
        assert sorted(r["status"] for r in store.runs()) == ["done"] * 3 + ["failed"]
