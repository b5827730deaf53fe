"""The registry contract, written once and run against every backend.

Backends (the ``backend`` fixture):

* ``memory`` — :class:`MemoryRegistry` in this process;
* ``remote`` — :class:`RemoteRegistry` to a :class:`RegistryServer` in this process;
* ``remote-child`` — :class:`RemoteRegistry` to a server in a child process (really
  cross-process);
* ``etcd`` — :class:`EtcdRegistry` to a real etcd (skipped only if ``etcd`` is absent);
* ``etcd-tls`` — the same over TLS with client certificates, logged in as a user whose
  role may read and write every key under ``/`` (tests/multiproc/comm/test_etcd_tls.py
  checks what such an etcd refuses).

Lease tests use each backend's smallest TTL (0.5 s, etcd's 2 s) and let leases lapse
rather than revoking them. etcd deletes a lapsed lease's keys up to ~1.5 s after the
TTL (measured), so its slack is larger. Every key lives under a per-test prefix, so
the module-scoped servers are shared safely. After the contract come backend-specific
tests: the memory history, the served registry's handling of malformed input and
unknown methods, its bound on parked polls, the client's timeouts and late replies, and
an etcd watch across an etcd crash and restart.
"""

from __future__ import annotations

import selectors
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import msgpack
import pytest
import zmq

from comm import refusals
from comm.codec import unpack_raw
from comm.errors import ProtocolError, RegistryError, RegistryTimeoutError
from comm.refusals import Refusals
from comm.registry import (
    EventType,
    KeepAlive,
    MemoryRegistry,
    Registry,
    RegistryServer,
    RemoteRegistry,
    Watch,
    WatchEvent,
    connect_registry,
)
from comm.registry.etcd import EtcdRegistry
from comm.registry.etcd_options import PASSWORD_ENV, PASSWORD_FILE_ENV
from comm.registry.etcd_watch import WatchRetry
from comm.registry.protocol import EventsReply, RevisionReply, WatchPollRequest
from comm.registry.remote import RemoteLease
from comm.registry.server import RegistryService
from comm.rpc import (
    Call,
    Empty,
    ReplyEnvelope,
    RequestEnvelope,
    RpcClient,
    ServiceBase,
    ServiceHost,
    reply_frames,
)
from comm.sockets import bind_port, make_socket
from tests.harness.certs import make_certs, openssl_available
from tests.harness.etcd import EtcdServer, etcd_available
from tests.harness.spies import record_calls

REPO_ROOT = Path(__file__).resolve().parents[3]
EVENT_WAIT = timedelta(seconds=5)  # the bound on waiting for an event that must come
QUIET = timedelta(milliseconds=200)  # how long "no further event" is checked for

# A child that holds a lease with a KeepAlive until it is killed.
HOLD_LEASE_CHILD = """
import sys, time
from datetime import timedelta
from comm.registry import KeepAlive, connect_registry
url, key, ttl = sys.argv[1], sys.argv[2], float(sys.argv[3])
registry = connect_registry(url)
lease = registry.lease(timedelta(seconds=ttl))
keeper = KeepAlive(lease)
registry.put(key, b"alive", lease=lease)
print("READY", lease.ttl.total_seconds(), flush=True)
time.sleep(60)
"""

# A child that serves a registry until its stdin closes.
SERVER_CHILD = """
import sys
from datetime import timedelta
from comm.registry import RegistryServer
server = RegistryServer().start()
print(server.address, flush=True)
sys.stdin.read()
server.shutdown(timedelta(seconds=5))
"""


# -- helpers ----------------------------------------------------------------------------


