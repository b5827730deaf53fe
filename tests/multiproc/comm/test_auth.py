"""The job's CURVE keys and the ZAP handler, over real TCP sockets on loopback.

Each peer gets its own ZeroMQ context, as separate processes would: the server's context
runs the ZAP handler, an outsider's context knows nothing of the job.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq

from comm.auth import (
    Credentials,
    JobKeys,
    KeyPair,
    ZapHandler,
    ensure_zap_handler,
    release_keys,
    secure_client,
    secure_server,
)
from comm.sockets import bind_port

WAIT_MS = 3000
REFUSED_MS = 700  # how long an outsider waits to see that nothing comes back


@pytest.fixture
def keys() -> JobKeys:
    return JobKeys.generate()


@pytest.fixture
def server(keys: JobKeys) -> Iterator[tuple[zmq.Socket[bytes], str, ZapHandler]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server(sock, Credentials(keys, "worker"))
    address = bind_port(sock, "127.0.0.1")
    handler = ensure_zap_handler(ctx, keys)
    yield sock, address, handler
    handler.stop()
    sock.close(0)
    ctx.term()


Context = zmq.Context[zmq.Socket[bytes]]


def _client(address: str, configure: object = None) -> tuple[Context, zmq.Socket[bytes]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if callable(configure):
        configure(sock)
    sock.connect(address)
    return ctx, sock


def _close(ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes]) -> None:
    sock.close(0)
    ctx.term()


def _outsider(keys: JobKeys) -> Credentials:
    """An outsider who learnt the server's public key (it is no secret) and made a key pair."""
    return Credentials(JobKeys(server=KeyPair(public=keys.server.public, secret=KeyPair.generate().secret),
                               coordinator=KeyPair.generate(), worker=KeyPair.generate()), "coordinator")


def _echo_once(server: zmq.Socket[bytes], timeout_ms: int) -> str | None:
    """Serve one request if one arrives: reply with the role ZeroMQ attached to it."""
    if not server.poll(timeout_ms):
        return None
    ident, body = server.recv_multipart(copy=False)
    role = body.get("User-Id")
    server.send_multipart([ident.bytes, role.encode()])
    return str(role)


@pytest.mark.parametrize("role", ["coordinator", "worker"])
def test_a_job_key_is_served_and_its_role_rides_on_each_message(
        server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys, role: str) -> None:
    sock, address, handler = server
    ctx, client = _client(address, lambda s: secure_client(s, Credentials(keys, role)))  # type: ignore[arg-type]
    try:
        client.send(b"hello")
        assert _echo_once(sock, WAIT_MS) == role
        assert client.poll(WAIT_MS) and client.recv() == role.encode()
        assert handler.rejected() == 0
    finally:
        _close(ctx, client)


def test_an_outsider_key_is_never_served_and_is_counted(
        server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys) -> None:
    sock, address, handler = server
    # a well-formed key pair that is not the job's, by an outsider who learnt the server's public key
    stranger = _outsider(keys)
    ctx, client = _client(address, lambda s: secure_client(s, stranger))
    try:
        client.send(b"assign os:system")
        assert _echo_once(sock, REFUSED_MS) is None
        assert not client.poll(100)
        assert any("not the job's" in reason for _, reason in handler.rejections)
    finally:
        _close(ctx, client)
    # and the server keeps serving the job
    ctx, good = _client(address, lambda s: secure_client(s, Credentials(keys, "coordinator")))
    try:
        good.send(b"hello")
        assert _echo_once(sock, WAIT_MS) == "coordinator"
    finally:
        _close(ctx, good)


def test_a_client_without_the_server_key_fails_the_handshake(
        server: tuple[zmq.Socket[bytes], str, ZapHandler]) -> None:
    """A client that encrypts to another server key is refused by the cryptography, before ZAP."""
    sock, address, _ = server
    stranger = Credentials(JobKeys.generate(), "worker")
    ctx, client = _client(address, lambda s: secure_client(s, stranger))
    try:
        client.send(b"release")
        assert _echo_once(sock, REFUSED_MS) is None
    finally:
        _close(ctx, client)


def test_a_client_that_knows_the_server_key_but_not_a_job_key_is_refused(
        server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys) -> None:
    """The server's public key is not a secret: knowing it admits nobody."""
    sock, address, handler = server

    def configure(s: zmq.Socket[bytes]) -> None:
        public, secret = zmq.curve_keypair()
        s.setsockopt(zmq.CURVE_SECRETKEY, secret)
        s.setsockopt(zmq.CURVE_PUBLICKEY, public)
        s.setsockopt(zmq.CURVE_SERVERKEY, keys.server.public.encode())

    ctx, client = _client(address, configure)
    try:
        client.send(b"parameters")
        assert _echo_once(sock, REFUSED_MS) is None
        assert handler.rejected() >= 1
    finally:
        _close(ctx, client)


