"""The client of a :class:`comm.registry.server.RegistryServer`: a :class:`Registry` over the one RPC layer.

Every call is one request to the host's ``registry`` service through a
:class:`~comm.rpc.client.RpcClient` (bodies in :mod:`comm.registry.protocol`), bounded by
``request_timeout``. The envelope carries a request id; a reply to a request that already
timed out arrives later with the old id and is dropped, so it can never be mistaken for
the answer to the next request.

A watch is a sequence of long polls on its own client: "the events under the prefix
from revision R on, waiting up to T". Each reply says up to which revision it looked,
so the next poll resumes right after it: nothing is lost or repeated between polls,
and a poll that failed (server busy, reply lost) is simply asked again.

Cross-process limits: leases live in the server's process. A client that dies stops
refreshing its leases and their keys vanish after their TTL; a server that dies takes
every key with it (clients then get :class:`RegistryTimeoutError`).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from datetime import timedelta
from typing import TypeVar

from pydantic import BaseModel

from comm.errors import LeaseExpiredError, ProtocolError, RegistryError, RegistryTimeoutError
from comm.registry.base import KeyValue, Lease, Registry, Watch, WatchEvent
from comm.registry.protocol import (
    SERVICE,
    BoolReply,
    CasRequest,
    DeleteRequest,
    EventsReply,
    GetReply,
    GetRequest,
    LeaseGrantRequest,
    LeaseReply,
    LeaseRequest,
    ListReply,
    ListRequest,
    PutRequest,
    RevisionReply,
    WatchPollRequest,
)
from comm.rpc import Empty, RpcClient, RpcError

__all__ = ["DEFAULT_POLL_WAIT", "DEFAULT_REQUEST_TIMEOUT", "RemoteLease", "RemoteRegistry", "RemoteWatch"]

DEFAULT_REQUEST_TIMEOUT = timedelta(seconds=10)
DEFAULT_POLL_WAIT = timedelta(seconds=5)
"""The longest single watch poll; a longer ``get`` is several polls, so a dead server shows."""

R = TypeVar("R", bound=BaseModel)


def _call(client: RpcClient, what: str, method: str, request: BaseModel, reply_type: type[R],
          timeout: timedelta) -> R:
    """``registry.method(request)`` through ``client``, its errors as the registry's own.

    Raises:
        RegistryTimeoutError: no reply within ``timeout`` (naming the server and ``what``).
        ProtocolError: the server rejected the request as malformed, or its reply was.
        ValueError: the server rejected an argument.
        LeaseExpiredError: the lease named no longer exists on the server.
        RegistryError: any other refusal (an expired lease, a compacted revision, a closed
            client, an address that serves no registry).
    """
    try:
        body, _ = client.call(SERVICE, method, request, reply_type, timeout=timeout)
    except TimeoutError as exc:
        raise RegistryTimeoutError(f"registry server at {client.address} did not answer {what} within "
                                   f"{timeout.total_seconds():.1f}s") from exc
    except RpcError as exc:
        if exc.code == "closed":
            raise RegistryError(f"registry client for {client.address}: {exc.message}") from None
        message = f"registry server at {client.address} refused {what}: [{exc.code}] {exc.message}"
        if exc.code == "bad_request":
            raise ProtocolError(message) from None
        if exc.code == "value":
            raise ValueError(message) from None
        if exc.code == "lease_expired":
            raise LeaseExpiredError(message) from None
        raise RegistryError(message) from None
    return body


class RemoteLease(Lease):
    """A lease held by the server; refresh and revoke are requests."""

    def __init__(self, registry: RemoteRegistry, lease_id: int, ttl: timedelta) -> None:
        super().__init__(lease_id, ttl)
        self._registry = registry

    def refresh(self) -> None:
        """One request on the registry's lease client: never queued behind another call in flight."""
        request = LeaseRequest(lease=self._id)
        self._registry._lease_call(f"refresh of lease {self._id}", "lease_refresh", request, Empty)

    def revoke(self) -> None:
        self._registry._call(f"revoke of lease {self._id}", "lease_revoke", LeaseRequest(lease=self._id),
                             Empty)

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
    Thread-safe: requests from several threads are serialized on one client; each
    watch has a client of its own, and lease refreshes have one too. A refresh queued behind
    another thread's call would reach the server only once that call was answered; when the
    server's process stalls, that is after the lease's deadline, and the server's guard for
    refreshes sent in time (see [Note: leases of a stalled server] in
    ``comm/registry/memory.py``) cannot see a refresh that was never sent. Nor one that waits in a
    connection's handshake (with the job's keys, the serving process's ZAP handler admits each new
    connection, and it stalls with that process): so the lease client is made by the first grant, which
    travels on it, and every refresh finds its connection made.
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
        self._client = RpcClient(address, timeout=request_timeout)
        self._lease_client: RpcClient | None = None  # made at the first lease grant
        self._lease_lock = threading.Lock()
        self._watches: weakref.WeakSet[RemoteWatch] = weakref.WeakSet()
        self._closed = False

    def _call(self, what: str, method: str, request: BaseModel, reply_type: type[R]) -> R:
        return _call(self._client, what, method, request, reply_type, self.request_timeout)

    def _lease_call(self, what: str, method: str, request: BaseModel, reply_type: type[R]) -> R:
        with self._lease_lock:
            if self._lease_client is None:
                if self._closed:
                    raise RegistryError(f"registry client for {self.address} is closed")
                self._lease_client = RpcClient(self.address, timeout=self.request_timeout)
            client = self._lease_client
        return _call(client, what, method, request, reply_type, self.request_timeout)

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        request = PutRequest(key=key, value=value, lease=None if lease is None else lease.id)
        return self._call(f"put of {key!r}", "put", request, RevisionReply).revision

    def get(self, key: str) -> KeyValue | None:
        reply = self._call(f"get of {key!r}", "get", GetRequest(key=key), GetReply)
        return None if reply.kv is None else reply.kv.to_key_value()

    def delete(self, key: str) -> bool:
        return self._call(f"delete of {key!r}", "delete", DeleteRequest(key=key), BoolReply).value

    def list(self, prefix: str) -> list[KeyValue]:
        reply = self._call(f"list of {prefix!r}", "list", ListRequest(prefix=prefix), ListReply)
        return [kv.to_key_value() for kv in reply.items]

    def compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: Lease | None = None
    ) -> bool:
        lease_id = None if lease is None else lease.id
        request = CasRequest(key=key, expected=expected, value=value, lease=lease_id)
        return self._call(f"compare-and-set of {key!r}", "cas", request, BoolReply).value

    def lease(self, ttl: timedelta) -> RemoteLease:
        """Grant a lease of ``ttl`` (rounded up to whole milliseconds) on the server.

        Raises:
            ValueError: if ``ttl`` is not positive.
        """
        ttl_ms = -(-ttl // timedelta(milliseconds=1))  # ceil
        if ttl_ms <= 0:
            raise ValueError(f"a lease needs a positive ttl, got {ttl.total_seconds()}s")
        # on the refreshes' client: its connection is made (and, with the job's keys, admitted) before the
        # lease exists, so no refresh of it ever waits in a handshake ([Note: leases of a stalled server])
        reply = self._lease_call("lease grant", "lease_grant", LeaseGrantRequest(ttl_ms=ttl_ms), LeaseReply)
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
        return self._call("revision", "revision", Empty(), RevisionReply).revision

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            watch.cancel()
        self._client.close()
        with self._lease_lock:
            if self._lease_client is not None:
                self._lease_client.close()


class RemoteWatch(Watch):
    """A watch served by long polls on a client of its own (see the module docstring)."""

    def __init__(self, registry: RemoteRegistry, prefix: str, start_revision: int) -> None:
        self._prefix = prefix
        self._next = start_revision
        self._poll_wait = registry.poll_wait
        self._request_timeout = registry.request_timeout
        self._client = RpcClient(registry.address, timeout=registry.request_timeout)
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
        request = WatchPollRequest(prefix=self._prefix, from_revision=self._next, wait_ms=wait_ms)
        what = f"watch poll of {self._prefix!r} from revision {self._next}"
        reply = _call(self._client, what, "watch_poll", request, EventsReply,
                      self._request_timeout + timedelta(milliseconds=wait_ms))
        self._buffer.extend(e.to_event() for e in reply.events)
        self._next = max(self._next, reply.revision + 1)

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._buffer.clear()
        self._client.close()
