"""The worker process: registers with a lease, reports its resources, hosts assigned services.

A worker is a :class:`~comm.rpc.host.ServiceHost` plus a ``worker`` control service. It
publishes a :class:`~services.protocol.WorkerCard` under ``/cellmesh/{job}/workers/{name}``
attached to a lease it renews by heartbeat; if the process dies, the lease lapses and the
card vanishes (the coordinator's watch sees it go). Services arrive by message
(:class:`~services.protocol.Assignment`), naming an importable factory, never code.

A worker builds only its own job's factories: those of the job spec it was started with
(``--job-spec``, the file a pod mounts from the job's ConfigMap) or named one by one
(``--factory``, what a local run's harness passes). Any other name in an assignment is
refused with an error reply naming it, before anything is imported, whoever sent it
(``services/factories.py``). Started with neither, the worker builds no factory at all
(barriers and parameter servers need none).

SIGTERM (and SIGINT) drain the worker: it stops taking assignments, lets the request in
hand finish, closes its services, deletes its card, revokes its lease and exits 0.

Registry outages and a coordinator that is gone (see [Note: registry outages] in
``comm/registry/keepalive.py``): the lease is refreshed through any outage, and if the registry
lost it meanwhile the worker gets a new one and publishes its card again (same name, same
address). The worker leaves only when its coordinator is gone, which it tells by the
registry's URL:

* ``tcp://`` (the embedded registry, served by the coordinator's process): the registry not
  answering for a whole lease means its coordinator is gone;
* ``etcd://`` (the registry outlives the coordinator): the coordinator's presence key
  ``/cellmesh/{job}/coordinator`` (:class:`~comm.registry.presence.Presence`, kept by the
  coordinator's event loop) vanished while etcd answers. A worker started before its
  coordinator waits for it, and one whose coordinator closed cleanly waits for the next.

It then drains without a goodbye to a registry that died with the coordinator, logs one
WARNING line naming why and exits 0 at once (without the interpreter's teardown, which takes
seconds once a job's tensors filled the heap).

In a pod the worker takes who it is from the environment as a torchrun worker would
(``RANK``/``WORLD_SIZE``/``MASTER_*`` or the ``PET_*`` form: ``services/host/launch.py``),
binds the pod's address (``CELLMESH_HOST``) on a fixed ``--port``, and serves its probes
on ``--health-port`` (``services/host/health.py``): ``/readyz`` once its card is published,
``/healthz`` until its coordinator is gone (never for a registry outage alone).

``--memory-limit BYTES`` (or ``CELLMESH_MEMORY_LIMIT``) caps what the process may allocate beyond
what it holds at start, torch imported (see [Note: the memory cap] in ``comm/memcap.py``); its card
then reports the cap as its memory.

It logs to stderr through ``comm/logs.py``: ``CELLMESH_LOG_LEVEL`` (default INFO) and
``CELLMESH_LOG_FORMAT`` (``human`` or ``json``), every record carrying the worker's name and
rank, and the service and step of the request being served. A local run's harness sends
that stream to the run directory's ``workers/NAME.log``.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import secrets
import signal
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from pathlib import Path
from types import FrameType
from typing import NoReturn

from prometheus_client import CollectorRegistry, Gauge

from comm import auth
from comm.allocator import tune_malloc
from comm.codec import pack
from comm.errors import LeaseExpiredError
from comm.heap import settle_imports
from comm.logs import configure_logging, set_process_context
from comm.memcap import apply_cap
from comm.registry import connect_registry, follows_presence
from comm.registry.base import Lease, Registry
from comm.registry.keepalive import KeepAlive
from comm.registry.presence import PresenceMonitor
from comm.rpc import Call, RpcError, ServiceBase, ServiceHost
from services.factories import FactoryAllowList, FactoryError, spec_factories
from services.host.health import HealthServer, TrafficCollector
from services.host.launch import LaunchEnv, LaunchEnvError, read_launch_env
from services.protocol import Assignment, AssignmentReply, Empty, Release, WorkerCard, WorkerStatus

__all__ = ["SERVICE_BUILDERS", "Worker", "allowed_factories", "coordinator_key", "main", "run", "worker_key"]

log = logging.getLogger(__name__)

DEFAULT_LEASE_TTL = timedelta(seconds=5)
DEREGISTER_TIMEOUT = timedelta(seconds=3)
DRAIN_TIMEOUT = timedelta(seconds=10)
"""The most :meth:`Worker.drain` waits for the request in hand before it closes the services."""

ServiceBuilder = Callable[[Assignment, FactoryAllowList], ServiceBase]
"""``build(assignment, factories)``: the service an assignment asks for, resolving only ``factories``."""


def _build_barrier(assignment: Assignment, factories: FactoryAllowList) -> ServiceBase:
    from services.barrier import BarrierService

    return BarrierService()


def _build_param_server(assignment: Assignment, factories: FactoryAllowList) -> ServiceBase:
    from services.params.server import ParamServerService

    return ParamServerService.from_assignment(assignment)


def _build_compute(assignment: Assignment, factories: FactoryAllowList) -> ServiceBase:
    from services.compute.service import CellComputeService

    return CellComputeService.from_assignment(assignment, factories)


SERVICE_BUILDERS: dict[str, ServiceBuilder] = {
    "barrier": _build_barrier,
    "param_server": _build_param_server,
    "compute": _build_compute,
}


def worker_key(job: str, name: str) -> str:
    return f"/cellmesh/{job}/workers/{name}"


def coordinator_key(job: str) -> str:
    """The job's coordinator's presence key (``coordinator/runtime/loop.py`` keeps it)."""
    return f"/cellmesh/{job}/coordinator"


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


RUNTIME_MODULES = ("torch", "torch.distributed.checkpoint", "torch._dynamo")
"""What every worker imports before its memory cap and its first assignment: any optimizer's
constructor imports ``torch._dynamo`` (1-2 s of CPU, tens of MiB), the checkpoint path
``torch.distributed.checkpoint``. Loaded at start they are the process's baseline, the same in a
forked worker (the fork server preloads them) and a fresh interpreter, and never part of a stage's
measured peak or its cap (the runtime probe, ``coordinator/planning/runtime_bytes.py``, loads them
first too)."""


def _load_runtime() -> None:
    for module in RUNTIME_MODULES:
        importlib.import_module(module)


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


class _Control(ServiceBase):
    """The ``worker`` service: assignments, releases and status."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker

    def rpc_assign(self, request: Assignment, call: Call) -> AssignmentReply:
        if self.worker.draining.is_set():
            raise RpcError("draining", f"worker {self.worker.name} is shutting down")
        builder = self.worker.builders.get(request.kind)
        if builder is None:
            raise RpcError("bad_request", f"unknown service kind {request.kind!r}")
        if request.service in self.worker.host.names():
            raise RpcError("bad_request", f"service {request.service!r} is already hosted here")
        service = builder(request, self.worker.factories)
        self.worker.host.add(request.service, service)
        self.worker.publish()
        log.info("[worker %s] hosting %s (%s)", self.worker.name, request.service, request.kind)
        return AssignmentReply(service=request.service, address=self.worker.host.address)

    def rpc_release(self, request: Release, call: Call) -> Empty:
        if request.service == "worker":
            raise RpcError("bad_request", "the worker control service cannot be released")
        if request.service in self.worker.host.names():
            self.worker.host.remove(request.service)
            self.worker.publish()
            log.info("[worker %s] released %s", self.worker.name, request.service)
        return Empty()

    def rpc_status(self, request: Empty, call: Call) -> WorkerStatus:
        services = [n for n in self.worker.host.names() if n != "worker"]
        return WorkerStatus(name=self.worker.name, services=services, draining=self.worker.draining.is_set(),
                            finished=self.worker.host.finished_steps())


