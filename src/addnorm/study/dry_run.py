"""``addnorm study --dry-run``: what a study would run, where, and how long it would take, with nothing
run or written.

Each run's resolved settings that differ from the base, whether it is already stored, its estimated wall
time (from the runs stored for the device at the packing it would train at, else the cost model:
:mod:`.cost_model`) and its memory; with ``--budget`` which runs would start in the window and how many such
windows the rest needs. It refuses what this machine cannot run (:mod:`.limits`) and a database it cannot
resume (:mod:`.resume`), as the study would.

``--for-device NAME`` plans for another machine's GPU (a name its stored runs give, ``NVIDIA H200``)
from here, a CPU say: the estimates and packings measured on that GPU, no check of this machine's memory.
That GPU's free memory and its host's cores are not known here, so ``--workers auto`` packs as many runs
as the budget and the gain measured there allow (``--workers N``: N at once; ``--memory-limit SIZE``: the
memory each run may have there).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .cost_model import POOL_START_S, Budget, Estimator, fmt_time, report_reserve, window
from .executors import max_nproc, plan_workers
from .limits import check_eval, check_plan, estimate_memory, fmt_bytes
from .packing import Packing, choose, memory_need, plan_windows
from .resume import check_resumable, timings
from .runner import estimator_for, pack_this_gpu
from .spec import SpecError, StudySpec
from .store import FINISHED, stored_runs


def print_plan(
    plan: StudySpec,
    folder: Path,
    where: str | None,
    console: Console,
    budget: Budget | None = None,
    for_device: str | None = None,
    **local,
) -> None:
    """Print what ``addnorm study`` would run (see the module docstring). ``where``: the Ray cluster's
    description (its size is unknown until connected), or None for the local executor (``local``:
    workers, threads, memory limit); ``for_device``: plan for that GPU instead of this machine."""
    resolved = plan.resolved()
    runs = list(resolved.runs)
    db = folder / "study.sqlite"
    measured = stored_runs(db)
    check_resumable(measured, resolved, db)
    stored = {row["id"] for row in measured if row["status"] in FINISHED}
    todo = [r for r in runs if r.run_id not in stored]
    room = budget.left() - report_reserve(len(runs)) if budget is not None else None
    packing: Packing | None = None
    need = None
    if where is not None:  # a Ray cluster: its size and devices are not known until it is connected
        gpu = "GPU" in where
        estimator = Estimator("", gpu)
        check_eval(todo)
        total = sum(estimator.seconds(r.config) for r in todo)
        side = "one GPU" if gpu else "one core"
        header = f"{where}; estimated {fmt_time(total)} of {side}'s time, shared over the cluster"
        workers = None
    else:
        if for_device is not None:
            gpu, threads = True, 1
            history = Estimator(for_device, True, timings(measured))
            if local["workers"] == "auto":
                packing = choose(todo, history, room=room, start_s=POOL_START_S)
            workers = packing.k if packing is not None else local["workers"]
            estimator = Estimator(for_device, True, timings(measured), workers)
            need = lambda config: memory_need(config, estimator)  # noqa: E731
            check_plan(todo, workers, True, local["memory"] or "off", need)
            place = f"on {for_device}, {workers} run(s) at once (planned here, not on that machine)"
        else:
            gpu = torch.cuda.is_available()
            workers, threads = plan_workers(local["workers"], local["threads"], len(todo), max_nproc(todo))
            if gpu and local["workers"] == "auto" and todo and max_nproc(todo) == 1:
                packing = pack_this_gpu(todo, measured, budget, len(runs))
                workers = packing.k
            estimator = estimator_for(measured, gpu, workers)
            if gpu:
                need = lambda config: memory_need(config, estimator)  # noqa: E731
            try:
                check_plan(todo, workers, gpu, local["memory"], need)
            except SpecError as err:
                devices = {str((r.get("provenance") or {}).get("device") or "") for r in measured}
                others = sorted(d for d in devices - {estimator.device} if d)
                if gpu or not others:
                    raise
                raise SpecError(
                    f"{err}; or plan for the device of the stored runs: --for-device {others[0]!r}"
                ) from None
            place = f"on {workers} worker(s) x {threads} torch thread(s)"
        # a GPU's runs at once share it (their estimates say so); CPU workers have a core each
        total = sum(estimator.seconds(r.config) for r in todo) / workers
        side = "one GPU" if gpu else "one core"
        header = f"{place}; estimated {fmt_time(total)} ({side}'s times from {estimator.describe()})"
    fits: set[str] | None = None
    if budget is not None and workers is not None:
        start = POOL_START_S if workers > 1 else 0.0
        chosen, end = window(todo, lambda r: estimator.needs(r.config), room, workers, start)
        fits = {r.run_id for r in chosen}
        header += (
            f"; --budget {fmt_time(budget.seconds)}: {len(chosen)} of the {len(todo)} runs left would "
            f"start (done by about {fmt_time(end)}, then the report), the others in the next invocation"
        )
        fixed = None if packing is not None else workers  # a packing is chosen again for each window
        header += _windows(todo, estimator, room, fixed, start, gpu)
    console.print(
        f"study {plan.name!r} ({plan.source}): {len(runs)} runs, {len(runs) - len(todo)} already stored in "
        f"{db}, {len(todo)} to run {header}",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    if packing is not None:
        console.print(packing.line(), markup=False, highlight=False, soft_wrap=True)
    console.print("base: " + json.dumps(resolved.base), markup=False, highlight=False, soft_wrap=True)
    console.print(_table(resolved, stored, estimator, fits, need, gpu))


def _windows(
    todo: list, estimator: Estimator, room: float, workers: int | None, start: float, gpu: bool
) -> str:
    """How many windows like this one the runs left need at these estimates (nothing learnt in between;
    ``workers`` runs at once, or None: packed anew for each window's runs); on a GPU also one run at a
    time, and the gain from running them side by side that one window would need."""
    if not todo:
        return ""
    plan = plan_windows(todo, estimator, room, start, workers)
    text = f"; at these estimates the {len(todo)} runs left need " + _said(plan)
    if gpu:
        alone = sum(estimator.seconds(r.config, 1) for r in todo)
        gains = estimator.gains()
        said = ", ".join(f"x {g:.1f} at {k}" for k, g in gains.items())
        gain = f"measured: {said}" if gains else f"not measured on {estimator.device} yet"
        one = _said(plan_windows(todo, estimator, room, start, 1))
        text += (
            f"; one at a time they take {fmt_time(alone)} of the GPU ({one}), so one window holds them all "
            f"if running them side by side gains x {alone / max(room, 1):.1f} or more ({gain})"
        )
    return text


def _said(plan: list[tuple[int, int]] | None) -> str:
    """A plan of windows in words: how many, how many runs at once, how many runs each starts."""
    if plan is None:
        return "a longer window (a run fits in none)"
    ks, ns = sorted({k for k, _ in plan}), [n for _, n in plan]
    at = f"{ks[0]}" if len(ks) == 1 else f"{ks[0]} to {ks[-1]}"
    runs = f"{ns[0]}" if min(ns) == max(ns) else f"{min(ns)} to {max(ns)}"
    return f"{len(plan)} such window(s): {at} run(s) at once, {runs} run(s) each"


def _table(resolved, stored: set[str], estimator: Estimator, fits: set[str] | None, need, gpu: bool) -> Table:
    """One row per run: its experiment and label, id, whether stored, estimate, memory, settings."""
    table = Table(show_lines=False)
    columns = ["experiment", "label", "run id", "stored", "est.", "memory", "settings different from base"]
    if fits is not None:
        columns.insert(5, "in budget")
    for column in columns:
        table.add_column(column, overflow="fold", no_wrap=column in ("run id", "est.", "memory"))
    base, members = resolved.base, resolved.memberships
    for run in resolved.runs:
        diff = {k: v for k, v in run.config.to_dict().items() if base.get(k) != v}
        also = [f"{e}: {lab}" for e, lab in members[run.run_id][1:]]
        memory = need(run.config)[0] if need is not None else estimate_memory(run.config, gpu).total
        cells = [
            escape(run.experiment),
            escape(run.label + (f" (also {'; '.join(also)})" if also else "")),
            run.run_id,
            "yes" if run.run_id in stored else "",
            fmt_time(estimator.seconds(run.config)),
            fmt_bytes(memory),
            escape(", ".join(f"{k}={json.dumps(v)}" for k, v in diff.items())),
        ]
        if fits is not None:
            cells.insert(5, "starts" if run.run_id in fits else "")
        table.add_row(*cells)
    return table
