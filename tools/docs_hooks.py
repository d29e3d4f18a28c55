"""mkdocs hooks for the docs site (``hooks:`` in mkdocs.yml): the README is the front page, and a
relative link to a repository file outside ``docs/`` becomes a link to that file on GitHub.

- :func:`on_files`: ``README.md`` is the site's ``index.md`` (one front page, written once), unless
  ``docs/index.md`` exists.
- :func:`on_page_markdown`: every relative link and image of a page (Markdown ``[t](target)``,
  ``[t]: target`` definitions, HTML ``src=``/``href=``; not inside code) is resolved against the
  page's place in the repository (``docs/`` for the topic pages, the root for the README). A target
  inside ``docs/`` stays a site link (the README's ``docs/guide.md`` becomes ``guide.md``); one
  outside it (``../benchmarks/results/README.md``) must exist on disk and becomes its
  ``https://github.com/addnorm/addnorm/blob/main/...`` address; a target that does not exist fails
  the build, naming the page and the link.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
GITHUB = "https://github.com/addnorm/addnorm"
FRONT = "index.md"  # the README's place in the site

FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
# inline code (left as it is) | a Markdown link or image target | an HTML src/href attribute
LINK = re.compile(
    r"(?P<code>(`+).+?\2)|\]\((?P<md><[^>]*>|[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)|"
    r"(?P<attr>\b(?:src|href))=\"(?P<html>[^\"]+)\""
)
DEFINITION = re.compile(r"^(?P<head> {0,3}\[[^\]]+\]:\s*)(?P<target>\S+)(?P<rest>.*)$")


def on_files(files, config):
    """Add the README as the front page unless ``docs/index.md`` exists."""
    if files.get_file_from_path(FRONT) is None:
        files.append(File.generated(config, FRONT, abs_src_path=str(ROOT / "README.md")))
    return files


def source_dir(page, docs: Path) -> Path:
    """Where the page's Markdown lives in the repository: its links are relative to that."""
    if page.file.src_uri == FRONT and page.file.abs_src_path == str(ROOT / "README.md"):
        return ROOT
    return (docs / page.file.src_uri).parent


def rewrite(target: str, here: Path, where: str, docs: Path) -> str:
    """The link ``target`` of a page living in ``here``: a site link for a file under docs/, a GitHub
    address for any other repository file, unchanged for URLs and anchors; PluginError if missing."""
    bare = target[1:-1] if target.startswith("<") and target.endswith(">") else target
    if not bare or bare.startswith(("#", "/")) or re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", bare):
        return target
    path, sep, anchor = bare.partition("#")
    resolved = (here / unquote(path)).resolve()
    if not resolved.is_relative_to(ROOT) and not resolved.is_relative_to(docs):
        raise PluginError(f"{where}: the link {target!r} points outside the repository")
    if not resolved.exists():
        raise PluginError(f"{where}: the link {target!r} names {resolved}, which does not exist")
    if resolved.is_relative_to(docs) and resolved.is_file():
        site = os.path.relpath(resolved, here if here.is_relative_to(docs) else docs)
        return Path(site).as_posix() + sep + anchor
    in_repo = resolved.relative_to(ROOT)
    kind = "tree" if resolved.is_dir() else "blob"
    return f"{GITHUB}/{kind}/main/{in_repo.as_posix()}" + sep + anchor


def rewrite_line(line: str, here: Path, where: str, docs: Path) -> str:
    definition = DEFINITION.match(line)
    if definition:
        target = rewrite(definition["target"], here, where, docs)
        return definition["head"] + target + definition["rest"]

    def one(m: re.Match) -> str:
        if m["code"]:
            return m[0]
        if m["md"] is not None:
            return f"]({rewrite(m['md'], here, where, docs)}{m['title'] or ''})"
        return f'{m["attr"]}="{rewrite(m["html"], here, where, docs)}"'

    return LINK.sub(one, line)


def on_page_markdown(markdown: str, page, config, files) -> str:
    """Check and rewrite the page's relative links (see the module's docstring); code is left alone."""
    docs = Path(config["docs_dir"]).resolve()
    here, where = source_dir(page, docs), page.file.src_uri
    if here == ROOT:
        where = "README.md"
    out, fence = [], None
    for line in markdown.split("\n"):
        opened = FENCE.match(line)
        if fence is None and opened:
            fence = opened[1]
        elif (
            fence is not None
            and line.strip().startswith(fence[0] * len(fence))
            and line.strip(fence[0]).strip() == ""
        ):
            fence = None
        elif fence is None:
            line = rewrite_line(line, here, where, docs)
        out.append(line)
    return "\n".join(out)