class Worker:
    """One worker process's host, card and lease.

    Args:
        registry: where the card goes.
        job: the job's name (the registry prefix).
        name: this worker's unique name within the job.
        lease_ttl: the card vanishes this long after the process stops renewing it.
        host: the interface services bind to (:func:`comm.sockets.default_host` by default).
        port: the port services are served on (0: one the OS chooses).
        launch: rank, world size and resource limits from the environment (``services/host/launch.py``).
        factories: the factories assignments may name (:func:`allowed_factories`); default none.
        follows_presence: learn that the coordinator is gone from its presence key (etcd) rather
            than from the registry going silent (the embedded registry); see the module docstring.
        builders: what builds each kind of service an assignment names (:data:`SERVICE_BUILDERS`; a hollow
            worker's compute does no tensor work: ``services/host/hollow.py``).
    """

    def __init__(self, registry: Registry, job: str, name: str, *,
                 lease_ttl: timedelta = DEFAULT_LEASE_TTL, host: str | None = None, port: int = 0,
                 launch: LaunchEnv | None = None, factories: FactoryAllowList | None = None,
                 follows_presence: bool = False,
                 builders: Mapping[str, ServiceBuilder] | None = None) -> None:
        self.registry = registry
        self.builders = dict(SERVICE_BUILDERS if builders is None else builders)
        self.job = job
        self.name = name
        self.lease_ttl = lease_ttl
        self.follows_presence = follows_presence
        self.launch = launch or LaunchEnv()
        self.factories = factories or FactoryAllowList(frozenset(), "no --job-spec or --factory")
        self.host = ServiceHost(host, port)
        self.published = threading.Event()
        self.draining = threading.Event()
        self.stopped = threading.Event()
        self.incarnation = secrets.token_hex(8)
        self._publishing = threading.Lock()  # publish() and the keepalive's renewal put the same card
        self._lease = registry.lease(lease_ttl)
        self._keepalive: KeepAlive | None = None
        self._coordinator: PresenceMonitor | None = None
        self.host.add("worker", _Control(self))

    def card(self) -> WorkerCard:
        launch = self.launch
        return WorkerCard(
            name=self.name, address=self.host.address, pid=os.getpid(),
            cpus=launch.cpus or os.cpu_count() or 1, memory_bytes=launch.memory_bytes or _memory_bytes(),
            gpus=_gpus(), services=[n for n in self.host.names() if n != "worker"],
            rank=launch.rank, world_size=launch.world_size, local_rank=launch.local_rank,
            incarnation=self.incarnation,
        )

    def publish(self) -> None:
        """Put the card (again: the services it lists changed) under the lease."""
        with self._publishing:
            try:
                self.registry.put(worker_key(self.job, self.name), pack(self.card()), lease=self._lease)
            except LeaseExpiredError:  # an outage cost the lease: the keepalive renews it with a fresh card
                log.info("[worker %s] its lease expired in a registry outage; the card goes out with the new "
                         "one", self.name)
                return
        self.published.set()

    def _renew(self) -> Lease:
        """A new lease and the card put with it (the registry lost the old lease in an outage)."""
        with self._publishing:
            lease = self.registry.lease(self.lease_ttl)
            self.registry.put(worker_key(self.job, self.name), pack(self.card()), lease=lease)
            self._lease = lease
        self.published.set()
        return lease

    def metrics(self) -> CollectorRegistry:
        """``/metrics`` of the worker: the services it hosts, 1 while it is ready, the bytes it sent per
        backend and what it refused from peers by reason (:class:`~services.host.health.TrafficCollector`)."""
        registry = CollectorRegistry()
        Gauge("cellmesh_worker_services", "Services this worker hosts", registry=registry).set_function(
            lambda: len(self.host.names()) - 1)
        Gauge("cellmesh_worker_ready", "1 while the worker is registered and not draining",
              registry=registry).set_function(lambda: float(self.readiness()[0]))
        registry.register(TrafficCollector())
        return registry

    def liveness(self) -> tuple[bool, str]:
        """``/healthz``: alive until the coordinator is gone (then the process is about to exit)."""
        gone = self.coordinator_gone()
        if gone is not None:
            return False, f"worker {self.name}: {gone}"
        return True, f"worker {self.name}: alive"

    def coordinator_gone(self) -> str | None:
        """Why this worker's coordinator is gone, or None while it may be there (see the module docstring)."""
        if self._keepalive is None:
            return None
        if self._coordinator is not None:
            return self._coordinator.reason if self._coordinator.gone.is_set() else None
        silent = self._keepalive.unreachable_for()
        if silent >= self.lease_ttl.total_seconds():
            return (f"its coordinator is gone: the registry the coordinator serves has not answered for "
                    f"{silent:.1f}s (a whole lease)")
        return None

    def readiness(self) -> tuple[bool, str]:
        """``/readyz``: ready once the card is in the registry, until the worker drains."""
        if self.draining.is_set():
            return False, f"worker {self.name}: draining"
        if not self.published.is_set():
            return False, f"worker {self.name}: not registered yet"
        return self.liveness()

    def start(self) -> Worker:
        """Serve, publish the card, keep the lease and (on etcd) follow the coordinator's presence."""
        self.host.start()
        self.publish()
        self._keepalive = KeepAlive(self._lease, renew=self._renew, what=f"worker {self.name}'s card")
        if self.follows_presence:
            monitor = PresenceMonitor(self.registry, coordinator_key(self.job),
                                      in_doubt=self._keepalive.in_doubt, what="its coordinator")
            self._coordinator = monitor.start()
        return self

    def drain(self, timeout: timedelta = DRAIN_TIMEOUT, *, orphaned: str | None = None) -> None:
        """Stop taking work, close services, deregister. Idempotent and bounded by ``timeout``.

        Deregistering is best effort: when the registry does not answer, the worker gives up
        after a few seconds and its lease lapses. ``orphaned`` (why the coordinator is gone)
        skips it where the registry died with the coordinator, and is the one line logged.
        """
        if self.stopped.is_set():
            return
        self.draining.set()
        if self._coordinator is not None:
            self._coordinator.close()
        self.host.shutdown(timeout)
        if orphaned is not None and not self.follows_presence:  # the registry died with the coordinator
            self.stopped.set()
            log.warning("[worker %s] %s; drained, exiting", self.name, orphaned)
            return

        def deregister() -> None:
            try:
                self.registry.delete(worker_key(self.job, self.name))
            except Exception:  # the lease revocation below removes it too
                log.debug("[worker %s] could not delete its card", self.name, exc_info=True)
            if self._keepalive is not None:
                self._keepalive.stop(revoke=True)

        cleanup = threading.Thread(target=deregister, name="worker-deregister", daemon=True)
        cleanup.start()
        cleanup.join(min(timeout.total_seconds(), DEREGISTER_TIMEOUT.total_seconds()))
        if cleanup.is_alive():
            log.warning("[worker %s] the registry did not answer; leaving without deregistering", self.name)
        self.stopped.set()
        if orphaned is not None:
            log.warning("[worker %s] %s; drained, exiting", self.name, orphaned)
        else:
            log.info("[worker %s] drained", self.name)

    def serve_forever(self, stop: threading.Event | None = None) -> str | None:
        """Serve until ``stop`` is set (default: on SIGTERM/SIGINT, :func:`stop_on_signals`), :meth:`drain`
        from elsewhere, or the coordinator is gone, and drain. Returns why the coordinator is gone, or None
        when the worker was stopped."""
        stop = stop or stop_on_signals()
        while not stop.wait(0.2):
            if self.stopped.is_set():
                return None
            gone = self.coordinator_gone()
            if gone is not None:
                self.drain(orphaned=gone)
                return gone
        self.drain()
        return None


