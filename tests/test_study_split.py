"""Placements whose seeds split between trained and not trained: the rule on synthetic outcomes with a
known answer, the ranking that shows them apart without letters, and the report's line on them."""

from __future__ import annotations

import math
import random
import statistics
import time

import pytest

from addnorm.study import Store, build_report
from addnorm.study.analysis import analyse
from addnorm.study.ranking import SPLIT, rank, reference_sd, split
from addnorm.train import RunConfig, RunResult

BIMODAL = [2.30, 2.31, 4.06]  # two seeds train, one stalls at the unigram loss


def test_two_clusters_far_apart_split_and_one_spread_does_not():
    s = split(BIMODAL, reference_sd=0.05)
    assert s is not None and (s.trained, s.untrained) == ([2.30, 2.31], [4.06])
    assert s.text() == "split (2 of 3 trained): 2.305 vs 4.060" and s.gap == pytest.approx(1.75)
    assert split([4.06, 2.30, 4.07, 4.05], 0.05).trained == [2.30]  # order does not matter
    # one wide spread: the largest gap (1.1) is not 4 spreads within the clusters (0.49)
    assert split([2.2, 2.9, 4.0], reference_sd=0.05) is None
    # a gap of 1.75 is not 8 usual spreads where the setting's seeds spread by 0.3
    assert split(BIMODAL, reference_sd=0.3) is None
    # seeds that agree to the fourth digit: a gap 4 spreads wide but 0.02% of the loss is no split
    assert split([2.3610, 2.3612, 2.3650], reference_sd=0.0001) is None
    # two seeds: only the setting's usual spread can judge them
    assert split([2.3, 4.0], reference_sd=0.05) is not None and split([2.3, 4.0]) is None
    assert split([2.3, 2.31, math.inf], 0.05) is None and split([2.3], 0.05) is None


def test_seeds_that_scatter_normally_are_not_split():
    """Three or five seeds drawn around one mean with the setting's usual spread: never split in 20,000
    draws (the rule asks for a gap of 8 usual spreads)."""
    rng = random.Random(0)
    for n in (3, 5):
        for _ in range(10000):
            assert split([2.3 + rng.gauss(0, 0.05) for _ in range(n)], reference_sd=0.05) is None


def samples_with_one_split() -> dict[str, list[float]]:
    rng = random.Random(1)
    out = {f"p{i}": [2.2 + 0.05 * i + rng.gauss(0, 0.02) for _ in range(3)] for i in range(5)}
    out["post"] = list(BIMODAL)
    out["blown"] = [2.3, math.inf, 2.4]
    return out


def test_the_ranking_shows_a_split_placement_apart_and_letters_the_rest_as_without_it():
    samples = samples_with_one_split()
    rows = rank(samples, splits=True)
    names = [r.name for r in rows]
    assert names[-2:] == ["post", "blown"]  # after every placement that is not split, before a diverged one
    post = rows[-2]
    assert post.groups == SPLIT and not post.best and post.text().startswith("split (2 of 3 trained)")
    without = {k: v for k, v in samples.items() if k != "post"}
    oracle = {r.name: (r.groups, r.best) for r in rank(without)}
    assert {r.name: (r.groups, r.best) for r in rows if r.name != "post"} == oracle
    assert all(r.split is None for r in rank(samples))  # only when asked
    finite = [v for v in samples.values() if all(math.isfinite(x) for x in v)]  # not the diverged one
    assert reference_sd(samples) == pytest.approx(statistics.median(statistics.stdev(v) for v in finite))


def test_the_report_says_which_placement_split_and_ranks_it_unlettered(tmp_path):
    samples = samples_with_one_split()
    del samples["blown"]
    with Store(tmp_path / "study.sqlite") as store:
        plan = []
        for placement, values in samples.items():
            name = {"p0": "pre", "p1": "sandwich", "p2": "deepnorm", "p3": "mix", "p4": "b2t"}.get(
                placement, placement
            )
            for seed, value in enumerate(values):
                cfg = RunConfig(placement=name, seed=seed).to_dict()
                final = {"train_loss": value, "val_loss": value, "val_metric": 0.0, "metric": "accuracy"}
                result = RunResult(status="done", final=final, steps_done=cfg["steps"])
                result.provenance = {"device": "AMD EPYC"}
                label = f"placement={name}, seed={seed}"
                run_id = RunConfig(**cfg).run_id
                store.save_run("s", run_id, [("main", label)], cfg, result, time.time())
                plan.append((run_id, "main", label))
        store.save_plan("s", {"name": "s", "experiments": {"main": {"rank": True}}}, {}, plan)
        table = analyse(store).ranking.tables[0]
    assert [r.name for r in table.rows][-1] == "post" and table.rows[-1].groups == SPLIT
    assert table.devices == ["AMD EPYC"] and table.sensitivity.pairs == 10  # the five lettered ones
    page = build_report(tmp_path).read_text()
    assert "<td>split (2 of 3 trained): 2.305 vs 4.060</td>" in page
    assert "Seeds split between trained and not trained (post: (2 of 3 trained): 2.305 vs 4.060)" in page
    assert "Measured on AMD EPYC." in page
