"""The positions a sequence shard is embedded at, which context parallel relies on (its test:
``test_tensor_parallel.py``): each kind of position encoding gives a shard at its own positions those
rows of the whole sequence's embedding, and bad positions are one-line errors."""

from __future__ import annotations

import pytest
import torch
from _tp_models import VOCAB, lm

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed")


def test_positions_pick_rows_of_the_position_table():
    """What context parallel relies on: a sequence shard embedded at its own positions is those rows of
    the whole sequence's embedding (each kind of position encoding)."""
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(2))
    chunks = torch.tensor([0, 1, 8, 9, 2, 3, 6, 7])  # load-balanced shards: chunks from both ends
    for kind in ("sinusoidal", "learned", "none"):
        model = lm(positional=kind).eval()
        whole = model.embed(ids, "tokens")
        torch.testing.assert_close(
            model.embed(ids[:, chunks], "tokens", chunks), whole[:, chunks], atol=0, rtol=0
        )
        per_row = chunks.expand(2, -1)
        torch.testing.assert_close(
            model.embed(ids[:, chunks], "tokens", per_row), whole[:, chunks], atol=0, rtol=0
        )
        torch.testing.assert_close(model(ids, positions=torch.arange(10)), model(ids), atol=0, rtol=0)


@pytest.mark.parametrize(
    ("positions", "message"),
    [
        (
            torch.arange(9),
            r"^positions: expected integer positions of shape \(seq,\) or \(batch, seq\) like the "
            r"tokens' \(2, 10\), got dtype torch.int64, shape \(9,\)$",
        ),
        (torch.arange(10.0), r"^positions: expected integer positions .* got dtype torch.float32"),
        (torch.arange(10) + 10, r"^positions: position 19 is outside the table of 16 positions \(max_len=16"),
    ],
)
def test_bad_positions_are_one_line_errors(positions, message):
    with pytest.raises(ValueError, match=message):
        lm()(torch.zeros(2, 10, dtype=torch.long), positions=positions)
