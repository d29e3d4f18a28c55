"""The addnorm command line: list, explain, inspect (the physics claim of Xiong et al. 2020), errors."""

from __future__ import annotations

import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import addnorm as an
from addnorm.cli import commands as cli
from addnorm.explain import layer_norm
from addnorm.study.findings import GROWTH, trend
from addnorm.tasks import read_corpus

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(cli.app, list(args))


def test_list_names_every_placement_and_norm_with_formula_and_citation():
    result = invoke("list")
    assert result.exit_code == 0, result.output
    for name, placement in an.PLACEMENTS.items():
        assert name in result.output
        assert placement.formula in result.output
        assert placement.citation in result.output
    lines = result.output.split("Norms (over the last dimension):")[1].strip().splitlines()
    assert len(lines) == len(an.NORMS)
    for line, (name, cls) in zip(lines, an.NORMS.items(), strict=True):
        shown = line.split(None, 1)[1]
        doc = " ".join(cls.__doc__.split()).replace("``", "")
        assert line.split()[0] == name and doc.startswith(shown)  # the docstring's opening, whole words
        assert shown.endswith(".") and shown.count("(") == shown.count(")"), shown  # a complete sentence


def test_first_sentence_reads_across_line_breaks_and_abbreviations():
    doc = """Projection onto the unit sphere: y = x / max(||x||_2, eps) (nGPT, Loshchilov et
    al. 2024), e.g. for nGPT. Takes the common signature.

    More text."""
    assert cli.first_sentence(doc) == (
        "Projection onto the unit sphere: y = x / max(||x||_2, eps) (nGPT, Loshchilov et al. 2024), "
        "e.g. for nGPT."
    )
    assert cli.first_sentence("One scalar g initialised to\n    sqrt(dim). ``affine=False`` fixes g.") == (
        "One scalar g initialised to sqrt(dim)."
    )
    assert cli.first_sentence("No period at all\n\nsecond paragraph.") == "No period at all"
    assert cli.first_sentence(None) == ""


def _numbers_after(output: str, label: str) -> list[float]:
    (line,) = [ln for ln in output.splitlines() if label in ln]
    rhs = line.rsplit("=", 1)[1].strip().strip("[]")
    return [float(v) for v in rhs.split(",")]


@pytest.mark.parametrize(
    ("x", "fx"), [("1,2,3", "0.5,-1,1.5"), ("0.1,-2,7,3.5", "1,1,-1,0")], ids=["default", "other"]
)
def test_explain_steps_match_reference(x, fx):
    args = [] if x == "1,2,3" else ["--x", x, "--fx", fx]
    result = invoke("explain", *args)
    assert result.exit_code == 0, result.output
    xs, fxs = [float(v) for v in x.split(",")], [float(v) for v in fx.split(",")]
    z = [a + b for a, b in zip(xs, fxs, strict=True)]
    mean = sum(z) / len(z)
    var = sum((v - mean) ** 2 for v in z) / len(z)
    assert _numbers_after(result.output, "z = x + F(x)") == pytest.approx(z, rel=1e-3)
    assert _numbers_after(result.output, "mu = sum(z)") == pytest.approx([mean], abs=1e-4)
    assert _numbers_after(result.output, "var = sum(") == pytest.approx([var], abs=1e-4)
    assert _numbers_after(result.output, "sigma = sqrt") == pytest.approx([math.sqrt(var + 1e-5)], abs=1e-4)
    expected = [(v - mean) / math.sqrt(var + 1e-5) for v in z]
    assert _numbers_after(result.output, "y = (z - mu)") == pytest.approx(expected, rel=1e-3, abs=1e-4)
    assert expected == pytest.approx(list(layer_norm(z)), rel=1e-12)


