"""The op policy's measured rules (``addnorm.ops.measured.MEASURED``) against the recorded tables they
come from, and the decisions the policy gives from them: a model fuses on a GPU only where a recorded
step on that very GPU ran faster fused; the op's ``auto`` backend leaves to the eager ops the shapes a
recorded table found faster there."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path

import pytest
import torch

import addnorm as an
from addnorm import connection as connection_module
from addnorm.ops import measured, policy

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
HAS_TRITON = importlib.util.find_spec("triton") is not None
H100, H200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
PROV = measured.Provenance("a test row", "/ratio", "0000000", "2026-12-01")  # a made-up row's
ROW_IDS = lambda m: f"{m.device}-{m.scope}-{m.source}-{m.dropout}-{m.model}"  # noqa: E731


@pytest.fixture
def gpu_named(monkeypatch):
    """``gpu_named(name)``: CUDA devices report ``name`` to the policy (no GPU needed); the policy's
    cached decisions are forgotten before and after."""

    def name_it(name: str) -> None:
        monkeypatch.setattr(measured, "_cuda_name", lambda index: name)
        policy.set_fusion("measured")

    yield name_it
    policy.set_fusion("measured")


def _json_value(data, key: str):
    """The value at JSON pointer ``key`` (RFC 6901), walked here without the tool that wrote the rows."""
    for part in key.split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        data = data[int(part)] if isinstance(data, list) else data[part]
    return data


@pytest.mark.parametrize("row", measured.MEASURED, ids=ROW_IDS)
def test_each_measured_row_is_the_number_its_benchmark_json_holds(row):
    """Each row's ratio is the value its benchmark wrote: at its key in its JSON file (divided by the
    value at ``over``, inverted where the file gives unfused over fused); the file is in the window
    of the row's commit and date and names the row's device; the ratio is beyond the runs' spread (a
    tie is not a rule)."""
    p = row.provenance
    data = json.loads((RESULTS / p.file).read_text())
    value = float(_json_value(data, p.key)) / (float(_json_value(data, p.over)) if p.over else 1.0)
    assert row.ratio == (1 / value if p.inverse else value), (row, value)
    device, window = Path(p.file).parts[:2]
    assert window.startswith(p.date) and p.commit in window, (p, window)
    assert (
        row.device == "cpu"
        and device == "cpu"
        or row.device in json.dumps(data)
        or row.device in (RESULTS / p.file).with_suffix(".md").read_text()
    )
    assert row.slower or row.faster
    assert row.scope in measured.SCOPES


@pytest.mark.parametrize("row", [m for m in measured.MEASURED if m.scope == "step"], ids=ROW_IDS)
def test_the_decision_on_the_call_each_step_row_timed_is_that_row(row, gpu_named):
    """``fusion_decision`` on the very call a step row was recorded on (its device, mode, dropout,
    elements per call and model) answers with that row: not fused where it ran slower, fused where
    it ran faster."""
    device = "cpu" if row.device == "cpu" else "cuda"
    if device == "cuda":
        gpu_named(row.device)
    numel = row.max_numel if row.max_numel is not None else 8 * 1024 * 768
    d = policy.fusion_decision(
        device,
        dropout=bool(row.dropout),
        numel=numel,
        compiling=row.mode == "compile",
        model=row.model or "addnorm",
    )
    assert d.row == row and d.fuse == row.faster and row.source in d.why, d


def test_the_rows_tool_writes_a_row_from_a_window_json_and_refuses_a_tie(tmp_path):
    """``tools.measured_rows add`` reads the ratio where the benchmark wrote it and the commit and date
    from the window folder; the row it writes loads back as written; a ratio within the spread is
    refused with one line; ``check`` names a row whose file no longer holds its value."""
    from tools import measured_rows

    results, rows = tmp_path / "results", tmp_path / "rows"
    window = results / "h200" / "2026-12-01-abcdef1"
    window.mkdir(parents=True)
    rows.mkdir()
    (window / "step.json").write_text(json.dumps({"r": [{"a/b": {"fused": 90.0, "plain": 100.0}}]}))
    argv = ["add", "h200", "--device", H200, "--json", "h200/2026-12-01-abcdef1/step.json"]
    argv += ["--key", "/r/0/a~1b/fused", "--over", "/r/0/a~1b/plain", "--scope", "step", "--mode", "eager"]
    argv += ["--dropout", "false", "--model", "hf", "--what", "a test step"]
    args = measured_rows.parser().parse_args(argv)
    measured_rows.add(args, rows, results)
    (row,) = measured.load_rows(rows)
    assert row.device == H200 and row.ratio == 0.9 and row.faster and row.model == "hf" and not row.dropout
    assert (row.provenance.commit, row.provenance.date) == ("abcdef1", "2026-12-01")
    assert measured_rows.check(rows, results) == []
    (window / "step.json").write_text(json.dumps({"r": [{"a/b": {"fused": 99.0, "plain": 100.0}}]}))
    (bad,) = measured_rows.check(rows, results)
    assert "row 0.9, file 0.99" in bad
    with pytest.raises(ValueError, match="within the spread"):
        measured_rows.add(args, rows, results)


@pytest.mark.parametrize(
    "row", [m for m in measured.MEASURED if m.slower], ids=lambda m: f"{m.device}-{m.source}"
)
def test_each_slower_row_covers_its_calls_and_no_narrower_smaller_or_other_ones(row, gpu_named):
    """At the row's bounds the eager ops are preferred; one column narrower (a row from a hidden size
    on) or one element more (a row up to a size) they are not, nor for another norm, placement,
    dropout, execution mode or model than the row's."""
    device = "cpu" if row.device == "cpu" else "cuda"
    if device == "cuda":
        gpu_named(row.device)
    hidden = row.min_hidden or 64
    numel = row.max_numel if row.max_numel is not None else hidden * 8
    call = {"scope": row.scope, "mode": row.mode or "eager", "hidden": hidden, "numel": numel}
    call |= {"norm": row.norm or "layernorm", "prenorm": bool(row.prenorm), "dropout": bool(row.dropout)}
    call |= {"model": row.model}
    assert policy.eager_faster(device, **call) == row
    if row.min_hidden:
        assert policy.eager_faster(device, **{**call, "hidden": row.min_hidden - 1}) != row
    if row.max_numel is not None:
        assert policy.eager_faster(device, **{**call, "numel": row.max_numel + 1}) != row
    if row.norm is not None:
        assert (
            policy.eager_faster(
                device, **{**call, "norm": "rmsnorm" if row.norm == "layernorm" else "layernorm"}
            )
            != row
        )
    if row.prenorm is not None:
        assert policy.eager_faster(device, **{**call, "prenorm": not row.prenorm}) != row
    if row.dropout is not None:
        assert policy.eager_faster(device, **{**call, "dropout": not row.dropout}) != row
    if row.mode is not None:
        assert policy.eager_faster(device, **{**call, "mode": "compile"}) != row
    if row.model is not None:
        for other in (m for m in measured.MODELS if m != row.model):
            assert policy.eager_faster(device, **{**call, "model": other}) != row


