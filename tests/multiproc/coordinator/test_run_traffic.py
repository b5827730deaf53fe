"""A local run's metrics show the job's traffic: the bytes its all-reduces sent, the frames refused.

One ``cellmesh run`` in this process (``train``, as the command runs it) of the tests' MLP on
two data-parallel replicas over zmq, with ``--metrics-port``. After its first step, this
process (the coordinator, holding the job's keys) sends a few malformed frames to each
replica's data socket, and a stranger tries to connect to it. At the last step the
coordinator's ``/metrics`` must show

* ``cellmesh_bytes_sent_total{backend="zmq"}`` between what the gradient all-reduces must
  send and what the largest algorithm sends, derived from the model's parameter count: every
  step all-reduces each replica's gradients (S bytes) among n = 2 replicas; the ring sends
  2(n-1)/n * S from each rank, the direct path (n-1) * S;
* ``cellmesh_refused_frames_total`` for the data channels: exactly the frames sent;
* ``cellmesh_refused_connections_total``: the stranger's handshakes.

The coordinator process's own counts are subtracted: the metrics add them, and this test
process may have counted some before.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from comm.sockets import SocketLimits, make_socket
from comm.traffic import TrafficCounts, snapshot
from coordinator.commands.jobspec import load_job
from coordinator.commands.run import RunOptions, train
from coordinator.runtime.records import StepRecord
from tests.harness.http import http_get
from tests.multiproc.coordinator import models
from tests.multiproc.coordinator.test_run import SPEC
from tests.multiproc.security.outsider import stranger
from tests.multiproc.security.running import targets_of

pytestmark = pytest.mark.timeout(120)

STEPS = 20  # the garbage is read as the replicas receive: about one frame per channel a step (margin: 6x)
HANDSHAKE_S = 20.0  # how long the insider's CURVE handshake with a replica's socket may take
GARBAGE = 3  # malformed frames to each replica's data socket
REPLICAS = 2
FLOAT64 = 8  # bytes per gradient element: the spec's MLP is float64


def _samples(body: str, name: str, label: str) -> dict[str, float]:
    return {m.group(1): float(m.group(2))
            for m in re.finditer(rf'^{name}{{{label}="([^"]*)"}} (\S+)$', body, re.MULTILINE)}


def _connect_after_handshake(sock: zmq.Socket[bytes], address: str) -> None:
    """Connect ``sock`` and wait until its CURVE handshake is done, so what it sends next is
    queued at the replica before the next step rather than some steps later on a loaded machine."""
    monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                      | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
    try:
        sock.connect(address)
        if not monitor.poll(int(HANDSHAKE_S * 1000)):
            raise TimeoutError(f"no CURVE handshake with the replica's data socket {address} "
                               f"in {HANDSHAKE_S}s")
        event = recv_monitor_message(monitor)["event"]
        assert event == zmq.EVENT_HANDSHAKE_SUCCEEDED, f"handshake with {address} failed: {event}"
    finally:
        sock.disable_monitor()
        monitor.close(0)


def test_the_run_metrics_show_the_bytes_sent_and_the_frames_refused(tmp_path: Path) -> None:
    spec = tmp_path / "dp.json"
    spec.write_text(json.dumps({**SPEC, "steps": STEPS, "plan": {"data_parallel": REPLICAS}}))
    # one step per request: the garbage sent after step 0 reaches the workers while later steps run
    options = RunOptions(job=str(spec), settings={"runtime.workers": REPLICAS, "logging.metrics_port": 0,
                                                  "logging.run_dir": str(tmp_path / "run"),
                                                  "runtime.steps_per_request": 1})
    loaded = load_job(str(spec), options.settings)
    out = io.StringIO()
    sockets: list[zmq.Socket[bytes]] = []
    scraped: list[tuple[str, TrafficCounts]] = []

    def on_step(record: StepRecord) -> None:
        if record.step == 0:  # the data-parallel group is up: its data sockets are in the registry
            harness = loaded.job.harness
            assert harness is not None
            targets = targets_of(harness, tmp_path / "unused")
            assert len(targets.data) == REPLICAS, targets.data  # each replica's socket for the other
            for port in targets.data:
                insider = make_socket(zmq.PUSH, SocketLimits.data(), curve="client", plane="data")
                outsider = make_socket(zmq.PUSH, SocketLimits.data())
                stranger(targets.server_public_key)(outsider)
                sockets.extend([insider, outsider])
                _connect_after_handshake(insider, port.address)
                outsider.connect(port.address)
                for k in range(GARBAGE):
                    insider.send_multipart([b"\xc1 not a header %d" % k, b"body"])
        if record.step == STEPS - 1:
            match = re.search(r"metrics at (http://127\.0\.0\.1:\d+)/metrics", out.getvalue())
            assert match, out.getvalue()
            status, body = http_get(match.group(1) + "/metrics")
            assert status == 200, body
            scraped.append((body, snapshot()))

    try:
        train(loaded, options, out, on_step=on_step)
    finally:
        for sock in sockets:
            sock.close(0)
    ((body, own),) = scraped

    sent = _samples(body, "cellmesh_bytes_sent_total", "backend")
    workers_sent = sent.get("zmq", 0.0) - own.bytes_sent.get("zmq", 0)
    gradient = sum(p.numel() for m in models.mlp() for p in m.parameters()) * FLOAT64  # S
    n = REPLICAS
    least = STEPS * n * 2 * (n - 1) / n * gradient  # the ring: 2(n-1)/n * S from each of n ranks
    most = STEPS * n * (n - 1) * gradient  # the direct path: S to each of the n - 1 others
    assert least <= workers_sent <= most + 1024, (workers_sent, least, most, body)

    frames = _samples(body, "cellmesh_refused_frames_total", "reason")
    data = {r: v - own.refused_frames.get(r, 0) for r, v in frames.items() if r.startswith("data/")}
    assert sum(data.values()) == GARBAGE * REPLICAS, (data, body)
    connections = _samples(body, "cellmesh_refused_connections_total", "reason")
    strangers = connections.get("a key that is not the job's", 0.0) - own.refused_connections.get(
        "a key that is not the job's", 0)
    assert strangers >= REPLICAS, body  # one handshake at least to each replica's socket

