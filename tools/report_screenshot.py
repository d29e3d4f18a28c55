"""Screenshot a study report, or one section of it, as headless Chromium renders it (the `docs/report-*.png`).

    python -m tools.report_screenshot OUT/report.html docs/report-llama.png --section ranking \
        --height 2400
    python -m tools.report_screenshot --docs addnorm-out   # every docs/report-*.png

The page is the report cut to its title and intro plus the named section (``<h2 id=SECTION>`` up to the
next ``<h2 id=...>``; ``--section all``: the whole report), everything else of it untouched (styles,
embedded plots). ``--docs ROOT`` regenerates the README's screenshots (:data:`DOCS`) from the reports of
the ``quick``, ``literature`` and ``llama`` studies under ROOT (run them first: ``addnorm study quick``,
``addnorm study literature``, ``addnorm study llama``; ``make report-screenshots``), so a screenshot
always shows a report as built. Chromium runs with a fresh
profile and no network services; the PNG is then reduced to a 128-colour palette (the report's flat
colours survive it) so the file stays small. Needs ``chromium`` on PATH (Debian: ``apt-get install
chromium``) and Pillow (a matplotlib dependency).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import tempfile
from pathlib import Path

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--hide-scrollbars",
    "--virtual-time-budget=15000",
)


# The README's screenshots: (study, output, section, width, height).
DOCS = (
    ("quick", "docs/report-quick.png", "all", 1280, 900),
    ("literature", "docs/report-literature.png", "ranking", 1200, 2440),
    ("llama", "docs/report-llama.png", "ranking", 1200, 3020),
)


def section_page(report: str, section: str) -> str:
    """The report's HTML cut to everything before its first section (head, title, intro) and the section
    ``<h2 id='SECTION'>`` up to the next ``<h2 id=``; a missing section is an error naming it. ``all``: the
    report as it is."""
    if section == "all":
        return report
    marker = f"<h2 id='{section}'>"
    if marker not in report:
        raise ValueError(f"section: the report has no section {section!r}")
    first = report.index("<h2 id=")
    start = report.index(marker)
    end = report.find("<h2 id=", start + len(marker))
    end = report.index("</body>", start) if end < 0 else end
    return report[:first] + report[start:end] + "</body></html>"


def screenshot(report: Path, out: Path, section: str, width: int, height: int, colours: int) -> None:
    from PIL import Image

    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("error: chromium is not on PATH (apt-get install chromium)")
    with tempfile.TemporaryDirectory() as tmp:
        page = report.parent / f".{section}-view.html"  # beside the report: relative links still resolve
        page.write_text(section_page(report.read_text(), section))
        raw = Path(tmp) / "raw.png"
        try:
            subprocess.run(
                [
                    browser,
                    *CHROMIUM_FLAGS,
                    f"--user-data-dir={tmp}/profile",
                    f"--screenshot={raw}",
                    f"--window-size={width},{height}",
                    page.resolve().as_uri(),
                ],
                check=True,
                capture_output=True,
                timeout=300,
            )
        finally:
            page.unlink()
        image = Image.open(raw).convert("RGB")
        image.quantize(colors=colours, method=Image.Quantize.FASTOCTREE).save(out, optimize=True)
    print(f"{out}: {width}x{height}, {out.stat().st_size // 1024} KB")


def docs_plan(root: Path, docs: Path) -> list[tuple[Path, Path, str, int, int]]:
    """(report, png, section, width, height) of each README screenshot whose study report is under
    ``root``; a missing report is an error naming the study to run."""
    plan = []
    for study, png, section, width, height in DOCS:
        report = root / study / "report.html"
        if not report.is_file():
            raise SystemExit(
                f"error: no report at {report}; run `addnorm study {study} --out {root / study}` first"
            )
        plan.append((report, docs / Path(png).name, section, width, height))
    return plan


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path, nargs="?")
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--section", default="ranking", help="a section id, or all")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=2400)
    parser.add_argument("--colours", type=int, default=128)
    parser.add_argument("--docs", type=Path, metavar="ROOT", help="regenerate every docs/report-*.png")
    args = parser.parse_args(argv)
    if args.docs is not None:
        docs = Path(__file__).resolve().parents[1] / "docs"
        for report, png, section, width, height in docs_plan(args.docs, docs):
            screenshot(report, png, section, width, height, args.colours)
        return
    if args.report is None or args.out is None:
        parser.error("expected REPORT and OUT (or --docs ROOT)")
    screenshot(args.report, args.out, args.section, args.width, args.height, args.colours)


if __name__ == "__main__":
    main()
