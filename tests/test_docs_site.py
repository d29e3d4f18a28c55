"""The docs site (issue 51 item 3): ``mkdocs.yml`` builds with ``--strict`` (a broken link, a missing page,
a page left out of the nav or an unreadable docstring fails), every public module has its API page
with the parameters as tables, links to repository files outside ``docs/`` become GitHub addresses
(``tools/docs_hooks.py``), and a real headless Chromium renders the front page and an API page with
their navigation and no console error. Chromium is Debian's package (``make browser``); where it is
not installed the browser test skips, saying so."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
pytest.importorskip("mkdocstrings", reason="the docs extra is not installed (pip install -e '.[docs]')")
from mkdocs.exceptions import PluginError  # noqa: E402

pytestmark = pytest.mark.slow  # a compiler of a kind: the site's build, and a browser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_MODULES = (
    "connection", "placements", "placement_spec", "norms", "ops", "model", "probe", "hf", "titan", "train",
    "study", "tasks", "registry",
)  # fmt: skip
GITHUB = "https://github.com/addnorm/addnorm"


def load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "tools" / "docs_hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    ran = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert ran.returncode == 0, f"mkdocs build --strict failed:\n{ran.stderr[-6000:]}"
    return out


def test_the_site_builds_strict_with_every_page_and_an_api_page_per_module(site):
    assert (site / "index.html").is_file()  # the README, as the front page
    for page in DOCS.glob("*.md"):
        assert (site / page.stem / "index.html").is_file(), f"{page.name} has no page in the site"
    for module in API_MODULES:
        assert (DOCS / "api" / f"{module}.md").is_file() and (site / "api" / module / "index.html").is_file()
    connection = (site / "api" / "connection" / "index.html").read_text()
    assert 'id="addnorm.connection.AddNorm"' in connection
    params = connection[connection.index('id="addnorm.connection.AddNorm"') :]
    # Google-style Args rendered as a table: name, type, description, default
    assert re.search(r"<th>\s*Name\s*</th>\s*<th>\s*Type\s*</th>\s*<th>\s*Description\s*</th>", params)
    assert "<code>d_model</code>" in params and "<code>placement</code>" in params


def test_links_to_repository_files_become_github_addresses(tmp_path):
    hooks, docs = load_hooks(), DOCS.resolve()
    assert (
        hooks.rewrite("../pyproject.toml#L1", docs, "x.md", docs) == f"{GITHUB}/blob/main/pyproject.toml#L1"
    )
    assert hooks.rewrite("../src/addnorm", docs, "x.md", docs) == f"{GITHUB}/tree/main/src/addnorm"
    assert hooks.rewrite("docs/placements.md#top", ROOT, "README.md", docs) == "placements.md#top"
    assert hooks.rewrite("placements.md", docs, "x.md", docs) == "placements.md"
    for kept in ("https://pytorch.org", "#install", "mailto:a@b.c"):
        assert hooks.rewrite(kept, docs, "x.md", docs) == kept
    with pytest.raises(PluginError, match="does not exist"):
        hooks.rewrite("../no/such/file.md", docs, "x.md", docs)
    with pytest.raises(PluginError, match="outside the repository"):
        hooks.rewrite("../../etc/passwd", docs, "x.md", docs)
    line = 'see `[a](../missing.md)` and [b](../LICENSE) or <img src="../LICENSE">'
    licence = f"{GITHUB}/blob/main/LICENSE"
    assert hooks.rewrite_line(line, docs, "x.md", docs) == (
        f'see `[a](../missing.md)` and [b]({licence}) or <img src="{licence}">'
    )  # inline code is left alone


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def render(browser: str, url: str, profile: Path) -> tuple[str, list[str]]:
    """The page's DOM after its scripts ran, and every console message Chromium logged for it."""
    ran = subprocess.run(
        [
            browser, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
            "--disable-background-networking", "--disable-component-update", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", "--dump-dom", url,
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stderr[-3000:]
    return ran.stdout, [line for line in ran.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(chromium() is None, reason="no chromium on PATH (make browser installs Debian's package)")
def test_a_browser_renders_the_front_page_and_an_api_page(site, tmp_path):
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *args: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        for path, expect in (
            ("/", ("API reference",)),
            ("/api/connection/", ('id="addnorm.connection.AddNorm"', "<code>d_model</code>")),
        ):
            dom, console = render(chromium(), base + path, tmp_path / "profile")
            assert console == [], f"{path}: console messages {console}"
            assert re.search(r"<html[^>]*class=\"[^\"]*\bjs\b", dom), (
                f"{path}: the theme's scripts did not run"
            )
            nav = dom[dom.index("md-nav--primary") :]
            for page in ("Home", "API reference", "addnorm.connection"):
                assert re.search(rf">\s*{re.escape(page)}\s*<", nav), f"{path}: the navigation lacks {page!r}"
            for text in expect:
                assert text in dom, f"{path}: {text!r} not rendered"
    finally:
        server.shutdown()
