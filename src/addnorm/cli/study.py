"""The study commands of the ``addnorm`` CLI: ``study``, ``report``, ``export`` and ``compare``.

The main Typer app (``addnorm.cli``) calls :func:`register`; a library error in any of these commands
becomes one ``error: ...`` line on stderr and exit code 2, never a traceback. ``addnorm study`` exits
with code 1 when a run of the spec failed (after storing and reporting everything else).
"""

from __future__ import annotations

import os
import re
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..commit import COMMIT_ENV
from ..study.export import write_csv
from ..study.findings import INCONCLUSIVE, NOT_SUPPORTED, RULE, SUPPORTED, Finding, compute_findings
from ..study.keys import OVERRIDE_HELP, SMOKE_HELP
from ..study.keys import markdown as keys_markdown
from ..study.keys import text as keys_text
from ..study.lock import folder_lock
from ..study.report import build_report
from ..study.store import Store, write_atomic
from ..study.trackers import TRACKERS
from .errors import handle_errors

if TYPE_CHECKING:
    from ..study.executors import Executor

DEFAULT_OUT = Path("addnorm-out")
VERDICT_STYLE = {SUPPORTED: "green", NOT_SUPPORTED: "red", INCONCLUSIVE: "yellow"}
EXECUTORS = ("local", "ray")


def _database(out: Path) -> Path:
    db = Path(out) / "study.sqlite"
    if not db.is_file():
        raise ValueError(f"out: no study database at {str(db)!r}; run `addnorm study --out {out}` first")
    return db


BUDGET_HELP = (
    "wall-clock seconds for this whole invocation (a device window): a run starts only if its estimate "
    "(from the runs stored for this device, else FLOPs) ends inside it, leaving time for the report; the "
    "rest wait for the next invocation, which resumes (exit 0, 'N of M runs stored, resume to continue'). "
    "A budget too small for any run left: exit 2"
)
MIX_HELP = (
    "rank runs of one setting measured on different devices (CPU models, GPUs) in one table; by default "
    "each device gets its own"
)
ADDRESS_HELP = "with --executor ray: the cluster (auto or host:port); default: a local one for this study"
KEYS_HELP = "list every key a spec may hold (run keys with defaults, the structure) and exit"
WAIT_HELP = (
    "if another study holds the output folder: wait up to SECONDS (inf: until it is free) for it, "
    "saying once whom for, instead of exiting 3 at once"
)


FOR_DEVICE_HELP = (
    "with --dry-run: plan for that GPU (its name as its stored runs give it, e.g. 'NVIDIA H200') instead of "
    "this machine: the times and packings measured there, no check of this machine's memory"
)
COMMIT_HELP = (
    "the commit of the code that runs, stored in every run's provenance (where the tree has no .git and "
    "no benchmarks/.commit); sets $ADDNORM_COMMIT for the workers"
)


def _set_commit(sha: str) -> None:
    """``--commit SHA``: the commit every run of this invocation records (its workers inherit it)."""
    if not re.fullmatch(r"[0-9a-fA-F]{4,40}", sha.strip()):
        raise ValueError(f"--commit: expected a git commit (4 to 40 hex digits), got {sha!r}")
    os.environ[COMMIT_ENV] = sha.strip()
    os.environ[COMMIT_ENV + "_SOURCE"] = "--commit"


def _lock(folder: Path, wait: float | None):
    """The folder's study lock for a command with ``--wait`` (None: refuse at once if in use)."""
    if wait is not None and not wait >= 0:
        raise ValueError(f"--wait: expected a number of seconds >= 0 (or inf), got {wait}")
    return folder_lock(folder, wait=wait or 0.0, notify=lambda line: typer.echo(line, err=True))


def _workers(text: str) -> int | str:
    if text.strip().lower() == "auto":
        return "auto"
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"--workers: expected a positive integer or 'auto', got {text!r}")
    return value


