"""The data plane's modes (CELLMESH_DATA_PLANE): whom an ``authenticated`` data channel admits; a job on it.

Socket level: each peer has a ZeroMQ context of its own, as separate processes would. Job
level: a data-parallel job on the zmq backend with every body through the socket
(``CELLMESH_SHM=0``, as between hosts) trains exactly as one process does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import zmq

from comm import auth
from comm.auth import Credentials, JobKeys, ZapHandler, ensure_zap_handler
from comm.sockets import bind_port, make_socket
from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference

Context = zmq.Context[zmq.Socket[bytes]]
WAIT_MS = 3000
REFUSED_MS = 700
SEND_MS = 10_000  # a send waits for its connection at most this long
M = "tests.multiproc.coordinator.models"


@pytest.fixture
def keys() -> JobKeys:
    return JobKeys.generate()


@pytest.fixture
def data_server(keys: JobKeys) -> Iterator[tuple[zmq.Socket[bytes], str, ZapHandler]]:
    """A data channel's PULL socket of an ``authenticated`` job (credentials installed as a worker's)."""
    ctx: Context = zmq.Context()
    auth.install(Credentials(keys, "worker", data_plane="authenticated"))
    try:
        sock = make_socket(zmq.PULL, context=ctx, curve="server", plane="data")
        address = bind_port(sock, "127.0.0.1")  # allowed: it authenticates
    finally:
        auth.install(None)
    handler = ensure_zap_handler(ctx, keys)
    yield sock, address, handler
    handler.stop()
    sock.close(0)
    ctx.term()


Configure = Callable[[zmq.Socket[bytes]], object]


def _send(address: str, configure: Configure) -> tuple[Context, zmq.Socket[bytes]]:
    """A peer in a context of its own that sends one message (once its handshake passes)."""
    ctx: Context = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    configure(sock)
    sock.setsockopt(zmq.SNDTIMEO, SEND_MS)  # queued once the connection's pipe exists (it may lag, loaded)
    sock.connect(address)
    sock.send(b"a tensor chunk")
    return ctx, sock


def test_the_token_is_the_job_s_and_only_the_data_plane_takes_it(keys: JobKeys) -> None:
    assert auth.data_token(keys) == auth.data_token(keys.for_workers())  # every holder of the worker keys
    assert auth.data_token(keys) != auth.data_token(JobKeys.generate())
    assert auth.data_plane({}) == "encrypted" and auth.data_plane({auth.DATA_PLANE_ENV: "authenticated"}) == (
        "authenticated")
    with pytest.raises(ValueError, match="CELLMESH_DATA_PLANE='mac': use encrypted or authenticated"):
        auth.data_plane({auth.DATA_PLANE_ENV: "mac"})


def test_an_authenticated_data_channel_admits_the_job_s_token_only(
        data_server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys) -> None:
    sock, address, handler = data_server
    outsider = Credentials(JobKeys.generate(), "worker", data_plane="authenticated")
    member = Credentials(keys.for_workers(), "worker", data_plane="authenticated")
    peers = [_send(address, lambda s: auth.secure_data_client(s, outsider)),  # another job's token
             _send(address, lambda s: s.setsockopt(zmq.PLAIN_USERNAME, b"worker")),  # no token at all
             _send(address, lambda s: auth.secure_client(s, Credentials(keys, "worker"))),  # CURVE: not here
             _send(address, lambda s: auth.secure_data_client(s, member))]
    try:
        assert sock.poll(WAIT_MS) and sock.recv() == b"a tensor chunk", "the job's peer was not received"
        assert not sock.poll(REFUSED_MS), "a second message arrived: an outsider was admitted"
    finally:
        for ctx, peer in peers:
            peer.close(0)
            ctx.term()
    reasons = {reason for _, reason in handler.rejections}
    assert "a data-plane token that is not the job's" in reasons, handler.rejections
    assert handler.admitted["data"] == 1


def test_a_control_socket_never_takes_the_token(keys: JobKeys) -> None:
    ctx: Context = zmq.Context()
    auth.install(Credentials(keys, "worker", data_plane="authenticated"))
    try:
        server = make_socket(zmq.ROUTER, context=ctx, curve="server")  # control: CURVE whatever the mode
        address = bind_port(server, "127.0.0.1")
        assert auth.is_curve_server(server)
        member = Credentials(keys, "worker", data_plane="authenticated")
        client_ctx, client = _send(address, lambda s: auth.secure_data_client(s, member))
        assert not server.poll(REFUSED_MS), "a control socket took the data-plane token"
        client.close(0)
        client_ctx.term()
    finally:
        auth.install(None)
    server.close(0)
    ctx.term()


def test_a_job_trains_exactly_over_authenticated_sockets(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(auth.DATA_PLANE_ENV, "authenticated")  # the harness's credentials and its workers
    monkeypatch.setenv("CELLMESH_SHM", "0")  # every body through the socket, as between hosts
    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", global_batch=16, seed=3,
              resources=Resources.local(2), data_parallel=2, num_stages=1, step_timeout_s=60)
    factories = [f"{M}:mlp", f"{M}:regression", f"{M}:mse"]
    with LocalHarness(["local-0", "local-1"], job="t-plane", lease_ttl=timedelta(seconds=6),
                      factories=factories) as harness:
        credentials = auth.installed()
        assert credentials is not None and credentials.data_plane == "authenticated"
        with job.attach(harness):
            result = job.fit(3)
    assert max_abs_diff(result.state_dict, train_reference(job, 3).state_dict) < 1e-10
