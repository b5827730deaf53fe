"""The HTTP endpoint a process serves for probes and metrics: ``/healthz``, ``/readyz``, ``/metrics``.

Kubernetes probes a worker or the coordinator here (``k8s/``): ``/healthz`` (liveness)
answers 200 while the process can still do its work and 503 once it cannot (the worker's
lease is lost, the coordinator's job failed); ``/readyz`` (readiness) answers 200 once it
is registered and serving. ``/metrics`` is the Prometheus text format of the process's
own :class:`prometheus_client.CollectorRegistry`. Each check is a callable returning
``(ok, detail)``; the detail is the response body, so ``kubectl describe pod`` shows why
a probe failed.

The server is the standard library's threading HTTP server on a daemon thread; every
connection has a read timeout, and a malformed request gets a 400 from the server and
changes nothing.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from comm.sockets import default_host
from comm.traffic import TrafficCounts, snapshot

__all__ = ["Check", "HealthServer", "TrafficCollector"]

log = logging.getLogger(__name__)

Check = Callable[[], tuple[bool, str]]
REQUEST_TIMEOUT_S = 5.0


class HealthServer:
    """Serves ``/healthz``, ``/readyz`` and ``/metrics`` on ``host:port`` from a daemon thread.

    Args:
        live: The liveness check.
        ready: The readiness check.
        metrics: The registry ``/metrics`` renders (a new, empty one by default).
        host: The interface (:func:`comm.sockets.default_host` by default: the pod IP in a pod,
            which is where the kubelet probes).
        port: The port (0: one the OS chooses; :attr:`port` tells which).
    """

    def __init__(self, *, live: Check, ready: Check, metrics: CollectorRegistry | None = None,
                 host: str | None = None, port: int = 0) -> None:
        self.metrics = metrics or CollectorRegistry()
        checks: dict[str, Check] = {"/healthz": live, "/readyz": ready}
        registry = self.metrics

        class Handler(BaseHTTPRequestHandler):
            timeout = REQUEST_TIMEOUT_S  # a client that sends nothing is dropped, not waited for

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(HTTPStatus.OK, generate_latest(registry), CONTENT_TYPE_LATEST)
                    return
                check = checks.get(path)
                if check is None:
                    self._reply(HTTPStatus.NOT_FOUND, b"not found: try /healthz, /readyz or /metrics\n")
                    return
                try:
                    ok, detail = check()
                except Exception as exc:  # a failing check is an unhealthy answer, not a dead server
                    ok, detail = False, f"check failed: {type(exc).__name__}: {exc}"
                status = HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE
                self._reply(status, (detail or status.phrase).encode() + b"\n")

            def _reply(self, status: HTTPStatus, body: bytes, content_type: str = "text/plain; charset=utf-8"
                       ) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                log.debug("health %s: " + format, self.client_address[0], *args)

        self._server = ThreadingHTTPServer((host or default_host(), port), Handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        host = str(self._server.server_address[0])
        return f"http://{host}:{self.port}"

    def start(self) -> HealthServer:
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-http", daemon=True)
        self._thread.start()
        return self

    def close(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop serving (bounded by ``timeout``). Idempotent."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(timeout.total_seconds())
            self._thread = None
        self._server.server_close()


class TrafficCollector(Collector):
    """``/metrics`` of a process's traffic (:class:`comm.traffic.TrafficCounts`), read at scrape time.

    * ``cellmesh_bytes_sent_total{backend}``: tensor bytes sent through the ``zmq``, ``gloo``
      or ``nccl`` backend (what counts: [Note: what "bytes sent" counts] in ``comm/traffic.py``);
    * ``cellmesh_refused_frames_total{reason}``: messages dropped or answered with an error
      before a handler saw them (``data/size``, ``data/version``..., ``rpc/bad_request``,
      ``rpc/forbidden``, ``rpc/unknown_service``...);
    * ``cellmesh_refused_connections_total{reason}``: handshakes the job's ZAP handler refused
      (a key that is not the job's, a socket without CURVE...).

    The one definition of these names: a worker registers it on its own counters
    (:func:`comm.traffic.snapshot`, the default), the coordinator on the sum of its workers'
    and its own (``coordinator/commands/metrics.py``).

    Args:
        read: The counters to show, called at each scrape.
    """

    def __init__(self, read: Callable[[], TrafficCounts] = snapshot) -> None:
        self.read = read

    def collect(self) -> Iterator[CounterMetricFamily]:
        counts = self.read()
        sent = CounterMetricFamily("cellmesh_bytes_sent", "Tensor bytes sent, by backend", labels=["backend"])
        frames = CounterMetricFamily("cellmesh_refused_frames", "Messages from peers refused before any "
                                     "handler saw them, by reason", labels=["reason"])
        connections = CounterMetricFamily("cellmesh_refused_connections", "Connections the job's "
                                          "authentication refused, by reason", labels=["reason"])
        for family, values in ((sent, counts.bytes_sent), (frames, counts.refused_frames),
                               (connections, counts.refused_connections)):
            for label, value in sorted(values.items()):
                family.add_metric([label], value)
            yield family
