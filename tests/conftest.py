import contextlib
import importlib
import os
import sys
import warnings
from pathlib import Path

import order
import pytest
import tiers
import torch
import torch._functorch.config
import torch._inductor.config
import triton_interpreter

# No on-disk FX-graph / AOTAutograd cache in the tests: their keys miss a custom op's registered
# autograd (pytorch/pytorch#144344), so an entry compiled against an older add_norm_bwd could replay.
torch._inductor.config.fx_graph_cache = False
torch._functorch.config.enable_autograd_cache = False

# The Triton interpreter without its re-patching of triton.language on every helper call (same kernels,
# a third of their time: tests/triton_interpreter.py)
triton_interpreter.install()

# Two pytest-xdist workers on two cores: one thread each (workers x threads <= cores).
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"


def pytest_addoption(parser):
    parser.addoption(
        "--failures-to",
        default=None,
        metavar="DIR",
        help="write each failing test's report to DIR/test_failures.txt as it fails (the GPU suite's "
        "tests, whose budget can stop pytest before its summary)",
    )


def pytest_runtest_logreport(report):
    """With ``--failures-to DIR``: a failing test's id, phase and report, appended to
    ``DIR/test_failures.txt`` and printed the moment it fails, so a run stopped before pytest's summary
    still says why (the H200 run at 81f67f7 lost a failure that way)."""
    folder = _failures_to[0]
    if folder is None or not report.failed:
        return
    text = f"FAILED {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n\n"
    with open(Path(folder) / "test_failures.txt", "a") as f:
        f.write(text)
    sys.stdout.write("\n" + text)
    sys.stdout.flush()


_failures_to: list[str | None] = [None]


