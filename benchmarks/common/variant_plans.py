"""A backward variant (``addnorm.ops.launch_config.BWD_VARIANTS``) around some steps, with call plans of
its own: selecting a variant (``use_bwd_variant``) makes every cached call plan anew, which in steps that
alternate with the default's would time plan building in every step. A :class:`BackwardVariant` swaps in
its variant and its own plan cache on entry and puts the others' back on exit, so that once both are
warm no plan is rebuilt. The benchmarks use it to time a candidate variant beside the default in the
same interleaved rounds (``benchmarks/host/step_host.py``, ``benchmarks/step/hf_step.py``'s diagnostics). A
:class:`SublayerCast` does the same for the candidate way of handing a sublayer its input
(``addnorm.model.stream.AUTOCAST_SUBLAYER_INPUT``), whose calls have plans of their own already.
"""

from __future__ import annotations

__all__ = ["BackwardVariant", "SublayerCast"]


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


class SublayerCast:
    """``with SublayerCast(True):`` runs its block with ``addnorm.model.stream.AUTOCAST_SUBLAYER_INPUT``
    set to the value given (True: a fused op writes a sublayer's normed input in autocast's dtype), then
    puts the previous value back. Calling it returns itself, as :class:`BackwardVariant`."""

    def __init__(self, value: bool) -> None:
        self.value = bool(value)
        self.saved: bool | None = None

    def __call__(self) -> SublayerCast:
        return self

    def __enter__(self) -> SublayerCast:
        from addnorm.model import stream

        self.saved, stream.AUTOCAST_SUBLAYER_INPUT = stream.AUTOCAST_SUBLAYER_INPUT, self.value
        return self

    def __exit__(self, *exc) -> None:
        from addnorm.model import stream

        stream.AUTOCAST_SUBLAYER_INPUT, self.saved = self.saved, None
