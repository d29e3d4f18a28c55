"""Runs as Ray tasks: a study's runs spread over a Ray cluster (the ``ray`` extra).

Each planned run is one Ray task asking for ``cpus_per_run`` CPUs (its torch threads) and
``gpus_per_run`` GPUs (Ray sets ``CUDA_VISIBLE_DEVICES``; the run trains on CUDA when it got one). The
driver alone writes the study's database, as results come back (:mod:`.executors` says the contract).

- Cluster: an existing one (``address="auto"`` or ``host:port``) or, without an address, a local one
  started for the study and stopped after it: as many CPUs as this process may use, so at most
  cores / cpus_per_run runs train at once, each with cpus_per_run threads (never more threads than
  cores); it listens on the loopback interface only.
- Progress: each task sends its per-step losses in batches, at most two a second, and its latest
  progress event (building its model, evaluation batch k of n) as often, to a small actor that the
  driver empties four times a second; the driver passes them on in step order.
- Faults: ``max_retries=0`` by default: a task whose worker process dies (killed, out of memory, a
  node lost) comes back as a ``failed`` run; finished runs are stored as they arrive, so nothing
  finished is lost, and the next invocation of the study runs only what is missing. An interrupt
  (Ctrl-C) cancels every task not yet back (``ray.cancel(force=True)`` stops those in flight).
- A run on N processes (``distributed``) is one task with N x ``cpus_per_run`` CPUs and, with
  ``gpus_per_run`` > 0, N GPUs; torchrun starts its processes inside the task.
- The cluster's nodes need addnorm installed (the same version: each run's provenance records it),
  and a ``corpus`` path must exist on every node.
"""

from __future__ import annotations

import math
import os
import socket
import time
from collections.abc import Iterator

import torch

from ..extras import check
from ..train import FAILED, RunResult
from .executors import (
    PROGRESS_EVERY,
    Executor,
    ProgressThrottle,
    StepBatcher,
    StepRelay,
    execute,
    usable_cores,
)
from .spec import PlannedRun

FEATURE = "--executor ray"
ACK_WAIT = 30.0  # seconds a remote run waits at most for the driver to take its first progress batch
# the HTTP/2 client preface and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with SETTINGS
HTTP2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
LOCAL_OBJECT_STORE = 256 * 2**20  # bytes: results are small; the default takes 30% of the memory


def progress_box():
    """The Ray actor class that tasks send their per-step losses to and the driver empties. Defined in
    a function so that Ray ships it by value: its process then imports neither addnorm nor torch."""

    class ProgressBox:
        def __init__(self) -> None:
            self._batches: list = []
            self._events: dict = {}  # run id -> its latest (phase, done, total)
            self._drained: set = set()

        def report(self, run_id: str, steps: list) -> None:
            self._batches.append((run_id, steps))

        def progress(self, run_id: str, phase: str, done: int, total: int) -> None:
            self._events[run_id] = (phase, done, total)

        def drain(self) -> tuple:
            """(step batches, latest progress event per run) since the last drain."""
            batches, self._batches = self._batches, []
            events, self._events = self._events, {}
            self._drained.update(run_id for run_id, _ in batches)
            return batches, events

        def acknowledged(self, run_id: str) -> bool:
            """Whether the driver has taken a batch of ``run_id``."""
            return run_id in self._drained

    return ProgressBox


def _await_ack(box, run_id: str) -> None:
    """Wait (at most ``ACK_WAIT`` seconds) until the driver has taken ``run_id``'s first batch."""
    import ray

    deadline = time.monotonic() + ACK_WAIT
    while time.monotonic() < deadline and not ray.get(box.acknowledged.remote(run_id)):
        time.sleep(0.02)


def run_task(config: dict, run_id: str, threads: int, box) -> RunResult:
    """One run inside a Ray worker: its torch threads, its steps to ``box``, its result back. After its
    first step the run waits for the driver to take that batch (a fraction of a second; at most
    ``ACK_WAIT`` s), so a run's progress is live by construction, whatever its length or the load."""
    torch.set_num_threads(threads)
    first = [True]

    def send(steps: list) -> None:
        box.report.remote(run_id, steps)
        if first[0]:
            first[0] = False
            _await_ack(box, run_id)

    batcher = StepBatcher(send, PROGRESS_EVERY)
    throttle = ProgressThrottle(lambda *event: box.progress.remote(run_id, *event), PROGRESS_EVERY)
    result = execute(config, batcher, throttle)
    batcher.flush()
    return result


def _import_ray(local: bool):
    """Import ray; for a cluster on this machine (one started here, or an address on the loopback
    interface), first tell it to keep to the loopback interface: otherwise it replaces 127.0.0.1 by the
    machine's network address. Ray reads this once, at its import (a ray imported earlier keeps its
    own setting)."""
    check("ray", "ray", FEATURE)
    if local:
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    return ray


