"""The report's ranking on stored results with a known answer: a failed (killed) run is missing data, not
a diverged one."""

from __future__ import annotations

import re
import time

from addnorm.study import Store, build_report
from addnorm.study.analysis import analyse
from addnorm.train import RunConfig, RunResult

SPEC = {"name": "r", "experiments": {"main": {"sweep": {"placement": [], "seed": []}, "rank": True}}}


def store_runs(path, results: dict[str, list[float | str]], n_layers: int = 2) -> None:
    """One run per (placement, seed): a float is a finished run's held-out loss, "failed" a run killed
    before it finished, "diverged" one whose loss blew up; the plan holds them all."""
    members = []
    with Store(path / "study.sqlite") as store:
        for placement, values in results.items():
            for seed, value in enumerate(values):
                cfg = RunConfig(placement=placement, seed=seed, n_layers=n_layers).to_dict()
                run_id = RunConfig(**cfg).run_id
                label = f"placement={placement}, seed={seed}"
                if isinstance(value, float):
                    final = {"train_loss": value, "val_loss": value, "val_metric": 0.0, "metric": "bpb"}
                    result = RunResult(status="done", final=final)
                elif value == "failed":
                    result = RunResult(status="failed", error="worker killed (SIGKILL)")
                else:
                    result = RunResult(status="diverged", diverged_step=3)
                store.save_run("r", run_id, [("main", label)], cfg, result, time.time())
                members.append((run_id, "main", label))
        store.save_plan("r", SPEC, {}, members)


def seeds_column(page: str, placement: str) -> str:
    row = re.search(rf"<tr><td>(\d+)</td><td>{placement}</td>(?:<td>[^<]*</td>){{4}}<td>([^<]*)</td>", page)
    return row.group(1), row.group(2)


def test_a_failed_run_is_missing_data_not_a_diverged_one(tmp_path):
    store_runs(
        tmp_path,
        {
            "post": [2.00, "failed", 2.02],  # the best placement, one run killed
            "pre": [2.50, 2.52, 2.51],
            "rezero": [3.00, 3.01, "diverged"],
            "sandwich": ["failed", "failed", "failed"],  # nothing finished: not ranked, still named
        },
    )
    with Store(tmp_path / "study.sqlite") as store:
        (table,) = analyse(store).ranking.tables
    rows = {r.name: r for r in table.rows}
    assert [r.name for r in table.rows] == ["post", "pre", "rezero"]  # ranked on what finished
    assert rows["post"].n == 2 and rows["post"].diverged == 0 and rows["post"].mean == 2.01
    assert (
        rows["rezero"].diverged == 1 and rows["rezero"].groups == "diverged"
    )  # a diverged seed still ranks last
    assert table.failed == {"post": 1, "sandwich": 3}
    page = build_report(tmp_path).read_text()
    ranking = page[page.index("<h2 id='ranking'>") : page.index("<h2 id='main'>")]
    assert seeds_column(ranking, "post") == ("1", "2 (1 failed, left out)")
    assert seeds_column(ranking, "rezero") == ("3", "3 (1 diverged)")
    assert "Not ranked, no run finished: sandwich (3 failed)." in ranking
    assert "A failed run (an error, a killed worker) is missing data" in ranking
