"""The report: self-contained HTML built from the database alone, plots only where the data exists."""

from __future__ import annotations

import re

from addnorm.study import Store, build_report, parse_spec, run_study

TINY = dict(d_model=16, n_heads=2, d_ff=32, n_layers=2, steps=4, batch_size=4, seq_len=16, eval_batches=1)


def figures(page: str) -> list[str]:
    return re.findall(r'<img alt="([^"]*)" src="data:image/png;base64,', page)


def test_plots_follow_the_data(tmp_path):
    spec = {
        "name": "plots",
        "base": {**TINY, "eval_every": 2},
        "experiments": {
            "lrs": {"sweep": {"placement": ["post", "pre"], "lr": [0.001, 0.01], "seed": [0, 1]}},
            "noeval": {"set": {"eval_every": 0, "seed": 7}},
        },
    }
    run_study(parse_spec(spec), tmp_path, progress=False)
    page = (tmp_path / "report.html").read_text()
    assert not re.search(r'src="(?!data:)', page)  # nothing to fetch: one self-contained file
    lrs = figures(page[page.index("<h2>lrs</h2>") : page.index("<h2>noeval</h2>")])
    assert "final loss vs lr" in lrs and "final loss vs warmup" not in lrs
    assert {"loss curves", "per layer: FFN weight-gradient norm", "per layer: residual stream RMS"} <= set(
        lrs
    )
    assert {"per layer: residual-stream gradient norm", "per layer: FFN update / weight (mean)"} <= set(lrs)
    assert "x, F(x), x + F(x)" in lrs
    noeval = figures(page[page.index("<h2>noeval</h2>") :])
    assert "final loss vs lr" not in noeval and "loss curves" in noeval


def test_report_is_rebuilt_from_the_database_alone(tmp_path):
    spec = {"name": "r", "base": {**TINY, "eval_every": 0}, "experiments": {"a": {"sweep": {"seed": [0, 1]}}}}
    run_study(parse_spec(spec), tmp_path, progress=False)
    first = (tmp_path / "report.html").read_text()
    (tmp_path / "report.html").unlink()
    with Store(tmp_path / "study.sqlite") as store:  # a stored number changes: the report follows
        run_id = store.runs()[0]["id"]
        store.db.execute("UPDATE runs SET final_val_loss = 12.345 WHERE id = ?", (run_id,))
        store.db.commit()
    second = build_report(tmp_path).read_text()
    assert "12.345" in second and "12.345" not in first
    assert second.count("<tr>") == first.count("<tr>")