def test_on_the_cpu_a_model_fuses_unless_a_recorded_step_ran_slower():
    """The CPU: without dropout the op runs the unfused modules' own ops (fused); with dropout the
    recorded step ran slower fused (the unfused modules); a DTensor stream always fuses."""
    yes = policy.fusion_decision("cpu", dropout=False)
    assert yes.fuse and yes.row is None and "torch's own ops" in yes.why
    no = policy.fusion_decision(torch.device("cpu"), dropout=True)
    assert not no.fuse and no.row.source.endswith("host_overhead_cpu.json") and "1.06x slower" in no.why
    assert policy.fusion_decision("cpu", dropout=True, sharded=True).fuse
    assert policy.fused_op_preferred("cpu", dropout=False) and not policy.fused_op_preferred(
        "cpu", dropout=True
    )


def test_on_a_gpu_a_model_fuses_only_where_that_gpu_ran_the_step_faster(gpu_named):
    """Each GPU by its own rows: the H100's HF step ran faster fused without dropout (fused there for
    any model, its rows predating the model key, but not its tiny host-bound calls, which ran slower);
    on the H200 (81f67f7) the same call fuses in a Hugging Face model (its HF step ran 1.05x faster)
    and not in addnorm's (its LM ran 0.93x); with dropout (addnorm's LM level: no row) and compiled
    (not timed), neither does; a GPU with no recorded step: unfused, the reason saying so."""
    big, tiny = 8 * 1024 * 768, 8 * 16 * 64
    gpu_named(H100)
    for model in measured.MODELS:
        d = policy.fusion_decision("cuda", dropout=False, numel=big, model=model)
        assert d.fuse and d.row.source.endswith("hf_step_gpu.json") and "1.05x faster" in str(d)
    d = policy.fusion_decision(torch.device("cuda", 0), dropout=False, numel=tiny)
    assert not d.fuse and d.row.source.endswith("host_overhead_cuda.json")
    d = policy.fusion_decision("cuda", dropout=True, numel=big)
    assert not d.fuse and d.row is None and "no recorded step on NVIDIA H100 80GB HBM3" in d.why
    assert not policy.fusion_decision("cuda", dropout=False, numel=big, compiling=True).fuse
    gpu_named(H200)  # an H100 row does not decide for an H200
    d = policy.fusion_decision("cuda", dropout=False, numel=big, model="hf")
    assert d.fuse and d.row.source.endswith("81f67f7/hf_step_h200.json") and "1.05x faster" in d.why
    d = policy.fusion_decision("cuda", dropout=False, numel=big)  # model="addnorm", the default
    assert not d.fuse and d.row.source.endswith("81f67f7/lm_step_h200.json") and "1.08x slower" in d.why
    for model in measured.MODELS:
        d = policy.fusion_decision("cuda", dropout=True, numel=big, model=model)
        assert not d.fuse and d.row is None and f"{model} model, eager, with dropout" in d.why
        assert not policy.fusion_decision("cuda", dropout=False, numel=big, compiling=True, model=model).fuse
    gpu_named("NVIDIA A100-SXM4-80GB")
    d = policy.fusion_decision("cuda", dropout=False, numel=big)
    assert not d.fuse and "NVIDIA A100-SXM4-80GB" in d.why
    assert policy.fusion_decision("cuda", dropout=False, numel=big, sharded=True).fuse
    with pytest.raises(ValueError, match="model: expected one of"):
        policy.fusion_decision("cuda", dropout=False, model="llama")


