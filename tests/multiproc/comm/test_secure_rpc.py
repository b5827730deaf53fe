"""The service host with the job's credentials installed: only the job is served, and roles gate methods.

One process plays every part: credentials are installed before each socket is made, as a
process of that role would at its start (:func:`comm.auth.install`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import zmq

from comm import auth
from comm.auth import Credentials, JobKeys, KeyPair
from comm.codec import Message
from comm.refusals import REFUSALS
from comm.rpc import Call, Empty, RpcClient, RpcError, ServiceBase, ServiceHost, callable_by
from comm.sockets import bind_port, make_socket, shared_context

REFUSED = timedelta(seconds=0.8)


class Who(Message):
    role: str | None


class Toy(ServiceBase):
    def __init__(self) -> None:
        self.controlled = 0

    def rpc_control(self, request: Empty, call: Call) -> Empty:
        self.controlled += 1
        return Empty()

    @callable_by("worker", "coordinator")
    def rpc_whoami(self, request: Empty, call: Call) -> Who:
        return Who(role=call.peer.user)


@pytest.fixture
def keys() -> Iterator[JobKeys]:
    keys = JobKeys.generate()
    yield keys
    auth.install(None)


@pytest.fixture
def host(keys: JobKeys) -> Iterator[tuple[ServiceHost, Toy]]:
    auth.install(Credentials(keys, "coordinator"))
    service = Toy()
    host = ServiceHost("127.0.0.1")
    host.add("toy", service)
    host.start()
    yield host, service
    host.shutdown()


def _client(address: str, credentials: Credentials | None,
            timeout: timedelta = timedelta(seconds=10)) -> RpcClient:
    auth.install(credentials)  # the client's socket takes the credentials in force when it is made
    return RpcClient(address, timeout=timeout)


def test_the_coordinator_calls_control_methods_and_is_named(
        host: tuple[ServiceHost, Toy], keys: JobKeys) -> None:
    server, service = host
    client = _client(server.address, Credentials(keys, "coordinator"))
    try:
        client.call("toy", "control", Empty(), Empty)
        assert service.controlled == 1
        assert client.call("toy", "whoami", Empty(), Who)[0].role == "coordinator"
    finally:
        client.close()


def test_a_worker_is_refused_control_methods_but_served_its_data_methods(
        host: tuple[ServiceHost, Toy], keys: JobKeys) -> None:
    server, service = host
    client = _client(server.address, Credentials(keys.for_workers(), "worker"))
    try:
        with pytest.raises(RpcError, match=r"\[forbidden\] toy.control: callable by coordinator only"):
            client.call("toy", "control", Empty(), Empty)
        assert service.controlled == 0 and server.refused == 1
        assert client.call("toy", "whoami", Empty(), Who)[0].role == "worker"
    finally:
        client.close()


def test_an_outsider_gets_no_answer_at_all(host: tuple[ServiceHost, Toy], keys: JobKeys) -> None:
    """A client with a key pair of its own (and the server's public key, which is no secret)."""
    server, service = host
    handler = auth.ensure_zap_handler(shared_context(), keys)
    before = handler.rejected()
    outsider = JobKeys(server=KeyPair(public=keys.server.public, secret=KeyPair.generate().secret),
                       coordinator=KeyPair.generate(), worker=KeyPair.generate())
    client = _client(server.address, Credentials(outsider, "coordinator"), timeout=REFUSED)
    try:
        with pytest.raises(TimeoutError, match=r"toy\.control"):
            client.call("toy", "control", Empty(), Empty)
    finally:
        client.close()
    assert service.controlled == 0
    assert server.refused == 0 and server.bad_requests == 0  # refused before any request was read
    assert handler.rejected() > before


def _handshake_refusals(*reasons: str) -> int:
    counts = REFUSALS.counts()
    return sum(counts.get(("connection", r), 0) for r in reasons)


def _counted_beyond(before: int, *reasons: str, wait: float = 5.0) -> bool:
    """The host counts a failed handshake when its thread reads the socket's monitor: wait for it, bounded."""
    deadline = time.monotonic() + wait
    while _handshake_refusals(*reasons) <= before and time.monotonic() < deadline:
        time.sleep(0.05)
    return _handshake_refusals(*reasons) > before


def test_a_plain_client_gets_no_answer_and_is_counted(host: tuple[ServiceHost, Toy]) -> None:
    server, service = host
    before = _handshake_refusals("handshake", "mechanism")
    client = _client(server.address, None, timeout=REFUSED)
    try:
        with pytest.raises(TimeoutError):
            client.call("toy", "control", Empty(), Empty)
    finally:
        client.close()
    assert service.controlled == 0
    assert _counted_beyond(before, "handshake", "mechanism")


def test_a_client_without_the_server_key_is_counted_and_warned_about_once(
        host: tuple[ServiceHost, Toy], caplog: pytest.LogCaptureFixture) -> None:
    server, service = host
    before = _handshake_refusals("server_key")
    with caplog.at_level(logging.WARNING, logger="comm.rpc.host"):
        client = _client(server.address, Credentials(JobKeys.generate(), "coordinator"), timeout=REFUSED)
        try:  # it retries its handshake every reconnect interval: several refusals, one warning
            with pytest.raises(TimeoutError):
                client.call("toy", "control", Empty(), Empty)
        finally:
            client.close()
    assert service.controlled == 0
    assert _counted_beyond(before, "server_key")
    warned = [r for r in caplog.records if "server key" in r.getMessage()]
    assert len(warned) <= 1


def test_a_socket_that_forgot_to_authenticate_is_not_bound(keys: JobKeys) -> None:
    auth.install(Credentials(keys, "worker"))
    sock = make_socket(zmq.ROUTER)
    try:
        with pytest.raises(RuntimeError, match="curve='server'"):
            bind_port(sock, "127.0.0.1")
    finally:
        sock.close(0)
