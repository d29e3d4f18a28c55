"""The end-to-end Trainer example of docs/huggingface.md, extracted from the page and run as written
(in a temporary directory): it trains, TensorBoard's event reader finds the probe's values, and the
reloaded model is the trained one in bfloat16."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import addnorm.hf as anhf

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("tensorboard")

PAGE = Path(__file__).resolve().parents[1] / "docs" / "huggingface.md"


def _trainer_example() -> str:
    blocks = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.S)
    found = [b for b in blocks if "ProbeCallback" in b and "transformers.Trainer" in b]
    assert len(found) == 1, "docs/huggingface.md has one end-to-end Trainer example"
    return found[0]


def test_readme_trainer_example_runs(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    torch.set_num_threads(1)
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    scope: dict = {}
    exec(compile(_trainer_example(), "docs/huggingface.md", "exec"), scope)
    trainer, model, reloaded = scope["trainer"], scope["model"], scope["reloaded"]
    assert trainer.state.global_step == 20
    events = next((tmp_path / "run").rglob("events.out.tfevents.*")).parent
    tags = EventAccumulator(str(events)).Reload().Tags()["scalars"]
    assert "train/loss" in tags and "train/probe/stream_grad/layer_3" in tags
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.addnorm["placement"] == "deepnorm"
    ids = scope["ids"][:2]
    expected = model.eval()(ids).logits  # the trained model; the float32 reload is it exactly
    assert torch.equal(anhf.from_pretrained(tmp_path / "run" / "final")(ids).logits, expected)
    torch.testing.assert_close(reloaded(ids).logits.float(), expected, rtol=0.05, atol=0.05)