def _spawn(code: str, *args: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=REPO_ROOT,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _read_line(proc: subprocess.Popen[bytes], timeout: timedelta, what: str) -> str:
    """One line of the child's stdout, bounded by ``timeout``."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout.total_seconds()):
            proc.kill()
            raise TimeoutError(f"child did not print {what} within {timeout.total_seconds():.0f}s")
    line = proc.stdout.readline().decode().strip()
    if not line:
        proc.kill()
        stderr = proc.stderr.read().decode() if proc.stderr else ""
        raise RuntimeError(f"child exited before printing {what}:\n{stderr}")
    return line


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def _next_event(watch: Watch, wait: timedelta = EVENT_WAIT) -> WatchEvent:
    event = watch.get(wait)
    assert event is not None, f"no event within {wait.total_seconds():.1f}s"
    return event


def _collect(watch: Watch, count: int, wait: timedelta = EVENT_WAIT) -> list[WatchEvent]:
    return [_next_event(watch, wait) for _ in range(count)]


def _summary(events: list[WatchEvent]) -> list[tuple[str, str, bytes]]:
    return [(e.type.value, e.key, e.value) for e in events]


# -- backends ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Backend:
    name: str
    connect: Callable[[], Registry]
    url: str | None  # where another process reaches the same store (None: this process only)
    ttl: timedelta  # the smallest lease the backend grants; what lease tests use
    lapse_slack: timedelta  # how late after its TTL a lapsed lease's keys may vanish


@pytest.fixture(scope="module")
def etcd_server() -> Iterator[EtcdServer]:
    # `make test` installs etcd; a suite run without it would silently lose the etcd backend
    if not etcd_available():
        pytest.fail("the etcd server binary is not installed: run `make etcd` "
                    "(apt-get install etcd-server) or `make test`, which does")
    with EtcdServer() as server:
        yield server


@pytest.fixture(scope="module")
def etcd_tls_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A TLS etcd with users on, and the URL of its user ``contract`` (the password in this process's
    environment, so child processes have it too)."""
    if not (etcd_available() and openssl_available()):
        pytest.fail("the etcd server or openssl binary is not installed (`make test` installs etcd)")
    root = tmp_path_factory.mktemp("etcd-tls")
    certs = make_certs(root / "certs", clients=("root", "contract"))
    password = root / "password"
    password.write_text(uuid.uuid4().hex)
    with EtcdServer(tls=certs) as server, pytest.MonkeyPatch.context() as env:
        server.enable_auth(uuid.uuid4().hex, {"contract": (password.read_text(), "/")})
        env.setenv(PASSWORD_FILE_ENV, str(password))
        env.delenv(PASSWORD_ENV, raising=False)
        client = certs.clients["contract"]
        yield (f"etcd://127.0.0.1:{server.client_port}?ca={certs.ca}&cert={client.cert}&key={client.key}"
               "&user=contract")


@pytest.fixture(scope="module")
def served() -> Iterator[RegistryServer]:
    server = RegistryServer().start()
    yield server
    server.shutdown(timedelta(seconds=5))


@pytest.fixture(scope="module")
def child_server() -> Iterator[str]:
    proc = _spawn(SERVER_CHILD)
    try:
        yield _read_line(proc, timedelta(seconds=20), "the server address")
        assert proc.stdin is not None
        proc.stdin.close()  # asks the child to shut its server down
        proc.wait(timeout=10)
    finally:
        _reap(proc)


@pytest.fixture(
    scope="module", params=["memory", "remote", "remote-child", pytest.param("etcd", marks=pytest.mark.etcd),
                            pytest.param("etcd-tls", marks=pytest.mark.etcd)]
)
def backend(request: pytest.FixtureRequest) -> Backend:
    half_second = timedelta(milliseconds=500)
    if request.param == "memory":
        return Backend("memory", MemoryRegistry, None, half_second, timedelta(milliseconds=250))
    if request.param == "remote":
        address = request.getfixturevalue("served").address
        return Backend("remote", lambda: RemoteRegistry(address), address, half_second, half_second)
    if request.param == "remote-child":
        address = request.getfixturevalue("child_server")
        return Backend("remote-child", lambda: RemoteRegistry(address), address, half_second, half_second)
    if request.param == "etcd-tls":
        url = request.getfixturevalue("etcd_tls_url")
        two = timedelta(seconds=2)
        return Backend("etcd-tls", lambda: connect_registry(url), url, two, timedelta(seconds=2.5))
    etcd: EtcdServer = request.getfixturevalue("etcd_server")
    port = etcd.client_port
    return Backend(
        "etcd",
        lambda: EtcdRegistry("127.0.0.1", port),
        etcd.url,
        timedelta(seconds=2),
        timedelta(seconds=2.5),
    )


@pytest.fixture
def registry(backend: Backend) -> Iterator[Registry]:
    reg = backend.connect()
    try:
        yield reg
    finally:
        reg.close()


@pytest.fixture
def ns() -> str:
    """A key prefix of this test's own."""
    return f"/test/{uuid.uuid4().hex[:12]}/"


# -- the contract -----------------------------------------------------------------------


def test_put_get_delete_list(registry: Registry, ns: str) -> None:
    assert registry.get(ns + "a") is None
    assert registry.list(ns) == []
    registry.put(ns + "b", b"2")
    rev_a = registry.put(ns + "a", b"1")
    registry.put(ns + "c/d", b"\x00\xff")
    registry.put(ns + "empty", b"")
    registry.put(ns[:-1] + "x", b"shares the prefix string but not the folder")

    kv = registry.get(ns + "a")
    assert kv is not None and kv.value == b"1" and kv.revision == rev_a
    assert [kv.key for kv in registry.list(ns)] == [ns + "a", ns + "b", ns + "c/d", ns + "empty"]
    assert [kv.value for kv in registry.list(ns)] == [b"1", b"2", b"\x00\xff", b""]

    rev_a2 = registry.put(ns + "a", b"one")
    kv = registry.get(ns + "a")
    assert kv is not None and kv.value == b"one" and kv.revision == rev_a2 > rev_a

    assert registry.delete(ns + "a") is True
    assert registry.get(ns + "a") is None
    assert registry.delete(ns + "a") is False
    assert [kv.key for kv in registry.list(ns)] == [ns + "b", ns + "c/d", ns + "empty"]
    registry.delete(ns[:-1] + "x")


def test_revisions_increase(registry: Registry, ns: str) -> None:
    before = registry.revision()
    revisions = [registry.put(ns + f"k{i}", b"x") for i in range(5)]
    assert before < revisions[0]
    assert revisions == sorted(set(revisions)), revisions
    assert registry.revision() >= revisions[-1]
    assert [kv.revision for kv in registry.list(ns)] == revisions
    registry.delete(ns + "k0")
    assert registry.revision() > revisions[-1]


def test_compare_and_set(registry: Registry, ns: str) -> None:
    key = ns + "leader"
    assert registry.compare_and_set(key, b"anything", b"x") is False  # a missing key matches no value
    assert registry.get(key) is None
    assert registry.compare_and_set(key, None, b"alice") is True  # create-only on a missing key
    assert registry.compare_and_set(key, None, b"bob") is False  # create-only on an existing key
    assert registry.compare_and_set(key, b"bob", b"carol") is False  # mismatching
    kv = registry.get(key)
    assert kv is not None and kv.value == b"alice"
    assert registry.compare_and_set(key, b"alice", b"dave") is True  # matching
    kv = registry.get(key)
    assert kv is not None and kv.value == b"dave"


def test_compare_and_set_race_has_one_winner(registry: Registry, ns: str) -> None:
    key = ns + "race"
    results: dict[int, bool] = {}
    start = threading.Barrier(6)

    def contend(i: int) -> None:
        start.wait(timeout=10)
        results[i] = registry.compare_and_set(key, None, f"w{i}".encode())

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    winners = [i for i, won in results.items() if won]
    assert len(results) == 6 and len(winners) == 1, results
    kv = registry.get(key)
    assert kv is not None and kv.value == f"w{winners[0]}".encode()


def test_lease_ttl(registry: Registry, backend: Backend) -> None:
    with pytest.raises(ValueError):
        registry.lease(timedelta(0))
    lease = registry.lease(timedelta(milliseconds=500))
    try:
        assert lease.ttl == max(timedelta(milliseconds=500), backend.ttl)  # etcd rounds up to 2 s
    finally:
        lease.revoke()


def test_lease_lapses_and_keepalive_outlives_it(registry: Registry, backend: Backend, ns: str) -> None:
    with registry.watch(ns) as watch:
        t0 = time.monotonic()
        lapsing = registry.lease(backend.ttl)
        kept = registry.lease(backend.ttl)
        ttl = lapsing.ttl.total_seconds()
        registry.put(ns + "lapsing", b"1", lease=lapsing)
        registry.put(ns + "kept", b"1", lease=kept)
        keeper = KeepAlive(kept)
        try:
            assert _summary(_collect(watch, 2)) == [("put", ns + "lapsing", b"1"), ("put", ns + "kept", b"1")]
            # Nobody refreshes "lapsing": its DELETE must come, on time.
            event = _next_event(watch, timedelta(seconds=ttl) + backend.lapse_slack + timedelta(seconds=1))
            lapsed_after = time.monotonic() - t0
            assert (event.type, event.key) == (EventType.DELETE, ns + "lapsing")
            assert ttl - 0.05 <= lapsed_after <= ttl + backend.lapse_slack.total_seconds(), lapsed_after
            # The kept lease was granted at the same time with the same TTL.
            assert registry.get(ns + "kept") is not None
            time.sleep(ttl / 2)
            assert registry.get(ns + "kept") is not None
            assert not keeper.lost.is_set()
            with pytest.raises(RegistryError):
                lapsing.refresh()
        finally:
            keeper.stop(revoke=True)
        assert registry.get(ns + "kept") is None
        assert (_next_event(watch).type, registry.list(ns)) == (EventType.DELETE, [])


def test_lease_revoke_deletes_keys_and_is_idempotent(registry: Registry, backend: Backend, ns: str) -> None:
    lease = registry.lease(backend.ttl)
    registry.put(ns + "a", b"1", lease=lease)
    assert registry.compare_and_set(ns + "b", None, b"2", lease=lease)
    lease.refresh()
    lease.revoke()
    assert registry.list(ns) == []
    lease.revoke()  # a no-op
    with pytest.raises(RegistryError):
        lease.refresh()
    with pytest.raises(RegistryError):
        registry.put(ns + "c", b"3", lease=lease)
    assert registry.get(ns + "c") is None


# an in-process registry has no other process whose death it could notice (lapse: see the lease tests)
@pytest.mark.parametrize(
    "backend", ["remote", "remote-child", pytest.param("etcd", marks=pytest.mark.etcd),
                pytest.param("etcd-tls", marks=pytest.mark.etcd)], indirect=True
)
def test_killed_owner_key_vanishes(registry: Registry, backend: Backend, ns: str) -> None:
    assert backend.url is not None
    key = ns + "worker/0"
    proc = _spawn(HOLD_LEASE_CHILD, backend.url, key, str(backend.ttl.total_seconds()))
    try:
        ready = _read_line(proc, timedelta(seconds=20), "READY")
        assert ready.startswith("READY"), ready
        ttl = float(ready.split()[1])
        kv = registry.get(key)
        assert kv is not None and kv.value == b"alive"
        time.sleep(ttl * 0.75)  # the holder's KeepAlive has refreshed at least once by now
        assert registry.get(key) is not None
        proc.kill()  # SIGKILL: no revoke, no goodbye
        killed = time.monotonic()
        registry.wait_for(
            ns,
            lambda items: not items,
            timeout=timedelta(seconds=ttl) + backend.lapse_slack + timedelta(seconds=2),
            what="the killed holder's key to vanish",
        )
        assert time.monotonic() - killed <= ttl + backend.lapse_slack.total_seconds()
    finally:
        _reap(proc)


def test_watch_delivers_puts_and_deletes_in_order(registry: Registry, ns: str) -> None:
    registry.put(ns + "before", b"0")  # before the watch: not delivered
    with registry.watch(ns) as watch:
        revisions = [
            registry.put(ns + "a", b"1"),
            registry.put(ns + "b", b"2"),
            registry.put(ns + "a", b"3"),
        ]
        registry.delete(ns + "a")
        events = _collect(watch, 4)
        assert _summary(events) == [
            ("put", ns + "a", b"1"),
            ("put", ns + "b", b"2"),
            ("put", ns + "a", b"3"),
            ("delete", ns + "a", b""),
        ]
        assert [e.revision for e in events[:3]] == revisions
        assert events[3].revision > revisions[2]
        assert watch.get(QUIET) is None
    watch.cancel()  # idempotent
    with pytest.raises(RegistryError):
        watch.get(QUIET)


def test_watch_replays_from_start_revision(registry: Registry, ns: str) -> None:
    registry.put(ns + "a", b"1")
    rev_b = registry.put(ns + "b", b"2")
    registry.delete(ns + "a")
    registry.put(ns + "c", b"3")
    with registry.watch(ns, start_revision=rev_b) as watch:  # inclusive
        registry.put(ns + "d", b"4")  # live, after the replay
        assert _summary(_collect(watch, 4)) == [
            ("put", ns + "b", b"2"),
            ("delete", ns + "a", b""),
            ("put", ns + "c", b"3"),
            ("put", ns + "d", b"4"),
        ]
        assert watch.get(QUIET) is None


def test_watch_resumes_after_last_revision(registry: Registry, ns: str) -> None:
    with registry.watch(ns) as first:
        registry.put(ns + "a", b"1")
        seen = _next_event(first)
    registry.put(ns + "b", b"2")  # while nobody watches
    with registry.watch(ns, start_revision=seen.revision + 1) as second:
        assert _summary([_next_event(second)]) == [("put", ns + "b", b"2")]
        assert second.get(QUIET) is None


def test_watch_prefix_isolation(registry: Registry, ns: str) -> None:
    with registry.watch(ns + "in/") as watch:
        registry.put(ns + "out/x", b"no")
        registry.put(ns + "in/x", b"1")
        registry.put(ns + "inx", b"no")
        registry.put(ns + "in/y", b"2")
        registry.delete(ns + "out/x")
        assert [e.key for e in _collect(watch, 2)] == [ns + "in/x", ns + "in/y"]
        assert watch.get(QUIET) is None


def test_wait_for_success(registry: Registry, ns: str) -> None:
    def join_later() -> None:
        for i in range(2):
            time.sleep(0.1)
            registry.put(ns + f"w{i}", b"up")

    writer = threading.Thread(target=join_later)
    writer.start()
    try:
        items = registry.wait_for(
            ns, lambda kvs: len(kvs) >= 2, timeout=timedelta(seconds=10), what="2 workers"
        )
    finally:
        writer.join(timeout=10)
    assert [kv.key for kv in items] == [ns + "w0", ns + "w1"]


def test_wait_for_follows_comings_and_goings_and_lists_once(registry: Registry, ns: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Members join, one leaves and one is rewritten while the wait runs: the listing returned is the
    registry's own at that moment, built from the watch's events rather than a listing per event."""
    real_list = registry.list
    listings = record_calls(monkeypatch, registry, "list")
    registry.put(ns + "gone", b"soon")

    def churn() -> None:
        time.sleep(0.1)
        for i in range(12):
            registry.put(ns + f"m{i:02d}", b"up")
        registry.delete(ns + "gone")
        registry.put(ns + "m03", b"again")

    writer = threading.Thread(target=churn)
    writer.start()
    try:
        items = registry.wait_for(ns, lambda kvs: len(kvs) == 12 and all(kv.key != ns + "gone" for kv in kvs)
                                  and any(kv.value == b"again" for kv in kvs),
                                  timeout=timedelta(seconds=10), what="12 members")
    finally:
        writer.join(timeout=10)
    assert [(kv.key, kv.value) for kv in items] == [(kv.key, kv.value) for kv in real_list(ns)]
    assert len(listings) <= 4, listings  # before the watch, after it, and a quiet half-second or two


def test_wait_for_timeout_names_what_and_how_long(registry: Registry, ns: str) -> None:
    registry.put(ns + "w0", b"up")
    start = time.monotonic()
    with pytest.raises(RegistryTimeoutError) as info:
        registry.wait_for(ns, lambda kvs: len(kvs) >= 3, timeout=timedelta(seconds=0.3), what="3 workers")
    assert time.monotonic() - start < 3
    message = str(info.value)
    assert "3 workers" in message and "0.3s" in message and ns + "w0" in message


# -- memory -----------------------------------------------------------------------------


def test_memory_history_is_bounded_and_compaction_is_reported() -> None:
    with MemoryRegistry(history=10) as reg:
        revisions = [reg.put(f"/k/{i}", b"x") for i in range(30)]
        with pytest.raises(RegistryError, match="compacted"):
            reg.watch("/k/", start_revision=revisions[0])
        with reg.watch("/k/", start_revision=revisions[-5]) as watch:
            assert [e.revision for e in _collect(watch, 5)] == revisions[-5:]
        with pytest.raises(ValueError):
            reg.watch("/k/", start_revision=0)


def test_memory_lapse_is_prompt_with_many_leases() -> None:
    with MemoryRegistry() as reg, reg.watch("/w/") as watch:
        leases = [reg.lease(timedelta(seconds=0.2 + i * 0.05)) for i in range(5)]
        t0 = time.monotonic()
        for i, lease in enumerate(leases):
            reg.put(f"/w/{i}", b"x", lease=lease)
        _collect(watch, 5)
        for i in range(5):
            event = _next_event(watch, timedelta(seconds=2))
            late = time.monotonic() - t0 - (0.2 + i * 0.05)
            assert (event.type, event.key) == (EventType.DELETE, f"/w/{i}")
            assert -0.02 <= late <= 0.15, late  # ~0.1 s, with room for a busy 2-core machine


def test_memory_refreshed_leases_outlive_their_ttl_and_the_rest_lapse_in_deadline_order() -> None:
    """Deadlines change with every refresh (the heap keeps outdated entries, skipped, and compacts them):
    a lease refreshed many times past its TTL holds its key; the ones let go lapse, each at its own time."""
    with MemoryRegistry() as reg, reg.watch("/r/") as watch:
        kept = reg.lease(timedelta(seconds=0.5))
        reg.put("/r/kept", b"x", lease=kept)
        dropped = [reg.lease(timedelta(seconds=0.4 + i * 0.1)) for i in range(3)]
        for i, lease in enumerate(dropped):
            reg.put(f"/r/{i}", b"x", lease=lease)
        _collect(watch, 4)
        t0 = time.monotonic()
        for _ in range(300):  # over 1.2 s of refreshes, far more entries than leases
            kept.refresh()
            for lease in dropped[1:]:  # only until 0.2 s: then these two are let go too
                if time.monotonic() - t0 < 0.2:
                    lease.refresh()
            time.sleep(0.004)
        lapsed = [_next_event(watch, timedelta(seconds=2)) for _ in range(3)]
        assert [(e.type, e.key) for e in lapsed] == [(EventType.DELETE, f"/r/{i}") for i in range(3)]
        assert [kv.key for kv in reg.list("/r/")] == ["/r/kept"]
        kept.refresh()


# -- the served registry ----------------------------------------------------------------


def _packb(body: object) -> bytes:
    data = msgpack.packb(body)
    assert isinstance(data, bytes)
    return data


def _request(request_id: object, method: str, body: object, /, **envelope: object) -> bytes:
    """A request envelope to the registry service, with ``envelope``'s fields replaced or added."""
    fields: dict[str, object] = {"v": 1, "id": request_id, "service": "registry", "method": method,
                                 "body": body, "tensors": []}
    fields.update(envelope)
    return _packb({k: v for k, v in fields.items() if v is not _DROP})


_DROP = object()  # a field _request leaves out


def _reply(sock: zmq.Socket[bytes], what: str) -> ReplyEnvelope:
    assert sock.poll(5000), f"no reply to {what} within 5s"
    frames = sock.recv_multipart()
    assert len(frames) == 1, frames
    return ReplyEnvelope.model_validate(unpack_raw(frames[0]))


# case: (frames, what the bad_request reply must say, the id it must echo: 0 when unreadable)
MALFORMED: dict[str, tuple[list[bytes], str, int]] = {
    "not msgpack": ([b"\xc1\xc1\xc1"], "not msgpack", 0),
    "empty frame": ([b""], "not msgpack", 0),
    "not a map": ([_packb([1, 2])], "map", 0),
    "wrong version": ([_request(1, "get", {"key": "k"}, v=99)], "protocol version 99", 0),
    "no version": ([_request(1, "get", {"key": "k"}, v=_DROP)], "protocol version None", 0),
    "no method": ([_request(2, "get", {"key": "k"}, method=_DROP)], "method", 2),
    "body not a map": ([_request(2, "get", [1])], "body", 2),
    "int for str": ([_request(3, "put", {"key": 5, "value": b"x"})], "key", 3),
    "str for bytes": ([_request(4, "put", {"key": "k", "value": "x"})], "value", 4),
    "extra field": ([_request(5, "get", {"key": "k", "bogus": 1})], "bogus", 5),
    "missing field": ([_request(6, "get", {})], "key", 6),
    "str for int": ([_request(7, "lease_grant", {"ttl_ms": "500"})], "ttl_ms", 7),
    "bad id": ([_request("x", "get", {"key": "k"})], "id", 0),
    "out of range": ([_request(8, "watch_poll", {"prefix": "", "from_revision": 0, "wait_ms": 5})],
                     "from_revision", 8),
    "two frames": ([_request(9, "get", {"key": "k"}), b"extra"], "frames", 9),
    "a tensor announced, none sent": (
        [_request(10, "get", {"key": "k"},
                  tensors=[{"name": "t", "dtype": "float32", "shape": [1], "frames": 1}])],
        "frames",
        10,
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_server_answers_malformed_requests_and_keeps_serving(
    served: RegistryServer, case: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    frames, expected, expected_id = MALFORMED[case]
    counted = Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)  # this case's counts and warnings alone
    sock = make_socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        with caplog.at_level("WARNING", logger="comm.rpc.host"):
            sock.send_multipart(frames)
            reply = _reply(sock, "a malformed request")
        assert not reply.ok and reply.error is not None, reply
        assert (reply.error.code, reply.id) == ("bad_request", expected_id)
        assert expected in reply.error.message, reply.error.message
        # counted, and warned about once (a peer repeating it is counted, warned about once a minute)
        assert counted.counts() == {("frame", "rpc/bad_request"): 1}
        warned = [r for r in caplog.records if r.name == "comm.rpc.host" and r.levelname == "WARNING"]
        assert len(warned) == 1 and expected in warned[0].getMessage(), [r.getMessage() for r in warned]
        sock.send(_request(100, "get", {"key": "/nothing"}))
        assert _reply(sock, "a valid get after it") == ReplyEnvelope(id=100, ok=True, body={"kv": None})
    finally:
        sock.close(linger=0)


@pytest.mark.parametrize(("service", "method", "code", "says"), [
    ("registry", "frobnicate", "unknown_method", "registry has no method 'frobnicate'"),
    ("registri", "get", "unknown_service", "no service 'registri' here; hosted: ['registry']"),
])
def test_server_names_an_unknown_method_or_service(
    served: RegistryServer, service: str, method: str, code: str, says: str
) -> None:
    sock = make_socket(zmq.DEALER)
    sock.connect(served.address)
    try:
        sock.send(_request(3, method, {"key": "k"}, service=service))
        reply = _reply(sock, f"{service}.{method}")
        assert not reply.ok and reply.error is not None and reply.id == 3, reply
        assert reply.error.code == code and says in reply.error.message, reply.error
        if code == "unknown_method":
            assert "watch_poll" in reply.error.message  # and it lists what there is
    finally:
        sock.close(linger=0)


def test_parked_polls_are_bounded_and_answered_by_a_change(ns: str) -> None:
    with MemoryRegistry() as registry:
        host = ServiceHost("127.0.0.1")
        host.add("registry", RegistryService(registry, host, max_parked=2))
        host.start()
        sock = make_socket(zmq.DEALER)
        sock.connect(host.address)
        try:
            start = registry.revision() + 1
            poll = {"prefix": ns, "from_revision": start, "wait_ms": 20_000}
            for request_id in (1, 2, 3):  # two park, the third finds no room
                sock.send(_request(request_id, "watch_poll", poll))
            first = _reply(sock, "the poll beyond the bound")
            assert (first.id, first.ok, first.body) == (3, True, {"events": [], "revision": start - 1})
            assert not sock.poll(200), "a parked poll was answered with nothing to say"
            revision = registry.put(ns + "a", b"1")  # in process: the listener wakes the host
            replies = [_reply(sock, "a parked poll"), _reply(sock, "a parked poll")]
            assert sorted(r.id for r in replies) == [1, 2]
            event = {"kind": "put", "key": ns + "a", "value": b"1", "revision": revision}
            assert all(r.body == {"events": [event], "revision": revision} for r in replies), replies
            sock.send(_request(4, "watch_poll", {**poll, "from_revision": revision + 1, "wait_ms": 300}))
            waited = time.monotonic()
            timed_out = _reply(sock, "a poll that times out")
            assert 0.25 <= time.monotonic() - waited < 3
            assert (timed_out.id, timed_out.ok) == (4, True)
            assert timed_out.body == {"events": [], "revision": revision}
        finally:
            sock.close(linger=0)
            host.shutdown()


def test_a_host_serves_the_registry_next_to_other_services() -> None:
    with MemoryRegistry() as registry:
        host = ServiceHost("127.0.0.1")
        host.add("other", _Other())
        host.start()
        client = RemoteRegistry(host.address)
        try:
            with pytest.raises(RegistryError, match=r"unknown_service.*no service 'registry'"):
                client.revision()
            host.add("registry", RegistryService(registry, host))
            assert client.put("/k", b"v") == registry.revision()
            kv = registry.get("/k")
            assert kv is not None and kv.value == b"v"
            with RpcClient(host.address) as other:
                assert other.call("other", "ping", Empty(), Empty)[0] == Empty()
        finally:
            client.close()
            host.shutdown()


class _Other(ServiceBase):
    def rpc_ping(self, request: Empty, call: Call) -> Empty:
        return Empty()


def test_server_lifecycle_and_remote_compaction() -> None:
    server = RegistryServer(MemoryRegistry(history=10))
    with pytest.raises(RuntimeError, match="start"):
        _ = server.address
    with server:
        client = RemoteRegistry(server.address)
        try:
            revisions = [client.put(f"/k/{i}", b"x") for i in range(30)]
            with pytest.raises(RegistryError, match="compacted"):
                client.watch("/k/", start_revision=revisions[0])
            with client.watch("/k/", start_revision=revisions[-3]) as watch:
                assert [e.revision for e in _collect(watch, 3)] == revisions[-3:]
        finally:
            client.close()
    server.shutdown()  # idempotent
    server.registry.close()


def test_remote_request_timeout_names_server() -> None:
    sock = make_socket(zmq.ROUTER)
    address = bind_port(sock)  # a peer that never answers
    client = RemoteRegistry(address, request_timeout=timedelta(milliseconds=200))
    try:
        start = time.monotonic()
        with pytest.raises(RegistryTimeoutError, match=f"{address}.*revision.*0.2s"):
            client.revision()
        assert time.monotonic() - start < 2
    finally:
        client.close()
        sock.close(linger=0)


def test_remote_drops_a_late_reply() -> None:
    router = make_socket(zmq.ROUTER)
    address = bind_port(router)
    client = RemoteRegistry(address, request_timeout=timedelta(milliseconds=300))
    try:
        with pytest.raises(RegistryTimeoutError):
            client.revision()  # the fake server holds this request
        assert router.poll(5000)
        identity, frame = router.recv_multipart()
        first = RequestEnvelope.model_validate(unpack_raw(frame))
        assert (first.service, first.method) == ("registry", "revision")
        result: list[int] = []
        second_call = threading.Thread(target=lambda: result.append(client.revision()))
        second_call.start()
        assert router.poll(5000)
        identity2, frame2 = router.recv_multipart()
        second = RequestEnvelope.model_validate(unpack_raw(frame2))
        assert second.id != first.id
        router.send_multipart([identity, *reply_frames(first.id, RevisionReply(revision=111))])  # late
        router.send_multipart([identity2, *reply_frames(second.id, RevisionReply(revision=222))])
        second_call.join(timeout=5)
        assert result == [222]
    finally:
        client.close()
        router.close(linger=0)


def test_remote_error_replies_raise(served: RegistryServer) -> None:
    client = RemoteRegistry(served.address)
    try:
        with pytest.raises(ValueError):
            client.watch("/x/", start_revision=0)
        with pytest.raises(RegistryError, match="lease 987654 not found"):
            RemoteLease(client, 987654, timedelta(seconds=1)).refresh()
        with pytest.raises(ProtocolError, match="from_revision"):  # a client bug, reported by the server
            client._call(
                "a bad poll",
                "watch_poll",
                WatchPollRequest.model_construct(prefix="/x/", from_revision=0, wait_ms=0),
                EventsReply,
            )
    finally:
        client.close()


# -- etcd -------------------------------------------------------------------------------


@pytest.mark.etcd
def test_etcd_watch_survives_an_etcd_restart(etcd_server: EtcdServer, ns: str) -> None:
    # The watcher waits 3 s before reconnecting, so the writes right after the restart
    # land while it is disconnected: it must replay them from its last revision.
    retry = WatchRetry(
        initial=timedelta(seconds=3), maximum=timedelta(seconds=3), give_up_after=timedelta(seconds=30)
    )
    watcher = EtcdRegistry("127.0.0.1", etcd_server.client_port, watch_retry=retry)
    writer = EtcdRegistry("127.0.0.1", etcd_server.client_port)
    expected: list[tuple[str, str, bytes]] = []

    def put(key: str, value: bytes) -> None:
        writer.put(ns + key, value)
        expected.append(("put", ns + key, value))

    def delete(key: str) -> None:
        assert writer.delete(ns + key)
        expected.append(("delete", ns + key, b""))

    try:
        watch = watcher.watch(ns)
        put("a", b"1")
        put("b", b"1")
        events = _collect(watch, 2)

        etcd_server.kill()
        etcd_server.restart()
        put("a", b"2")  # during: the watcher is still waiting to reconnect
        put("c", b"1")
        delete("b")
        assert watch.reconnects == 0, "the watcher reconnected before the writes: no gap tested"
        events += _collect(watch, 3, timedelta(seconds=10))
        assert watch.reconnects == 1

        put("d", b"1")  # after
        delete("a")
        events += _collect(watch, 2)
        assert watch.get(QUIET) is None

        assert _summary(events) == expected  # every change, once, in order
        revisions = [e.revision for e in events]
        assert revisions == sorted(set(revisions))
        watch.cancel()
    finally:
        watcher.close()
        writer.close()


# -- connect_registry -------------------------------------------------------------------


def test_connect_registry_by_url(served: RegistryServer) -> None:
    with connect_registry("memory://") as reg:
        assert isinstance(reg, MemoryRegistry)
    with connect_registry(served.address) as reg:
        assert isinstance(reg, RemoteRegistry) and reg.revision() >= 1
    with connect_registry("etcd://127.0.0.1:1") as reg:  # connects lazily
        assert isinstance(reg, EtcdRegistry)
    with pytest.raises(ValueError, match=r"memory://, tcp://, etcd://"):
        connect_registry("http://127.0.0.1:80")
    with pytest.raises(ValueError, match="host and a port"):
        connect_registry("tcp://127.0.0.1")