def pytest_collection_modifyitems(config, items):
    """In an xdist worker (each collects every test, and all must agree): files longest first, so the
    two workers end together (tests/order.py)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        order.longest_first(items)


def pytest_configure(config):
    _failures_to[0] = config.getoption("--failures-to", default=None)
    tiers.register(config)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def bench_module():
    """``load(name)``: a fresh import of the module ``name`` (``"benchmarks.step.lm_step"``; the repository
    root is on the tests' path: ``pythonpath`` in pyproject.toml), so that a test's changes to one copy's
    globals reach no other test."""

    def load(name):
        sys.modules.pop(name, None)
        return importlib.import_module(name)

    return load


@pytest.fixture
def backend_env(monkeypatch):
    """``set_env(value)``: set ADDNORM_BACKEND (None: unset; read at import, re-read on request) and
    return what ``auto`` now means; restored afterwards."""
    from addnorm.ops import policy

    def set_env(value):
        if value is None:
            monkeypatch.delenv("ADDNORM_BACKEND", raising=False)
        else:
            monkeypatch.setenv("ADDNORM_BACKEND", value)
        return policy.read_backend_env()

    yield set_env
    monkeypatch.undo()
    policy.read_backend_env()


@pytest.fixture(params=["slices", "row_sums", "kernel_sums"])
def small_chunks(request, monkeypatch):
    """Launch configurations that chunk rows wider than 32 columns (fwd) / 16 (bwd, the register-heavy
    variants too), so the chunked kernels run on small shapes in the interpreter; once per backward
    variant (``launch_config.BWD_VARIANTS``: the slices reading each other for the row sums, or the
    row-sums pre-pass, in tiles of two rows, then slices of two rows; or that with the partial sums
    added up in the kernel, in groups of two programs, so that there are several groups). Yields
    ``launch_config``."""
    from addnorm.ops import launch_config as k
    from addnorm.ops import policy
    from addnorm.ops.triton import launchers as triton_launch

    monkeypatch.setattr(k, "FWD_MAX_ONE_PASS", 32)
    monkeypatch.setattr(k, "BWD_MAX_ONE_PASS", 16)
    monkeypatch.setattr(k, "BWD_MAX_ONE_PASS_HEAVY", 16)
    monkeypatch.setattr(k, "FWD_CHUNK", k.Launch(2, 32, True, 4))
    monkeypatch.setattr(k, "BWD_SLICE", k.Launch(2, 16, True, 4))
    monkeypatch.setattr(k, "BWD_SLICE_NARROW", k.Launch(2, 16, True, 4))
    monkeypatch.setattr(k, "BWD_ROW_SUMS_MIN", 16)
    monkeypatch.setattr(k, "BWD_ROW_SUMS_MIN_HEAVY", 16)
    monkeypatch.setattr(k, "BWD_ROW_SUMS_SLICE", k.Launch(2, 16, True, 4))
    monkeypatch.setattr(k, "BWD_ONE_PROGRAM_TILES", 0)  # several programs and their partial sums
    monkeypatch.setattr(k, "BWD_FINISH_GROUP", 2)  # "kernel_sums": the interpreter's 4 programs, 2 groups
    previous = k.use_bwd_variant(request.param)  # invalidates the cached call plans: they hold specs
    triton_launch.clear_caches()
    yield k
    monkeypatch.undo()
    k.use_bwd_variant(previous)
    triton_launch.clear_caches()
    policy.invalidate()


@pytest.fixture
def triton_backend(backend_env):
    """``ADDNORM_BACKEND=triton`` (what ``auto`` means on a GPU) for the test, the kernels run by
    Triton's CPU interpreter; skips where they cannot run on CPU tensors. Restored afterwards."""
    import importlib.util

    from addnorm.ops.args import interpreting

    if importlib.util.find_spec("triton") is None or not interpreting():
        pytest.skip("needs triton and TRITON_INTERPRET=1")
    from addnorm.ops.triton.kernels import kernels_are_interpreted

    if not kernels_are_interpreted():
        pytest.skip("the Triton kernels were imported without TRITON_INTERPRET=1")
    backend_env("triton")


@pytest.fixture
def scalar_inductor():
    """Inductor's C++ kernels without explicit SIMD (``cpp.simdlen`` 0 picks no vector ISA) for the tests
    that check what addnorm hands ``torch.compile`` (graph capture, no breaks, eager's numbers): they
    hold for either codegen, the scalar one is the same on every CI machine's ISA, and it takes about a
    quarter less CPU (no vectorised kernels to generate and build beside the scalar ones: 191 -> 139 s
    for test_ops_compiled.py and test_sublayer_dtype.py here, cold). Inductor's vectorised codegen of
    the dropout mask's integer hash stays covered by test_ops_paths.py, which compiles with it."""
    with torch._inductor.config.patch({"cpp.simdlen": 0}):
        yield


@pytest.fixture
def dynamo_cache_warnings():
    """``with dynamo_cache_warnings() as cached:``, the messages of the warnings raised in the block
    that Dynamo traced through a ``functools`` (lru_) cache. Dynamo warns once per message and process:
    its memory of earlier warnings is cleared first."""

    @contextlib.contextmanager
    def record():
        if hasattr(torch._dynamo.utils.warn_once, "cache_clear"):
            torch._dynamo.utils.warn_once.cache_clear()
        cached: list[str] = []
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield cached
        cached.extend(str(c.message) for c in caught if "lru_cache" in str(c.message))

    return record


@pytest.fixture
def registries_restored():
    """Every addnorm registry (placements, placement inits, HF architectures, ...) as it was before the
    test, entries and aliases: what a test or a docs block registers (docs/placements.md's "deep_pre")
    must not reach another test's ``set(PLACEMENTS)``."""
    from addnorm.registry import Registry

    def found():
        modules = [m for name, m in list(sys.modules.items()) if name.startswith("addnorm") and m]
        return {id(r): r for m in modules for r in vars(m).values() if isinstance(r, Registry)}

    saved = {key: (dict(r._entries), dict(r._aliases)) for key, r in found().items()}
    yield
    for key, registry in found().items():
        if key in saved:
            entries, aliases = saved[key]
            registry._entries.clear()
            registry._entries.update(entries)
            registry._aliases.clear()
            registry._aliases.update(aliases)


@pytest.fixture
def native_path():
    """The native call path on (``addnorm.ops.set_call_path("native")``), CPU tensors let through (the
    interpreter's Triton backend), restored after."""
    from addnorm import ops
    from addnorm.ops import functional, native

    previous = ops.set_call_path("native")
    native._ALLOW_CPU = True
    functional.clear_plans()
    try:
        yield
    finally:
        native._ALLOW_CPU = False
        ops.set_call_path(previous)
        functional.clear_plans()
