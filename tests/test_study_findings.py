"""Every finding's verdict follows the stored numbers under the stated rule: change them in the database,
the verdict changes; seeds that disagree make it inconclusive."""

from __future__ import annotations

import math
import time

import pytest

from addnorm.study import Store, compute_findings
from addnorm.study.findings import (
    GROWTH,
    INCONCLUSIVE,
    NOT_SUPPORTED,
    NOT_TESTED,
    SUPPORTED,
    Arm,
    differ,
    pooled_std,
    trend,
)
from addnorm.train import RunConfig, RunResult

WARMUP = "Pre-LN trains without warmup where Post-LN needs it"
POST_GRAD = "Post-LN gradient norms grow toward the top layers"
PRE_GRAD = "Pre-LN gradient norms stay flat across layers"
RESIDUAL = "Removing the residual connection fails beyond about 6 layers"
NO_NORM = "Removing the normalization is unstable"
BATCHNORM = "BatchNorm generalises worse than LayerNorm"
FINAL_NORM = "Pre-LN without a final norm is worse than with it"
SEEDS = (0, 1, 2)


def save(store, val_loss, status="done", grads=None, rms=None, **config):
    cfg = RunConfig(**config).to_dict()
    rows = [
        {"step": 0, "layer": layer, "layer_name": f"layers.{layer}", "sublayer": "ff",
         "metric": "weight_grad_norm", "param": "ff.w1.weight", "value": g}
        for layer, g in enumerate(grads or [])
    ] + [
        {"step": 0, "layer": layer, "layer_name": f"layers.{layer}", "sublayer": "",
         "metric": "act_rms", "param": None, "value": v}
        for layer, v in enumerate(rms or [])
    ]  # fmt: skip
    final = {"train_loss": val_loss, "val_loss": val_loss, "val_metric": 0.0, "metric": "bits_per_byte"}
    result = RunResult(status=status, final=final if status == "done" else {}, layer_metrics=rows)
    run_id = RunConfig(**cfg).run_id
    store.save_run("fake", run_id, [("x", run_id)], cfg, result, time.time())
    return run_id


def save_arm(store, losses, **config) -> list[str]:
    """One run per seed with the given held-out losses."""
    return [save(store, loss, seed=seed, **config) for seed, loss in zip(SEEDS, losses, strict=True)]


def save_seeds(store, metric: str, lower: list, tops, **config) -> list[str]:
    """One run per seed (held-out loss 2.0) whose per-layer ``metric`` ("grads" or "rms") is ``lower``,
    then that seed's entry of ``tops`` at the top layer."""
    runs = zip(SEEDS, tops, strict=True)
    return [save(store, 2.0, seed=seed, **{metric: [*lower, top]}, **config) for seed, top in runs]


def verdicts(store) -> dict[str, list]:
    out: dict[str, list] = {}
    for f in compute_findings(store):
        out.setdefault(f.claim, []).append(f)
    return out


def one(store, claim):
    (finding,) = verdicts(store)[claim]
    return finding


def xavier(findings):
    (finding,) = [f for f in findings if "init xavier" in f.evidence]
    return finding


def set_top_gradient(store, run_id, value):
    query = (
        "UPDATE layer_metrics SET value = ? WHERE run_id = ? AND layer = 3 AND metric = 'weight_grad_norm'"
    )
    store.db.execute(query, (value, run_id))
    store.db.commit()


def set_loss(store, run_id, value):
    store.db.execute("UPDATE runs SET final_val_loss = ? WHERE id = ?", (value, run_id))
    store.db.commit()


