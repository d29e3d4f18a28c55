"""What a study database must be for a study to resume it, and what its stored runs measured.

A study folder moves between machines (a GPU study grows window by window: the database is carried to
the device, resumed, and brought back): its runs are identified by their settings' hash, not by a path
or a machine, so a copy resumes anywhere. Two things are refused, in one line, before anything is
written (:class:`NotResumable`, exit 2):

- runs stored by **another addnorm version** (``provenance.addnorm``): the results of two versions are not
  mixed in one study (the git commit may differ: a study resumed after a commit is still one version);
- a run stored under the id of a planned run with **other settings** than the spec gives it (a database of
  another study, or of settings whose hashing changed): a stored result would stand for a run it is not.
  Keys added to the run settings since a run was stored (``LATER_KEYS``) read as the value runs had
  before they existed.

:func:`timings` turns the stored runs into the measurements the budget's :class:`~.budget.Estimator`
reads (wall time, device, whether every step trained).
"""

from __future__ import annotations

import json
from pathlib import Path

from .. import __version__
from ..train.config import LATER_KEYS
from .cost_model import Timing
from .spec import ResolvedPlan


class NotResumable(ValueError):
    """The study database cannot be resumed by this spec and this addnorm (one line: why, what to do)."""


def _canonical(config: dict) -> dict:
    return json.loads(json.dumps(config, sort_keys=True))


def _text(value) -> str:
    """A setting as JSON text, so that values compare as stored (NaN equals NaN)."""
    return json.dumps(value, sort_keys=True)


def check_resumable(stored: list[dict], plan: ResolvedPlan, db: str | Path) -> None:
    """Refuse (:class:`NotResumable`) a database ``db`` whose runs ``stored`` (``Store.measurements``)
    come from another addnorm version, or hold a planned run's id with other settings."""
    planned = {run.run_id: run for run in plan.runs}
    for row in stored:
        if row["id"] not in planned:
            continue  # not part of this spec: never read into its results
        version = (row.get("provenance") or {}).get("addnorm")
        if version is not None and version != __version__:
            raise NotResumable(
                f"{db}: its runs were stored by addnorm {version}, this is addnorm {__version__}; the "
                "results of two versions are not mixed in one study: resume it with addnorm "
                f"{version}, or use another --out"
            )
        run = planned[row["id"]]
        here = _canonical(run.config.to_dict())
        there = {**_canonical(LATER_KEYS), **_canonical(row["config"])}
        differs = sorted(k for k in set(here) | set(there) if _text(here.get(k)) != _text(there.get(k)))
        if differs:
            key = differs[0]
            raise NotResumable(
                f"{db}: run {row['id']} ({run.experiment}: {run.label}) is stored with other settings "
                f"than this spec gives it ({key}: {json.dumps(there.get(key))} stored, "
                f"{json.dumps(here.get(key))} here); the database belongs to another study or addnorm: "
                "use another --out"
            )


def timings(stored: list[dict]) -> list[Timing]:
    """The stored runs as measurements: complete when the run is done and trained every step; with how
    many runs shared the device (``provenance.packed``; 1 for a run stored before it was recorded, when
    a GPU ran one run at a time), tokens/s and a GPU's peak memory where stored."""
    out = []
    for row in stored:
        steps = row["config"].get("steps")
        complete = row["status"] == "done" and row["steps_done"] is not None and row["steps_done"] == steps
        prov = row.get("provenance") or {}
        out.append(
            Timing(
                row["config"],
                str(prov.get("device") or ""),
                float(row["wall_s"] or 0.0),
                complete,
                packed=float(prov.get("packed") or 1.0),
                tokens_per_s=row.get("tokens_per_s"),
                peak_memory=prov.get("peak_memory"),
            )
        )
    return out