def stop_on_signals() -> threading.Event:
    """An event SIGTERM and SIGINT set (main thread only). Installed before the worker registers, so a
    signal sent as soon as its card shows still drains it rather than killing it."""
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def allowed_factories(job_spec: str | None, names: Sequence[str]) -> FactoryAllowList:
    """What a worker started with ``--job-spec job_spec`` and ``--factory names`` may build.

    Raises:
        FactoryError: The spec cannot be read or names no factory, or a name is malformed or
            names the standard library.
    """
    listed = list(names)
    sources = [f"--factory {', '.join(names)}"] if names else []
    if job_spec is not None:
        listed += spec_factories(Path(job_spec))
        sources.insert(0, f"the job spec {job_spec}")
    return FactoryAllowList.of(listed, " and ".join(sources) or "no --job-spec or --factory")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cellmesh worker", description="run a cellmesh worker",
        epilog="The environment of torchrun and Kubeflow Trainer is honoured: RANK, WORLD_SIZE, LOCAL_RANK, "
               "MASTER_ADDR, MASTER_PORT and PET_NNODES, PET_NODE_RANK, PET_NPROC_PER_NODE, PET_MASTER_ADDR, "
               "PET_MASTER_PORT, PET_RDZV_BACKEND=etcd, PET_RDZV_ENDPOINT, PET_RDZV_ID; also "
               "CELLMESH_REGISTRY, CELLMESH_JOB, CELLMESH_HOST, CELLMESH_CPUS, CELLMESH_MEMORY_BYTES, "
               "CELLMESH_MEMORY_LIMIT (see docs/kubernetes.md).")
    parser.add_argument("--registry", default=None,
                        help="memory://, tcp://host:port or etcd://host:port (default: $CELLMESH_REGISTRY, "
                             "else the etcd of PET_RDZV_ENDPOINT)")
    parser.add_argument("--job", default=None, help="the job's name (default: $CELLMESH_JOB, $PET_RDZV_ID, "
                                                    "else 'default')")
    parser.add_argument("--name", default=None,
                        help="this worker's name (default: worker-RANK when a rank is given, "
                             "else hostname-pid)")
    parser.add_argument("--lease-ttl", type=float, default=DEFAULT_LEASE_TTL.total_seconds(),
                        help="seconds before a dead worker's card vanishes")
    parser.add_argument("--host", default=None, help="interface to serve on (default: $CELLMESH_HOST, "
                                                     "else 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0,
                        help="port to serve services on (default: any free one)")
    parser.add_argument("--job-spec", default=None, metavar="PATH",
                        help="the job's spec file (YAML/JSON): the worker builds only the factories it "
                             "names (a pod mounts it from the job's ConfigMap)")
    parser.add_argument("--factory", action="append", default=[], metavar="MODULE:FUNCTION",
                        help="a factory the worker may build (repeatable; with --job-spec: added to its)")
    parser.add_argument("--keys-dir", default=None,
                        help=f"the job's keys (default: ${auth.KEYS_DIR_ENV}; a local run makes them, a pod "
                             "mounts them from the job's Secret)")
    parser.add_argument("--insecure", action="store_true",
                        help="run without keys: serve anyone who reaches the ports (trusted networks only)")
    parser.add_argument("--health-port", type=int, default=None,
                        help="serve /healthz, /readyz and /metrics over HTTP on this port (0: any free one)")
    parser.add_argument("--memory-limit", type=int, default=None, metavar="BYTES",
                        help="cap what the process may allocate beyond what it holds at start (RLIMIT_DATA; "
                             "default: $CELLMESH_MEMORY_LIMIT, else none): an allocation beyond it fails the "
                             "step naming the cap, and the card reports it as the worker's memory")
    parser.add_argument("--health-host", default=None,
                        help="interface of the HTTP endpoint (default: as --host, where the kubelet probes)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of a worker process: configure, build, serve until signalled, drain."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        configure_logging()  # CELLMESH_LOG_LEVEL (default INFO) and CELLMESH_LOG_FORMAT, to stderr
    except ValueError as exc:
        parser.error(str(exc))
    try:
        launch = read_launch_env()
    except LaunchEnvError as exc:
        parser.error(str(exc))
    url = args.registry or launch.registry
    if not url:
        parser.error("no registry: give --registry, set CELLMESH_REGISTRY, or PET_RDZV_BACKEND=etcd with "
                     "PET_RDZV_ENDPOINT")
    try:  # before any socket: every one this worker makes speaks the job's keys
        auth.install(auth.credentials_for("worker", args.keys_dir, insecure=args.insecure))
    except (ValueError, OSError) as exc:
        parser.error(str(exc))
    try:
        factories = allowed_factories(args.job_spec, args.factory)
    except FactoryError as exc:
        parser.error(str(exc))
    launch.export()  # RANK, WORLD_SIZE, ... for torch.distributed code in the job's factories
    tune_malloc()
    _load_runtime()  # before the cap: the libraries are the process's baseline, not the plan's budget
    settle_imports()  # before the lease: no full collection scans them again ([Note: a worker's heap ...])
    name = args.name or launch.default_name() or f"{os.uname().nodename}-{os.getpid()}"
    limit = args.memory_limit if args.memory_limit is not None else launch.memory_limit
    if limit is not None:
        try:
            apply_cap(name, limit)
        except ValueError as exc:
            parser.error(str(exc))
        launch = launch.model_copy(update={"memory_bytes": limit})
    job = args.job or launch.job or "default"
    set_process_context(worker=name, rank=launch.rank)
    lease_ttl = timedelta(seconds=args.lease_ttl)
    # a registry call may not outlast the lease, so an unreachable registry is noticed in time
    registry = connect_registry(url, request_timeout=min(timedelta(seconds=10), lease_ttl))
    health: HealthServer | None = None
    try:
        worker = Worker(registry, job, name, lease_ttl=lease_ttl, host=args.host, port=args.port,
                        launch=launch, factories=factories, follows_presence=follows_presence(url))
        if args.health_port is not None:
            health = HealthServer(live=worker.liveness, ready=worker.readiness, metrics=worker.metrics(),
                                  host=args.health_host or args.host, port=args.health_port).start()
    except Exception as exc:
        registry.close()
        log.error("[worker %s] cannot start: %s", name, exc)
        return 1
    try:
        stop = stop_on_signals()
        worker.start()
        where = f" (probes at {health.url})" if health is not None else ""
        log.info("cellmesh worker %s of job %s serving at %s%s; builds %s", name, job, worker.host.address,
                 where, ", ".join(sorted(factories.names)) or "no factory")
        worker.serve_forever(stop)
    except Exception:
        log.exception("[worker %s] failed", name)
        worker.drain()
        return 1
    finally:
        if health is not None:
            health.close()
        registry.close()
    return 0


def run(argv: Sequence[str] | None = None) -> NoReturn:
    """The worker process: :func:`main`, then leave at once. A drained worker has nothing left to hand
    over, but a step thread of a service it released may still be blocked on a dead peer until its
    timeout, and the interpreter's exit would wait for it (executor threads are joined at exit) and
    tear down a large heap for seconds."""
    code = main(argv)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
