"""The etcd backend: a :class:`Registry` over an etcd v3 cluster, through the ``etcd3`` package.

What a cluster uses (the embedded registry is for local runs). Mapping:

* put / get / delete / list: etcd's KV API; ``list`` is a range over the prefix,
  sorted by key; revisions come from the response headers (``KeyValue.revision`` is
  etcd's ``mod_revision``).
* compare-and-set: one transaction comparing the value (or ``version == 0``, "the key
  does not exist", for create-only) and putting on success.
* leases: etcd leases. etcd's smallest TTL is 2 s here (it is derived from the
  election timeout) and TTLs are whole seconds: a requested TTL is rounded *up* to
  ``max(2 s, ceil(ttl))``; :attr:`Lease.ttl` is what etcd granted. A lapsed lease's
  keys vanish up to ~1.5 s after the TTL (etcd checks expiry periodically).
* watches: see [Note: resuming etcd watches].

[Note: etcd3 0.12 workarounds]
The package's high-level calls are awkward in three ways, so this module uses the
client only for its gRPC channel and stubs (``client.kvstub``, ``client.leasestub``)
and its protobuf messages (``etcd3.etcdrpc``):

1. its methods pass only a deadline, so a call made while the channel is reconnecting
   (just after an etcd restart) fails at once with UNAVAILABLE; we call the stubs with
   ``wait_for_ready=True``, which waits for the channel, bounded by the same deadline;
2. its ``Watcher`` re-opens the stream in a tight loop while etcd is down, drops the
   callbacks of every watch on an error and never resumes them, and cancels by
   queueing a request onto a stream that may be gone; we drive the bidirectional
   ``Watch`` RPC ourselves, one stream per watch, and cancel it with the gRPC call's
   own ``cancel()``;
3. gRPC errors other than four codes escape untranslated; we translate every
   ``grpc.RpcError`` into :class:`RegistryError` / :class:`RegistryTimeoutError`.

[Note: resuming etcd watches]
An :class:`EtcdWatch` runs its stream in a daemon thread and remembers the revision of
the last event it delivered. On any error or end of the stream (etcd restarted, the
connection dropped) it reconnects, with exponential backoff bounded by
:class:`WatchRetry`, and re-creates the watch at ``last revision + 1``. etcd sends
whole revisions in one response (we never ask for fragmented responses), so resuming
after the last delivered revision loses and repeats nothing. If etcd stays unreachable
longer than ``give_up_after``, or the revision to resume from was compacted, the
watch fails: :meth:`EtcdWatch.get` raises :class:`RegistryError`.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc

from comm.errors import RegistryError, RegistryTimeoutError
from comm.registry.base import EventType, KeyValue, Lease, Registry, Watch, WatchEvent

with warnings.catch_warnings():
    # etcd3 0.12's generated protobuf modules use descriptor calls that protobuf 3.20
    # deprecates; the warning is about etcd3's code, not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    import etcd3
    import etcd3.etcdrpc as etcdrpc

__all__ = ["DEFAULT_REQUEST_TIMEOUT", "MIN_TTL", "EtcdLease", "EtcdRegistry", "EtcdWatch", "WatchRetry"]

logger = logging.getLogger(__name__)

DEFAULT_REQUEST_TIMEOUT = timedelta(seconds=10)
MIN_TTL = timedelta(seconds=2)
"""etcd's smallest lease TTL with its default election timeout (1 s): 1.5 x 1 s, rounded up."""

_WATCH_QUEUE = 10_000  # events buffered per watch before the stream is back-pressured

# Reconnect quickly after an etcd restart (gRPC's own default backoff starts at 1 s and
# grows to 2 min); ping a silent connection every 10 s (etcd's default minimum is 5 s).
_GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


@dataclass(frozen=True, slots=True)
class WatchRetry:
    """How a broken watch stream is re-established.

    Attributes:
        initial: the wait before the first reconnect attempt; doubled after each failure.
        maximum: the longest wait between attempts.
        give_up_after: how long etcd may stay unreachable before the watch fails.
    """

    initial: timedelta = timedelta(milliseconds=50)
    maximum: timedelta = timedelta(seconds=1)
    give_up_after: timedelta = timedelta(seconds=60)


def _prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range for ``prefix``: the prefix with its last byte incremented.

    An empty prefix (every key) is the range ``[b"\\0", b"\\0")`` in etcd's convention.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


