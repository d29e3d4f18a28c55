"""What fusion can remove from a training step: the time the unfused step spends in the residual
dropout, the residual add and the norms, measured with the torch profiler.

A fused Add & Norm replaces, per connection, the branch dropout D, the add s = base + D(f) and the norm
N(s) (forward), and their backward (the norm's backward, the dropout's, the add's casts and the
accumulation of the stream's gradient where the norm's input also feeds the next add) with one kernel
each way. Everything else in the step (matmuls, attention, activations, the FFN's and the embedding's
own dropout, the loss, the optimizer) stays. So the *removable time* of a step is the time of those ops
in the unfused step, and a fused step's saving (unfused step time - fused step time, from the timed
steps) as a share of it says how much of what fusion can gain it gains (issue 30: >= 70%).

How each profiled op is classified (``classify``), on the CPU (an op's own CPU time) and on CUDA (the
device time of the kernels it launched) alike:

- **forward**, by aten op and the scope it runs in: ``aten::layer_norm`` / ``native_layer_norm`` /
  ``rms_norm`` / ``_fused_rms_norm`` are *norm*; everything inside a norm module of the stream's width
  (``removable_scopes`` opens a ``record_function`` scope around each one during the profiled steps:
  a hand-written RMSNorm such as Hugging Face Llama's is pow/mean/rsqrt/mul ops) is *norm*; everything
  inside a connection's branch dropout module (``AddNorm.dropout``, ``nn.TransformerEncoderLayer``'s
  ``dropout1``/``dropout2``) is *dropout* -- the FFN's activation dropout and the embedding's dropout
  are other modules and stay out; an ``aten::add`` / ``add_`` of two tensors of the stream's shape
  (batch, seq, d_model) is the residual *add*;
- **backward**: every op and kernel under an autograd node takes the class of the forward op that made
  the node (the profiler's sequence number and forward thread link them, as
  ``torch.autograd.profiler_util`` does for stack traces), so a gradient accumulation of the stream
  under the norm's backward counts and one under a matmul's backward (q/k/v reading one input) does not;
- **never counted**: anything under a matmul or attention op (``aten::mm``, ``addmm``, ``bmm``,
  ``linear``, ``matmul``, scaled-dot-product attention, embedding), whatever the scope;
- **kernels named by what they fuse** (CUDA): addnorm's own kernels and registered ops (``add_norm``
  in the name) are *fused* (what remains of add & norm in a fused step); Inductor's kernels
  (``triton_poi/red/per_fused_<aten ops>``) are *norm* when they name a norm (``layer_norm``, ``rsqrt``),
  else *dropout* when they name dropout or random bits, else *add* when they fuse only adds, copies
  and casts, and never when they name a matmul, activation, softmax, attention, embedding, loss or
  optimizer op. Under ``torch.compile`` this is the only evidence there is (the graph's aten ops are
  gone); it counts a norm kernel into which Inductor also fused a cast or an add of its neighbours.

``classify`` returns milliseconds per step per class (*norm*, *dropout*, *add*: removable; *fused*;
*other*), the number of classified units per step (an op subtree or a kernel: a check against a
model's structure), and the largest classified entries.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
from torch import nn

__all__ = [
    "REMOVABLE",
    "SCOPE_PREFIX",
    "classify",
    "event_classes",
    "inductor_kernel_class",
    "profile_steps",
    "removable_scopes",
    "residual_modules",
]

REMOVABLE = ("norm", "dropout", "add")
SCOPE_PREFIX = "addnorm.removable::"
NORM_OPS = frozenset(
    {
        "aten::layer_norm",
        "aten::native_layer_norm",
        "aten::native_layer_norm_backward",
        "aten::rms_norm",
        "aten::_fused_rms_norm",
        "aten::_fused_rms_norm_backward",
    }
)
ADD_OPS = frozenset({"aten::add", "aten::add_"})
# matmul, attention and embedding ops: nothing under them is removable
EXCLUDED_OP = re.compile(
    r"^aten::(mm|bmm|addmm|addmv|addbmm|baddbmm|matmul|linear|_addmm_activation|_scaled_mm|dot|mv"
    r"|.*scaled_dot_product.*|_flash_attention.*|_efficient_attention.*|_cudnn_attention.*"
    r"|embedding.*)$"
)
FUSED_NAME = re.compile(r"add_norm")
INDUCTOR_NAME = re.compile(r"^(triton_[a-z]+_fused_|cpp_fused_)")
INDUCTOR_EXCLUDED = re.compile(
    r"mm|gelu|silu|sigmoid|softmax|attention|sdpa|flash|embedding|nll|cross_entropy|tanh|erf|adam"
    r"|foreach|index|gather|scatter|convolution"
)
INDUCTOR_NORM = re.compile(r"layer_norm|rms_norm|rsqrt")
INDUCTOR_DROPOUT = re.compile(r"dropout|bernoulli|philox|rand")
INDUCTOR_ADD_ONLY = re.compile(r"^(triton_[a-z]+_fused_|cpp_fused_)((add|clone|_to_copy|view|copy)_?)+\d*$")


def inductor_kernel_class(name: str) -> str | None:
    """The class of an Inductor kernel from its name (``triton_per_fused_add_native_layer_norm_3``):
    "norm", "dropout", "add" or None (not removable, or not an Inductor kernel)."""
    if not INDUCTOR_NAME.match(name) or INDUCTOR_EXCLUDED.search(name):
        return None
    if INDUCTOR_NORM.search(name):
        return "norm"
    if INDUCTOR_DROPOUT.search(name):
        return "dropout"
    if INDUCTOR_ADD_ONLY.match(name):
        return "add"
    return None


def _kernel_name_class(name: str) -> str | bool | None:
    """A kernel's class from its name alone: "fused" for addnorm's, Inductor's by
    ``inductor_kernel_class`` (False: an Inductor kernel that is not removable), None: not known by name."""
    if FUSED_NAME.search(name):
        return "fused"
    if INDUCTOR_NAME.match(name):
        return inductor_kernel_class(name) or False
    return None


def _is_norm_module(module: nn.Module, d_model: int) -> bool:
    name = type(module).__name__
    if not (name.endswith("LayerNorm") or name.endswith("RMSNorm")):
        return False
    weight = getattr(module, "weight", None)
    if weight is None:
        weight = getattr(module, "gain", None)
    dim = getattr(module, "dim", None)
    width = dim if isinstance(dim, int) else weight.numel() if isinstance(weight, torch.Tensor) else None
    return width == d_model


def residual_modules(model: nn.Module, d_model: int) -> list[tuple[nn.Module, str]]:
    """The modules whose work a fused Add & Norm replaces, each with its class: the norms of the
    stream's width (not q/k norms over a head), and the connections' branch dropouts (``AddNorm``'s
    ``dropout`` on the branch, ``nn.TransformerEncoderLayer``'s ``dropout1``/``dropout2``)."""
    found: list[tuple[nn.Module, str]] = []
    for m in model.modules():
        if _is_norm_module(m, d_model):
            found.append((m, "norm"))
        if type(m).__name__ == "AddNorm" and getattr(m, "dropout_at", None) == "branch":
            found.append((m.dropout, "dropout"))
        if isinstance(m, nn.TransformerEncoderLayer):
            found += [(m.dropout1, "dropout"), (m.dropout2, "dropout")]
    return found


@contextmanager
def removable_scopes(model: nn.Module, d_model: int) -> Iterator[int]:
    """During the block, each module of ``residual_modules`` runs inside a profiler scope named
    ``SCOPE_PREFIX + class`` (forward hooks that only open and close a ``record_function``: the
    computation is unchanged). Yields how many modules got one. Only for eager models: hooks added to a
    compiled model would make it recompile."""
    handles = []
    found = residual_modules(model, d_model)
    for module, cls in found:
        stack: list = []

        def pre(mod, args, _cls=cls, _stack=stack):
            rf = torch.autograd.profiler.record_function(SCOPE_PREFIX + _cls)
            rf.__enter__()
            _stack.append(rf)

        def post(mod, args, out, _stack=stack):
            _stack.pop().__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
    try:
        yield len(found)
    finally:
        for h in handles:
            h.remove()


def _backward_root(e):
    """The autograd node an event runs under: the node's own record (RecordScope::BACKWARD_FUNCTION)
    or the engine's ``evaluate_function: X`` around it, where the gradients it returns are accumulated
    into its inputs' buffers; both carry the node's sequence number. None in the forward."""
    while e is not None:
        if e.scope == 1 or e.name.startswith("autograd::engine::evaluate_function"):
            return e
        e = e.cpu_parent
    return None


def _forward_class(e, stream_shape: tuple[int, ...] | None) -> str | None:
    """A forward event's class from itself and its ancestors (the first rule that applies going up)."""
    a = e
    while a is not None:
        name = a.name
        if EXCLUDED_OP.match(name):
            return None
        if name.startswith(SCOPE_PREFIX):
            return name[len(SCOPE_PREFIX) :]
        if name in NORM_OPS:
            return "norm"
        if name in ADD_OPS and stream_shape is not None:
            shapes = [tuple(s) for s in (a.input_shapes or [])[:2]]
            if len(shapes) == 2 and shapes[0] == shapes[1] == stream_shape:
                return "add"
        a = a.cpu_parent
    return None


def _backward_class(e, root, by_node: dict) -> str | None:
    a = e
    while a is not None and a is not root:
        if EXCLUDED_OP.match(a.name):
            return None
        a = a.cpu_parent
    return by_node.get((root.sequence_nr, root.fwd_thread))


def event_classes(events, stream_shape=None) -> dict[int, str | None]:
    """Each CPU event's class ("norm", "dropout", "add" or None), by ``id(event)``: forward events by
    their own name and scope, backward events by the forward op that made their autograd node."""
    shape = tuple(stream_shape) if stream_shape is not None else None
    cpu_events = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU]
    roots = {id(e): _backward_root(e) for e in cpu_events}
    by_node: dict = {}
    for e in cpu_events:
        if roots[id(e)] is None and e.sequence_nr >= 0:
            cls = _forward_class(e, shape)
            if cls is not None:
                by_node.setdefault((e.sequence_nr, e.thread), cls)
    out: dict[int, str | None] = {}
    for e in cpu_events:
        root = roots[id(e)]
        out[id(e)] = _backward_class(e, root, by_node) if root is not None else _forward_class(e, shape)
    return out


