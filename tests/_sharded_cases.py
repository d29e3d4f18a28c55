"""The shared helpers of the tests of ``add_norm`` on DTensors (``test_ops_sharded*.py``): the world and
shape, the backends and the op's option sets, each case's whole tensors, the one-process op they are
checked against, and a spawn's result by name."""

from __future__ import annotations

import importlib.util

import torch

from addnorm.ops import add_norm
from addnorm.ops.args import interpreting

WORLD = 2
SHAPE = (2, 5, 9)  # Shard(1) and Shard(-1) split unevenly over 2 ranks (3 + 2 rows, 5 + 4 columns)
TOL = {"atol": 2e-5, "rtol": 2e-5}


def _triton_interpreted() -> bool:
    return importlib.util.find_spec("triton") is not None and interpreting()


BACKENDS = ["torch"] + (["triton"] if _triton_interpreted() else [])

# the options: Post-LN; Pre-LN with dropout, a ReZero gate and alpha != 1; DeepNorm-like Post-LN with
# dropout and a LayerScale gate
CONFIGS = {
    "post": {"prenorm": False, "dropout_p": 0.0, "gate": None, "alpha": 1.0},
    "pre-dropout-rezero": {"prenorm": True, "dropout_p": 0.3, "gate": "scalar", "alpha": 0.8},
    "post-dropout-layerscale": {"prenorm": False, "dropout_p": 0.2, "gate": "vector", "alpha": 1.5},
}


def _data(case: dict, dtype=torch.float32, offset: float = 3.0, shape: tuple = SHAPE) -> dict:
    """The case's whole tensors (the same in every process: a fixed generator)."""
    g = torch.Generator().manual_seed(7)
    h = shape[-1]

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    gate = CONFIGS[case["config"]]["gate"]
    t = {
        "x": rnd(*shape),
        "r": rnd(*shape) + offset,
        "w": 1 + 0.5 * rnd(h),
        "b": 0.5 * rnd(h),
        "g": None if gate is None else (rnd(1) if gate == "scalar" else rnd(h)),
        "dy": rnd(*shape),
        "ds": rnd(*shape),
    }
    return {k: None if v is None else v.to(dtype) for k, v in t.items()}


def _kwargs(case: dict) -> dict:
    c = CONFIGS[case["config"]]
    return {"norm": case["norm"], "prenorm": c["prenorm"], "alpha": c["alpha"], "dropout_p": c["dropout_p"]}


def single_process(case: dict, data: dict) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(outputs, gradients of x, r, w, b, g) of the op on the whole tensors in one process."""
    names = [n for n in ("x", "r", "w", "b", "g") if data[n] is not None]
    leaves = {n: data[n].clone().requires_grad_(True) for n in names}
    out = add_norm(
        leaves["x"], leaves["r"], leaves["w"], leaves["b"], gate=leaves.get("g"), seed=11,
        backend=case["backend"], **_kwargs(case),
    )  # fmt: skip
    outs = list(out) if isinstance(out, tuple) else [out]
    grads = torch.autograd.grad(outs, [leaves[n] for n in names], [data["dy"], data["ds"]][: len(outs)])
    return [o.detach() for o in outs], list(grads)


def _got(results, name):
    got = results[name]
    assert not isinstance(got, str), f"{name}: {got}"
    return got