def test_a_connection_asks_for_its_models_rows_hugging_face_ones_for_hf(monkeypatch):
    """A row of the HF models' steps decides for the connections addnorm.hf puts in a Hugging Face
    model (fusion_model "hf"), not for addnorm's own model's: a CPU stand-in row, HF steps slower fused,
    leaves the rewired Llama's adds unfused and addnorm's LM's fused; each gives its unfused model's
    values."""
    pytest.importorskip("transformers")
    from addnorm import hf as anhf
    from addnorm.hf.tiny import tiny_model

    row = measured.Measured("cpu", "step", None, None, None, None, 0, None, 2.0, "", PROV, "hf")
    monkeypatch.setitem(measured._BY_DEVICE, ("cpu", "step"), (row,))
    policy.set_fusion("measured")  # forget cached decisions
    calls = []
    op = connection_module.add_norm
    monkeypatch.setattr(connection_module, "add_norm", lambda *a, **k: calls.append(1) or op(*a, **k))
    ids = torch.arange(6).reshape(1, 6)
    plain = tiny_model("llama").eval()
    fused = anhf.fuse(copy.deepcopy(plain))
    conns = [m for m in fused.modules() if isinstance(m, an.AddNorm)]
    assert conns and {c.fusion_model for c in conns} == {"hf"}
    with torch.no_grad():
        torch.testing.assert_close(fused(ids).logits, plain(ids).logits)
    assert not calls
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="post")
    lm = an.LanguageModel(cfg, vocab=40).eval()
    assert {m.fusion_model for m in lm.modules() if isinstance(m, an.AddNorm)} == {"addnorm"}
    lm(ids)
    assert calls
    monkeypatch.undo()
    policy.set_fusion("measured")


def test_set_fusion_overrides_the_measured_rule_and_is_checked(gpu_named):
    gpu_named("NVIDIA A100-SXM4-80GB")
    with policy.fusion("always"):
        assert policy.fusion_decision("cuda", dropout=True, numel=10).fuse
        assert policy.fusion_decision("cpu", dropout=True).fuse
    with policy.fusion("never"):
        assert not policy.fusion_decision("cpu", dropout=False).fuse
        assert policy.fusion_decision(
            "cpu", dropout=False, sharded=True
        ).fuse  # a DTensor stream needs the op
    assert not policy.fusion_decision("cpu", dropout=True).fuse
    with pytest.raises(ValueError, match="mode: expected one of"):
        policy.set_fusion("sometimes")


