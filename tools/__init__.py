"""Project tools that are not benchmarks: the study's fault trials (``fault_trials`` and its parts), the
documentation's runnable blocks and report screenshots (``doc_blocks``, ``report_screenshot``), the
plain-torch gloo exit repro (``gloo_exit_repro``), the test tiers' durations and CPU census
(``test_durations``, ``census``) and child-process helpers (``procs``) the benchmarks,
the tools and the tests share. Run from the repository root: ``python -m tools.fault_trials``."""
