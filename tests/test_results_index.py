"""The recorded results follow their naming rule (``benchmarks/results/README.md``): every folder is
``<device>/<date>-<commit>[-dirty]/`` or a live study's ``<device>/study-<preset>/``, holds a README
saying what its files are, and is listed in the index with the results it holds."""

from __future__ import annotations

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
WINDOW = re.compile(r"^\d{4}-\d{2}-\d{2}-[0-9a-f]{7}(-dirty)?$|^study-[a-z0-9-]+$")


def test_every_results_folder_follows_the_rule_has_a_readme_and_is_in_the_index():
    index = (RESULTS / "README.md").read_text()
    folders = [
        p
        for device in RESULTS.iterdir()
        if device.is_dir() and device.name != "scratch"
        for p in device.iterdir()
    ]
    assert folders, "no recorded results found"
    for folder in folders:
        where = folder.relative_to(RESULTS).as_posix()
        assert folder.is_dir() and WINDOW.match(folder.name), (
            f"{where}: not <date>-<commit> or study-<preset>"
        )
        assert (folder / "README.md").is_file(), f"{where}: no README.md saying what its files are"
        (row,) = [line for line in index.splitlines() if line.startswith(f"| [`{where}/`]")] or [""]
        assert row, f"{where}: not in benchmarks/results/README.md"
        stems = {p.name.split(".")[0] for p in folder.iterdir() if p.suffix in (".md", ".json", ".sqlite")}
        assert {s for s in stems if s != "README"} <= set(re.findall(r"`([^`/]+)`", row)), (where, row)