def test_the_environment_variable_sets_the_fusion_mode(monkeypatch):
    monkeypatch.setenv("ADDNORM_FUSION", "Never")
    assert policy._fusion_env() == "never"
    monkeypatch.setenv("ADDNORM_FUSION", "off")
    with pytest.raises(ValueError, match="ADDNORM_FUSION: expected one of"):
        policy._fusion_env()


@pytest.mark.skipif(not HAS_TRITON, reason="auto means triton on CUDA only where triton is installed")
def test_the_op_s_auto_backend_takes_its_torch_path_only_where_a_row_of_that_gpu_says(
    backend_env, gpu_named, monkeypatch
):
    """resolve_backend('auto') on a CUDA device: the kernels, on every GPU, since no recorded table shows
    the op's torch path faster (the H100's Post-LN row that sent 16384 columns to it on every GPU is
    gone); a row of one GPU's, here a stand-in for the H200's Post-LN LayerNorm from 16384 columns,
    sends its calls there on that GPU only; an explicit backend is never overridden."""
    backend_env(None)
    cuda, bf16 = torch.device("cuda"), (torch.bfloat16,)
    assert not [m for m in measured.MEASURED if m.scope == "op"]
    for name in (H100, H200):
        gpu_named(name)
        assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", False, False) == "triton"
    row = measured.Measured(H200, "op", None, "layernorm", False, None, 16384, None, 2.0, "", PROV)
    monkeypatch.setitem(measured._BY_DEVICE, (H200, "op"), (row,))
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", False, True) == "torch"
    assert policy.resolve_backend("auto", cuda, 8192, bf16, "layernorm", False, True) == "triton"
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", True, True) == "triton"
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "rmsnorm", False, True) == "triton"
    assert policy.resolve_backend("triton", cuda, 16384, bf16, "layernorm", False, True) == "triton"
    gpu_named(H100)
    assert policy.resolve_backend("auto", cuda, 16384, bf16, "layernorm", False, True) == "triton"


@pytest.mark.parametrize("tokens, fused", [(4, True), (3, False)])
def test_a_model_runs_unfused_where_a_size_rule_covers_its_calls(monkeypatch, tokens, fused):
    """AddNorm asks the policy with its stream's element count: a CPU step row up to 3 x 16 elements (a
    stand-in for the H100's tiny-call row) sends a 3-token call to the unfused modules and leaves a
    4-token call to the op; both give the unfused model's values."""
    row = measured.Measured("cpu", "step", None, None, None, None, 0, 3 * 16, 2.0, "", PROV)
    monkeypatch.setitem(measured._BY_DEVICE, ("cpu", "step"), (row,))
    policy.set_fusion("measured")  # forget cached decisions
    calls = []
    op = connection_module.add_norm
    monkeypatch.setattr(connection_module, "add_norm", lambda *a, **k: calls.append(1) or op(*a, **k))
    torch.manual_seed(0)
    cfg = an.TransformerConfig(d_model=16, n_heads=2, d_ff=32, n_layers=2, dropout=0.0, placement="post")
    model = an.LanguageModel(cfg, vocab=40).eval()
    unfused = copy.deepcopy(model)
    for m in unfused.modules():
        if isinstance(m, an.AddNorm):
            m.fused = False
    ids = torch.arange(tokens).reshape(1, tokens)
    out = model(ids)
    monkeypatch.undo()
    policy.set_fusion("measured")
    assert bool(calls) is fused
    torch.testing.assert_close(out, unfused(ids))


def test_the_device_name_is_a_constant_to_torch_compile_without_importing_dynamo_at_import():
    """``device_name`` carries the mark ``torch.compiler.assume_constant_result`` sets (set directly so
    that importing addnorm does not import torch._dynamo and Triton), and a full graph compiled through
    it holds: the name is read once, not traced."""

    def probe() -> None:
        pass

    marked = torch.compiler.assume_constant_result(probe)
    mark = set(vars(marked))
    assert mark and mark <= set(vars(measured.device_name)), mark

    def step(x):
        return x + len(measured.device_name(x.device))

    x = torch.zeros(3)
    assert torch.equal(torch.compile(step, backend="eager", fullgraph=True)(x), x + 3)


def test_a_cuda_device_is_named_cuda_where_torch_has_no_cuda():
    if torch.cuda.is_available():
        pytest.skip("this torch has a CUDA device to name")
    assert measured.device_name(torch.device("cuda")) == "cuda"
    assert measured.device_name(torch.device("cuda", 1)) == "cuda"
