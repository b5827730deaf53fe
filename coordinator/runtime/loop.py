"""The coordinator's event loop: service replies and membership changes, from one ZeroMQ poller.

Two kinds of source feed one stream of :data:`Event` s:

* the workers' service hosts: one DEALER socket per worker; requests go out at once
  (:meth:`EventLoop.send` never waits) and each reply becomes a :class:`Reply` event,
  validated against the type the request expects;
* the registry: a watch on ``/cellmesh/{job}/workers/`` turns a new card into
  :class:`WorkerJoined` and a vanished one (drained, or its lease lapsed because the
  process died) into :class:`WorkerLost`. The watch runs on a thread that posts events
  to the poller through an inproc socket, so the loop sleeps in exactly one place:
  ``zmq.Poller.poll`` bounded by the caller's deadline.

:meth:`EventLoop.next_event` is the only way to wait; the runtime decides what an event
means (``coordinator/runtime/driver.py``). Use from one thread (the watch thread only posts).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import msgpack
import torch
import zmq
from pydantic import BaseModel, ValidationError

from comm.codec import PROTOCOL_VERSION, pack, unpack, unpack_raw
from comm.errors import ProtocolError
from comm.registry.base import EventType, Registry
from comm.rpc.service import decode_tensors, encode_tensors
from comm.sockets import make_socket
from services.protocol import ReplyEnvelope, RequestEnvelope, WorkerCard

__all__ = ["Event", "EventLoop", "Reply", "WorkerJoined", "WorkerLost"]

log = logging.getLogger(__name__)

_WATCH_POLL = timedelta(seconds=0.25)  # how often the watch thread checks for close()
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)  # plain ints: no enum objects on the hot path


@dataclass(frozen=True)
class WorkerJoined:
    """A worker's card appeared (or changed) in the registry."""

    name: str
    card: WorkerCard
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class WorkerLost:
    """A worker's card vanished: it drained, or its process died and its lease lapsed."""

    name: str
    at: float = field(default_factory=time.time)


@dataclass(frozen=True)
class Reply:
    """A service's answer to request ``id``: ``body`` if ``ok``, else ``code`` and ``message``."""

    id: int
    worker: str
    service: str
    method: str
    ok: bool
    body: Any = None
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    code: str = ""
    message: str = ""
    sent: float = 0.0
    received: float = field(default_factory=time.time)


Event = WorkerJoined | WorkerLost | Reply


@dataclass(frozen=True)
class _Request:
    worker: str
    service: str
    method: str
    reply_type: type[BaseModel]
    sent: float


