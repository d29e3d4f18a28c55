"""Text corpora read as bytes: the Python standard library's own sources (on every machine) or a path."""

from __future__ import annotations

import functools
import math
import os
import sysconfig
from pathlib import Path

import torch
from torch import nn

from ..model import LanguageModel
from .base import TASKS, Batch, Task, to_device

DEFAULT_CORPUS_BYTES = 4_000_000
HELD_OUT = 0.1  # the share of a corpus, at its end, that language modelling holds out for evaluation


_LEFT_OUT = frozenset(("site-packages", "dist-packages", "test", "tests", "idlelib"))


def _sources(root: Path) -> list[Path]:
    """The ``.py`` paths below ``root`` outside the folders of :data:`_LEFT_OUT`, which are not entered
    (an interpreter's own site-packages can hold far more files than its standard library), nor are
    links to folders (as ``Path.rglob``)."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in _LEFT_OUT]
        found.extend(Path(folder, f) for f in files if f.endswith(".py"))
    return found


@functools.lru_cache(maxsize=4)  # read once per process: every run of a study uses it
def stdlib_corpus(limit: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """The ``.py`` files of the standard library (``sysconfig`` 'stdlib' path) in sorted order, as bytes,
    capped at ``limit``; site-packages and tests are left out so every machine reads the same kind of text."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(_sources(root)):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= limit:
            break
    corpus = b"".join(chunks)[:limit]
    if not corpus:
        raise ValueError(f"corpus: found no Python source files under the stdlib directory {root}")
    return corpus


def read_corpus(path: str | Path | None = None, limit: int = DEFAULT_CORPUS_BYTES) -> bytes:
    """Bytes of a text file, or of every file below a folder (sorted), or the stdlib default for None."""
    if path is None or str(path) in ("", "stdlib"):
        return stdlib_corpus(limit)
    p = Path(path)
    if p.is_file():
        data = p.read_bytes()[:limit]
    elif p.is_dir():
        data = b"".join(f.read_bytes() for f in sorted(p.rglob("*")) if f.is_file())[:limit]
    else:
        raise ValueError(f"corpus: {str(path)!r} is neither a file nor a folder")
    if len(data) < 1024:
        raise ValueError(f"corpus: {str(path)!r} has {len(data)} bytes; at least 1024 are needed")
    return data


@TASKS.register("lm", aliases=("language_modelling", "char_lm"))
class LanguageModelling(Task):
    """Byte-level next-token prediction (vocab 256) with a decoder-only model; the last 10% of the
    corpus is held out. Metric: bits per byte = loss / ln 2.

    Batches are cut on the device: the corpus is copied there once (as bytes), and each batch sends
    only its window starts, drawn on the CPU so that a seed gives the same batches on every device."""

    name = "lm"
    metric = "bits_per_byte"
    vocab = 256

    def __init__(self, corpus: str | None = None, limit: int = DEFAULT_CORPUS_BYTES) -> None:
        data = torch.frombuffer(bytearray(read_corpus(corpus, limit)), dtype=torch.uint8)
        cut = int((1 - HELD_OUT) * data.numel())
        self.splits = {"train": data[:cut], "val": data[cut:]}
        self._placed: dict[tuple[str, torch.device], torch.Tensor] = {}

    def _split_on(self, split: str, device: torch.device) -> torch.Tensor:
        if device.type == "cpu":
            return self.splits[split]
        key = (split, device)
        if key not in self._placed:
            self._placed[key] = self.splits[split].to(device)
        return self._placed[key]

    def batch(self, split, batch_size, seq_len, generator, device=None):
        data = self.splits[split]
        if data.numel() <= seq_len + 1:
            raise ValueError(f"seq_len: {seq_len} is too long for the {split} split ({data.numel()} bytes)")
        device = torch.device("cpu") if device is None else torch.device(device)
        starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
        offsets = to_device(starts, device)[:, None] + torch.arange(seq_len + 1, device=device)
        windows = self._split_on(split, device)[offsets].long()
        return Batch(None, windows[:, :-1], windows[:, 1:])

    def build_model(self, cfg) -> nn.Module:
        return LanguageModel(cfg, self.vocab)

    def metric_value(self, loss, logits, batch) -> float:
        return loss / math.log(2)
