"""Serve a :class:`MemoryRegistry` to other local processes: the ``registry`` service of a service host.

The coordinator runs one :class:`RegistryServer` (a :class:`~comm.rpc.host.ServiceHost` with
a :class:`RegistryService` on it); workers connect to its address with
:class:`comm.registry.remote.RemoteRegistry`. A process that already has a host may add a
:class:`RegistryService` to it instead. The host validates every request before the
service sees it (:mod:`comm.rpc.host`): a malformed one gets a logged ``bad_request`` error
reply naming the field and the reason, and the host keeps serving.

Watches are long polls: a ``watch_poll`` with nothing to report yet is *parked* (a deferred
call of the host) until an event under its prefix arrives or its ``wait_ms`` passes, then
answered. At most ``max_parked`` polls wait at once; beyond that a poll is answered at once.

A re-check reads the keys changed since the last one once, and polls again only the parked polls
whose prefix one of them is under. (Polling every parked poll on every change cost parked polls x
events since each one's cursor per write: with a watch per pipeline rank, the rendezvous of 64
pipelines of 4 starved this thread past its callers' 10 s bounds, and the workers' leases lapsed.)

Synchronization::

    clients                host thread                              registry writers
    -------                -----------                              ----------------
    watch_poll  -->        validate -> poll once: nothing -> park
                                                                    put() -> listener
                           (mailbox) <-- call_soon(recheck) -------/
                           recheck: answer parked polls with events
                <-- reply
"""

from __future__ import annotations

import logging
from datetime import timedelta

from comm.errors import LeaseExpiredError, ProtocolError, RegistryError
from comm.registry.memory import MemoryRegistry
from comm.registry.protocol import (
    SERVICE,
    BoolReply,
    CasRequest,
    DeleteRequest,
    EventMsg,
    EventsReply,
    GetReply,
    GetRequest,
    KeyValueMsg,
    LeaseGrantRequest,
    LeaseReply,
    LeaseRequest,
    ListReply,
    ListRequest,
    PutRequest,
    RevisionReply,
    WatchPollRequest,
)
from comm.rpc import Call, Empty, ServiceBase, ServiceHost, callable_by

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "MAX_PARKED_POLLS", "RegistryServer", "RegistryService"]

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = timedelta(seconds=5)
MAX_PARKED_POLLS = 10_000
"""Watch polls waiting at once; beyond it a poll is answered at once with no events."""