def _loopback(address: str) -> bool:
    host = address.rpartition(":")[0].strip("[]")
    return host == "localhost" or host.startswith("127.") or host == "::1"


def start_local_cluster(num_cpus: int | None = None) -> str:
    """Start a Ray instance on this machine for a study: ``num_cpus`` (default: the cores this process
    may use), the GPUs Ray finds, a small object store, on the loopback interface. Its address."""
    import logging

    ray = _import_ray(local=True)
    ray.init(
        num_cpus=num_cpus or usable_cores(),
        object_store_memory=LOCAL_OBJECT_STORE,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    return ray.get_runtime_context().gcs_address


def _check_reachable(address: str) -> None:
    """A ``host:port`` address must accept a connection (Ray itself retries for minutes)."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"--address: expected auto or host:port, got {address!r}")
    try:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(HTTP2_PREFACE)
            reply = conn.recv(9)
    except OSError as err:
        raise ValueError(f"--address: no Ray cluster answers at {address} ({err.strerror or err})") from None
    if len(reply) < 4 or reply[3] != 0x4:  # a Ray GCS speaks gRPC: it answers with an HTTP/2 SETTINGS frame
        raise ValueError(f"--address: {address} answers, but not as a Ray cluster (no gRPC/HTTP2 reply)")


class RayExecutor(Executor):
    """Runs as Ray tasks with ``cpus_per_run`` CPUs (= torch threads) and ``gpus_per_run`` GPUs each
    (a fraction shares a GPU), on the cluster at ``address`` or on a local one started for the study.
    Connects when the first run is submitted; ``workers`` is then how many runs the cluster holds at
    once."""

    on_this_machine = False  # the cluster decides where and when each run starts

    def __init__(
        self,
        address: str | None = None,
        cpus_per_run: int = 1,
        gpus_per_run: float = 0.0,
        max_retries: int = 0,
    ) -> None:
        if isinstance(cpus_per_run, bool) or not isinstance(cpus_per_run, int) or cpus_per_run < 1:
            raise ValueError(f"--cpus-per-run: expected a positive integer, got {cpus_per_run!r}")
        if isinstance(gpus_per_run, bool) or not isinstance(gpus_per_run, (int, float)) or gpus_per_run < 0:
            raise ValueError(f"--gpus-per-run: expected a number >= 0, got {gpus_per_run!r}")
        if gpus_per_run > 1 and gpus_per_run != int(gpus_per_run):
            raise ValueError(f"--gpus-per-run: a fraction must be below 1, got {gpus_per_run!r}")
        if address is not None and (not isinstance(address, str) or not address.strip()):
            raise ValueError(f"--address: expected auto or host:port, got {address!r}")
        check("ray", "ray", FEATURE)
        self.address = address.strip() if address else None
        self.cpus_per_run, self.gpus_per_run, self.max_retries = (
            cpus_per_run,
            float(gpus_per_run),
            max_retries,
        )
        self.threads = cpus_per_run
        self.workers = 1
        self.gpu = self.gpus_per_run > 0
        self._ray = None
        self._owned = False
        self._box = None
        self._draining = None  # the drain request in flight
        self._task = None
        self._refs: dict = {}

    # --- the cluster ------------------------------------------------------------------------------
    def _connect(self) -> None:
        ray = _import_ray(local=self.address is None or _loopback(self.address))
        if not ray.is_initialized():
            if self.address is None:
                start_local_cluster()
                self._owned = True
            else:
                _check_reachable(self.address)
                try:
                    ray.init(address=self.address, log_to_driver=False)
                except (ConnectionError, RuntimeError, ValueError) as err:
                    first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
                    raise ValueError(
                        f"--address: cannot connect to a Ray cluster at {self.address}: {first}"
                    ) from None
        self._ray = ray
        try:
            self.workers = self._capacity(ray)
        except ValueError:
            self.close()
            raise
        self._box = ray.remote(progress_box()).options(num_cpus=0).remote()
        self._draining = None
        self._task = ray.remote(run_task)

    def _capacity(self, ray) -> int:
        """Runs the cluster holds at once; an error when no node can hold one."""
        nodes = [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]
        fits = [
            min(
                math.floor(r.get("CPU", 0) / self.cpus_per_run),
                math.floor(r.get("GPU", 0) / self.gpus_per_run) if self.gpus_per_run else math.inf,
            )
            for r in nodes
        ]
        if not any(f >= 1 for f in fits):
            cpus = max((r.get("CPU", 0) for r in nodes), default=0)
            gpus = max((r.get("GPU", 0) for r in nodes), default=0)
            if cpus < self.cpus_per_run:
                raise ValueError(
                    f"--cpus-per-run: {self.cpus_per_run} CPUs per run, but the largest node of the Ray "
                    f"cluster has {cpus:g}"
                )
            raise ValueError(
                f"--gpus-per-run: {self.gpus_per_run:g} GPUs per run, but the largest node of the Ray "
                f"cluster has {gpus:g}"
            )
        return int(sum(f for f in fits if f >= 1))

    def _check_fits(self, options: dict) -> None:
        """A run on several processes that no node can hold is an error, not a task waiting forever."""
        nodes = [n.get("Resources", {}) for n in self._ray.nodes() if n.get("Alive")]
        if not any(
            r.get("CPU", 0) >= options["num_cpus"] and r.get("GPU", 0) >= options["num_gpus"] for r in nodes
        ):
            raise ValueError(
                f"distributed.nproc: a run on several processes asks for {options['num_cpus']:g} CPUs and "
                f"{options['num_gpus']:g} GPUs on one node; no node of the Ray cluster has that many"
            )

    # --- the executor interface ---------------------------------------------------------------------
    def task_options(self, run: PlannedRun) -> dict:
        """Ray's options for ``run``'s task. A run on N processes (``distributed``) asks for N times
        ``cpus_per_run`` CPUs and, on GPUs, N whole GPUs (one per process; torchrun starts them inside
        the task, on the GPUs Ray gave it)."""
        nproc = run.config.distributed["nproc"] if run.config.distributed else 1
        gpus = self.gpus_per_run if nproc == 1 else (float(nproc) if self.gpus_per_run else 0.0)
        return {
            "name": f"addnorm:{run.run_id}",  # the worker's process title while it trains: ray::addnorm:<id>
            "num_cpus": self.cpus_per_run * nproc,
            "num_gpus": gpus,
            "max_retries": self.max_retries,
            "retry_exceptions": False,
        }

    def submit(self, run: PlannedRun) -> None:
        if self._ray is None:
            self._connect()
        options = self.task_options(run)
        if run.config.distributed:
            self._check_fits(options)
        task = self._task.options(**options)
        self._refs[task.remote(run.config.to_dict(), run.run_id, self.threads, self._box)] = run

    def _drain(self, relay: StepRelay) -> None:
        """Pass on the batches the actor holds, without waiting for it (it may still be starting)."""
        if self._draining is None:
            self._draining = self._box.drain.remote()
        ready, _ = self._ray.wait([self._draining], timeout=0)
        if not ready:
            return
        (batches, events), self._draining = self._ray.get(ready[0]), None
        by_id = {run.run_id: run for run in self._refs.values()}
        for run_id, steps in batches:
            if run_id in by_id:
                relay.deliver(by_id[run_id], steps)
        for run_id, event in events.items():
            if run_id in by_id:
                relay.progress(by_id[run_id], *event)

    def _result(self, ref) -> RunResult:
        from ray.exceptions import RayError, RayTaskError

        try:
            return self._ray.get(ref)
        except RayTaskError as err:  # the task raised outside execute (e.g. could not import addnorm)
            cause = err.cause if getattr(err, "cause", None) is not None else err
            return RunResult(status=FAILED, error=f"ray task failed: {type(cause).__name__}: {cause}")
        except RayError as err:  # the worker process died, the node was lost, ...
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            return RunResult(status=FAILED, error=f"worker died: {type(err).__name__}: {first}")

    def results(self, on_step=None, on_progress=None) -> Iterator[tuple[PlannedRun, RunResult]]:
        relay = StepRelay(on_step, on_progress)
        try:
            pending = list(self._refs)
            while pending:
                ready, pending = self._ray.wait(pending, num_returns=1, timeout=0.25)
                self._drain(relay)
                for ref in ready:
                    result = self._result(ref)
                    run = self._refs.pop(ref)
                    relay.complete(run, result)
                    yield run, result
        except BaseException:  # interrupted (Ctrl-C) or abandoned: cancel what has not come back
            self.cancel()
            raise
        finally:
            self.close()

    def cancel(self) -> None:
        """Cancel every task not yet back, stopping those in flight, and release the cluster."""
        if self._ray is not None:
            for ref in self._refs:
                try:
                    self._ray.cancel(ref, force=True)
                except Exception:  # noqa: BLE001 - already finished or gone
                    pass
        self._refs.clear()
        self.close()

    def close(self) -> None:
        """Release the progress actor, and stop the local cluster if this executor started it."""
        if self._ray is None:
            return
        if self._box is not None:
            try:
                self._ray.kill(self._box)
            except Exception:  # noqa: BLE001 - the cluster is going away anyway
                pass
            self._box = None
        if self._owned:
            self._ray.shutdown()
            self._owned = False
        self._ray = None
