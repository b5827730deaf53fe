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
* watches: :class:`~comm.registry.etcd_watch.EtcdWatch`, see [Note: resuming etcd watches]
  in ``comm/registry/etcd_watch.py``.

How the package's client is used: [Note: etcd3 0.12 workarounds] in ``comm/registry/etcd_grpc.py``;
TLS, client certificates and users: [Note: etcd TLS and users] there and
``comm/registry/etcd_options.py``.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import grpc

from comm.errors import LeaseExpiredError, RegistryError, RegistryTimeoutError
from comm.registry.base import KeyValue, Lease, Registry
from comm.registry.etcd_grpc import (
    EtcdLogin,
    TokenCheckedStream,
    etcdrpc,
    open_client,
    prefix_end,
    status_name,
)
from comm.registry.etcd_options import EtcdOptions
from comm.registry.etcd_watch import EtcdWatch, WatchRetry

__all__ = ["DEFAULT_REQUEST_TIMEOUT", "MIN_TTL", "REVISION_RANGE", "EtcdLease", "EtcdRegistry"]

DEFAULT_REQUEST_TIMEOUT = timedelta(seconds=10)
REVISION_RANGE = b"/cellmesh/"
"""The keys :meth:`EtcdRegistry.revision` counts: every cellmesh key is under them."""
MIN_TTL = timedelta(seconds=2)
"""etcd's smallest lease TTL with its default election timeout (1 s): 1.5 x 1 s, rounded up."""



class EtcdLease(Lease):
    """An etcd lease; refresh sends one keep-alive, revoke revokes it (and deletes its keys)."""

    def __init__(self, registry: EtcdRegistry, lease_id: int, ttl: timedelta) -> None:
        super().__init__(lease_id, ttl)
        self._registry = registry

    def refresh(self) -> None:
        """Send one keep-alive.

        Raises:
            LeaseExpiredError: if etcd no longer knows the lease (it answers with TTL 0).
            RegistryError: if etcd is unreachable; RegistryTimeoutError after the request timeout.
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
        options: TLS files and the user to log in as (:class:`EtcdOptions`; default: plain, no login).

    Creating the registry does not contact etcd (gRPC connects lazily, and a user logs in
    on the first call); the first call to an unreachable etcd raises
    :class:`RegistryTimeoutError` after ``request_timeout``.

    Raises:
        ValueError: ``request_timeout`` is not positive, or a TLS file cannot be read.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 2379,
        *,
        request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT,
        watch_retry: WatchRetry | None = None,
        options: EtcdOptions | None = None,
    ) -> None:
        if request_timeout <= timedelta(0):
            raise ValueError(f"request_timeout must be positive, got {request_timeout}")
        self.endpoint = f"{host}:{port}"
        self.request_timeout = request_timeout
        self.watch_retry = watch_retry or WatchRetry()
        self._timeout = request_timeout.total_seconds()
        self.options = options or EtcdOptions()
        self._client: Any = open_client(host, port, self.options, self._timeout)
        self._login = EtcdLogin(self._client.channel, self.endpoint, self.options, self._timeout)
        self._kv: Any = self._client.kvstub
        self._leases: Any = self._client.leasestub
        self._watch_stub: Any = etcdrpc.WatchStub(self._client.channel)
        self._watches: weakref.WeakSet[EtcdWatch] = weakref.WeakSet()
        self._closed = False

    # -- calls -------------------------------------------------------------------------

    def _logged_in(self, what: str, call: Callable[[Any], Any]) -> Any:
        """``call(metadata)`` with the user's token; once more after a new login if etcd refused the token."""
        if self._closed:
            raise RegistryError(f"etcd registry for {self.endpoint} is closed")
        metadata = self._login.metadata()
        try:
            return call(metadata)
        except grpc.RpcError as exc:
            if status_name(exc)[0] != grpc.StatusCode.UNAUTHENTICATED or not self._login.forget(metadata):
                raise self._translate(what, exc) from None
        try:  # etcd restarted or the token expired: log in again, once
            return call(self._login.metadata())
        except grpc.RpcError as exc:
            raise self._translate(what, exc) from None

    def _rpc(self, what: str, method: Callable[..., Any], request: Any) -> Any:
        """One unary call, waiting for a reconnecting channel (bounded by the timeout)."""
        timeout = self._timeout
        return self._logged_in(
            what, lambda metadata: method(request, timeout=timeout, wait_for_ready=True, metadata=metadata)
        )

    def _translate(self, what: str, exc: grpc.RpcError) -> RegistryError:
        code, name = status_name(exc)
        details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return RegistryTimeoutError(
                f"etcd at {self.endpoint}: {what} did not complete within {self._timeout:.1f}s ({details})"
            )
        if code == grpc.StatusCode.NOT_FOUND and "lease not found" in str(details):  # a put with a dead lease
            return LeaseExpiredError(f"etcd at {self.endpoint}: {what} failed: {details}; grant a new lease")
        hint = ""
        if code == grpc.StatusCode.PERMISSION_DENIED:
            hint = (f" (connected with {self.options.describe()}: grant that etcd user a role with readwrite "
                    "on the job's keys, /cellmesh/)")
        return RegistryError(f"etcd at {self.endpoint}: {what} failed: {name}: {details}{hint}")

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
            range_end=prefix_end(raw),
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
        """The store's revision (a linearizable read).

        Any range's header carries it; this one counts ``/cellmesh/``, which a job's etcd user
        may read (docs/security.md), where the range of every key needs etcd's root.
        """
        request = etcdrpc.RangeRequest(
            key=REVISION_RANGE, range_end=prefix_end(REVISION_RANGE), count_only=True
        )
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
        request = etcdrpc.LeaseKeepAliveRequest(ID=lease_id)

        def keep_alive(metadata: Any) -> Any:
            # A keep-alive is a stream; one request, one response, then we hang up.
            responses = self._leases.LeaseKeepAlive(
                iter([request]), timeout=self._timeout, wait_for_ready=True, metadata=metadata
            )
            try:
                return next(responses, None)
            finally:
                responses.cancel()

        response = self._logged_in(what, keep_alive)
        if response is None:
            raise RegistryError(f"etcd at {self.endpoint}: {what}: no answer")
        if int(response.TTL) <= 0:  # etcd's answer for a lease it does not know
            raise LeaseExpiredError(f"etcd at {self.endpoint}: lease {lease_id:#x} expired; grant a new one")

    def _revoke_lease(self, lease_id: int) -> None:
        what = f"revoke of lease {lease_id:#x}"
        request = etcdrpc.LeaseRevokeRequest(ID=lease_id)

        def revoke(metadata: Any) -> None:
            try:
                self._leases.LeaseRevoke(
                    request, timeout=self._timeout, wait_for_ready=True, metadata=metadata
                )
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.NOT_FOUND:  # NOT_FOUND: already revoked or expired
                    raise

        self._logged_in(what, revoke)

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
        watch = EtcdWatch(self._open_watch_stream, self.endpoint, prefix, start_revision, self.watch_retry)
        self._watches.add(watch)
        return watch

    def _open_watch_stream(self, requests: Iterator[Any]) -> Any:
        """One ``Watch`` RPC; see :class:`EtcdWatch` for why it has no deadline.

        Logging in here may raise; the watch's reconnect loop then paces the next attempt.
        """
        metadata = self._login.metadata()
        return TokenCheckedStream(self._watch_stub.Watch(requests, metadata=metadata), self._login, metadata)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for watch in list(self._watches):
            watch.cancel()
        self._client.close()