def test_the_rule_in_closed_form():
    a, b = Arm([2.0, 2.2, 2.4], [0, 1, 2]), Arm([1.0, 1.1, 1.2], [0, 1, 2])
    # pooled sd = sqrt((2 * 0.04 + 2 * 0.01) / 4) = sqrt(0.025); difference 1.2 > 2 * 0.158
    assert pooled_std(a, b) == pytest.approx(math.sqrt(0.025))
    assert differ(a, b) == 1 and differ(b, a) == -1
    close = Arm([1.25, 1.05, 1.4], [0, 1, 2])  # difference 0.133 < 2 * pooled sd
    assert differ(close, b) == 0
    assert differ(Arm([2.0], [0]), Arm([1.0], [0])) == 0  # one seed: no spread, no verdict
    diverged, fine = Arm([math.inf] * 3, [0, 1, 2]), Arm([3.0, 3.1, 2.9], [0, 1, 2])
    assert differ(diverged, fine) == 1 and differ(Arm([math.inf, 1.0, 1.0], [0, 1, 2]), fine) == 0
    assert [trend(r) for r in (GROWTH * 1.01, 1.0, 1 / GROWTH / 1.01, float("nan"))] == [
        "grows", "flat", "shrinks", "undefined",
    ]  # fmt: skip


