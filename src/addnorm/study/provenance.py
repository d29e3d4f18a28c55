"""Where and with what a run ran: package, commit, torch and Python versions, device, threads, date.

Computed in the process that trains (an executor's worker), so it describes that process; the
driver stores it with the run and the report prints it. The training loop adds what it chose itself
(the device it trained on, its precision, whether it compiled, a GPU's peak memory) and the driver how
many runs shared the device (``packed``, :mod:`.packing`).

The commit is :func:`addnorm.commit.commit_of`'s, the source of truth the benchmarks read too:
``addnorm study --commit SHA`` (``$ADDNORM_COMMIT``, which the workers inherit), else the checkout's
``benchmarks/.commit`` (a copy of the tree without ``.git``), else git; ``commit_source`` says which.
"""

from __future__ import annotations

import platform
from datetime import datetime, timezone

import torch

from .. import __version__
from ..commit import commit_of
from ..train.device import cpu_model, device_name

__all__ = ["cpu_model", "device_name", "provenance"]


def provenance() -> dict:
    """This process's provenance, as stored with each run."""
    commit = commit_of()
    return {
        "addnorm": __version__,
        "git_commit": commit.sha,
        "git_dirty": commit.dirty,
        "commit_source": commit.source,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device_name(),
        "threads": torch.get_num_threads(),
        "platform": platform.platform(terse=True),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }
