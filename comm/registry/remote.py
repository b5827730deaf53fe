"""The client of a :class:`comm.registry.server.RegistryServer`: a :class:`Registry` over ZeroMQ.

Every call is one request and one reply on a DEALER socket (see
:mod:`comm.registry.protocol`), bounded by ``request_timeout``. Requests carry an id;
a reply to a request that already timed out arrives later with the old id and is
dropped, so it can never be mistaken for the answer to the next request.

A watch is a sequence of long polls on its own socket: "the events under the prefix
from revision R on, waiting up to T". Each reply says up to which revision it looked,
so the next poll resumes right after it: nothing is lost or repeated between polls,
and a poll that failed (server busy, reply lost) is simply asked again.

Cross-process limits: leases live in the server's process. A client that dies stops
refreshing its leases and their keys vanish after their TTL; a server that dies takes
every key with it (clients then get :class:`RegistryTimeoutError`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import TypeVar

import zmq

from comm.codec import pack
from comm.errors import ProtocolError, RegistryError, RegistryTimeoutError
from comm.registry.base import KeyValue, Lease, Registry, Watch, WatchEvent
from comm.registry.protocol import (
    BadMessage,
    BoolReply,
    CasRequest,
    DeleteRequest,
    ErrorReply,
    EventsReply,
    GetReply,
    GetRequest,
    LeaseGrantRequest,
    LeaseRefreshRequest,
    LeaseReply,
    LeaseRevokeRequest,
    ListReply,
    ListRequest,
    OkReply,
    PutRequest,
    Reply,
    Request,
    RevisionReply,
    RevisionRequest,
    WatchPollRequest,
    decode_reply,
)
from comm.sockets import make_socket

__all__ = ["DEFAULT_POLL_WAIT", "DEFAULT_REQUEST_TIMEOUT", "RemoteLease", "RemoteRegistry", "RemoteWatch"]

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = timedelta(seconds=10)
DEFAULT_POLL_WAIT = timedelta(seconds=5)
"""The longest single watch poll; a longer ``get`` is several polls, so a dead server shows."""

R = TypeVar("R", bound=Reply)

_POLL_SLICE_MS = 100


class _Channel:
    """One DEALER socket with request ids; thread-safe (one request in flight at a time)."""

    def __init__(self, address: str, request_timeout: timedelta) -> None:
        self.address = address
        self.request_timeout = request_timeout
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closing = False
        self._sock: zmq.Socket[bytes] | None = make_socket(zmq.DEALER)
        self._sock.connect(address)

    def call(
        self,
        what: str,
        make: Callable[[int], Request],
        expect: type[R],
        *,
        extra_wait: timedelta = timedelta(0),
    ) -> R:
        """Send ``make(id)`` and wait ``request_timeout + extra_wait`` for its reply.

        Raises:
            RegistryTimeoutError: no reply in time (naming the server and the request).
            RegistryError: the server answered with an error (``ProtocolError`` for a
                rejected request, ``ValueError`` for a bad argument).
            ProtocolError: the reply was malformed or of the wrong type.
        """
        waited = self.request_timeout + extra_wait
        with self._lock:
            sock = self._sock
            if sock is None:
                raise RegistryError(f"registry client for {self.address} is closed")
            request_id = next(self._ids)
            try:
                sock.send(pack(make(request_id)), zmq.NOBLOCK)
            except zmq.Again:
                raise RegistryTimeoutError(
                    f"registry server at {self.address}: cannot queue {what}: the send queue is full"
                ) from None
            deadline = time.monotonic() + waited.total_seconds()
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryTimeoutError(
                        f"registry server at {self.address} did not answer {what} within "
                        f"{waited.total_seconds():.1f}s"
                    )
                if self._closing:
                    raise RegistryError(f"registry client for {self.address} was closed during {what}")
                # Poll in short slices so that close() from another thread is seen promptly.
                if not sock.poll(min(_POLL_SLICE_MS, max(1, int(left * 1000))), zmq.POLLIN):
                    continue
                frames = sock.recv_multipart()
                if len(frames) != 1:
                    raise ProtocolError(f"registry reply to {what}: expected 1 frame, got {len(frames)}")
                try:
                    reply = decode_reply(frames[0])
                except BadMessage as exc:
                    if exc.request_id not in (None, request_id):
                        continue  # a late, malformed answer to an older request
                    raise
                if reply.id != request_id:
                    logger.debug("dropping a late reply (id %s) while waiting for %d", reply.id, request_id)
                    continue
                if isinstance(reply, ErrorReply):
                    raise _error_from(reply, what, self.address)
                if not isinstance(reply, expect):
                    raise ProtocolError(
                        f"registry reply to {what}: expected {expect.__name__}, got {type(reply).__name__}"
                    )
                return reply

    def close(self) -> None:
        self._closing = True  # a call in flight on another thread gives up within a poll slice
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def _error_from(reply: ErrorReply, what: str, address: str) -> Exception:
    message = f"registry server at {address} refused {what}: {reply.message}"
    if reply.kind == "protocol":
        return ProtocolError(message)
    if reply.kind == "value":
        return ValueError(message)
    return RegistryError(message)


class RemoteLease(Lease):
    """A lease held by the server; refresh and revoke are requests."""

    def __init__(self, registry: RemoteRegistry, lease_id: int, ttl: timedelta) -> None:
        super().__init__(lease_id, ttl)
        self._registry = registry

    def refresh(self) -> None:
        self._registry._call(
            f"refresh of lease {self._id}", lambda i: LeaseRefreshRequest(id=i, lease=self._id), OkReply
        )

    def revoke(self) -> None:
        self._registry._call(
            f"revoke of lease {self._id}", lambda i: LeaseRevokeRequest(id=i, lease=self._id), OkReply
        )

    def __repr__(self) -> str:
        return f"RemoteLease(id={self._id}, ttl={self._ttl.total_seconds()}s)"


class RemoteRegistry(Registry):
    """A :class:`Registry` served by a :class:`RegistryServer` at ``address``.

    Args:
        address: the server's ``tcp://host:port``.

    Keyword Args:
        request_timeout: the bound on every request (default 10 s); a watch poll waits
            its long-poll time plus this.
        poll_wait: the longest single watch poll (default 5 s).

    Connecting never blocks (ZeroMQ connects in the background); the first request
    to an absent server raises :class:`RegistryTimeoutError` after ``request_timeout``.
    Thread-safe: requests from several threads are serialized on one socket; each
    watch has a socket of its own.
    """

    def __init__(
        self,
        address: str,
        *,
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        poll_wait: timedelta = DEFAULT_POLL_WAIT,
    ) -> None:
        if request_timeout <= timedelta(0):
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.address = address
        self.request_timeout = request_timeout
        self.poll_wait = poll_wait
        self._channel = _Channel(address, request_timeout)
        self._watches: weakref.WeakSet[RemoteWatch] = weakref.WeakSet()
        self._closed = False

    def _call(self, what: str, make: Callable[[int], Request], expect: type[R]) -> R:
        return self._channel.call(what, make, expect)

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        lease_id = None if lease is None else lease.id
        reply = self._call(
            f"put of {key!r}",
            lambda i: PutRequest(id=i, key=key, value=value, lease=lease_id),
            RevisionReply,
        )
        return reply.revision

    def get(self, key: str) -> KeyValue | None:
        reply = self._call(f"get of {key!r}", lambda i: GetRequest(id=i, key=key), GetReply)
        return None if reply.kv is None else reply.kv.to_key_value()

    def delete(self, key: str) -> bool:
        return self._call(f"delete of {key!r}", lambda i: DeleteRequest(id=i, key=key), BoolReply).value

    def list(self, prefix: str) -> list[KeyValue]:
        reply = self._call(f"list of {prefix!r}", lambda i: ListRequest(id=i, prefix=prefix), ListReply)
        return [kv.to_key_value() for kv in reply.items]

    def compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: Lease | None = None
    ) -> bool:
        lease_id = None if lease is None else lease.id
        reply = self._call(
            f"compare-and-set of {key!r}",
            lambda i: CasRequest(id=i, key=key, expected=expected, value=value, lease=lease_id),
            BoolReply,
        )
        return reply.value

    def lease(self, ttl: timedelta) -> RemoteLease:
        """Grant a lease of ``ttl`` (rounded up to whole milliseconds) on the server.

        Raises:
            ValueError: if ``ttl`` is not positive.
        """
        ttl_ms = -(-ttl // timedelta(milliseconds=1))  # ceil
        if ttl_ms <= 0:
            raise ValueError(f"a lease needs a positive ttl, got {ttl.total_seconds()}s")
        reply = self._call("lease grant", lambda i: LeaseGrantRequest(id=i, ttl_ms=ttl_ms), LeaseReply)
        return RemoteLease(self, reply.lease, timedelta(milliseconds=reply.ttl_ms))

    def watch(self, prefix: str, *, start_revision: int | None = None) -> RemoteWatch:
        """Watch ``prefix``; see :meth:`Registry.watch`.

        Raises:
            ValueError: if ``start_revision`` is below 1.
            RegistryError: if ``start_revision`` is compacted on the server.
        """
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        if self._closed:
            raise RegistryError(f"registry client for {self.address} is closed")
        if start_revision is None:
            start_revision = self.revision() + 1
        watch = RemoteWatch(self, prefix, start_revision)
        try:
            watch.prefetch()  # surfaces a compacted start revision here, not at the first get
        except Exception:
            watch.cancel()
            raise
        self._watches.add(watch)
        return watch

    def revision(self) -> int:
        return self._call("revision", lambda i: RevisionRequest(id=i), RevisionReply).revision

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            watch.cancel()
        self._channel.close()


class RemoteWatch(Watch):
    """A watch served by long polls on a socket of its own (see the module docstring)."""

    def __init__(self, registry: RemoteRegistry, prefix: str, start_revision: int) -> None:
        self._prefix = prefix
        self._next = start_revision
        self._poll_wait = registry.poll_wait
        self._channel = _Channel(registry.address, registry.request_timeout)
        self._buffer: deque[WatchEvent] = deque()
        self._cancelled = False

    def prefetch(self) -> None:
        self._poll(timedelta(0))

    def get(self, timeout: timedelta) -> WatchEvent | None:
        """The next event, or None if none arrived within ``timeout``.

        Raises:
            RegistryTimeoutError: the server did not answer a poll (``request_timeout``
                after the poll's own wait).
            RegistryError: the watch was cancelled, or its revision was compacted.
        """
        deadline = time.monotonic() + max(0.0, timeout.total_seconds())
        while not self._buffer:
            if self._cancelled:
                raise RegistryError(f"the watch on {self._prefix!r} was cancelled")
            left = max(0.0, deadline - time.monotonic())
            self._poll(min(timedelta(seconds=left), self._poll_wait))
            if not self._buffer and time.monotonic() >= deadline:
                return None
        return self._buffer.popleft()

    def _poll(self, wait: timedelta) -> None:
        wait_ms = int(wait.total_seconds() * 1000)
        reply = self._channel.call(
            f"watch poll of {self._prefix!r} from revision {self._next}",
            lambda i: WatchPollRequest(id=i, prefix=self._prefix, from_revision=self._next, wait_ms=wait_ms),
            EventsReply,
            extra_wait=timedelta(milliseconds=wait_ms),
        )
        self._buffer.extend(e.to_event() for e in reply.events)
        self._next = max(self._next, reply.revision + 1)

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._buffer.clear()
        self._channel.close()