def test_an_empty_study_tests_nothing(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        found = compute_findings(store)
    assert len(found) == 10 and {f.verdict for f in found} == {NOT_TESTED}


def test_gradient_profiles_per_init_with_the_mechanism(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        # Post-LN's gradients grow toward the top layer, Pre-LN's stay flat while its stream grows
        post_grads, pre_grads = [1.0, 1.5, 2.0], [1, 1.1, 0.9]
        save_seeds(store, "grads", post_grads, (3.0, 3.3, 2.7), placement="post", n_layers=4, rms=[1] * 4)
        pre_rms = [1, 1.5, 2, 2.1]
        pre = save_seeds(
            store, "grads", pre_grads, (1.0, 1.05, 0.95), placement="pre", n_layers=4, rms=pre_rms
        )
        save(store, 2.0, placement="pre", init="gpt2", n_layers=4, seed=0, grads=[1.0, 1.0, 1.0, 1.0])
        found = verdicts(store)
        post = found[POST_GRAD][0]
        assert (
            post.verdict == SUPPORTED
            and "per seed 3.00, 3.30, 2.70" in post.evidence
            and post.seeds == [0, 1, 2]
        )
        assert "init xavier" in post.evidence and "4 layers" in post.scale and "seeds 0, 1, 2" in post.scale
        pre_x, pre_gpt2 = sorted(found[PRE_GRAD], key=lambda f: "gpt2" in f.evidence)
        assert (
            pre_x.verdict == SUPPORTED and "predicts 1/2.10 = 0.48, measured 1.00" in pre_x.evidence
        )  # stream RMS 1 -> 2.1
        assert pre_gpt2.verdict == INCONCLUSIVE and "init gpt2" in pre_gpt2.evidence  # one seed only
        # the seeds disagree: one shrinks, one is flat, one grows -> inconclusive
        for run_id, top in zip(pre, (0.5, 1.0, 2.0), strict=True):
            set_top_gradient(store, run_id, top)
        assert xavier(verdicts(store)[PRE_GRAD]).verdict == INCONCLUSIVE
        for run_id in pre:  # every seed's top-layer gradient collapses: clearly not flat
            set_top_gradient(store, run_id, 0.1)
        pre_x = xavier(verdicts(store)[PRE_GRAD])
        assert pre_x.verdict == NOT_SUPPORTED and "0.10" in pre_x.evidence


def test_ablations_need_the_difference_to_beat_the_spread(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        deep_no_res, deep_no_norm = [], []
        for depth, base, no_res, no_norm, bn in ((2, 2.0, 2.1, 2.0, 2.3), (8, 1.8, 3.0, 2.5, 2.1)):
            save_arm(store, [base - 0.01, base, base + 0.01], n_layers=depth)
            ids = save_arm(store, [no_res - 0.01, no_res, no_res + 0.01], n_layers=depth, residual=False)
            ids_nn = save_arm(store, [no_norm - 0.01, no_norm, no_norm + 0.01], n_layers=depth, norm="none")
            save_arm(store, [bn - 0.01, bn, bn + 0.01], n_layers=depth, norm="batchnorm")
            if depth == 8:
                deep_no_res, deep_no_norm = ids, ids_nn
        save_arm(store, [1.89, 1.9, 1.91], n_layers=6, final_norm="auto")
        no_final = save_arm(store, [2.19, 2.2, 2.21], n_layers=6, final_norm=False)
        found = {c: one(store, c) for c in (RESIDUAL, NO_NORM, BATCHNORM, FINAL_NORM)}
        assert {f.verdict for f in found.values()} == {SUPPORTED}
        assert "8 layers: with residual 1.800 ± 0.010 (3 seeds), without residual 3.000 ± 0.010" in (
            found[RESIDUAL].evidence
        )
        assert "pooled sd" in found[BATCHNORM].evidence and "seeds 0, 1, 2" in found[BATCHNORM].scale
        # the seeds of the no-final-norm arm now straddle the other arm: inconclusive
        for run_id, value in zip(no_final, (1.7, 1.95, 2.2), strict=True):
            set_loss(store, run_id, value)
        assert one(store, FINAL_NORM).verdict == INCONCLUSIVE
        for run_id, value in zip(no_final, (1.79, 1.8, 1.81), strict=True):  # clearly better without
            set_loss(store, run_id, value)
        assert one(store, FINAL_NORM).verdict == NOT_SUPPORTED
        for run_id in deep_no_res:  # no residual is now better at 8 layers
            set_loss(store, run_id, 1.5)
        assert one(store, RESIDUAL).verdict == NOT_SUPPORTED
        for run_id, value in zip(deep_no_norm, (1.5, 1.51, 1.49), strict=True):  # no norm better when deep
            set_loss(store, run_id, value)
        assert one(store, NO_NORM).verdict == NOT_SUPPORTED
        store.db.execute(
            f"UPDATE runs SET status = 'diverged', final_val_loss = NULL WHERE id IN ({','.join('?' * 3)})",
            deep_no_norm,
        )
        store.db.commit()
        no_norm = one(store, NO_NORM)
        assert no_norm.verdict == SUPPORTED and "diverged (3 of 3 seeds)" in no_norm.evidence


def test_warmup_needs_both_placements_and_agreeing_seeds(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        post_cold = save_arm(store, [3.0, 3.1, 2.9], placement="post", warmup=0)
        save_arm(store, [2.0, 2.05, 1.95], placement="post", warmup=50)
        assert one(store, WARMUP).verdict == NOT_TESTED  # no Pre-LN runs yet
        save_arm(store, [1.9, 1.95, 1.85], placement="pre", warmup=0)
        pre_warm = save_arm(store, [1.9, 1.92, 1.88], placement="pre", warmup=50)
        finding = one(store, WARMUP)
        assert finding.verdict == SUPPORTED and "Post-LN 3.000 ± 0.100 (3 seeds)" in finding.evidence
        assert finding.seeds == [0, 1, 2] and "lr 0.001" in finding.scale
        for run_id, value in zip(post_cold, (1.6, 2.1, 3.6), strict=True):  # seeds disagree
            set_loss(store, run_id, value)
        assert one(store, WARMUP).verdict == INCONCLUSIVE
        for run_id, value in zip(post_cold, (3.0, 3.1, 2.9), strict=True):
            set_loss(store, run_id, value)
        for run_id in pre_warm:  # now Pre-LN clearly needs warmup too
            set_loss(store, run_id, 1.5)
        assert one(store, WARMUP).verdict == NOT_SUPPORTED


def test_failed_runs_are_not_evidence(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        save_arm(store, [2.0, 2.01, 1.99], n_layers=2)
        save(store, 0.0, status="failed", n_layers=2, norm="batchnorm")
        assert one(store, BATCHNORM).verdict == NOT_TESTED


def test_runs_that_start_alike_are_one_seed_not_two(tmp_path):
    """Warmup does not change the initialisation: two runs of seed 0 are one sample, not a spread of 0."""
    with Store(tmp_path / "s.sqlite") as store:
        for warmup in (0, 50):
            save(
                store, 2.0, placement="pre", n_layers=4, warmup=warmup, steps=100, grads=[1.0, 0.9, 0.8, 0.5]
            )
        (finding,) = verdicts(store)[PRE_GRAD]
        assert finding.seeds == [0] and finding.verdict == INCONCLUSIVE and "(seeds 0)" in finding.evidence


DEEPNORM = "DeepNorm trains better than Post-LN at depth"
PERI = "Peri-LN (sandwich) keeps the residual stream's activations from growing with depth as Pre-LN's do"
MIX = "Mix-LN gives the last layers larger gradients than Pre-LN"


def test_deepnorm_beats_post_only_at_depth_and_by_the_rule(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        assert one(store, DEEPNORM).verdict == NOT_TESTED
        save_arm(store, [3.0, 3.1, 3.2], placement="post", n_layers=2)
        save_arm(store, [2.0, 2.1, 2.2], placement="deepnorm", n_layers=2)
        assert one(store, DEEPNORM).verdict == NOT_TESTED  # 2 layers is not "at depth"
        post = save_arm(store, [3.0, 3.1, 3.2], placement="post", n_layers=8)
        save_arm(store, [2.0, 2.1, 2.2], placement="deepnorm", n_layers=8)
        found = one(store, DEEPNORM)
        assert (
            found.verdict == SUPPORTED and "8 layers" in found.evidence and "2 layers:" not in found.evidence
        )
        for run_id, loss in zip(post, (2.0, 2.1, 2.2), strict=True):  # now the same: no difference
            set_loss(store, run_id, loss)
        assert one(store, DEEPNORM).verdict == INCONCLUSIVE
        for run_id, loss in zip(post, (1.0, 1.1, 1.2), strict=True):
            set_loss(store, run_id, loss)
        assert one(store, DEEPNORM).verdict == NOT_SUPPORTED


_GROWS, _FLAT = ([1.0, 2.0, 4.0], 8.0), ([1.0, 1.0, 1.0], 1.1)  # (the lower layers, the top one)


@pytest.mark.parametrize(
    "pre, sandwich, verdict",
    [(_GROWS, _FLAT, SUPPORTED), (_FLAT, _GROWS, NOT_SUPPORTED)],
    ids=["pre-grows", "sandwich-grows"],
)
def test_peri_ln_activation_growth_against_pre_ln(tmp_path, pre, sandwich, verdict):
    """A stream growing 8x over 4 layers against one growing 1.1x: log-ratios 2.08 vs 0.10 (seed spread
    ~0.01); supported when Pre-LN's is the one that grows."""
    with Store(tmp_path / "s.sqlite") as store:
        for placement, (lower, top) in (("pre", pre), ("sandwich", sandwich)):
            tops = [top * jitter for jitter in (1.0, 1.01, 0.99)]
            save_seeds(store, "rms", lower, tops, placement=placement, n_layers=8)
        assert one(store, PERI).verdict == verdict


def test_mix_ln_top_layer_gradients_against_pre_ln(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        jitters = (1.0, 1.02, 0.98)
        save_seeds(store, "grads", [1.0, 0.5, 0.3], [0.2 * j for j in jitters], placement="pre", n_layers=8)
        save_seeds(store, "grads", [1.0, 0.9, 0.9], [0.8 * j for j in jitters], placement="mix", n_layers=8)
        found = one(store, MIX)
        assert found.verdict == SUPPORTED and "Li et al. 2024" in found.source
        # seeds that disagree: inconclusive
        save(store, 2.0, grads=[1.0, 0.5, 0.3, 2.0], placement="pre", n_layers=8, seed=3)
        save(store, 2.0, grads=[1.0, 0.9, 0.9, 0.1], placement="mix", n_layers=8, seed=3)
        assert one(store, MIX).verdict == INCONCLUSIVE
