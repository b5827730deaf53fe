"""A worker's ``/metrics`` counts what it refused, by reason; its log says it once.

A real worker process (``python -m services.host.worker --health-port``) with the job's
keys, its registry served from this process (the coordinator's part). Peers then send it:
a stranger's handshakes, garbage and forbidden requests with a worker's key; its
``/metrics`` must count each by reason, and its log warn about each reason once.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from comm import auth
from comm.auth import Credentials, JobKeys
from comm.codec import unpack
from comm.registry import RegistryServer
from comm.rpc.framing import request_frames
from comm.sockets import free_port
from services.host.worker import worker_key
from services.protocol import Release, WorkerCard
from tests.harness import commands
from tests.harness.http import http_get
from tests.multiproc.security.outsider import holder, stranger
from tests.multiproc.security.running import log_lines

pytestmark = pytest.mark.timeout(120)

Context = zmq.Context[zmq.Socket[bytes]]


@pytest.fixture
def keys() -> Iterator[JobKeys]:
    keys = JobKeys.generate()
    auth.install(Credentials(keys, "coordinator"))  # this process serves the registry, as a coordinator does
    yield keys
    auth.install(None)


def _metric(text: str, name: str, reason: str) -> float:
    prefix = f'{name}{{reason="{reason}"}} '
    values = [float(line[len(prefix):]) for line in text.splitlines() if line.startswith(prefix)]
    return values[0] if values else 0.0


def _dealer(ctx: Context, address: str, configure: object) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if callable(configure):
        configure(sock)
    sock.connect(address)
    return sock


def test_refusals_are_on_the_workers_metrics(keys: JobKeys, tmp_path: Path) -> None:
    keys_dir = tmp_path / "keys"
    keys.for_workers().save(keys_dir)
    health = free_port()
    log = tmp_path / "worker.log"
    with RegistryServer() as server:
        proc = commands.start(
            [sys.executable, "-m", "services.host.worker", "--registry", server.address, "--job", "m",
             "--name", "w0", "--keys-dir", str(keys_dir), "--health-port", str(health),
             "--host", "127.0.0.1"],
            env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=log, stderr=commands.STDOUT)
        ctx: Context = zmq.Context()
        try:
            deadline = time.monotonic() + 60
            while (kv := server.registry.get(worker_key("m", "w0"))) is None:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            address = unpack(kv.value, WorkerCard).address

            # strangers know the server's public key (no secret) and have key pairs of their own
            strangers = [_dealer(ctx, address, stranger(keys.server.public)) for _ in range(3)]
            insider = _dealer(ctx, address, holder(Credentials(keys.for_workers(), "worker")))
            for s in strangers:
                s.send_multipart(request_frames(1, "worker", "status", {}))
            for _ in range(5):
                insider.send(b"\xc1 not msgpack")
            for i in range(4):
                insider.send_multipart(request_frames(10 + i, "worker", "release", Release(service="x")))
            answers: list[list[bytes]] = []
            while len(answers) < 9:
                assert insider.poll(10_000), f"the worker answered {len(answers)} of 9 requests"
                answers.append(insider.recv_multipart())
            assert not any(s.poll(200) for s in strangers)  # strangers: nothing

            deadline = time.monotonic() + 10
            while True:  # the refusals of handshakes are counted as the ZAP handler answers them
                status, text = http_get(f"http://127.0.0.1:{health}/metrics")
                assert status == 200, text
                refused = _metric(text, "cellmesh_refused_connections_total", "a key that is not the job's")
                if refused >= 3 or time.monotonic() > deadline:
                    break
                time.sleep(0.1)
        finally:
            ctx.destroy(0)
            proc.terminate()
            assert proc.wait(15) == 0, log.read_text()
    assert refused >= 3, text
    assert _metric(text, "cellmesh_refused_frames_total", "rpc/bad_request") == 5, text
    assert _metric(text, "cellmesh_refused_frames_total", "rpc/forbidden") == 4, text
    warned = log_lines([log])
    assert len([w for w in warned if "rejected a bad request" in w]) == 1, warned
    assert len([w for w in warned if "refused worker.release" in w]) == 1, warned
    assert len([w for w in warned if "refused a connection" in w]) == 1, warned