class EtcdLease(Lease):
    """An etcd lease; refresh sends one keep-alive, revoke revokes it (and deletes its keys)."""

    def __init__(self, registry: EtcdRegistry, lease_id: int, ttl: timedelta) -> None:
        super().__init__(lease_id, ttl)
        self._registry = registry

    def refresh(self) -> None:
        """Send one keep-alive.

        Raises:
            RegistryError: if etcd no longer knows the lease (it answers with TTL 0), or
                etcd is unreachable; RegistryTimeoutError after the request timeout.
        """
        self._registry._refresh_lease(self._id)

    def revoke(self) -> None:
        self._registry._revoke_lease(self._id)

    def __repr__(self) -> str:
        return f"EtcdLease(id={self._id:#x}, ttl={self._ttl.total_seconds()}s)"


class EtcdRegistry(Registry):
    """A :class:`Registry` over etcd at ``host:port``.

    Args:
        host: etcd's client address.
        port: etcd's client port.

    Keyword Args:
        request_timeout: the bound on every call (default 10 s), including the wait for
            a reconnecting channel.
        watch_retry: how watches reconnect after etcd restarts (see :class:`WatchRetry`).

    Creating the registry does not contact etcd (gRPC connects lazily); the first call
    to an unreachable etcd raises :class:`RegistryTimeoutError` after ``request_timeout``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 2379,
        *,
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        watch_retry: WatchRetry | None = None,
    ) -> None:
        if request_timeout <= timedelta(0):
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.endpoint = f"{host}:{port}"
        self.request_timeout = request_timeout
        self.watch_retry = watch_retry or WatchRetry()
        self._timeout = request_timeout.total_seconds()
        self._client: Any = etcd3.client(
            host=host, port=port, timeout=self._timeout, grpc_options=_GRPC_OPTIONS
        )
        self._kv: Any = self._client.kvstub
        self._leases: Any = self._client.leasestub
        self._watch_stub: Any = etcdrpc.WatchStub(self._client.channel)
        self._watches: weakref.WeakSet[EtcdWatch] = weakref.WeakSet()
        self._closed = False

    # -- calls -------------------------------------------------------------------------

    def _call_kwargs(self) -> dict[str, Any]:
        return {"metadata": self._client.metadata, "credentials": self._client.call_credentials}

    def _rpc(self, what: str, method: Callable[..., Any], request: Any) -> Any:
        """One unary call, waiting for a reconnecting channel (bounded by the timeout)."""
        if self._closed:
            raise RegistryError(f"etcd registry for {self.endpoint} is closed")
        try:
            return method(request, timeout=self._timeout, wait_for_ready=True, **self._call_kwargs())
        except grpc.RpcError as exc:
            raise self._translate(what, exc) from None

    def _translate(self, what: str, exc: grpc.RpcError) -> RegistryError:
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RegistryTimeoutError(
                f"etcd at {self.endpoint}: {what} did not complete within {self._timeout:.1f}s ({details})"
            )
        name = code.name if code is not None else type(exc).__name__
        return RegistryError(f"etcd at {self.endpoint}: {what} failed: {name}: {details}")

    # -- key-value ---------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        request = etcdrpc.PutRequest(key=key.encode(), value=value, lease=0 if lease is None else lease.id)
        response = self._rpc(f"put of {key!r}", self._kv.Put, request)
        return int(response.header.revision)

    def get(self, key: str) -> KeyValue | None:
        response = self._rpc(f"get of {key!r}", self._kv.Range, etcdrpc.RangeRequest(key=key.encode()))
        if not response.kvs:
            return None
        kv = response.kvs[0]
        return KeyValue(key, bytes(kv.value), int(kv.mod_revision))

    def delete(self, key: str) -> bool:
        request = etcdrpc.DeleteRangeRequest(key=key.encode())
        response = self._rpc(f"delete of {key!r}", self._kv.DeleteRange, request)
        return int(response.deleted) > 0

    def list(self, prefix: str) -> list[KeyValue]:
        raw = prefix.encode()
        request = etcdrpc.RangeRequest(
            key=raw or b"\0",
            range_end=_prefix_end(raw),
            sort_order=etcdrpc.RangeRequest.ASCEND,
            sort_target=etcdrpc.RangeRequest.KEY,
        )
        response = self._rpc(f"list of {prefix!r}", self._kv.Range, request)
        return [KeyValue(kv.key.decode(), bytes(kv.value), int(kv.mod_revision)) for kv in response.kvs]

    def compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: Lease | None = None
    ) -> bool:
        raw = key.encode()
        if expected is None:  # create-only: the key has no version, i.e. does not exist
            compare = etcdrpc.Compare(
                key=raw, target=etcdrpc.Compare.VERSION, result=etcdrpc.Compare.EQUAL, version=0
            )
        else:  # etcd fails a value comparison on a missing key, as the contract wants
            compare = etcdrpc.Compare(
                key=raw, target=etcdrpc.Compare.VALUE, result=etcdrpc.Compare.EQUAL, value=expected
            )
        put = etcdrpc.PutRequest(key=raw, value=value, lease=0 if lease is None else lease.id)
        request = etcdrpc.TxnRequest(compare=[compare], success=[etcdrpc.RequestOp(request_put=put)])
        response = self._rpc(f"compare-and-set of {key!r}", self._kv.Txn, request)
        return bool(response.succeeded)

    def revision(self) -> int:
        request = etcdrpc.RangeRequest(key=b"\0", count_only=True)
        return int(self._rpc("revision", self._kv.Range, request).header.revision)

    # -- leases ------------------------------------------------------------------------

    def lease(self, ttl: timedelta) -> EtcdLease:
        """Grant a lease of ``max(2 s, ceil(ttl))`` (etcd's minimum and granularity).

        Raises:
            ValueError: if ``ttl`` is not positive.
        """
        seconds = ttl.total_seconds()
        if seconds <= 0:
            raise ValueError(f"a lease needs a positive ttl, got {seconds}s")
        asked = max(int(MIN_TTL.total_seconds()), math.ceil(seconds))
        response = self._rpc("lease grant", self._leases.LeaseGrant, etcdrpc.LeaseGrantRequest(TTL=asked))
        if response.error:
            raise RegistryError(f"etcd at {self.endpoint}: lease grant failed: {response.error}")
        return EtcdLease(self, int(response.ID), timedelta(seconds=int(response.TTL)))

    def _refresh_lease(self, lease_id: int) -> None:
        what = f"refresh of lease {lease_id:#x}"
        if self._closed:
            raise RegistryError(f"etcd registry for {self.endpoint} is closed")
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)
        # A keep-alive is a stream; one request, one response, then we hang up.
        responses = self._leases.LeaseKeepAlive(
            iter([request]), timeout=self._timeout, wait_for_ready=True, **self._call_kwargs()
        )
        try:
            response = next(responses)
        except StopIteration:
            raise RegistryError(f"etcd at {self.endpoint}: {what}: no answer") from None
        except grpc.RpcError as exc:
            raise self._translate(what, exc) from None
        finally:
            responses.cancel()
        if int(response.TTL) <= 0:  # etcd's answer for a lease it does not know
            raise RegistryError(f"etcd at {self.endpoint}: lease {lease_id:#x} expired; grant a new one")

    def _revoke_lease(self, lease_id: int) -> None:
        what = f"revoke of lease {lease_id:#x}"
        if self._closed:
            raise RegistryError(f"etcd registry for {self.endpoint} is closed")
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)
        try:
            self._leases.LeaseRevoke(
                request, timeout=self._timeout, wait_for_ready=True, **self._call_kwargs()
            )
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: already revoked or expired
                raise self._translate(what, exc) from None

    # -- watches -----------------------------------------------------------------------

    def watch(self, prefix: str, *, start_revision: int | None = None) -> EtcdWatch:
        """Watch ``prefix``; see :meth:`Registry.watch` and [Note: resuming etcd watches].

        A compacted ``start_revision`` is reported by the first :meth:`EtcdWatch.get`.

        Raises:
            ValueError: if ``start_revision`` is below 1.
            RegistryError: if etcd is unreachable (the current revision is read first).
        """
        if start_revision is not None and start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        if start_revision is None:
            start_revision = self.revision() + 1
        watch = EtcdWatch(self, prefix, start_revision)
        self._watches.add(watch)
        return watch

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            watch.cancel()
        self._client.close()


class _WatchFailed(Exception):
    """The watch cannot continue (compacted revision): deliver the error and stop."""

    def __init__(self, error: RegistryError) -> None:
        super().__init__(str(error))
        self.error = error


class EtcdWatch(Watch):
    """An etcd watch that survives etcd restarts (see [Note: resuming etcd watches]).

    Attributes:
        reconnects: how many times the stream was re-established after a failure.
    """

    def __init__(self, registry: EtcdRegistry, prefix: str, start_revision: int) -> None:
        self._registry = registry
        self._prefix = prefix
        self._key = prefix.encode() or b"\0"
        self._range_end = _prefix_end(prefix.encode())
        self._next = start_revision  # the revision to (re)start the stream at
        self._retry = registry.watch_retry
        self._queue: queue.Queue[WatchEvent | RegistryError] = queue.Queue(maxsize=_WATCH_QUEUE)
        self._error: RegistryError | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._call: Any = None
        self._stream_done: threading.Event | None = None
        self._established_once = False
        self._failing_since: float | None = None
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name=f"etcd-watch-{prefix}", daemon=True)
        self._thread.start()

    def get(self, timeout: timedelta) -> WatchEvent | None:
        """The next event, or None if none arrived within ``timeout``.

        Raises:
            RegistryError: the watch was cancelled, its revision was compacted, or etcd
                stayed unreachable longer than ``WatchRetry.give_up_after``.
        """
        if self._error is not None:
            raise self._error
        if self._stop.is_set():
            raise RegistryError(f"the watch on {self._prefix!r} was cancelled")
        try:
            item = self._queue.get(timeout=max(0.0, timeout.total_seconds()))
        except queue.Empty:
            return None
        if isinstance(item, RegistryError):
            self._error = item
            raise item
        return item

    def cancel(self) -> None:
        """Stop the stream and its thread (bounded: 5 s). Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        with self._lock:
            call, done = self._call, self._stream_done
        if done is not None:
            done.set()
        if call is not None:
            call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    # -- the watch thread --------------------------------------------------------------

    def _run(self) -> None:
        backoff = self._retry.initial.total_seconds()
        while not self._stop.is_set():
            try:
                self._stream_once()
                reason = "the stream ended"
            except _WatchFailed as exc:
                self._deliver(exc.error)
                return
            except grpc.RpcError as exc:
                code = exc.code() if callable(getattr(exc, "code", None)) else None
                reason = f"{getattr(code, 'name', type(exc).__name__)}"
            except Exception as exc:  # anything else from gRPC: reconnect all the same
                reason = f"{type(exc).__name__}: {exc}"
            if self._stop.is_set():
                return
            now = time.monotonic()
            if self._failing_since is None:
                self._failing_since = now
                backoff = self._retry.initial.total_seconds()
                logger.warning(
                    "etcd watch on %r at %s lost (%s); resuming from revision %d",
                    self._prefix,
                    self._registry.endpoint,
                    reason,
                    self._next,
                )
            elif now - self._failing_since > self._retry.give_up_after.total_seconds():
                self._deliver(
                    RegistryError(
                        f"etcd watch on {self._prefix!r}: etcd at {self._registry.endpoint} unreachable "
                        f"for {self._retry.give_up_after.total_seconds():.0f}s (last: {reason}); "
                        f"the watch stopped before revision {self._next}"
                    )
                )
                return
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self._retry.maximum.total_seconds())

    def _stream_once(self) -> None:
        done = threading.Event()
        create = etcdrpc.WatchCreateRequest(
            key=self._key, range_end=self._range_end, start_revision=self._next
        )

        def requests() -> Iterator[Any]:
            yield etcdrpc.WatchRequest(create_request=create)
            done.wait()  # keep our side open until this stream attempt ends

        call = self._watch_stub_call(requests())
        with self._lock:
            self._call, self._stream_done = call, done
        try:
            if self._stop.is_set():
                return
            for response in call:
                self._on_response(response)
        finally:
            done.set()
            call.cancel()
            with self._lock:
                self._call = self._stream_done = None

    def _watch_stub_call(self, requests: Iterator[Any]) -> Any:
        # No deadline: the stream lives until cancel() or an error; no wait_for_ready, so
        # an unreachable etcd fails the attempt at once and the backoff loop paces retries.
        return self._registry._watch_stub.Watch(requests, **self._registry._call_kwargs())

    def _on_response(self, response: Any) -> None:
        if response.compact_revision:
            raise _WatchFailed(
                RegistryError(
                    f"etcd watch on {self._prefix!r}: revision {self._next} is compacted "
                    f"(etcd keeps revisions from {response.compact_revision}); re-read with list() "
                    "and watch from revision() + 1"
                )
            )
        if response.created:
            if self._established_once:
                self.reconnects += 1
                logger.info("etcd watch on %r re-established at revision %d", self._prefix, self._next)
            self._established_once = True
            self._failing_since = None
        if response.canceled:
            raise RuntimeError(f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}")
        for event in response.events:
            kv = event.kv
            deleted = event.type == etcdrpc.kv_pb2.Event.DELETE
            self._deliver(
                WatchEvent(
                    EventType.DELETE if deleted else EventType.PUT,
                    kv.key.decode(),
                    b"" if deleted else bytes(kv.value),
                    int(kv.mod_revision),
                )
            )
            self._next = int(kv.mod_revision) + 1

    def _deliver(self, item: WatchEvent | RegistryError) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:  # the consumer is behind: hold the stream (gRPC flow control)
                continue