def classify(events, *, device: str, steps: int = 1, stream_shape=None, top: int = 12) -> dict:
    """Milliseconds per step per class of a profile's ``events`` (``prof.events()`` of ``steps`` steps):
    on "cuda" the device time of each kernel, on the CPU each op's own CPU time. ``stream_shape``:
    (batch, seq, d_model), which makes an add of two such tensors the residual add. See the module
    docstring for the rules. Returns ``ms`` (per class and "other"), ``removable_ms``, ``total_ms``,
    ``units`` (classified units per step) and ``top`` (the largest classified names)."""
    cls_of = event_classes(events, stream_shape)
    cpu_events = [e for e in events if id(e) in cls_of]
    us: dict[str, float] = defaultdict(float)
    units: dict[str, int] = defaultdict(int)
    names: dict[tuple[str, str], float] = defaultdict(float)
    if device == "cuda":
        # the kernels themselves: named ones (addnorm's, Inductor's) by name, and every kernel's time
        # in the total (a Triton kernel launched outside any op is attached to no CPU event)
        total = 0.0
        for e in events:
            if e.device_type == torch.autograd.DeviceType.CPU:
                continue
            dur = e.time_range.elapsed_us()
            total += dur
            kcls = _kernel_name_class(e.name)
            if kcls:
                us[kcls] += dur
                units[kcls] += 1
                names[(e.name, kcls)] += dur
        # the rest by the op that launched them
        for e in cpu_events:
            cls = cls_of[id(e)]
            for k in e.kernels:
                if cls is None or _kernel_name_class(k.name) is not None:
                    continue
                us[cls] += k.duration
                names[(k.name, cls)] += k.duration
        us["other"] = max(0.0, total - sum(us.values()))
    else:
        for e in cpu_events:
            cls = cls_of[id(e)]
            us[cls or "other"] += e.self_cpu_time_total
            if cls is not None:
                names[(e.name, cls)] += e.self_cpu_time_total
    for e in cpu_events:
        cls, parent = cls_of[id(e)], e.cpu_parent
        if cls is not None and (parent is None or cls_of.get(id(parent)) != cls):
            units[cls] += 1
    ms = {k: v / 1e3 / steps for k, v in us.items()}
    for k in (*REMOVABLE, "fused", "other"):
        ms.setdefault(k, 0.0)
    largest = sorted(names.items(), key=lambda kv: -kv[1])[:top]
    return {
        "ms": ms,
        "removable_ms": sum(ms[k] for k in REMOVABLE),
        "total_ms": sum(ms.values()),
        "units": {k: v / steps for k, v in units.items()},
        "top": [{"name": n[:120], "class": c, "ms": t / 1e3 / steps} for (n, c), t in largest],
    }


def profile_steps(
    step: Callable[[], object],
    *,
    device: str,
    steps: int = 2,
    model: nn.Module | None = None,
    d_model: int | None = None,
    stream_shape=None,
) -> dict:
    """Profile ``steps`` calls of ``step`` (one warm call first, unprofiled) and ``classify`` them; with
    ``model`` (eager) its norms and branch dropouts are scoped (``removable_scopes``)."""
    from torch.profiler import ProfilerActivity, profile

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    step()
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    scopes = removable_scopes(model, d_model) if model is not None else nullcontext()
    with scopes, profile(activities=activities, record_shapes=True) as prof:
        for _ in range(steps):
            step()
        sync()
    return classify(prof.events(), device=device, steps=steps, stream_shape=stream_shape)
