"""A backward variant (``addnorm.ops.launch_config.BWD_VARIANTS``) around some steps, with call plans of
its own: selecting a variant (``use_bwd_variant``) makes every cached call plan anew, which in steps that
alternate with the default's would time plan building in every step. A :class:`BackwardVariant` swaps in
its variant and its own plan cache on entry and puts the others' back on exit, so that once both are
warm no plan is rebuilt. The benchmarks use it to time a candidate variant beside the default in the
same interleaved rounds (``bench_step_host.py``, ``bench_hf_step.py``'s diagnostics).
"""

from __future__ import annotations

__all__ = ["BackwardVariant"]


class BackwardVariant:
    """``with BackwardVariant("kernel_sums"):`` runs its block with that backward variant and this
    object's own call plans (kept between blocks). Calling it returns itself: a switch of
    ``bench_hf_step.SWITCHES`` (a context for each step)."""

    def __init__(self, variant: str) -> None:
        from addnorm.ops import launch_config as lc

        if variant not in lc.BWD_VARIANTS:
            raise ValueError(f"variant: expected one of {lc.BWD_VARIANTS}, got {variant!r}")
        self.variant = variant
        self.plans: dict = {}
        self.last: tuple = (None, None)
        self.saved: tuple | None = None

    def __call__(self) -> BackwardVariant:
        return self

    def __enter__(self) -> BackwardVariant:
        from addnorm.ops import functional
        from addnorm.ops import launch_config as lc

        self.saved = functional._PLANS, functional._last, lc.BWD_VARIANT
        functional._PLANS, functional._last, lc.BWD_VARIANT = self.plans, self.last, self.variant
        return self

    def __exit__(self, *exc) -> None:
        from addnorm.ops import functional
        from addnorm.ops import launch_config as lc

        self.last = functional._last
        functional._PLANS, functional._last, lc.BWD_VARIANT = self.saved
        self.saved = None