def findings_table(findings: list[Finding]) -> Table:
    """The findings as a terminal table (claim, measured at, verdict); the evidence is in the report."""
    table = Table(title="Findings", title_justify="left", show_lines=False, expand=False)
    table.add_column("claim", overflow="fold", ratio=3)
    table.add_column("measured at", overflow="fold", ratio=3)
    table.add_column("verdict", no_wrap=True)
    for f in findings:
        style = VERDICT_STYLE.get(f.verdict, "dim")
        table.add_row(escape(f.claim), escape(f.scale), f"[{style}]{escape(f.verdict)}[/]")
    return table


def _interrupt_on_sigterm() -> None:
    """SIGTERM stops a study as Ctrl-C does (runs in flight cancelled, exit 130 with a message)."""
    if threading.current_thread() is threading.main_thread():

        def interrupt(signum, frame):
            raise KeyboardInterrupt

        signal.signal(signal.SIGTERM, interrupt)


def study(
    spec: str = typer.Argument("quick", help="a preset name (see --list) or a path to a YAML spec"),
    out: Path = typer.Option(None, "--out", help="output folder (default addnorm-out/<study name>)"),
    set_: list[str] = typer.Option([], "--set", help=OVERRIDE_HELP),
    workers: str = typer.Option(
        None,
        "--workers",
        help="processes running at once; auto (the default): one per usable core; on a CUDA machine as "
        "many runs at once as the GPU's memory, the cores and the measured gain allow, said in one line "
        "(1: in this process)",
    ),
    threads: int = typer.Option(
        None,
        "--threads",
        help="torch threads per worker (default 1; more only helps large models on an idle machine)",
    ),
    executor: str = typer.Option(
        "local",
        "--executor",
        help="local: this machine (see --workers); ray: one Ray task per run (the 'ray' extra)",
    ),
    address: str = typer.Option(None, "--address", help=ADDRESS_HELP),
    cpus_per_run: int = typer.Option(
        None, "--cpus-per-run", help="with --executor ray: CPUs (= torch threads) per run (default 1)"
    ),
    gpus_per_run: float = typer.Option(
        None, "--gpus-per-run", help="with --executor ray: GPUs per run, a fraction shares one (default 0)"
    ),
    nproc: int = typer.Option(
        None,
        "--nproc",
        help="train every run on N processes launched by torchrun, each on its shard of every batch "
        "(one per GPU; gloo on the CPU): sets distributed: {strategy, nproc: N} everywhere",
    ),
    strategy: str = typer.Option(None, "--strategy", help="with --nproc: ddp (the default) or fsdp2"),
    track: list[str] = typer.Option(
        [],
        "--track",
        help=f"log every run to an experiment tracker too, repeatable: {', '.join(TRACKERS)} (extras of "
        "the same names)",
    ),
    mlflow_uri: str = typer.Option(
        None,
        "--mlflow-uri",
        help="with --track mlflow: the tracking URI (default $MLFLOW_TRACKING_URI, else "
        "sqlite:///<out>/mlflow.db)",
    ),
    smoke: bool = typer.Option(False, "--smoke", help=SMOKE_HELP),
    csv: bool = typer.Option(False, "--csv", help="also export runs and metrics to <out>/csv"),
    quiet: bool = typer.Option(False, "--quiet", help="no progress display"),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="list the runs, their settings and a time estimate; run nothing"
    ),
    prune: bool = typer.Option(False, "--prune", help="delete stored runs that are not part of this spec"),
    wait: float = typer.Option(None, "--wait", metavar="SECONDS", help=WAIT_HELP),
    memory_limit: str = typer.Option(
        None,
        "--memory-limit",
        metavar="SIZE|off",
        help="memory one run may use (8G, 512M, ...; off: no check); default: the available memory "
        "shared by the workers (on CUDA the GPU's free memory), or $ADDNORM_MEMORY_LIMIT. Runs estimated "
        "above it are refused before anything trains",
    ),
    list_presets: bool = typer.Option(False, "--list", help="list the shipped presets and exit"),
    show: str = typer.Option(
        None, "--show", metavar="PRESET", help="print a preset's YAML (a template) and exit"
    ),
    keys: bool = typer.Option(False, "--keys", help=KEYS_HELP),
    markdown: bool = typer.Option(
        False, "--markdown", help="with --keys: as the Markdown of docs/study-spec.md"
    ),
    budget: float = typer.Option(None, "--budget", metavar="SECONDS", help=BUDGET_HELP),
    mix_devices: bool = typer.Option(False, "--mix-devices", help=MIX_HELP),
    for_device: str = typer.Option(None, "--for-device", metavar="NAME", help=FOR_DEVICE_HELP),
    commit: str = typer.Option(None, "--commit", metavar="SHA", help=COMMIT_HELP),
) -> None:
    """Run a study (resuming one already started in the same folder: finished runs are kept, failed
    runs tried again), write its report and print its findings. Exit code 1 if a run failed; with
    --budget, 0 when runs are left for the next invocation (it says how many are stored)."""
    # what trains imports torch, so only here: report, export, compare and --help start without it
    from ..study.cost_model import Budget, fmt_time
    from ..study.dry_run import print_plan
    from ..study.runner import prepare, run_study
    from ..study.spec import distributed_override, load_spec, preset_names, preset_text
    from ..study.trackers import make_trackers

    window_ = Budget(budget) if budget is not None else None  # the invocation's clock: from its start
    _interrupt_on_sigterm()
    if commit is not None:
        _set_commit(commit)
    if for_device is not None and not dry_run:
        raise ValueError("--for-device: only with --dry-run (runs train on the device they run on)")
    console = Console()
    if list_presets:
        for name in preset_names():
            typer.echo(f"{name}: {' '.join(load_spec(name).description.split())}")
        return
    if show is not None:
        typer.echo(preset_text(show), nl=False)
        return
    if keys:
        if markdown:
            typer.echo(keys_markdown(), nl=False)
            return
        typer.echo(keys_text(), nl=False)
        return
    n_workers = _workers(workers or "auto")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads: expected a positive integer, got {threads}")
    ray_options = {"--address": address, "--cpus-per-run": cpus_per_run, "--gpus-per-run": gpus_per_run}
    if executor not in EXECUTORS:
        raise ValueError(f"--executor: expected one of {', '.join(EXECUTORS)}, got {executor!r}")
    if executor == "ray":
        for option, value in (("--workers", workers), ("--threads", threads)):
            if value is not None:
                raise ValueError(
                    f"{option}: not with --executor ray (the cluster runs what fits; --cpus-per-run)"
                )
    else:
        for option, value in ray_options.items():
            if value is not None:
                raise ValueError(f"{option}: only with --executor ray")
    if mlflow_uri is not None and "mlflow" not in [t.strip().lower() for t in track]:
        raise ValueError("--mlflow-uri: only with --track mlflow")
    trackers = make_trackers(track, mlflow_uri)  # a missing extra is an error before anything runs
    if nproc is not None or strategy is not None:
        set_ = [*set_, distributed_override(nproc, strategy)]
    plan = load_spec(spec, set_, smoke=smoke)
    folder = out or DEFAULT_OUT / plan.name
    runner: Executor | None = None
    if executor == "ray":
        from ..study.ray_executor import RayExecutor

        if cpus_per_run is not None and cpus_per_run < 1:
            raise ValueError(f"--cpus-per-run: expected a whole number >= 1, got {cpus_per_run}")
        runner = RayExecutor(address, 1 if cpus_per_run is None else cpus_per_run, gpus_per_run or 0.0)
    if dry_run:
        where = None
        if runner is not None:
            cluster = f"the Ray cluster at {address}" if address else "a local Ray cluster"
            gpus = f" and {runner.gpus_per_run:g} GPU" if runner.gpu else ""
            where = f"on {cluster} with {runner.cpus_per_run} CPU(s){gpus} per run"
        print_plan(
            plan,
            folder,
            where,
            console,
            window_,
            for_device,
            workers=n_workers,
            threads=threads,
            memory=memory_limit,
        )
        return
    runner = prepare(
        plan, folder, n_workers, threads, runner, memory_limit, window_
    )  # nothing touched if refused
    with _lock(folder, wait):  # the study and the findings it prints are of one spec
        outcome = run_study(
            plan,
            folder,
            workers=n_workers,
            threads=threads,
            executor=runner,
            progress=not quiet,
            prune=prune,
            trackers=trackers,
            memory_limit=memory_limit,
            budget=window_,
            mix_devices=mix_devices,
        )
        with Store(folder / "study.sqlite") as store:
            if not quiet:
                console.print(findings_table(compute_findings(store)))
                console.print(f"Rule: {RULE}.", markup=False, highlight=False, style="dim")
            if csv:
                write_csv(store, folder / "csv")
    stale = f", {outcome.stale} stored runs not part of this spec" if outcome.stale else ""
    typer.echo(f"{outcome.total} runs ({outcome.skipped} already stored, {outcome.ran} run now{stale})")
    if outcome.left:
        typer.echo(
            f"{outcome.stored} of {outcome.total} runs stored, resume to continue ({outcome.left} did not "
            f"fit in the budget of {fmt_time(window_.seconds)}, {fmt_time(window_.spent())} used)"
        )
    typer.echo(f"report: {outcome.report}")
    typer.echo(f"database: {folder / 'study.sqlite'}")
    if csv:
        typer.echo(f"csv: {folder / 'csv'}")
    if outcome.failed:
        typer.echo(
            f"error: {len(outcome.failed)} run(s) failed (run the command again to retry them): "
            + "; ".join(outcome.failed[:3])
            + (" ..." if len(outcome.failed) > 3 else ""),
            err=True,
        )
        raise typer.Exit(code=1)


