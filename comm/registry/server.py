"""Serve a :class:`MemoryRegistry` over ZeroMQ so other local processes can use it.

The coordinator runs one :class:`RegistryServer`; workers connect to its address with
:class:`comm.registry.remote.RemoteRegistry`. One ROUTER socket, one background
thread. Each request (a single frame, see :mod:`comm.registry.protocol`) is validated
before it is acted on; a malformed one gets a logged error and an ``error`` reply
naming the field and the reason, and the server keeps serving.

Watches are long polls: a ``watch_poll`` with nothing to report yet is *parked* until
an event under its prefix arrives (the registry's listener wakes the server thread
through a pipe) or its ``wait_ms`` passes, then answered.

Synchronization::

    client threads         server thread                      registry writers
    --------------         -------------                      ----------------
    DEALER --request-->    ROUTER recv -> validate -> handle
                           (watch_poll with no events: park)
                                                               put() -> listener -> pipe
                           poll(ROUTER, pipe) wakes
                           answer parked polls with events
    DEALER <--reply---     ROUTER send
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import zmq
from pydantic import BaseModel

from comm.codec import pack
from comm.errors import ProtocolError, RegistryError
from comm.registry.memory import MemoryRegistry
from comm.registry.protocol import (
    BadMessage,
    BoolReply,
    CasRequest,
    DeleteRequest,
    ErrorReply,
    EventMsg,
    EventsReply,
    GetReply,
    GetRequest,
    KeyValueMsg,
    LeaseGrantRequest,
    LeaseRefreshRequest,
    LeaseReply,
    LeaseRevokeRequest,
    ListReply,
    ListRequest,
    OkReply,
    PutRequest,
    Request,
    RevisionReply,
    RevisionRequest,
    WatchPollRequest,
    decode_request,
)
from comm.sockets import bind_port, make_socket

__all__ = ["DEFAULT_SHUTDOWN_TIMEOUT", "MAX_PARKED_POLLS", "RegistryServer"]

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT = timedelta(seconds=5)
MAX_PARKED_POLLS = 10_000
"""Watch polls waiting at once; beyond it a poll is answered at once with no events."""
_MAX_BATCH = 256  # requests handled per wake-up before parked polls get a turn


@dataclass(slots=True)
class _Parked:
    identity: bytes
    request: WatchPollRequest
    deadline: float  # time.monotonic()


class RegistryServer:
    """A ROUTER socket on loopback answering registry requests from a background thread.

    Args:
        registry: the registry to serve; a new :class:`MemoryRegistry` when None (and
            then the server closes it on shutdown).
        host: the interface to bind (:func:`comm.sockets.default_host` by default).

    Lifecycle: ``start()`` binds and starts serving, ``address`` is where clients
    connect, ``shutdown(timeout)`` stops the thread and closes the socket. Also a
    context manager (start on enter, shutdown on exit).
    """

    def __init__(self, registry: MemoryRegistry | None = None, host: str | None = None) -> None:
        self._owns_registry = registry is None
        self._registry = registry if registry is not None else MemoryRegistry()
        self._host = host
        self._address: str | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._wake_r = self._wake_w = -1  # a pipe that wakes the server thread (made by start)
        self._unsubscribe: Callable[[], None] | None = None
        self._parked: list[_Parked] = []

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
        if self._address is None:
            raise RuntimeError("RegistryServer.address: call start() first")
        return self._address

    def start(self) -> RegistryServer:
        """Bind a free loopback port and serve from a daemon thread; returns self.

        Raises:
            RuntimeError: if already started.
        """
        if self._thread is not None:
            raise RuntimeError("RegistryServer.start: already started")
        sock = make_socket(zmq.ROUTER)
        try:
            self._address = bind_port(sock, self._host)
        except Exception:
            sock.close(linger=0)
            raise
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._unsubscribe = self._registry.subscribe(self._on_change)
        # The socket moves to the server thread here and is used and closed only there.
        self._thread = threading.Thread(
            target=self._serve, args=(sock,), name=f"registry-server-{self._address}", daemon=True
        )
        self._thread.start()
        logger.info("registry server listening on %s", self._address)
        return self

    def shutdown(self, timeout: timedelta = DEFAULT_SHUTDOWN_TIMEOUT) -> None:
        """Stop serving and release the socket (and the registry, if the server made it).

        Idempotent. Parked watch polls are dropped (their clients time out or retry).

        Raises:
            RegistryError: if the server thread did not stop within ``timeout``.
        """
        thread = self._thread
        if thread is None or self._stopping.is_set():
            return
        self._stopping.set()
        self._wake()
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None
        thread.join(timeout.total_seconds())
        if thread.is_alive():
            raise RegistryError(
                f"registry server at {self._address} did not stop within {timeout.total_seconds():.1f}s"
            )
        os.close(self._wake_r)
        os.close(self._wake_w)
        if self._owns_registry:
            self._registry.close()
        logger.info("registry server at %s stopped", self._address)

    def __enter__(self) -> RegistryServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- the server thread -------------------------------------------------------------

    def _on_change(self, revision: int) -> None:
        # Runs on a writer's thread under the registry lock: one non-blocking byte.
        if self._parked:
            self._wake()

    def _wake(self) -> None:
        # A full pipe means a wake-up is already pending; a closed one, that we shut down.
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"\0")

    def _serve(self, sock: zmq.Socket[bytes]) -> None:
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                ready = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake_r in ready:
                    self._drain_wake_pipe()
                if sock in ready:
                    self._receive_batch(sock)
                self._answer_parked(sock)
        except Exception:  # pragma: no cover - a bug; clients will time out
            logger.exception("registry server at %s crashed", self._address)
        finally:
            sock.close(linger=0)

    def _poll_timeout_ms(self) -> int:
        if not self._parked:
            return 1000
        soonest = min(p.deadline for p in self._parked)
        return max(0, min(1000, int((soonest - time.monotonic()) * 1000) + 1))

    def _drain_wake_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._wake_r, 4096):
                pass

    def _receive_batch(self, sock: zmq.Socket[bytes]) -> None:
        for _ in range(_MAX_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            reply = self._handle_frames(identity, body)
            if reply is not None:
                self._send(sock, identity, reply)

    def _handle_frames(self, identity: bytes, body: list[bytes]) -> BaseModel | None:
        if len(body) != 1:
            logger.error(
                "registry server %s: bad request from %r: expected 1 frame after the identity, got %d",
                self._address,
                identity,
                len(body),
            )
            return ErrorReply(
                id=None,
                kind="protocol",
                message=f"registry request: expected exactly 1 frame, got {len(body)}",
            )
        try:
            request = decode_request(body[0])
        except BadMessage as exc:
            logger.error("registry server %s: bad request from %r: %s", self._address, identity, exc)
            return ErrorReply(id=exc.request_id, kind="protocol", message=str(exc))
        try:
            return self._handle(identity, request)
        except RegistryError as exc:
            return ErrorReply(id=request.id, kind="registry", message=str(exc))
        except ProtocolError as exc:
            return ErrorReply(id=request.id, kind="protocol", message=str(exc))
        except ValueError as exc:
            return ErrorReply(id=request.id, kind="value", message=str(exc))
        except Exception as exc:
            logger.exception("registry server %s: %s request failed", self._address, request.type)
            return ErrorReply(id=request.id, kind="internal", message=f"{type(exc).__name__}: {exc}")

    def _handle(self, identity: bytes, request: Request) -> BaseModel | None:
        reg = self._registry
        if isinstance(request, PutRequest):
            lease = None if request.lease is None else reg.lease_handle(request.lease)
            return RevisionReply(id=request.id, revision=reg.put(request.key, request.value, lease=lease))
        if isinstance(request, GetRequest):
            kv = reg.get(request.key)
            return GetReply(id=request.id, kv=None if kv is None else KeyValueMsg.of(kv))
        if isinstance(request, DeleteRequest):
            return BoolReply(id=request.id, value=reg.delete(request.key))
        if isinstance(request, ListRequest):
            return ListReply(id=request.id, items=[KeyValueMsg.of(kv) for kv in reg.list(request.prefix)])
        if isinstance(request, CasRequest):
            lease = None if request.lease is None else reg.lease_handle(request.lease)
            written = reg.compare_and_set(request.key, request.expected, request.value, lease=lease)
            return BoolReply(id=request.id, value=written)
        if isinstance(request, LeaseGrantRequest):
            granted = reg.lease(timedelta(milliseconds=request.ttl_ms))
            ttl_ms = round(granted.ttl.total_seconds() * 1000)
            return LeaseReply(id=request.id, lease=granted.id, ttl_ms=ttl_ms)
        if isinstance(request, LeaseRefreshRequest):
            reg.refresh_lease(request.lease)
            return OkReply(id=request.id)
        if isinstance(request, LeaseRevokeRequest):
            reg.revoke_lease(request.lease)
            return OkReply(id=request.id)
        if isinstance(request, RevisionRequest):
            return RevisionReply(id=request.id, revision=reg.revision())
        # The last kind left: a watch poll. Answer now if there is something to say, else
        # park it; _answer_parked re-checks it right after this batch, so an event committed
        # between this read and the parking is not missed.
        reply = self._poll_once(request)
        if reply.events or request.wait_ms == 0 or len(self._parked) >= MAX_PARKED_POLLS:
            return reply
        deadline = time.monotonic() + request.wait_ms / 1000
        self._parked.append(_Parked(identity, request, deadline))
        return None

    def _poll_once(self, request: WatchPollRequest) -> EventsReply:
        events, through = self._registry.events_since(
            request.prefix, request.from_revision, timeout=timedelta(0), limit=request.limit
        )
        return EventsReply(id=request.id, events=[EventMsg.of(e) for e in events], revision=through)

    def _answer_parked(self, sock: zmq.Socket[bytes]) -> None:
        if not self._parked:
            return
        now = time.monotonic()
        still: list[_Parked] = []
        for parked in self._parked:
            reply: BaseModel
            try:
                reply = self._poll_once(parked.request)
            except RegistryError as exc:  # compacted, or the registry closed
                reply = ErrorReply(id=parked.request.id, kind="registry", message=str(exc))
            if isinstance(reply, EventsReply) and not reply.events and parked.deadline > now:
                still.append(parked)
            else:
                self._send(sock, parked.identity, reply)
        self._parked = still

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, reply: BaseModel) -> None:
        try:
            sock.send_multipart([identity, pack(reply)], zmq.NOBLOCK)
        except zmq.Again:  # the client's queue is full or it is gone: it will time out
            logger.warning(
                "registry server %s: dropped a reply to %r (peer not reading)", self._address, identity
            )