class EventLoop:
    """One poller over the workers' DEALER sockets and the registry watch (see the module docstring).

    Args:
        registry: Where the workers' cards live.
        job: The job's name.

    Attributes:
        members: The cards of the workers currently registered.
        poll_seconds: Seconds spent waiting in the poller so far.
    """

    def __init__(self, registry: Registry, job: str) -> None:
        self.registry = registry
        self.job = job
        self.prefix = f"/cellmesh/{job}/workers/"
        self.members: dict[str, WorkerCard] = {}
        self.poll_seconds = 0.0  # time spent waiting in the poller (the rest is the coordinator's work)
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._worker_of: dict[zmq.Socket[bytes], str] = {}
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._posted: deque[Event] = deque()
        self._ready: deque[Event] = deque()
        wake = f"inproc://coordinator-loop-{id(self)}"
        self._wake_in = make_socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = make_socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()
        self._poller.register(self._wake_in, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> EventLoop:
        """Read the current members, then watch for changes from the next revision on."""
        revision = self.registry.revision()
        for kv in self.registry.list(self.prefix):
            card = unpack(kv.value, WorkerCard)
            self.members[card.name] = card
        self._thread = threading.Thread(target=self._watch, args=(revision + 1,), daemon=True,
                                        name=f"coordinator-watch-{self.job}")
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the watch and close every socket. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * _WATCH_POLL.total_seconds() + 1)
        for sock in [*self._socks.values(), self._wake_in, self._wake_out]:
            sock.close()
        self._socks.clear()

    def __enter__(self) -> EventLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self, start_revision: int) -> None:
        try:
            with self.registry.watch(self.prefix, start_revision=start_revision) as watch:
                while not self._stop.is_set():
                    event = watch.get(_WATCH_POLL)
                    if event is None:
                        continue
                    name = event.key.removeprefix(self.prefix)
                    if event.type is EventType.DELETE:
                        self._post(WorkerLost(name))
                    else:
                        self._post(WorkerJoined(name, unpack(event.value, WorkerCard)))
        except Exception:
            if not self._stop.is_set():
                log.exception("[coordinator %s] the registry watch failed", self.job)

    def _post(self, event: Event) -> None:
        self._posted.append(event)
        with self._wake_lock, contextlib.suppress(zmq.Again, zmq.ZMQError):
            self._wake_out.send(b"", zmq.NOBLOCK)

    # -- requests -----------------------------------------------------------------------

    def connect(self, worker: str, address: str) -> None:
        """Open (once) the connection to ``worker``'s service host at ``address``."""
        if worker in self._socks:
            return
        sock = make_socket(zmq.DEALER)
        sock.connect(address)
        self._socks[worker] = sock
        self._worker_of[sock] = worker
        self._poller.register(sock, zmq.POLLIN)

    def send(self, worker: str, service: str, method: str, request: BaseModel | Mapping[str, Any],
             reply_type: type[BaseModel], *, tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> int:
        """Send ``request`` to ``service.method`` on ``worker``; its answer arrives as a :class:`Reply`.

        ``request`` is a message, or a message already dumped (``model_dump(mode="python")``),
        which a caller sending the same large parts every step can build from cached pieces;
        the service validates it either way.

        Returns:
            The request id (``Reply.id``).

        Raises:
            KeyError: ``worker`` is not connected.
        """
        sock = self._socks[worker]
        request_id = next(self._ids)
        body = request.model_dump(mode="python") if isinstance(request, BaseModel) else dict(request)
        if tensors:
            specs, frames = encode_tensors(tensors)
            envelope = RequestEnvelope(id=request_id, service=service, method=method, body=body,
                                       tensors=specs)
            sock.send_multipart([pack(envelope), *frames], copy=True)
        else:  # the envelope's fields as RequestEnvelope dumps them, without building one
            sock.send(msgpack.packb({"id": request_id, "service": service, "method": method, "body": body,
                                     "tensors": [], "v": PROTOCOL_VERSION}, use_bin_type=True), copy=True)
        self._requests[request_id] = _Request(worker, service, method, reply_type, time.time())
        return request_id

    def forget(self, request_id: int) -> None:
        """Drop a request whose answer no longer matters (a late reply is then ignored)."""
        self._requests.pop(request_id, None)

    # -- events -------------------------------------------------------------------------

    def next_event(self, timeout: timedelta) -> Event | None:
        """The next event, or None if none came within ``timeout``."""
        deadline = time.monotonic() + timeout.total_seconds()
        while not self._ready:
            while self._posted:
                self._ready.append(self._track(self._posted.popleft()))
            if self._ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            polled = time.monotonic()
            ready = self._poller.poll(int(left * 1000) + 1)
            self.poll_seconds += time.monotonic() - polled
            for sock, _ in ready:
                if sock is self._wake_in:
                    with contextlib.suppress(zmq.Again):
                        while True:
                            self._wake_in.recv(zmq.NOBLOCK)
                    continue
                self._drain(sock)
        return self._ready.popleft()

    def _track(self, event: Event) -> Event:
        if isinstance(event, WorkerJoined):
            self.members[event.name] = event.card
        elif isinstance(event, WorkerLost):
            self.members.pop(event.name, None)
        return event

    def _drain(self, sock: Any) -> None:
        worker = self._worker_of[sock]
        while sock.getsockopt(_EVENTS) & _POLLIN:  # no zmq.Again raised and caught per drain
            parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            reply = self._decode(worker, parts)
            if reply is not None:
                self._ready.append(reply)

    def _decode(self, worker: str, parts: list[zmq.Frame]) -> Reply | None:
        try:
            raw = unpack_raw(parts[0].bytes, what="reply envelope")
        except ProtocolError as exc:
            log.error("[coordinator %s] dropped a malformed reply from worker %s: %s", self.job, worker, exc)
            return None
        try:
            envelope = ReplyEnvelope.model_validate(raw)
        except ValidationError as exc:
            log.error("[coordinator %s] dropped a malformed reply from worker %s: %s", self.job, worker, exc)
            return None
        request = self._requests.pop(envelope.id, None)
        if request is None:
            return None  # a late reply to a forgotten request
        def failed(code: str, message: str) -> Reply:
            return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method,
                         ok=False, code=code, message=message, sent=request.sent)

        if not envelope.ok:
            error = envelope.error
            if error is None:
                return failed("internal", "error reply without error")
            return failed(error.code, error.message)
        try:
            body = request.reply_type.model_validate(envelope.body or {})
            tensors = decode_tensors(envelope.tensors, parts[1:])
        except (ValidationError, ProtocolError) as exc:
            return failed("bad_reply", f"{type(exc).__name__}: {exc}")
        return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method, ok=True,
                     body=body, tensors=tensors, sent=request.sent)
