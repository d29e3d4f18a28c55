"""The op policy's measured rules (``addnorm.ops.policy.MEASURED``) against the recorded tables they
come from, and the rules the policy's functions give against that table: where a recorded table shows
the eager ops faster than the fused op, ``auto`` does not choose the op."""

from __future__ import annotations

import copy
import importlib.util
import re
from pathlib import Path

import pytest
import torch

import addnorm as an
from addnorm import addnorm as addnorm_module
from addnorm.ops import policy

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
HAS_TRITON = importlib.util.find_spec("triton") is not None


@pytest.mark.parametrize("row", policy.MEASURED, ids=lambda m: f"{m.device_type}-{m.source}")
def test_each_measured_rule_is_a_recorded_number_beyond_the_spread(row):
    """Each row names its source table, which holds its evidence line, the device it names and its
    ratio (fused / eager time, or its inverse where the table gives speeds), and the ratio exceeds the
    runs' spread (a tie is not a rule)."""
    text = (RESULTS / row.source).read_text()
    assert row.device in text, (row.source, row.device)
    (line,) = [ln for ln in text.splitlines() if row.evidence in ln][:1]
    numbers = [float(v) for v in re.findall(r"(\d+\.\d+)x", line)]
    assert any(abs(v - row.ratio) < 1e-3 or abs(1 / v - row.ratio) < 1e-2 for v in numbers), (line, row)
    assert row.ratio > 1 + policy.SPREAD


@pytest.mark.parametrize("row", policy.MEASURED, ids=lambda m: f"{m.device_type}-{m.source}")
def test_each_rule_covers_its_measured_calls_and_no_smaller_or_larger_ones(row):
    """At the row's bounds the eager ops are preferred; one column narrower (a row from a hidden size
    on) or one element more (a row up to a size) the op is, as it is for another norm, placement or
    dropout than the row's."""
    hidden = row.min_hidden or 64
    numel = row.max_numel if row.max_numel is not None else hidden * 8
    call = {"hidden": hidden, "numel": numel, "norm": row.norm or "layernorm", "prenorm": bool(row.prenorm)}
    call["dropout"] = bool(row.dropout)
    assert policy.eager_faster(row.device_type, **call)
    if row.min_hidden:
        assert not policy.eager_faster(row.device_type, **{**call, "hidden": row.min_hidden - 1})
    if row.max_numel is not None:
        assert not policy.eager_faster(row.device_type, **{**call, "numel": row.max_numel + 1})
    if row.norm is not None:
        assert not policy.eager_faster(row.device_type, **{**call, "norm": "rmsnorm"})
    if row.prenorm is not None:
        assert not policy.eager_faster(row.device_type, **{**call, "prenorm": not row.prenorm})
    if row.dropout is not None:
        assert not policy.eager_faster(row.device_type, **{**call, "dropout": not row.dropout})


def test_a_model_fuses_where_no_measured_rule_says_otherwise():
    """fused_op_preferred (the rows without a size bound): the op except on the CPU with dropout; a
    DTensor stream always."""
    assert not policy.fused_op_preferred("cpu", dropout=True)
    assert policy.fused_op_preferred("cpu", dropout=False)
    assert policy.fused_op_preferred(torch.device("cuda"), dropout=True)
    assert policy.fused_op_preferred(torch.device("cuda"), dropout=False)
    assert policy.fused_op_preferred("cpu", dropout=True, sharded=True)
    # the size-bounded rows: the H100's tiny calls (the LM step at 8 x 16 x 64 elements)
    assert policy.eager_faster_at_size("cuda", 8 * 16 * 64, True)
    assert policy.eager_faster_at_size("cuda", 8 * 16 * 64, False)
    assert not policy.eager_faster_at_size("cuda", 8 * 16 * 64 + 1, True)
    assert not policy.eager_faster_at_size("cpu", 1, True)  # the CPU's dropout row is fused_op_preferred's


@pytest.mark.skipif(not HAS_TRITON, reason="auto means triton on CUDA only where triton is installed")
def test_the_op_s_auto_backend_leaves_to_torch_the_shapes_measured_faster_there(backend_env):
    """resolve_backend('auto') on a CUDA device: torch for Post-LN LayerNorm rows of 16384 columns and
    wider (the H100's op table), triton for narrower rows, Pre-LN, RMSNorm, or unknown norm; an explicit
    backend is never overridden."""
    backend_env(None)
    cuda, bf16 = torch.device("cuda"), (torch.bfloat16,)
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", False) == "torch"
    assert policy.resolve_backend("auto", cuda, 32768, bf16, "layernorm", False) == "torch"
    assert policy.resolve_backend("auto", cuda, 8192, bf16, "layernorm", False) == "triton"
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", True) == "triton"
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "rmsnorm", False) == "triton"
    assert policy.resolve_backend("auto", cuda, 16384, bf16) == "triton"
    assert policy.resolve_backend("triton", cuda, 16384, bf16, "layernorm", False) == "triton"


@pytest.mark.parametrize("tokens, fused", [(4, True), (3, False)])
def test_a_model_runs_unfused_where_a_size_rule_covers_its_calls(monkeypatch, tokens, fused):
    """AddNorm asks the size-bounded rows with its stream's element count: a CPU row up to 3 x 16
    elements (a stand-in for the H100's tiny-call row) sends a 3-token call to the unfused modules and
    leaves a 4-token call to the op; both give the unfused model's values."""
    row = policy.Measured("cpu", "test", None, None, None, 0, 3 * 16, 2.0, "", "")
    monkeypatch.setitem(policy._MEASURED_BY_DEVICE, "cpu", (row,))
    calls = []
    op = addnorm_module.add_norm
    monkeypatch.setattr(addnorm_module, "add_norm", lambda *a, **k: calls.append(1) or op(*a, **k))
    torch.manual_seed(0)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="post")
    model = an.LanguageModel(cfg, vocab=40).eval()
    unfused = copy.deepcopy(model)
    for m in unfused.modules():
        if isinstance(m, an.AddNorm):
            m.fused = False
    ids = torch.arange(tokens).reshape(1, tokens)
    out = model(ids)
    assert bool(calls) is fused
    torch.testing.assert_close(out, unfused(ids))