@pytest.mark.parametrize(
    ("x", "fx"),
    [("1,2,3", "0.5,-1,1.5"), ("1,2,3", "-1,-2,-3"), ("1,2,3,4", "0,0,0,-4"), ("0.3,0.1", "-0.3,-0.1")],
)
def test_explain_aligns_its_columns_and_never_prints_negative_zero(x, fx):
    result = invoke("explain", "--x", x, "--fx", fx)
    assert result.exit_code == 0, result.output
    assert not re.search(r"-0(\.0+)?(?![.\d])", result.output), result.output
    steps = result.output.splitlines()[1:-1]
    assert len(steps) == 7 and len({ln.rindex(" = ") for ln in steps}) == 1, result.output  # one '=' column
    starts = ("x ", "F(x) ", "z = x + F(x)", "mu = sum(z)", "var = sum(", "sigma = sqrt", "y = (z - mu)")
    assert len({ln.index(f, 2) for ln, f in zip(steps, starts, strict=True)}) == 1, result.output  # formulas


def test_explain_accepts_negative_first_value():
    result = invoke("explain", "--x", "-1,0,2", "--fx=-0.5,1,1")
    assert result.exit_code == 0, result.output
    assert _numbers_after(result.output, "z = x + F(x)") == pytest.approx([-1.5, 1, 3])


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["explain", "--x", "1,2,3", "--fx", "1,2"], "same length"),
        (["explain", "--x", "1,a"], "--x"),
        (["explain", "--eps", "0"], "eps"),
        (["inspect", "--placements", "post,bogus", "--layers", "1"], "bogus"),
        (["inspect", "--d-model", "30", "--heads", "4", "--layers", "1"], "d_model"),
        (["inspect", "--layers", "0"], "--layers"),
        (["inspect", "--norm", "lyernorm", "--layers", "1"], "lyernorm"),
    ],
)
def test_library_errors_are_one_line_exit_2(args, needle, tmp_path):
    result = runner.invoke(cli.app, [*args, *(["--out", str(tmp_path)] if args[0] == "inspect" else [])])
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], result.stderr
    assert "Traceback" not in result.output


def _direct_ffn_grad_norms(placement: str, seed: int, **kw) -> list[float]:
    """Oracle without the Probe or the task's loss: same model and batch, torch's cross-entropy, p.grad."""
    torch.manual_seed(seed)
    cfg = an.TransformerConfig(
        d_model=kw["d_model"], n_heads=kw["n_heads"], d_ff=4 * kw["d_model"], n_layers=kw["n_layers"],
        dropout=0.0, placement=placement, init="xavier", max_len=kw["seq"],
    )  # fmt: skip
    model = an.LanguageModel(cfg, 256)
    data = torch.frombuffer(bytearray(read_corpus(None)), dtype=torch.uint8).long()
    train = data[: int(0.9 * data.numel())]  # the lm task's training split
    starts = torch.randint(
        0, train.numel() - kw["seq"] - 1, (kw["batch"],), generator=torch.Generator().manual_seed(seed)
    )
    tokens = torch.stack([train[s : s + kw["seq"] + 1] for s in starts.tolist()])
    logits = model(tokens[:, :-1])
    torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1)).backward()
    return [
        math.hypot(la.ff.w1.weight.grad.norm().item(), la.ff.w2.weight.grad.norm().item())
        for la in model.layers
    ]


def test_ffn_grad_norms_match_direct_computation():
    kw = dict(n_layers=3, d_model=32, n_heads=2, seq=16, batch=2)
    got = cli.ffn_grad_norms_at_init("pre", seed=5, repeats=1, **kw)
    assert got["ff"] == pytest.approx(_direct_ffn_grad_norms("pre", 5, **kw), rel=1e-5)
    assert [math.hypot(a, b) for a, b in zip(got["w1"], got["w2"], strict=True)] == pytest.approx(got["ff"])


