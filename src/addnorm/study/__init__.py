"""Studies: a YAML spec expanded to runs, executed (in-process or a process pool), stored in SQLite,
and reported with the literature's claims checked against the numbers under a stated rule."""

from .._lazy import lazy_exports

# public name -> the submodule that defines it (imported on first use: ``study --keys`` reads
# ``addnorm.study.keys`` without torch)
_EXPORTS = {
    **dict.fromkeys(
        ("Executor", "LocalExecutor", "ProcessExecutor", "make_executor", "plan_workers"), ".executors"
    ),
    **dict.fromkeys(("CLAIMS", "RULE", "Finding", "compute_findings"), ".findings"),
    "build_report": ".report",
    **dict.fromkeys(("StudyOutcome", "run_study"), ".runner"),
    **dict.fromkeys(
        ("PlannedRun", "SpecError", "StudySpec", "load_spec", "parse_spec", "preset_names"), ".spec"
    ),
    "Store": ".store",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
