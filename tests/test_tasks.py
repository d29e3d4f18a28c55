"""Tasks: seeded batches, deterministic splits, corpora from a file or a folder."""

from __future__ import annotations

import pytest
import torch

from addnorm.tasks import TASKS, build_task, read_corpus


def test_registry_names_every_task():
    assert {"copy", "reverse", "sort", "lm"} <= set(TASKS)
    with pytest.raises(ValueError, match="task: unknown task 'revers'; expected one of"):
        build_task("revers")


def test_batches_are_seeded_and_splits_are_disjoint(tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes(bytes(range(256)) * 40)
    for name, options in (("lm", {"corpus": str(path)}), ("sort", {"symbols": 5})):
        task = build_task(name, **options)
        a = task.batch("train", 4, 12, torch.Generator().manual_seed(3))
        b = task.batch("train", 4, 12, torch.Generator().manual_seed(3))
        c = task.batch("train", 4, 12, torch.Generator().manual_seed(4))
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
        assert not torch.equal(a.inputs, c.inputs)
    lm = build_task("lm", corpus=str(path))
    again = build_task("lm", corpus=str(path))
    assert torch.equal(lm.splits["val"], again.splits["val"])  # the split does not depend on a seed
    assert lm.splits["val"].numel() == len(path.read_bytes()) - int(0.9 * len(path.read_bytes()))


def test_corpus_from_a_folder_is_sorted_and_capped(tmp_path):
    (tmp_path / "b.txt").write_bytes(b"B" * 700)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.txt").write_bytes(b"A" * 700)
    (tmp_path / "a.txt").write_bytes(b"a" * 700)
    data = read_corpus(tmp_path)
    assert data == b"a" * 700 + b"B" * 700 + b"A" * 700  # a.txt, b.txt, sub/a.txt
    assert read_corpus(tmp_path, limit=1500) == data[:1500]
    (tmp_path / "tiny.txt").write_bytes(b"x")
    with pytest.raises(ValueError, match="corpus: .* has 1 bytes; at least 1024 are needed"):
        read_corpus(tmp_path / "tiny.txt")


def test_stdlib_corpus_is_python_source():
    data = read_corpus(None, limit=200_000)
    assert len(data) == 200_000 and b"def " in data and b"import " in data
    assert read_corpus("stdlib", limit=200_000) == data  # same bytes, same order, every time


def test_stdlib_corpus_is_the_sorted_sources_outside_site_packages_and_tests():
    """The pruned walk reads what the definition names: every ``.py`` below the stdlib folder in sorted
    order, none below a site-packages, dist-packages, test, tests or idlelib folder (globbed here)."""
    import sysconfig
    from pathlib import Path

    from addnorm.tasks import stdlib_corpus
    from addnorm.tasks.corpus import _LEFT_OUT

    root = Path(sysconfig.get_paths()["stdlib"])
    paths = [p for p in sorted(root.rglob("*.py")) if not _LEFT_OUT & set(p.relative_to(root).parts[:-1])]
    expected = b"".join(p.read_bytes() for p in paths[:400])
    assert stdlib_corpus.__wrapped__(len(expected)) == expected


def test_lm_batches_are_cut_on_the_device_from_cpu_drawn_starts():
    """The batch is the corpus windows at starts drawn from the CPU generator (the same seed gives the
    same batch on every device), cut by indexing on the device: equal to slicing each window by hand."""
    task = build_task("lm")
    gen = torch.Generator().manual_seed(7)
    batch = task.batch("train", 5, 12, gen, torch.device("cpu"))
    starts = torch.randint(
        0, task.splits["train"].numel() - 13, (5,), generator=torch.Generator().manual_seed(7)
    )
    windows = torch.stack([task.splits["train"][s : s + 13].long() for s in starts.tolist()])
    assert torch.equal(batch.inputs, windows[:, :-1]) and torch.equal(batch.targets, windows[:, 1:])
    assert batch.inputs.dtype == torch.long
