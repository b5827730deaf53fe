"""The coordinator's event loop: service replies and membership changes, from one ZeroMQ poller.

Two kinds of source feed one stream of :data:`Event` s:

* the workers' service hosts: one DEALER socket per worker; requests go out at once
  (:meth:`EventLoop.send` never waits) and each reply becomes a :class:`Reply` event,
  validated against the type the request expects;
* the registry: a watch on ``/cellmesh/{job}/workers/`` turns a new or changed card into
  :class:`WorkerJoined` and a vanished one (drained, or its lease lapsed because the
  process died) into :class:`WorkerLost`. The watch runs on a thread that posts events
  to the poller through a :class:`~comm.rpc.mailbox.Mailbox`, so the loop sleeps in
  exactly one place: ``zmq.Poller.poll`` bounded by the caller's deadline.

While it runs, the loop keeps the coordinator's presence key ``/cellmesh/{job}/coordinator``
(:class:`~comm.registry.presence.Presence`): workers on etcd leave when it vanishes
(``services/host/worker.py``). Registry outages do not end a job (the data plane never needs
the registry; [Note: registry outages] in ``comm/registry/keepalive.py``): the watch follows the
workers through a :class:`~comm.registry.follow.Follower`, which re-lists them when the registry
answers again, reports no change for a card published again with a new lease, and holds the
deletion of a card seen around an outage until it is clearly not coming back.

Requests and replies are framed by :mod:`comm.rpc.framing`, exactly as every other client
of a service host frames them.

:meth:`EventLoop.next_event` is the only way to wait; the runtime decides what an event
means (``coordinator/runtime/driver.py``). Use from one thread (the watch thread only posts).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import zmq
from pydantic import BaseModel

from comm.codec import unpack
from comm.errors import ProtocolError
from comm.registry.base import Registry
from comm.registry.follow import Change, Follower
from comm.registry.presence import Presence
from comm.rpc import Mailbox, RpcError, open_reply, read_reply, request_frames
from comm.sockets import make_socket
from services.host.worker import coordinator_key
from services.protocol import WorkerCard

__all__ = ["DEFAULT_PRESENCE_TTL", "Event", "EventLoop", "Reply", "WorkerJoined", "WorkerLost"]

log = logging.getLogger(__name__)

DEFAULT_PRESENCE_TTL = timedelta(seconds=2)
"""The coordinator's presence lease: its workers on etcd notice it died this long after (etcd's smallest)."""
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

    Keyword Args:
        presence_ttl: The lease of the coordinator's presence key.

    Attributes:
        members: The cards of the workers currently registered.
        poll_seconds: Seconds spent waiting in the poller so far.
    """

    def __init__(self, registry: Registry, job: str, *,
                 presence_ttl: timedelta = DEFAULT_PRESENCE_TTL) -> None:
        self.registry = registry
        self.job = job
        self.prefix = f"/cellmesh/{job}/workers/"
        self.presence = Presence(registry, coordinator_key(job), presence_ttl)
        self._follower = Follower(registry, self.prefix, in_doubt=self.presence.in_doubt)
        self.members: dict[str, WorkerCard] = {}
        self.poll_seconds = 0.0  # time spent waiting in the poller (the rest is the coordinator's work)
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        self._addresses: dict[str, str] = {}
        self._worker_of: dict[zmq.Socket[bytes], str] = {}
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._poller = zmq.Poller()
        self._posted: Mailbox[Event] = Mailbox("coordinator-loop")
        self._ready: deque[Event] = deque()
        self._poller.register(self._posted.socket, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> EventLoop:
        """Publish the coordinator's presence, read the current members, then watch for changes.

        Raises:
            RegistryError: The registry did not answer (or refused).
        """
        self.presence.start()
        try:
            for key, value in self._follower.begin_now().items():
                card = self._card(key, value)
                if card is not None:
                    self.members[card.name] = card
        except BaseException:
            self.presence.close()
            raise
        self._thread = threading.Thread(target=self._watch, daemon=True, name=f"coordinator-watch-{self.job}")
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop the watch, close every socket, withdraw the presence. Idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2 * _WATCH_POLL.total_seconds() + 1)
        for sock in self._socks.values():
            sock.close()
        self._socks.clear()
        self._posted.close()
        self.presence.close()

    def __enter__(self) -> EventLoop:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _watch(self) -> None:
        try:
            while not self._stop.is_set():
                for change in self._follower.poll(_WATCH_POLL):
                    self._post(change)
        finally:
            self._follower.close()

    def _post(self, change: Change) -> None:
        name = change.key.removeprefix(self.prefix)
        if change.value is None:
            if change.after_outage:
                log.warning("[coordinator %s] worker %s's card vanished in a registry outage and was not "
                            "published again", self.job, name)
            self._posted.put(WorkerLost(name))
            return
        card = self._card(change.key, change.value)
        if card is not None:
            self._posted.put(WorkerJoined(name, card))

    def _card(self, key: str, value: bytes) -> WorkerCard | None:
        try:
            return unpack(value, WorkerCard, what=f"the worker card at {key}")
        except ProtocolError as exc:  # not a worker of this version: say so, keep following the others
            log.warning("[coordinator %s] ignoring %s: %s", self.job, key, exc)
            return None

    # -- requests -----------------------------------------------------------------------

    def connect(self, worker: str, address: str) -> None:
        """Open (once) the connection to ``worker``'s service host at ``address``; a worker that came back
        at another address (a replacement) is reconnected, and the requests sent to the old one forgotten."""
        old = self._socks.get(worker)
        if old is not None:
            if self._addresses[worker] == address:
                return
            self._poller.unregister(old)
            del self._worker_of[old]
            old.close(linger=0)
            for request_id in [i for i, r in self._requests.items() if r.worker == worker]:
                del self._requests[request_id]
        sock = make_socket(zmq.DEALER, curve="client")
        sock.connect(address)
        self._socks[worker] = sock
        self._addresses[worker] = address
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
        # copied into ZeroMQ's buffers: the caller may change its tensors as soon as this returns
        sock.send_multipart(request_frames(request_id, service, method, request, tensors), copy=True)
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
            for event in self._posted.take():
                self._ready.append(self._track(event))
            if self._ready:
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            polled = time.monotonic()
            ready = self._poller.poll(int(left * 1000) + 1)
            self.poll_seconds += time.monotonic() - polled
            for sock, _ in ready:
                if sock is self._posted.socket:
                    self._posted.clear_wakeups()
                else:
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
        envelope = read_reply(parts[0].bytes, f"worker {worker} (coordinator of {self.job})")
        if envelope is None:
            return None
        request = self._requests.pop(envelope.id, None)
        if request is None:
            return None  # a late reply to a forgotten request

        def failed(code: str, message: str) -> Reply:
            return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method,
                         ok=False, code=code, message=message, sent=request.sent)

        try:
            body, tensors = open_reply(envelope, parts[1:], request.reply_type, request.service,
                                       request.method)
        except RpcError as exc:
            return failed(exc.code, exc.message)
        except ProtocolError as exc:
            return failed("bad_reply", str(exc))
        return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method, ok=True,
                     body=body, tensors=tensors, sent=request.sent)
