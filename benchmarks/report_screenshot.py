"""Screenshot one section of a study report as headless Chromium renders it (the `docs/report-*.png`).

    python benchmarks/report_screenshot.py OUT/report.html docs/report-llama.png --section ranking \
        --height 2400

The page is the report cut to its title and intro plus the named section (``<h2 id=SECTION>`` up to the
next ``<h2 id=...>``), everything else of it untouched (styles, embedded plots). Chromium runs with a fresh
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


def section_page(report: str, section: str) -> str:
    """The report's HTML cut to everything before its first section (head, title, intro) and the section
    ``<h2 id='SECTION'>`` up to the next ``<h2 id=``; a missing section is an error naming it."""
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


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--section", default="ranking")
    parser.add_argument("--width", type=int, default=1200)
    parser.add_argument("--height", type=int, default=2400)
    parser.add_argument("--colours", type=int, default=128)
    args = parser.parse_args(argv)
    screenshot(args.report, args.out, args.section, args.width, args.height, args.colours)


if __name__ == "__main__":
    main()
