"""Executors: submit / results, in-process and in a process pool, failures returned as results."""

from __future__ import annotations

from addnorm.study import LocalExecutor, ProcessExecutor, Store, make_executor, parse_spec, run_study

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=3, batch_size=4, seq_len=16, eval_every=0)


def spec(**sweep):
    return parse_spec({"name": "ex", "base": dict(TINY), "experiments": {"main": {"sweep": sweep}}})


def losses(result):
    return [v for _, n, v in result.metrics if n == "train_loss"]


def test_make_executor():
    assert isinstance(make_executor(1), LocalExecutor)
    assert isinstance(make_executor(2), ProcessExecutor)


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
    there = {run.run_id: result for run, result in pool.map(runs + broken)}
    assert set(there) == set(here) | {broken[0].run_id}
    for run_id, result in here.items():
        assert result.status == there[run_id].status == "done"
        assert losses(result) == losses(there[run_id])  # same seed, same numbers in another process
    failed = there[broken[0].run_id]
    assert failed.status == "failed" and "is neither a file nor a folder" in failed.error


def test_study_with_workers_writes_every_run(tmp_path):
    outcome = run_study(spec(seed=[0, 1, 2]), tmp_path, workers=2, progress=False, report=False)
    assert outcome.ran == 3
    with Store(tmp_path / "study.sqlite") as store:
        assert [r["status"] for r in store.runs()] == ["done"] * 3
