"""The fast tier's coverage rule: a whole run of ``make test`` (``-m "not slow"``, no paths given) must
import every module of the package in its test processes, or it fails naming the ones it missed. Each
xdist worker hands its loaded ``addnorm`` modules to the controller (``workeroutput``), which adds them
up at the session's end. A run of chosen files, or of another marker expression, checks nothing."""

from __future__ import annotations

import pkgutil
import sys
from pathlib import Path

import pytest

FAST = "not slow"
PACKAGE = Path(__file__).resolve().parents[1] / "src" / "addnorm"
# run as a module's __main__ only (python -m addnorm, python -m addnorm.cli): nothing to import
ENTRY_POINTS = {"addnorm.__main__", "addnorm.cli.__main__"}


def package_modules() -> set[str]:
    """Every module of the source tree's package (``addnorm.ops.triton.kernels``, ...), subpackages
    included, without importing any."""
    names = {"addnorm"}
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="addnorm."):
        names.add(info.name)
    return names - ENTRY_POINTS


def loaded_modules() -> set[str]:
    """The ``addnorm`` modules this process has imported."""
    return {name for name in sys.modules if name == "addnorm" or name.startswith("addnorm.")}


def whole_fast_tier(config: pytest.Config) -> bool:
    """Whether this run is the whole fast tier: its marker expression, and no paths or ids given."""
    given = [a for a in config.args if not a.startswith("-")]
    default = [str(Path(config.rootpath) / p) for p in config.getini("testpaths")]
    plain = not given or sorted(str(Path(config.invocation_params.dir, a)) for a in given) == sorted(default)
    return config.getoption("markexpr") == FAST and not config.getoption("keyword") and plain


class TierCheck:
    """The plugin: collects every process's loaded modules and fails a whole fast-tier run that
    missed some."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def pytest_testnodedown(self, node, error):  # an xdist worker finished: its modules
        self.seen.update(node.workeroutput.get("addnorm_modules", ()))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        workeroutput = getattr(session.config, "workeroutput", None)
        if workeroutput is not None:  # a worker: hand the controller what it imported
            workeroutput["addnorm_modules"] = sorted(loaded_modules())
            return
        self.seen |= loaded_modules()
        missing = sorted(package_modules() - self.seen)
        if missing:
            sys.stderr.write(
                "\nerror: the fast tier imported no test of these modules (give each a fast test): "
                + ", ".join(missing)
                + "\n"
            )
            session.exitstatus = 1


def register(config: pytest.Config) -> None:
    """Installs the check where this run is the whole fast tier (on the controller and each worker)."""
    if whole_fast_tier(config):
        config.pluginmanager.register(TierCheck(), "addnorm-tier-check")