class RegistryService(ServiceBase):
    """The ``registry`` service: a :class:`MemoryRegistry`'s operations as RPC methods.

    Args:
        registry: the registry to serve (the service never closes it).
        host: the host it is added to (parked polls are re-checked on its thread).
        max_parked: the most watch polls parked at once.
    """

    error_codes = ((ProtocolError, "bad_request"), (LeaseExpiredError, "lease_expired"),
                   (RegistryError, "registry"), (ValueError, "value"))

    def __init__(self, registry: MemoryRegistry, host: ServiceHost, *,
                 max_parked: int = MAX_PARKED_POLLS) -> None:
        self._registry = registry
        self._host = host
        self._max_parked = max_parked
        self._parked: dict[Call, WatchPollRequest] = {}  # host thread only
        self._recheck_queued = False
        self._rechecked = registry.revision()  # the revision the last re-check covered
        self._unsubscribe = registry.subscribe(self._on_change)
        # leases lapse only up to what this host has read: [Note: leases of a stalled server]
        self._detach = registry.attach_server(host.read_up_to, host.wake)

    @property
    def parked(self) -> int:
        """Watch polls waiting now."""
        return len(self._parked)

    @callable_by("coordinator", "worker")
    def rpc_put(self, request: PutRequest, call: Call) -> RevisionReply:
        lease = None if request.lease is None else self._registry.lease_handle(request.lease)
        return RevisionReply(revision=self._registry.put(request.key, request.value, lease=lease))

    @callable_by("coordinator", "worker")
    def rpc_get(self, request: GetRequest, call: Call) -> GetReply:
        kv = self._registry.get(request.key)
        return GetReply(kv=None if kv is None else KeyValueMsg.of(kv))

    @callable_by("coordinator", "worker")
    def rpc_delete(self, request: DeleteRequest, call: Call) -> BoolReply:
        return BoolReply(value=self._registry.delete(request.key))

    @callable_by("coordinator", "worker")
    def rpc_list(self, request: ListRequest, call: Call) -> ListReply:
        return ListReply(items=[KeyValueMsg.of(kv) for kv in self._registry.list(request.prefix)])

    @callable_by("coordinator", "worker")
    def rpc_cas(self, request: CasRequest, call: Call) -> BoolReply:
        lease = None if request.lease is None else self._registry.lease_handle(request.lease)
        written = self._registry.compare_and_set(request.key, request.expected, request.value, lease=lease)
        return BoolReply(value=written)

    @callable_by("coordinator", "worker")
    def rpc_lease_grant(self, request: LeaseGrantRequest, call: Call) -> LeaseReply:
        granted = self._registry.lease(timedelta(milliseconds=request.ttl_ms))
        return LeaseReply(lease=granted.id, ttl_ms=round(granted.ttl.total_seconds() * 1000))

    @callable_by("coordinator", "worker")
    def rpc_lease_refresh(self, request: LeaseRequest, call: Call) -> Empty:
        self._registry.refresh_lease(request.lease)
        return Empty()

    @callable_by("coordinator", "worker")
    def rpc_lease_revoke(self, request: LeaseRequest, call: Call) -> Empty:
        self._registry.revoke_lease(request.lease)
        return Empty()

    @callable_by("coordinator", "worker")
    def rpc_revision(self, request: Empty, call: Call) -> RevisionReply:
        return RevisionReply(revision=self._registry.revision())

    @callable_by("coordinator", "worker")
    def rpc_watch_poll(self, request: WatchPollRequest, call: Call) -> EventsReply | None:
        """Answer now if there is something to say (or nothing to wait for), else park the poll.

        A change committed after this poll's read queues a re-check that runs after this
        handler on the host thread, so it is never missed between the read and the parking.
        """
        reply = self._poll_once(request)
        if reply.events or request.wait_ms == 0 or len(self._parked) >= self._max_parked:
            return reply
        self._parked[call] = request

        def on_timeout() -> EventsReply | tuple[str, str]:
            self._parked.pop(call, None)
            try:
                return self._poll_once(request)
            except RegistryError as exc:
                return "registry", str(exc)

        call.defer(timedelta(milliseconds=request.wait_ms), on_timeout)
        return None

    def on_close(self) -> None:
        self._detach()
        self._unsubscribe()
        self._parked.clear()

    def _poll_once(self, request: WatchPollRequest) -> EventsReply:
        events, through = self._registry.events_since(
            request.prefix, request.from_revision, timeout=timedelta(0), limit=request.limit
        )
        return EventsReply(events=[EventMsg.of(e) for e in events], revision=through)

    def _on_change(self, revision: int) -> None:
        # On a writer's thread under the registry's lock: only queue (once) a re-check.
        if not self._recheck_queued:
            self._recheck_queued = True
            self._host.call_soon(self._recheck)

    def _changed_keys(self) -> set[str] | None:
        """The keys changed since the last re-check (None: not known, the history was compacted)."""
        keys: set[str] = set()
        try:
            while True:
                events, through = self._registry.events_since("", self._rechecked + 1, timeout=timedelta(0))
                keys.update(e.key for e in events)
                if not events or through <= self._rechecked:
                    return keys
                self._rechecked = through
        except RegistryError:
            self._rechecked = self._registry.revision()
            return None

    def _recheck(self) -> None:
        """Answer the parked polls that now have events (on the host thread)."""
        self._recheck_queued = False  # first: a change committed from here on queues another
        keys = self._changed_keys()
        if keys is not None:
            prefixes = {request.prefix for request in self._parked.values()}
            touched = {p for p in prefixes if any(k.startswith(p) for k in keys)}
        for call, request in list(self._parked.items()):
            if keys is not None and request.prefix not in touched:
                continue
            try:
                reply = self._poll_once(request)
            except RegistryError as exc:  # compacted, or the registry closed
                del self._parked[call]
                call.fail("registry", str(exc))
                continue
            if reply.events:
                del self._parked[call]
                call.reply(reply)


class RegistryServer:
    """A :class:`MemoryRegistry` served as the ``registry`` service of a host of its own.

    Args:
        registry: the registry to serve; a new :class:`MemoryRegistry` when None (and
            then the server closes it on shutdown).
        host: the interface to bind (:func:`comm.sockets.default_host` by default).

    Lifecycle: ``start()`` binds and starts serving, ``address`` is where clients
    connect, ``shutdown(timeout)`` stops the host. Also a context manager (start on
    enter, shutdown on exit).
    """

    def __init__(self, registry: MemoryRegistry | None = None, host: str | None = None) -> None:
        self._owns_registry = registry is None
        self._registry = registry if registry is not None else MemoryRegistry()
        self._bind = host
        self._host: ServiceHost | None = None
        self._stopped = False

    @property
    def registry(self) -> MemoryRegistry:
        """The served registry (the coordinator may use it directly, in process)."""
        return self._registry

    @property
    def address(self) -> str:
        """``tcp://host:port``, once started.

        Raises:
            RuntimeError: if the server was not started.
        """
        if self._host is None:
            raise RuntimeError("RegistryServer.address: call start() first")
        return self._host.address

    def start(self) -> RegistryServer:
        """Bind a free port and serve from the host's thread; returns self.

        Raises:
            RuntimeError: if already started.
        """
        if self._host is not None:
            raise RuntimeError("RegistryServer.start: already started")
        host = ServiceHost(self._bind)
        host.add(SERVICE, RegistryService(self._registry, host))
        self._host = host.start()
        logger.info("registry server listening on %s", host.address)
        return self

    def shutdown(self, timeout: timedelta = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Stop serving and release the socket (and the registry, if the server made it).

        Idempotent. Parked watch polls are dropped (their clients time out or retry).

        Raises:
            RegistryError: if the host's thread did not stop within ``timeout``.
        """
        if self._host is None or self._stopped:
            return
        try:
            self._host.shutdown(timeout)
        except TimeoutError as exc:
            raise RegistryError(f"registry server at {self._host.address}: {exc}") from None
        self._stopped = True
        if self._owns_registry:
            self._registry.close()
        logger.info("registry server at %s stopped", self._host.address)

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
