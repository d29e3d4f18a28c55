"""Studies: a YAML spec expanded to runs, executed (in-process or a process pool), stored in SQLite,
and reported with the literature's claims checked against the numbers under a stated rule."""

from .executors import Executor, LocalExecutor, ProcessExecutor, make_executor, plan_workers
from .findings import CLAIMS, RULE, Finding, compute_findings
from .report import build_report
from .runner import StudyOutcome, run_study
from .spec import PlannedRun, SpecError, StudySpec, load_spec, parse_spec, preset_names
from .store import Store

__all__ = [
    "CLAIMS",
    "Executor",
    "Finding",
    "LocalExecutor",
    "PlannedRun",
    "ProcessExecutor",
    "RULE",
    "SpecError",
    "Store",
    "StudyOutcome",
    "StudySpec",
    "build_report",
    "compute_findings",
    "load_spec",
    "make_executor",
    "parse_spec",
    "plan_workers",
    "preset_names",
    "run_study",
]
