"""Stacks of layers with one placement per layer and the final norm that placement calls for."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..norms import build_norm
from ..placements import Placement
from .config import TransformerConfig
from .init import Depth
from .layers import DecoderLayer, EncoderLayer, _unbatch_mask, default_depth, enter, from_batch_first
from .stream import Stream


def needs_final_norm(cfg: TransformerConfig, placements: list[Placement]) -> bool:
    """``final_norm="auto"``: a norm after the stack exactly when its last layer leaves the stream
    unnormalised (Pre-LN and kin, Xiong et al. 2020); ``True``/``False`` force it."""
    if cfg.final_norm == "auto":
        return bool(placements) and placements[-1].final_norm
    return bool(cfg.final_norm)


class _Stack(nn.Module):
    """Layers plus the final norm, passing one :class:`Stream` from layer to layer, so that the add
    closing a layer can fuse with the next layer's input norm or the final norm (ResiDual: two streams,
    output xa + N(xd); nGPT: the input projected onto the unit sphere)."""

    layer_cls: type[EncoderLayer | DecoderLayer]

    def __init__(
        self,
        cfg: TransformerConfig,
        n_layers: int | None = None,
        *,
        depth: Depth | None = None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        depth = depth or default_depth(self.layer_cls.part, cfg, n_layers)
        self.cfg = cfg
        self.depth = depth
        placements = cfg.placements_for(depth.n_layers)
        streams = {p.stream for p in placements}
        if len(streams) > 1 and streams & {"resi_dual", "ngpt"}:
            raise ValueError(
                f"placement: {sorted(streams)} cannot be mixed in one stack; ResiDual and nGPT change the "
                "residual stream of every layer"
            )
        self.stream = placements[0].stream if placements else "standard"
        self.layers = nn.ModuleList(
            self.layer_cls(cfg, p, depth=depth, device=device, dtype=dtype) for p in placements
        )
        norm_name = placements[-1].norm if placements and placements[-1].norm else cfg.norm
        self.norm = (
            build_norm(
                norm_name, cfg.d_model, device=device, dtype=dtype, **cfg.norm_kwargs(), **cfg.norm_options
            )
            if needs_final_norm(cfg, placements)
            else None
        )

    @property
    def placements(self) -> list[Placement]:
        return [layer.placement for layer in self.layers]

    def _start(self, x: Tensor) -> Stream:
        """The stream the first layer reads: ResiDual's two streams both start at x; nGPT's on the sphere."""
        if self.stream == "resi_dual":
            return Stream(x, second=x)
        if self.stream == "ngpt":
            return Stream(F.normalize(x, dim=-1))
        return Stream(x)


class Encoder(_Stack):
    """A stack of :class:`EncoderLayer` (plus the final norm); call signature of ``nn.TransformerEncoder``."""

    layer_cls = EncoderLayer

    def forward(
        self,
        src: Tensor,
        mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool | None = None,
        *,
        batch_first: bool | None = None,
    ) -> Tensor:
        """Same arguments as ``nn.TransformerEncoder.forward``; ``batch_first`` overrides the config's
        layout for this call."""
        bf = self.cfg.batch_first if batch_first is None else batch_first
        x, unbatched = enter(src, "src", self.cfg.d_model, bf)
        kpm = _unbatch_mask(src_key_padding_mask, unbatched)
        x = self._start(x)
        for layer in self.layers:
            x = layer(x, mask, kpm, bool(is_causal))
        return from_batch_first(x.output(self.norm), bf, unbatched)


class Decoder(_Stack):
    """A stack of :class:`DecoderLayer` (plus the final norm); call signature of ``nn.TransformerDecoder``."""

    layer_cls = DecoderLayer

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
        *,
        batch_first: bool | None = None,
    ) -> Tensor:
        """Same arguments as ``nn.TransformerDecoder.forward``; ``batch_first`` overrides the config's
        layout for this call."""
        bf = self.cfg.batch_first if batch_first is None else batch_first
        d = self.cfg.d_model
        x, unbatched = enter(tgt, "tgt", d, bf)
        mem, _ = enter(memory, "memory", d, bf)
        kpm = _unbatch_mask(tgt_key_padding_mask, unbatched)
        mem_kpm = _unbatch_mask(memory_key_padding_mask, unbatched)
        x = self._start(x)
        for layer in self.layers:
            x = layer(x, mem, tgt_mask, memory_mask, kpm, mem_kpm, bool(tgt_is_causal), memory_is_causal)
        return from_batch_first(x.output(self.norm), bf, unbatched)
