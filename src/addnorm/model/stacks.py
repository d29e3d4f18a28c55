"""Stacks of layers with one placement per layer and the final norm that placement calls for."""

from __future__ import annotations

from torch import Tensor, nn

from ..norms import build_norm
from ..placements import Placement
from .config import TransformerConfig
from .layers import DecoderLayer, EncoderLayer, _unbatch_mask, check_input, from_batch_first, to_batch_first


def needs_final_norm(cfg: TransformerConfig, placements: list[Placement]) -> bool:
    """``final_norm="auto"``: a norm after the stack exactly when its last layer leaves the stream
    unnormalised (Pre-LN and kin, Xiong et al. 2020); ``True``/``False`` force it."""
    if cfg.final_norm == "auto":
        return bool(placements) and placements[-1].final_norm
    return bool(cfg.final_norm)


class _Stack(nn.Module):
    layer_cls: type[nn.Module]

    def __init__(self, cfg: TransformerConfig, n_layers: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.cfg = cfg
        placements = cfg.placements_for(n_layers)
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, p, n_layers=n_layers, device=device, dtype=dtype) for p in placements
        )
        self.norm = (
            build_norm(cfg.norm, cfg.d_model, device=device, dtype=dtype, **cfg.norm_kwargs())
            if needs_final_norm(cfg, placements)
            else None
        )

    @property
    def placements(self) -> list[Placement]:
        return [layer.placement for layer in self.layers]

    def _finish(self, x: Tensor) -> Tensor:
        return self.norm(x) if self.norm is not None else x


class Encoder(_Stack):
    """A stack of :class:`EncoderLayer` (plus the final norm); call signature of ``nn.TransformerEncoder``."""

    layer_cls = EncoderLayer

    def __init__(
        self, cfg: TransformerConfig, n_layers: int | None = None, *, device=None, dtype=None
    ) -> None:
        super().__init__(
            cfg, cfg.encoder_layers if n_layers is None else n_layers, device=device, dtype=dtype
        )

    def forward_batch_first(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        for layer in self.layers:
            x = layer.forward_batch_first(x, mask, src_key_padding_mask, is_causal)
        return self._finish(x)

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
    ) -> Tensor:
        check_input(src, "src", self.cfg.d_model)
        x, unbatched = to_batch_first(src, self.cfg.batch_first)
        y = self.forward_batch_first(x, mask, _unbatch_mask(src_key_padding_mask, unbatched), bool(is_causal))
        return from_batch_first(y, self.cfg.batch_first, unbatched)


class Decoder(_Stack):
    """A stack of :class:`DecoderLayer` (plus the final norm); call signature of ``nn.TransformerDecoder``."""

    layer_cls = DecoderLayer

    def __init__(
        self, cfg: TransformerConfig, n_layers: int | None = None, *, device=None, dtype=None
    ) -> None:
        super().__init__(
            cfg, cfg.decoder_layers if n_layers is None else n_layers, device=device, dtype=dtype
        )

    def forward_batch_first(
        self,
        x: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        for layer in self.layers:
            x = layer.forward_batch_first(
                x,
                memory,
                tgt_mask,
                memory_mask,
                tgt_key_padding_mask,
                memory_key_padding_mask,
                tgt_is_causal,
                memory_is_causal,
            )
        return self._finish(x)

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool | None = None,
        memory_is_causal: bool = False,
    ) -> Tensor:
        d = self.cfg.d_model
        check_input(tgt, "tgt", d)
        check_input(memory, "memory", d)
        x, unbatched = to_batch_first(tgt, self.cfg.batch_first)
        mem, _ = to_batch_first(memory, self.cfg.batch_first)
        y = self.forward_batch_first(
            x,
            mem,
            tgt_mask,
            memory_mask,
            _unbatch_mask(tgt_key_padding_mask, unbatched),
            _unbatch_mask(memory_key_padding_mask, unbatched),
            bool(tgt_is_causal),
            memory_is_causal,
        )
        return from_batch_first(y, self.cfg.batch_first, unbatched)
