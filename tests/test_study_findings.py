"""Every finding's verdict follows the stored numbers: change them in the database, the verdict changes."""

from __future__ import annotations

import time

from addnorm.study import Store, compute_findings
from addnorm.study.findings import NOT_SUPPORTED, NOT_TESTED, SUPPORTED
from addnorm.train import RunConfig, RunResult

WARMUP = "Pre-LN trains without warmup where Post-LN needs it"
POST_GRAD = "Post-LN gradient norms grow toward the top layers"
PRE_GRAD = "Pre-LN gradient norms stay flat across layers"
RESIDUAL = "Removing the residual connection fails beyond about 6 layers"
NO_NORM = "Removing the normalization is unstable"
BATCHNORM = "BatchNorm generalises worse than LayerNorm"
FINAL_NORM = "Pre-LN without a final norm is worse than with it"


def save(store, val_loss, status="done", grads=None, **config):
    cfg = RunConfig(**config).to_dict()
    rows = [
        {
            "step": 0,
            "layer": layer,
            "layer_name": f"layers.{layer}",
            "sublayer": "ff",
            "metric": "weight_grad_norm",
            "param": "ff.w1.weight",
            "value": g,
        }
        for layer, g in enumerate(grads or [])
    ]
    final = {"train_loss": val_loss, "val_loss": val_loss, "val_metric": 0.0, "metric": "bits_per_byte"}
    result = RunResult(status=status, final=final if status == "done" else {}, layer_metrics=rows)
    run_id = RunConfig(**cfg).run_id
    store.save_run("fake", run_id, [("x", run_id)], cfg, result, time.time())
    return run_id


def verdicts(store):
    return {f.claim: f for f in compute_findings(store)}


def set_loss(store, run_id, value):
    store.db.execute("UPDATE runs SET final_val_loss = ? WHERE id = ?", (value, run_id))
    store.db.commit()


def test_an_empty_study_tests_nothing(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        found = verdicts(store)
    assert len(found) == 7 and {f.verdict for f in found.values()} == {NOT_TESTED}


def test_gradient_profiles(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        save(store, 2.0, placement="post", n_layers=4, grads=[1.0, 1.5, 2.0, 3.0])
        pre = save(store, 2.0, placement="pre", n_layers=4, grads=[1.0, 1.1, 0.9, 1.0])
        found = verdicts(store)
        assert found[POST_GRAD].verdict == SUPPORTED and "3.00" in found[POST_GRAD].evidence
        assert found[PRE_GRAD].verdict == SUPPORTED
        store.db.execute(
            "UPDATE layer_metrics SET value = 0.1 WHERE run_id = ? AND layer = 3", (pre,)
        )  # the top layer's gradient collapses
        store.db.commit()
        found = verdicts(store)
        assert found[PRE_GRAD].verdict == NOT_SUPPORTED and "0.10" in found[PRE_GRAD].evidence


def test_residual_norm_batchnorm_and_final_norm_ablations(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        for depth, base, no_res, no_norm, bn in ((2, 2.0, 2.05, 2.0, 2.3), (8, 1.8, 3.0, 2.5, 2.1)):
            save(store, base, n_layers=depth)
            save(store, no_res, n_layers=depth, residual=False)
            save(store, no_norm, n_layers=depth, norm="none")
            save(store, bn, n_layers=depth, norm="batchnorm")
        deep_no_res = RunConfig(n_layers=8, residual=False).run_id
        deep_no_norm = RunConfig(n_layers=8, norm="none").run_id
        save(store, 1.9, n_layers=6, final_norm="auto")
        no_final = save(store, 2.2, n_layers=6, final_norm=False)
        found = verdicts(store)
        assert {found[c].verdict for c in (RESIDUAL, NO_NORM, BATCHNORM, FINAL_NORM)} == {SUPPORTED}
        assert "8 layers: loss without/with residual = 1.67" in found[RESIDUAL].evidence
        set_loss(store, deep_no_res, 1.8)
        set_loss(store, deep_no_norm, 1.8)
        set_loss(store, no_final, 1.85)
        found = verdicts(store)
        assert {found[c].verdict for c in (RESIDUAL, NO_NORM, FINAL_NORM)} == {NOT_SUPPORTED}
        store.db.execute(
            "UPDATE runs SET status = 'diverged', final_val_loss = NULL WHERE id = ?", (deep_no_norm,)
        )
        store.db.commit()
        found = verdicts(store)
        assert found[NO_NORM].verdict == SUPPORTED and "1 no-norm run(s) diverged" in found[NO_NORM].evidence


def test_warmup_needs_both_placements(tmp_path):
    with Store(tmp_path / "s.sqlite") as store:
        save(store, 3.0, placement="post", warmup=0)
        save(store, 2.0, placement="post", warmup=50)
        assert verdicts(store)[WARMUP].verdict == NOT_TESTED  # no Pre-LN runs yet
        save(store, 2.0, placement="pre", warmup=0)
        pre_warm = save(store, 2.0, placement="pre", warmup=50)
        assert verdicts(store)[WARMUP].verdict == SUPPORTED
        set_loss(store, pre_warm, 1.5)  # now Pre-LN needs warmup too
        assert verdicts(store)[WARMUP].verdict == NOT_SUPPORTED