def report(
    out: Path = typer.Argument(..., help="a study folder holding study.sqlite"),
    wait: float = typer.Option(None, "--wait", metavar="SECONDS", help=WAIT_HELP),
    mix_devices: bool = typer.Option(False, "--mix-devices", help=MIX_HELP),
) -> None:
    """Rebuild a study's report from its database (nothing is retrained)."""
    _database(out)
    with _lock(out, wait):
        typer.echo(f"report: {build_report(out, mix_devices=mix_devices)}")


def export(
    out: Path = typer.Argument(..., help="a study folder holding study.sqlite"),
    to: Path = typer.Option(None, "--to", help="folder for the CSV files (default <out>/csv)"),
    profiles: bool = typer.Option(
        False,
        "--profiles",
        help="also layer_profiles.csv: one value per run, step, layer, part (ffn, stream) and metric, a "
        "layer's rows combined as the report and the findings read them",
    ),
) -> None:
    """Export the current spec's runs as tidy CSV: runs.csv (one column per config key and provenance
    field), experiments.csv, metrics.csv and layer_metrics.csv (long format)."""
    with Store(_database(out), readonly=True) as store:
        for path in write_csv(store, to or out / "csv", profiles):
            typer.echo(str(path))


def compare(
    folders: list[Path] = typer.Argument(..., help="study folders, each holding study.sqlite"),
    to: Path = typer.Option(None, "--to", help="write the Markdown to this file (default: print it)"),
    mix_devices: bool = typer.Option(False, "--mix-devices", help=MIX_HELP),
) -> None:
    """Compare studies as Markdown: each ranked setting's table (letter groups, splits and their seeds),
    each study's verdicts, every placement's rank in every setting side by side, and Spearman's rank
    correlation between every pair of settings (nothing is retrained or written to the studies)."""
    from ..study.compare import read, render

    text = render([read(folder, mix_devices) for folder in folders])
    if to is None:
        typer.echo(text, nl=False)
        return
    Path(to).parent.mkdir(parents=True, exist_ok=True)
    write_atomic(to, text)
    typer.echo(f"comparison: {to}")


def register(app: typer.Typer) -> None:
    """Add the ``study``, ``report``, ``export`` and ``compare`` commands to ``app``."""
    app.command("study")(handle_errors(study))
    app.command("report")(handle_errors(report))
    app.command("export")(handle_errors(export))
    app.command("compare")(handle_errors(compare))
