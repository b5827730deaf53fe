"""``cellmesh coordinator JOB``: the coordinator process of a cluster job (the coordinator pod runs it).

It does what ``cellmesh run`` does (``coordinator/commands/run.py``) on workers it did not start:

1. load the job spec (the ConfigMap's ``job.yaml`` in Kubernetes: the same spec
   ``cellmesh run`` reads);
2. wait, bounded by ``--wait-timeout``, until the job's workers registered in the registry
   (etcd in a cluster) and describe them as the planner's resources
   (:class:`~coordinator.runtime.cluster.ClusterWorkers`);
3. plan, place, train (log lines), write the final state_dict to ``--output`` and a
   record of the finished run beside it (``{output}.json``, a :class:`CoordinatorStatus`);
4. keep serving until SIGTERM, so the checkpoint can be fetched (``--exit-when-done``
   exits instead). A coordinator that starts and finds the record of its finished job
   does not train it again.

While it runs it serves its state: the ``coordinator`` service's ``status`` method on
the control port (``--port``; :class:`CoordinatorStatus`), and over HTTP
(``--metrics-port``) ``/healthz``, ``/readyz`` and Prometheus ``/metrics`` (step, loss,
samples/s, step time, workers).

A failed job (a worker lost, a plan that does not fit, workers that never came) ends the
process with the error on stderr and a non-zero code: Kubernetes restarts the pod, which
trains the job again from the start on the workers then registered.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Literal, TextIO

from prometheus_client import CollectorRegistry, Gauge, Histogram
from pydantic import Field, ValidationError

from comm.codec import Message
from comm.rpc.service import Call, ServiceBase, ServiceHost
from coordinator.commands.jobspec import load_job
from coordinator.commands.run import (
    DEFAULT_OUTPUT_DIR,
    REPORTED,
    RunOptions,
    Terminated,
    check_writable,
    report,
    train,
    use_termination_as_exception,
)
from coordinator.runtime.cluster import ClusterWorkers
from coordinator.runtime.driver import StepRecord
from services.host.health import HealthServer
from services.protocol import Empty

__all__ = ["CoordinatorOptions", "CoordinatorServer", "CoordinatorStatus", "serve_job"]

log = logging.getLogger(__name__)

Phase = Literal["starting", "waiting", "training", "done", "failed"]
DEFAULT_WAIT_TIMEOUT = timedelta(minutes=10)


class CoordinatorStatus(Message):
    """Where the job is: the ``status`` reply and the record of a finished run."""

    job: str
    phase: Phase
    workers: list[str] = Field(default_factory=list)
    step: int = Field(default=0, ge=0)  # steps finished (each applied before the next one runs)
    steps: int = Field(default=0, ge=0)  # steps to train
    loss: float | None = None  # the last finished step's
    samples_per_s: float | None = None
    output: str = ""
    error: str = ""
    spec_sha256: str = ""  # of the job file: a record of another spec under the same name is not this job's


@dataclass(frozen=True)
class CoordinatorOptions:
    """``cellmesh coordinator``'s options.

    Attributes:
        run: The job, settings, output and progress options, as for ``cellmesh run``; the config's
            ``runtime.workers`` is how many workers to wait for.
        registry: Where the workers registered (``etcd://host:port``).
        host: The address the control port binds (``$CELLMESH_HOST``, else loopback).
        port: The control port (0: any free one).
        metrics_port: The HTTP port of ``/healthz``, ``/readyz`` and ``/metrics`` (None: none).
        health_host: The interface of that HTTP endpoint (None: as ``host``; the kubelet probes the pod IP).
        wait_timeout: Bounds the wait for the workers.
        exit_when_done: Exit after writing the checkpoint instead of serving until SIGTERM.
    """

    run: RunOptions
    registry: str
    host: str | None = None
    port: int = 0
    metrics_port: int | None = None
    health_host: str | None = None
    wait_timeout: timedelta = DEFAULT_WAIT_TIMEOUT
    exit_when_done: bool = False


class _StatusService(ServiceBase):
    def __init__(self, server: CoordinatorServer) -> None:
        self.server = server

    def rpc_status(self, request: Empty, call: Call) -> CoordinatorStatus:
        return self.server.status()


@dataclass
class _Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.step = Gauge("cellmesh_step", "Steps finished", registry=r)
        self.steps = Gauge("cellmesh_steps", "Steps the job trains", registry=r)
        self.loss = Gauge("cellmesh_loss", "Loss of the last finished step", registry=r)
        self.samples_per_s = Gauge(
            "cellmesh_samples_per_second", "Samples per second of the last step", registry=r
        )
        self.workers = Gauge("cellmesh_workers", "Workers the job trains on", registry=r)
        self.done = Gauge("cellmesh_done", "1 once the final state_dict is written", registry=r)
        self.step_seconds = Histogram(
            "cellmesh_step_seconds",
            "Wall time of a step",
            registry=r,
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.coordinator_seconds = Gauge(
            "cellmesh_coordinator_seconds", "Coordinator's own time in the last step", registry=r
        )


class CoordinatorServer:
    """One cluster job's coordinator: status service, probes, metrics, and the training run."""

    def __init__(self, options: CoordinatorOptions, out: TextIO | None = None) -> None:
        self.options = options
        self.out = out or sys.stdout
        self.metrics = _Metrics()
        self._lock = threading.Lock()
        self._status = CoordinatorStatus(job="", phase="starting")
        self._host: ServiceHost | None = None
        self._health: HealthServer | None = None

    # -- state --------------------------------------------------------------------------

    def status(self) -> CoordinatorStatus:
        with self._lock:
            return self._status

    def _set(self, **changes: object) -> None:
        with self._lock:
            self._status = self._status.model_copy(update=changes)

    def _on_step(self, record: StepRecord) -> None:
        seconds = max(record.seconds, 1e-9)
        with self._lock:
            self._status = self._status.model_copy(
                update={
                    "step": self._status.step + 1,
                    "loss": record.loss,
                    "samples_per_s": record.num_samples / seconds,
                }
            )
        m = self.metrics
        m.step.inc()
        m.loss.set(record.loss)
        m.samples_per_s.set(record.num_samples / seconds)
        m.step_seconds.observe(record.seconds)
        m.coordinator_seconds.set(record.coordinator_s)

    def _live(self) -> tuple[bool, str]:
        status = self.status()
        detail = f"coordinator of {status.job or 'a job'}: {status.phase}"
        return status.phase != "failed", detail + (f" ({status.error})" if status.error else "")

    def _ready(self) -> tuple[bool, str]:
        status = self.status()
        return status.phase != "starting", f"coordinator of {status.job or 'a job'}: {status.phase}"

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> CoordinatorServer:
        """Serve the control port and the HTTP endpoint."""
        self._host = ServiceHost(self.options.host, self.options.port)
        self._host.add("coordinator", _StatusService(self))
        self._host.start()
        if self.options.metrics_port is not None:
            self._health = HealthServer(
                live=self._live,
                ready=self._ready,
                metrics=self.metrics.registry,
                host=self.options.health_host or self.options.host,
                port=self.options.metrics_port,
            ).start()
        return self

    @property
    def address(self) -> str:
        assert self._host is not None, "start() first"
        return self._host.address

    @property
    def health_url(self) -> str | None:
        return self._health.url if self._health is not None else None

    def close(self) -> None:
        if self._health is not None:
            self._health.close()
            self._health = None
        if self._host is not None:
            self._host.shutdown(timedelta(seconds=5))
            self._host = None

    def run(self) -> None:
        """Load, wait for the workers, train and save (or find the job already finished).

        Raises:
            The errors of ``cellmesh run`` (``coordinator.commands.run.USER_ERRORS``), and
            TimeoutError when the workers do not all register within ``wait_timeout``.
        """
        opts = self.options
        loaded = load_job(opts.run.job, opts.run.settings)
        job = loaded.job
        output = opts.run.output or DEFAULT_OUTPUT_DIR / f"{loaded.name}.pt"
        workers = job.config.runtime.workers
        digest = hashlib.sha256(Path(opts.run.job).read_bytes()).hexdigest()
        self._set(job=job.name, steps=loaded.steps, output=str(output), spec_sha256=digest)
        self.metrics.steps.set(loaded.steps)
        finished = _finished_record(output, self.status())
        if finished is not None:
            self._set(**finished.model_dump(exclude={"job", "output"}))
            self.metrics.done.set(1)
            self.metrics.step.set(finished.step)
            print(
                f"cellmesh coordinator: {job.name} already finished ({output} and {_record_path(output)}); "
                "not training it again",
                file=self.out,
                flush=True,
            )
            return
        check_writable(output)
        self._set(phase="waiting")
        print(
            f"cellmesh coordinator: job {job.name}: waiting for {workers} workers in {opts.registry}",
            file=self.out,
            flush=True,
        )
        try:
            with ClusterWorkers(opts.registry, job.name, workers, timeout=opts.wait_timeout) as pool:
                job.resources = pool.resources()
                self.metrics.workers.set(len(pool.names))
                self._set(phase="training", workers=pool.names)
                result = train(loaded, opts.run, self.out, pool=pool, on_step=self._on_step)
        except BaseException as exc:
            self._set(phase="failed", error=" ".join(str(exc).split()))
            raise
        self._set(phase="done")
        _write_record(_record_path(output), self.status())
        self.metrics.done.set(1)
        log.info(
            "[coordinator %s] done: %d steps, final loss %s",
            job.name,
            len(result.fit.losses),
            f"{result.fit.losses[-1]:.4f}" if result.fit.losses else "-",
        )

    def wait_for_stop(self) -> None:
        """Serve until SIGTERM/SIGINT (the caller turns them into ``Terminated``/``KeyboardInterrupt``)."""
        while True:
            time.sleep(1.0)


def _record_path(output: Path) -> Path:
    return output.with_name(output.name + ".json")


def _write_record(path: Path, status: CoordinatorStatus) -> None:
    """Write the record atomically (a temporary file, then rename), as the state_dict is written."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(status.model_dump_json(indent=2) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _finished_record(output: Path, current: CoordinatorStatus) -> CoordinatorStatus | None:
    """The record of this job's finished run beside ``output`` (same name, steps, spec), if both are there."""
    record = _record_path(output)
    if not (record.is_file() and output.is_file()):
        return None
    try:
        status = CoordinatorStatus.model_validate_json(record.read_text())
    except (OSError, ValidationError) as exc:
        log.warning("ignoring the unreadable run record %s: %s", record, exc)
        return None
    same = (status.job, status.steps, status.spec_sha256) == (current.job, current.steps, current.spec_sha256)
    if not same or status.phase != "done":
        log.info("not the record of this job (%s); training it", record)
        return None
    return status


def serve_job(options: CoordinatorOptions, out: TextIO | None = None, *, show_traceback: bool = False) -> int:
    """The whole ``cellmesh coordinator`` command; returns the exit code."""
    out = out or sys.stdout
    server = CoordinatorServer(options, out)
    try:
        with use_termination_as_exception():
            server.start()
            where = f", probes and metrics at {server.health_url}" if server.health_url else ""
            print(f"cellmesh coordinator: control at {server.address}{where}", file=out, flush=True)
            try:
                server.run()
            except REPORTED as exc:
                if isinstance(exc, (Terminated, KeyboardInterrupt)):
                    raise
                return report(exc, show_traceback=show_traceback)
            if options.exit_when_done:
                return 0
            print("cellmesh coordinator: done; serving until stopped (SIGTERM)", file=out, flush=True)
            server.wait_for_stop()
    except (Terminated, KeyboardInterrupt) as exc:
        if server.status().phase == "done":
            return 0
        return report(exc)
    finally:
        server.close()
    return 0
