"""``addnorm export``: a study's current plan as tidy CSV, the stored rows (:meth:`.store.Store.export_csv`)
and, with ``--profiles``, the per-layer profiles the report and the findings read (:mod:`.profiles`)."""

from __future__ import annotations

import csv
from pathlib import Path

from .profiles import all_profiles
from .store import Store

PROFILE_COLUMNS = ("run_id", "step", "layer", "part", "metric", "value")


def write_csv(store: Store, folder: str | Path, profiles: bool = False) -> list[Path]:
    """``runs.csv``, ``experiments.csv``, ``metrics.csv`` and ``layer_metrics.csv`` as stored, and with
    ``profiles`` ``layer_profiles.csv``: one row per run, step, layer, part (``ffn``, ``stream``) and
    metric, a layer's rows combined by the profile rule (:func:`.profiles.layer_profile`)."""
    written = store.export_csv(folder)
    if not profiles:
        return written
    path = Path(folder) / "layer_profiles.csv"
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(PROFILE_COLUMNS)
        for run in store.runs():
            rows = store.layer_rows(run["id"])
            writer.writerows((run["id"], *values) for values in all_profiles(rows))
    return [*written, path]