def test_inspect_post_gradients_grow_with_depth_pre_do_not(tmp_path):
    """Xiong et al. 2020: at init, Post-LN's FFN gradient norms grow toward the top layers, Pre-LN's don't."""
    result = invoke("inspect", "--placements", "post,pre", "--layers", "12", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    data = json.loads((tmp_path / "inspect.json").read_text())
    post, pre = data["placements"]["post"]["ff"], data["placements"]["pre"]["ff"]
    assert len(post) == len(pre) == 12
    post_ratio, pre_ratio = post[-1] / post[0], pre[-1] / pre[0]
    assert post_ratio > 1.2, post
    assert pre_ratio < 1.0, pre
    assert post_ratio > 1.5 * pre_ratio
    assert post[-1] > 1.5 * pre[-1]  # the top layer's gradient is much larger under Post-LN
    # the printed table and verdicts come from the same numbers
    rows = [ln.split() for ln in result.output.splitlines() if ln.strip()[:1].isdigit()]
    assert [float(r[1]) for r in rows[:12]] == pytest.approx(post, rel=1e-3)
    assert f"last/first = {post_ratio:6.2f}  -> grows toward the top layers" in result.output
    assert f"last/first = {pre_ratio:6.2f}  -> shrinks toward the top layers" in result.output
    assert "seen here" in result.output and "NOT seen" not in result.output
    png = tmp_path / "inspect.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(png) in result.output


def test_console_script_runs(tmp_path):
    exe = shutil.which("addnorm", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.skip("the addnorm console script is not installed next to this Python")
    ok = subprocess.run([exe, "explain"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and "z = x + F(x)" in ok.stdout
    bad = subprocess.run(
        [exe, "inspect", "--placements", "nope", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2
    assert bad.stderr.strip().startswith("error: ") and "Traceback" not in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_verdict_words_share_the_study_thresholds():
    assert cli.verdict(2.0) == "grows toward the top layers"
    assert cli.verdict(0.5) == "shrinks toward the top layers"
    assert cli.verdict(1.0) == "nearly flat across depth"
    assert "undefined" in cli.verdict(float("nan"))
    # one definition: inspect's words and the study's findings switch at the same ratios
    for ratio in (GROWTH * 0.99, GROWTH * 1.01, 1 / GROWTH * 0.99, 1 / GROWTH * 1.01, 0.6, 1.9):
        assert (
            cli.verdict(ratio).split()[0]
            in {"grows": "grows", "shrinks": "shrinks", "flat": "nearly"}[trend(ratio)]
        )
    assert cli.verdict(0.6) == "shrinks toward the top layers"  # was "flat" under the study's old 0.5-2


def test_version_and_python_dash_m(tmp_path):
    result = invoke("--version")
    assert result.exit_code == 0 and result.output.strip() == f"addnorm {an.__version__}"
    ran = subprocess.run(
        [sys.executable, "-m", "addnorm", "--version"], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0 and ran.stdout.strip() == f"addnorm {an.__version__}"
    bad = subprocess.run(
        [sys.executable, "-m", "addnorm", "explain", "--x", "1,a"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and bad.stderr.strip().startswith("error: --x")


ROOT = Path(__file__).resolve().parents[1]


def test_packaging_metadata_license_and_readme_facts():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    from addnorm.study import load_spec

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert meta["version"] == an.__version__
    assert meta["license"] == {"text": "Apache-2.0"} and meta["license-files"] == ["LICENSE"]
    license_text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text  # the whole licence, not a stub
    assert {"Homepage", "Repository", "Issues"} <= set(meta["urls"])
    assert any(dep.startswith("rich") for dep in meta["dependencies"])
    page = (ROOT / "docs" / "study.md").read_text()
    quick = len(load_spec("quick").expand())
    assert f"it trains {quick} small" in page, "docs/study.md: the quick preset's run count is stale"


# --- an instant command line (issue 32): answers without importing torch ---------------------------
INSTANT = [
    ["--help"],
    ["--version"],
    ["study", "--list"],
    ["study", "--show", "quick"],
    ["study", "--show=depth"],
    ["study", "--keys"],
    ["study", "--keys", "--markdown"],
]
# Runs the command line in a fresh interpreter, then says on stderr whether torch was imported.
_AFTER = (
    "import sys\nfrom addnorm.cli import main\nsys.argv = ['addnorm', *sys.argv[1:]]\ntry:\n    main()\n"
    "except SystemExit as done:\n    code = done.code\nprint('torch imported:', 'torch' in sys.modules, "
    "file=sys.stderr)\nsys.exit(code)\n"
)


@pytest.mark.parametrize("args", INSTANT, ids=" ".join)
def test_instant_commands_do_not_import_torch_and_answer_as_the_full_commands(args):
    """Each instant command in a fresh process: exit 0, torch never imported, and what it prints is
    what the command prints with the study commands loaded (this process has imported them)."""
    ran = subprocess.run([sys.executable, "-c", _AFTER, *args], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stderr.strip().splitlines()[-1] == "torch imported: False"
    from addnorm.cli.lazy import run_study_command

    if args[0] == "study":
        full = run_study_command(["--show", "depth"] if args[1] == "--show=depth" else args[1:])
        assert ran.stdout == full
    elif args == ["--version"]:
        assert ran.stdout == f"addnorm {an.__version__}\n"
    else:
        for name in ("list", "explain", "inspect", "study", "report", "export"):
            assert re.search(rf"^│ {name} ", ran.stdout, re.M), name


# The three commands that only read a stored study, in one fresh interpreter; then whether torch came in.
_READERS = (
    "import sys\nfrom addnorm.cli import main\nout, to = sys.argv[1:]\ncodes = []\n"
    "for args in (['export', out, '--to', to + '/csv'], ['compare', out, '--to', to + '/compare.md'],"
    " ['report', out]):\n    sys.argv = ['addnorm', *args]\n    try:\n        main()\n"
    "    except SystemExit as done:\n        codes.append(done.code)\n"
    "print('exit codes:', codes, 'torch imported:', 'torch' in sys.modules, file=sys.stderr)\n"
)


def test_report_export_and_compare_read_a_study_without_importing_torch(tmp_path):
    """``report``, ``export`` and ``compare`` of a stored study (trained here) in a fresh process: exit
    0, torch never imported (they read SQLite and draw; only ``study`` trains), and the CSV files and the
    comparison are byte for byte those of the same commands in this process, where torch is loaded."""
    from addnorm.study import parse_spec, run_study

    tiny = dict(d_model=16, n_heads=2, d_ff=32, n_layers=1, steps=2, batch_size=2, seq_len=8, eval_every=0)
    spec = parse_spec(
        {"name": "r", "base": tiny, "experiments": {"a": {"sweep": {"placement": ["pre", "post"]}}}}
    )
    out = tmp_path / "study"
    run_study(spec, out, workers=1, progress=False, report=False)
    fresh, here = tmp_path / "fresh", tmp_path / "here"
    ran = subprocess.run(
        [sys.executable, "-c", _READERS, str(out), str(fresh)], capture_output=True, text=True, timeout=300
    )
    assert ran.stderr.strip().splitlines()[-1] == "exit codes: [0, 0, 0] torch imported: False", ran.stderr
    assert (out / "report.html").stat().st_size > 0
    assert invoke("export", str(out), "--to", str(here / "csv")).exit_code == 0
    assert invoke("compare", str(out), "--to", str(here / "compare.md")).exit_code == 0
    names = sorted(p.name for p in (fresh / "csv").iterdir())
    assert names and names == sorted(p.name for p in (here / "csv").iterdir())
    for name in names:
        assert (fresh / "csv" / name).read_bytes() == (here / "csv" / name).read_bytes(), name
    assert (fresh / "compare.md").read_text() == (here / "compare.md").read_text()


def test_help_lists_the_study_commands_with_their_own_help_before_they_load():
    """``addnorm --help`` shows the study commands' placeholders; their help is the loaded commands'."""
    from typer.main import get_command

    from addnorm.cli.lazy import STUDY_COMMANDS, study_commands

    group = get_command(cli.app)
    loaded = study_commands()
    assert set(loaded) == set(STUDY_COMMANDS)
    for name, command in loaded.items():
        assert group.commands[name].help == command.help and command.help


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["study", "--show", "quik"], "error: spec: unknown preset 'quik'"),
        (["study", "--keys", "--smoke"], "task "),  # other options: the study command itself
        (["study", "--list", "--keys"], "quick: "),
    ],
)
def test_anything_else_goes_to_the_study_command_itself(args, expected):
    result = invoke(*args)
    assert expected in result.output
    assert result.exit_code == (2 if "quik" in args else 0), result.output
