"""``cellmesh coordinator JOB``: the coordinator process of a cluster job (the coordinator pod runs it).

It does what ``cellmesh run`` does (``coordinator/commands/run.py``) on workers it did not start:

1. load the job spec (the ConfigMap's ``job.yaml`` in Kubernetes: the same spec
   ``cellmesh run`` reads) and log as its ``logging`` section says; a job that does not load
   is reported before anything is served;
2. wait, bounded by ``--wait-timeout``, until the job's workers registered in the registry
   (etcd in a cluster) and describe them as the planner's resources
   (:class:`~coordinator.runtime.cluster.ClusterWorkers`);
3. plan, place, train (log lines), write the final state_dict to the run directory's
   ``model.pt`` and the record of the run to its ``run.json`` (``coordinator/commands/rundir.py``;
   the manifests give ``--run-dir``, the config's ``logging.run_dir``, on the checkpoint volume);
4. keep serving until SIGTERM, so the checkpoint can be fetched (``--exit-when-done``
   exits instead). A coordinator that starts and finds the record of its finished job in
   its ``--run-dir`` does not train it again.

While it runs it serves its state: the ``coordinator`` service's ``status`` method on
the control port (``--port``; a :class:`~coordinator.commands.rundir.RunRecord`), and over
HTTP ``/healthz``, ``/readyz`` and Prometheus ``/metrics`` (``coordinator/commands/metrics.py``:
step, loss, samples/s, step time, workers) at the config's ``logging.metrics_port``
(``--metrics-port``): the same setting as ``cellmesh run``'s, the same metrics and probes,
served on ``--health-host`` (the pod's address, where the kubelet probes) rather than loopback.

A lost worker is replaced as in ``cellmesh run`` (the StatefulSet restarts its pod; see
``coordinator/runtime/session.py``). A failed job (the restart budget spent, a plan that does not
fit, workers that never came) ends the process with the error on stderr and a non-zero code:
Kubernetes restarts the pod, and the new coordinator resumes from the newest checkpoint (in the
run directory's ``checkpoints/``, else the one the last coordinator announced in the registry
under ``/cellmesh/{job}/checkpoint``); it starts over only when there is none.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import TextIO

from pydantic import ValidationError

from comm.rpc import Call, ServiceBase, ServiceHost
from coordinator.commands.jobspec import LoadedJob, load_job
from coordinator.commands.metrics import RunMetrics
from coordinator.commands.output import apply_logging, open_recorder
from coordinator.commands.recorder import RunRecorder
from coordinator.commands.run import (
    REPORTED,
    RunOptions,
    Terminated,
    report,
    train,
    use_termination_as_exception,
)
from coordinator.commands.rundir import RunDir, RunRecord
from coordinator.runtime.cluster import ClusterWorkers
from services.host.health import HealthServer
from services.protocol import Empty

__all__ = ["CoordinatorOptions", "CoordinatorServer", "serve_job"]

log = logging.getLogger(__name__)

DEFAULT_WAIT_TIMEOUT = timedelta(minutes=10)


@dataclass(frozen=True)
class CoordinatorOptions:
    """``cellmesh coordinator``'s options.

    Attributes:
        run: The job, settings, output and progress options, as for ``cellmesh run``; the config's
            ``runtime.workers`` is how many workers to wait for.
        registry: Where the workers registered (``etcd://host:port``).
        host: The address the control port binds (``$CELLMESH_HOST``, else loopback).
        port: The control port (0: any free one).
        health_host: The interface of the HTTP endpoint of ``/healthz``, ``/readyz`` and ``/metrics``
            (None: as ``host``; the kubelet probes the pod IP); its port is the config's
            ``logging.metrics_port`` (None: no endpoint).
        wait_timeout: Bounds the wait for the workers.
        exit_when_done: Exit after writing the checkpoint instead of serving until SIGTERM.
    """

    run: RunOptions
    registry: str
    host: str | None = None
    port: int = 0
    health_host: str | None = None
    wait_timeout: timedelta = DEFAULT_WAIT_TIMEOUT
    exit_when_done: bool = False


class _StatusService(ServiceBase):
    def __init__(self, server: CoordinatorServer) -> None:
        self.server = server

    def rpc_status(self, request: Empty, call: Call) -> RunRecord:
        return self.server.status()


class CoordinatorServer:
    """One cluster job's coordinator: status service, probes, metrics, and the training run of ``loaded``."""

    def __init__(self, options: CoordinatorOptions, loaded: LoadedJob, out: TextIO | None = None) -> None:
        self.options = options
        self.loaded = loaded
        self.out = out or sys.stdout
        self.metrics = RunMetrics()
        self.recorder: RunRecorder | None = None  # once run() made it
        self._finished: RunRecord | None = None  # the record of a run that finished before this process
        self._host: ServiceHost | None = None
        self._health: HealthServer | None = None

    # -- state --------------------------------------------------------------------------

    def status(self) -> RunRecord:
        if self._finished is not None:
            return self._finished
        recorder = self.recorder
        return recorder.status() if recorder is not None else RunRecord(job="", phase="starting")

    def _live(self) -> tuple[bool, str]:
        status = self.status()
        detail = f"coordinator of {status.job or 'a job'}: {status.phase}"
        return status.phase != "failed", detail + (f" ({status.error})" if status.error else "")

    def _ready(self) -> tuple[bool, str]:
        status = self.status()
        return status.phase != "starting", f"coordinator of {status.job or 'a job'}: {status.phase}"

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> CoordinatorServer:
        """Serve the control port and the HTTP endpoint (if the config's ``logging.metrics_port`` is set)."""
        self._host = ServiceHost(self.options.host, self.options.port)
        self._host.add("coordinator", _StatusService(self))
        self._host.start()
        port = self.loaded.job.config.logging.metrics_port
        if port is not None:
            self._health = HealthServer(
                live=self._live,
                ready=self._ready,
                metrics=self.metrics.registry,
                host=self.options.health_host or self.options.host,
                port=port,
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
        """Wait for the workers, train and save (or find the job already finished).

        Raises:
            The errors of ``cellmesh run`` (``coordinator.commands.run.USER_ERRORS``), and
            TimeoutError when the workers do not all register within ``wait_timeout``.
        """
        opts, loaded = self.options, self.loaded
        job = loaded.job
        workers = job.config.runtime.workers
        digest = hashlib.sha256(Path(opts.run.job).read_bytes()).hexdigest()
        recorder = open_recorder(job.name, loaded.steps, job.config.logging, serve_metrics=False,
                                 spec_sha256=digest, metrics=self.metrics)  # start() serves them
        run_dir = recorder.run_dir
        finished = _finished_record(run_dir, recorder.status())
        if finished is not None:
            self._finished = finished
            self.metrics.steps.set(finished.steps)
            self.metrics.step.set(finished.step)
            self.metrics.done.set(1)
            print(f"cellmesh coordinator: {job.name} already finished ({run_dir.model} and "
                  f"{run_dir.record}); not training it again", file=self.out, flush=True)
            return
        self.recorder = recorder
        with recorder:
            recorder.update(phase="waiting")
            print(f"cellmesh coordinator: job {job.name}: waiting for {workers} workers in {opts.registry}",
                  file=self.out, flush=True)
            with ClusterWorkers(opts.registry, job.name, workers, timeout=opts.wait_timeout) as pool:
                job.resources = pool.resources()
                self.metrics.workers.set(len(pool.names))
                run = dataclasses.replace(opts.run, resume=opts.run.resume or True)  # never start over
                result = train(loaded, run, self.out, pool=pool, recorder=recorder)
        log.info("[coordinator %s] done: %d steps, final loss %s", job.name, len(result.fit.losses),
                 f"{result.fit.losses[-1]:.4f}" if result.fit.losses else "-")

    def wait_for_stop(self) -> None:
        """Serve until SIGTERM/SIGINT (the caller turns them into ``Terminated``/``KeyboardInterrupt``)."""
        while True:
            time.sleep(1.0)


def _finished_record(run_dir: RunDir, current: RunRecord) -> RunRecord | None:
    """This job's finished run's record in ``run_dir`` (same name, steps, spec), if it and the model exist."""
    if not (run_dir.record.is_file() and run_dir.model.is_file()):
        return None
    try:
        record = RunRecord.model_validate_json(run_dir.record.read_text())
    except (OSError, ValidationError) as exc:
        log.warning("ignoring the unreadable run record %s: %s", run_dir.record, exc)
        return None
    same = (record.job, record.steps, record.spec_sha256) == (current.job, current.steps, current.spec_sha256)
    if not same or record.phase != "done":
        log.info("not the record of this job's finished run (%s); training it", run_dir.record)
        return None
    return record


def serve_job(options: CoordinatorOptions, out: TextIO | None = None, *, show_traceback: bool = False) -> int:
    """The whole ``cellmesh coordinator`` command; returns the exit code."""
    out = out or sys.stdout
    server: CoordinatorServer | None = None
    try:
        with use_termination_as_exception():
            try:
                loaded = load_job(options.run.job, options.run.settings)  # its settings say what to serve
                apply_logging(loaded.job.config.logging)
                server = CoordinatorServer(options, loaded, out)
                server.start()  # closed by the finally below, also when this fails half-way
                where = f", probes and metrics at {server.health_url}" if server.health_url else ""
                print(f"cellmesh coordinator: control at {server.address}{where}", file=out, flush=True)
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
        if server is not None and server.status().phase == "done":
            return 0
        return report(exc)
    finally:
        if server is not None:
            server.close()
    return 0