def test_a_plain_socket_without_curve_is_never_served(
        server: tuple[zmq.Socket[bytes], str, ZapHandler]) -> None:
    sock, address, _ = server
    ctx, client = _client(address)
    try:
        client.send(b"\x93\x01\x02\x03")
        assert _echo_once(sock, REFUSED_MS) is None
        assert not client.poll(100)
    finally:
        _close(ctx, client)


def test_refusals_log_once_per_peer_and_reason(server: tuple[zmq.Socket[bytes], str, ZapHandler],
                                              keys: JobKeys, caplog: pytest.LogCaptureFixture) -> None:
    sock, address, handler = server
    before = handler.rejected()
    with caplog.at_level(logging.WARNING, logger="comm.auth"):
        for i in range(8):
            stranger = _outsider(keys)
            ctx, client = _client(address, lambda s, k=stranger: secure_client(s, k))
            client.send(b"x")
            # the client stays until its handshake was refused: closed sooner on a loaded machine, it
            # could leave before the handshake reached the handler, and nothing would be refused
            deadline = time.monotonic() + 20
            while handler.rejected() - before <= i and time.monotonic() < deadline:
                assert _echo_once(sock, 50) is None  # never served
            _close(ctx, client)
    assert handler.rejected() - before == 8
    warnings = [r for r in caplog.records if r.name == "comm.auth"]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert "127.0.0.1" in warnings[0].getMessage()


def test_revoked_keys_are_refused_from_the_next_handshake(
        server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys) -> None:
    sock, address, handler = server
    handler.set_keys(JobKeys.generate())  # a new generation of keys: the old ones no longer admit
    ctx, client = _client(address, lambda s: secure_client(s, Credentials(keys, "coordinator")))
    try:
        client.send(b"hello")
        assert _echo_once(sock, REFUSED_MS) is None
    finally:
        handler.set_keys(keys)
        _close(ctx, client)


def test_the_keys_of_another_job_of_the_process_are_admitted_until_it_releases_them(
        server: tuple[zmq.Socket[bytes], str, ZapHandler], keys: JobKeys) -> None:
    """A process serving two local jobs one after the other (two harnesses) admits both jobs' keys."""
    sock, address, handler = server
    other = JobKeys.generate()
    # the other job's coordinator key, speaking to this server (its public key is no secret)
    theirs = Credentials(JobKeys(server=keys.server, coordinator=other.coordinator, worker=other.worker),
                         "coordinator")

    def served(credentials: Credentials, timeout_ms: int = WAIT_MS) -> bool:
        ctx, client = _client(address, lambda s: secure_client(s, credentials))
        try:
            client.send(b"hello")
            return _echo_once(sock, timeout_ms) is not None
        finally:
            _close(ctx, client)

    assert not served(theirs, REFUSED_MS)
    ensure_zap_handler(handler.context, other)  # the other job starts: its keys are admitted too
    assert served(theirs) and served(Credentials(keys, "worker"))
    release_keys(other)  # and ends: refused again, this job's keys still admitted
    assert not served(theirs, REFUSED_MS) and served(Credentials(keys, "worker"))
    handler.set_keys(keys)  # a new generation replaces every key
    assert handler.others == []


def test_the_handler_sleeps_until_a_request_and_stops_at_once(keys: JobKeys) -> None:
    """No polling while idle (its poll is woken by a request or by stop()), and stop() ends it at once."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    handler = ensure_zap_handler(ctx, keys)
    try:
        assert handler._thread is not None and handler._thread.is_alive()
        started = time.monotonic()
        handler.stop()
        assert not handler._thread.is_alive() and time.monotonic() - started < 1
    finally:
        ctx.term()


def test_keys_round_trip_through_a_private_file(tmp_path: Path, keys: JobKeys) -> None:
    path = keys.save(tmp_path / "keys")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert JobKeys.load(tmp_path / "keys") == keys


def test_keys_readable_by_others_are_refused(tmp_path: Path, keys: JobKeys) -> None:
    path = keys.save(tmp_path)
    path.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        JobKeys.load(tmp_path)


def test_missing_keys_say_where_they_come_from(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="Secret"):
        JobKeys.load(tmp_path)


def test_a_worker_copy_cannot_act_as_the_coordinator(keys: JobKeys) -> None:
    mine = keys.for_workers()
    assert mine.coordinator.secret is None and mine.coordinator.public == keys.coordinator.public
    assert mine.worker == keys.worker and mine.server == keys.server
    with pytest.raises(PermissionError, match="coordinator role"):
        Credentials(mine, "coordinator")
    Credentials(mine, "worker")  # what a worker is


def test_keys_are_validated() -> None:
    with pytest.raises(ValueError, match="40 Z85"):
        KeyPair(public="short")
    pair = KeyPair.generate()
    assert pair.secret is not None and pair.secret not in repr(pair) and pair.public not in repr(pair)
