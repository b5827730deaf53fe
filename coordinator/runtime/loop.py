"""The coordinator's event loop: service replies and membership changes, from one ZeroMQ poller.

Two kinds of source feed one stream of :data:`Event` s:

* the workers' service hosts: one ROUTER socket connected to every worker ([Note: one socket for
  every worker]); requests go out at once (:meth:`EventLoop.send` never waits) and each reply
  becomes a :class:`Reply` event, validated against the type the request expects (a plain step reply
  by the C decoder of ``services/protocol/hot.py``, anything else by the models);
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

[Note: one socket for every worker]
A wake-up must cost what is ready, not what is connected: when workers finish a step at different times
its replies come a few per wake-up, and a loop that looks at every worker on each wake-up costs O(N) per
wake-up times O(N) wake-ups per step.
With one DEALER socket per worker, ``zmq.Poller.poll`` is that loop (it reads every socket's
``ZMQ_EVENTS``: 164 µs of CPU per wake-up at 256 workers, 359 µs at 512; docs/benchmarks.md "Hollow
workers"). Sleeping in ``epoll`` on each socket's ``zmq.FD`` instead is cheap per wake-up but fragile:
the descriptor only signals that the socket's ``ZMQ_EVENTS`` may have changed, and whatever processes
the socket's commands (a send, a read, reading ``ZMQ_EVENTS``) consumes that signal, so every path that
touches a socket must re-check it before the loop may sleep, or a reply sits unread (a loop built that
way was reverted after placements waited 120 s for replies).

So the loop has one ROUTER socket and connects it to every worker's service host, one connection (and
one ZeroMQ pipe) per worker, each named by a routing id the loop picks (``ZMQ_CONNECT_ROUTING_ID``, a
fresh one per connection: ``r1``, ``r2``, ...). The poller watches two sockets whatever the worker count
(2 µs a wake-up at 16 or 512 workers), ZeroMQ's own fair queue hands over the next reply of any worker
in O(1), and ``zmq.Poller`` reads ``ZMQ_EVENTS`` itself, so no edge can be lost. What the wire carries
is unchanged: ROUTER strips the routing id on the way out and prepends it on the way in, so a service
host sees one client connection per worker exactly as with a DEALER, and its CURVE handshake and ZAP
check are per connection, with the process's one role key as before (the CURVE options are read at each
``connect``; the socket is made at the first one, when the job's credentials are installed). Routing ids
never repeat: a worker reconnected at another address (a replacement) gets a new one, and a late reply
on the old connection is dropped.

A send never blocks: with ``ZMQ_ROUTER_MANDATORY`` a request the socket cannot queue (the connection was
refused for good, e.g. a host that failed the CURVE handshake, or ``CONTROL_HWM`` requests are queued
unread) raises at once, and the loop turns it into a failed :class:`Reply` (code ``unreachable``) naming
the worker and its address. A DEALER would have blocked there.

:meth:`EventLoop.next_event` is the only way to wait; the runtime decides what an event
means (``coordinator/runtime/driver.py``). Use from one thread (the watch thread only posts).

[Note: fewer wake-ups]
A wake-up costs more than the reply it reads. A thread that sleeps in ``zmq_poll`` and is woken for one
message spends 22 µs of CPU on it when messages come 0.2 ms apart, 33 µs at 1 ms and 75 µs at 5 ms
(one process reading a ROUTER fed by another, recv alone, load average 3 on 2 cores: the longer it slept,
the colder its caches and the deeper the core's idle state), where reading and checking a step reply
warm costs about 10 µs. Hundreds of workers answer a step a few at a time (a hollow fleet of 128 took
78 wake-ups per step for its 128 replies; workers that finish at different times, one each), so the
wake-ups were most of a reply's cost and no decoding could reach 20 µs a reply.

So while several requests are outstanding (``coalesce_min``, 4) a wake-up that read replies is followed
by a hold before the next read, in which replies gather in ZeroMQ's queue; the next read drains them all.
A hold lasts 1% (``coalesce_share``) of the time the oldest outstanding request has waited, in whole
milliseconds, at most ``coalesce`` (5 ms), and none under a millisecond: replies that come 100 ms or
more after their requests may be read up to 1% of that later, never more, and steps shorter than 100 ms
never hold. It sleeps on the mailbox alone, so a registry event (a worker lost) ends it at once. Below
``coalesce_min`` outstanding every reply is read as it comes: a step of up to 4 workers never holds
(every plan of bench/train.py), and neither do a larger step's last 3 replies. So a step ends at most 1%
(5 ms) after its last reply came, usually as soon; in a data-parallel step whose replicas finish together
it is about that. The step's result cannot depend on it: replies are events in the order they are read,
as before, and the runtime needs every one of a step's replies before it acts (an asynchronous plan's
replica, which acts on a part of them, starts its next step as late). The threshold was 16 at first: then
a step of 16 workers never held (15 are left once one reply is read) and each reply after the first
woke the coordinator alone, 1-2 ms apart as a pipeline's last backward drains. At 4, a window of 10
steps of 16 workers (4 stages x 4 replicas) read its 16 replies in 6 drains, 5 ms apart; the coordinator
handled 1.16x the replies per CPU-second on a 16-stage pipeline and 1.36x on 64 workers of 4 stages, at
the medians of three alternated rounds, with no longer step; the traced 16 workers of 4 stages stayed
within the host's noise (1.01x), their coordinator's caches cold while four pipelines share its cores
(docs/benchmarks.md, "Hollow workers", 2026-12-01 23:00).
Rejected: spinning (``poll(0)`` in a loop) instead of a hold, which costs the CPU it saves when the
cores are shared; a fixed hold (a 50 ms step of 32 data-parallel workers would take a 5 ms hold's 10%);
and a multi-step request (one request starts K steps), which cuts the requests but not the replies, and
would put fault detection, a checkpoint every N steps and a ``stop`` at a step out of the coordinator's
step boundaries.

[Note: a cold step]
What a training step costs the coordinator, profiled (the coordinator thread's CPU split by hand around
each piece, ``time.thread_time``; bench/train.py, under load; the timers add their own cold cost), before
the changes below: one worker, about 500 µs a step: the reply's read 140-180 (msgpack 47, the hand check
35, the ``Reply`` 11), the frames' reads 50-65, the poller 50 a wake-up (1.4 a step), the request's build
and send 45-70, the commit's request 25-30, the step's bookkeeping (norm, non-finite, traffic, record) 25,
the session's own between steps about 60. A stage of 1F1B 2x8 the same, per reply. At 256 hollow
data-parallel workers, per reply: its read 38, its frames 27, its request 16, the poller 19. Each piece
costs about ten times its warm cost: a step touches the coordinator once per 50-100 ms and the workers'
compute evicts its caches in between, so what counts is how much code and memory a step touches, not
how many instructions. So, decided by that profile:

* the step reply is read in one C call (msgspec), envelope and body together, checked as the models
  check them (``services/protocol/hot.py``, [Note: why the step reply is decoded in C]): 16-23 µs cold
  for the decode against 74-110 for msgpack and the hand check;
* a reply's frames are read as ``bytes`` (a ROUTER's routing id and envelope are small): no
  ``zmq.Frame`` per part nor its ``.more`` and ``.bytes``; tensor frames stay zero-copy frames;
* a step's request is packed once per replica, its envelope written from a head packed once per
  service and method (``comm/rpc/hot.py``, [Note: a request packed once]), and the commit riding on it
  is the first commit's dump with its step, scale and save patched (the model checks the first request
  and the first commit; the services validate every one);
* kept as they are: the step's bookkeeping (each value is read every step: the norm for clipping, the
  non-finite check for skipping; the event lists were already built only when read,
  ``coordinator/runtime/records.py``); the poller (one wake-up per reply of a short step is the floor
  with one outstanding request; a blocking ``recv`` with a timeout in its place would need the registry
  mailbox on the ROUTER itself and the hold's mailbox-only sleep rebuilt, for part of 50 µs);
* not done, for issue 18: one request shared by every data-parallel replica (a PUB socket, or one frame
  sent N times without a copy). Their requests differ by their samples, which the coordinator's sampler
  draws, so a shared request needs the workers to draw their own from (step, replica), a change of the
  data path; and what a send costs now is ZeroMQ's work per pipe and the system call, N of them either
  way, not the encoding (a packed body costs one concatenation per request). Per-step replies stay: fault
  detection, checkpoints and ``stop`` read them.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections import Counter, deque
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
from comm.registry.follow import FOLLOW_POLL, Change, Follower
from comm.registry.presence import Presence
from comm.rpc import Mailbox, RpcError, open_reply, request_frames
from comm.rpc.framing import check_reply, reply_fields
from comm.rpc.hot import PackedBody, RequestHeads
from comm.sockets import CONTROL_HWM, make_socket
from services.host.worker import coordinator_key
from services.protocol import StepReply, WindowReply, WorkerCard
from services.protocol.hot import read_step_frame, read_window_frame

__all__ = ["DEFAULT_PRESENCE_TTL", "Event", "EventLoop", "Reply", "WorkerJoined", "WorkerLost"]

log = logging.getLogger(__name__)

DEFAULT_PRESENCE_TTL = timedelta(seconds=2)
"""The coordinator's presence lease: its workers on etcd notice it died this long after (etcd's smallest)."""
_WATCH_POLL = FOLLOW_POLL  # the watch thread's long poll: close() closes the follower, which ends it
# plain ints: pyzmq builds an enum object for a flag combined per call, and for each ZMQ_EVENTS read
_NOBLOCK, _MORE = int(zmq.NOBLOCK), int(zmq.NOBLOCK | zmq.SNDMORE)
_DRAIN_BATCH = 4096  # replies read per wake-up before the registry's events get a turn
_EVENTS, _POLLIN, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.RCVMORE)
COALESCE = timedelta(milliseconds=5)
"""The longest the loop lets replies gather before it reads again while many are outstanding
([Note: fewer wake-ups])."""
COALESCE_SHARE = 0.01
"""A hold lasts at most this share of the time the oldest outstanding request has waited (whole ms)."""
COALESCE_MIN = 4
"""The outstanding requests from which the loop lets replies gather (below it, each is read at once)."""


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


@dataclass(frozen=True, slots=True)
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


@dataclass(frozen=True, slots=True)
class _Request:
    worker: str
    service: str
    method: str
    reply_type: type[BaseModel]
    sent: float


class EventLoop:
    """One poller over the workers' ROUTER socket and the registry watch (see the module docstring).

    Args:
        registry: Where the workers' cards live.
        job: The job's name.

    Keyword Args:
        presence_ttl: The lease of the coordinator's presence key (a session gives its job's
            ``runtime.lease_ttl_s``: workers on etcd take the coordinator for gone that long after its
            process stops refreshing it).
        coalesce: The longest replies gather before the next read while at least ``coalesce_min``
            requests are outstanding (0: never; [Note: fewer wake-ups]).
        coalesce_share: A hold's share of the time the oldest outstanding request has waited.
        coalesce_min: See ``coalesce``.

    Attributes:
        members: The cards of the workers currently registered.
        poll_seconds: Seconds spent waiting in the poller so far.
        wakeups: How many times the poller returned so far (each costs the same at any worker count).
    """

    def __init__(self, registry: Registry, job: str, *,
                 presence_ttl: timedelta = DEFAULT_PRESENCE_TTL, coalesce: timedelta = COALESCE,
                 coalesce_share: float = COALESCE_SHARE, coalesce_min: int = COALESCE_MIN) -> None:
        self.registry = registry
        self.job = job
        self.prefix = f"/cellmesh/{job}/workers/"
        self.presence = Presence(registry, coordinator_key(job), presence_ttl)
        self._follower = Follower(registry, self.prefix, in_doubt=self.presence.in_doubt)
        self.members: dict[str, WorkerCard] = {}
        self.poll_seconds = 0.0  # time spent waiting in the poller (the rest is the coordinator's work)
        self.wakeups = 0
        self.requests = Counter[str]()  # requests sent, by method
        self.coalesce, self.coalesce_share, self.coalesce_min = coalesce, coalesce_share, coalesce_min
        self._hold = False  # the last wake-up read replies with many outstanding: let the next ones gather
        self._sock: zmq.Socket[bytes] | None = None  # made at the first connect ([Note: one socket ...])
        self._rid_of: dict[str, bytes] = {}  # worker -> the routing id of its current connection
        self._worker_of: dict[bytes, str] = {}  # routing id -> worker (current connections only)
        self._addresses: dict[str, str] = {}
        self._rids = itertools.count(1)
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._heads = RequestHeads()  # requests whose body comes packed ([Note: a request packed once])
        self._poller = zmq.Poller()
        self._posted: Mailbox[Event] = Mailbox("coordinator-loop")
        self._ready: deque[Event] = deque()
        self._poller.register(self._posted.socket, zmq.POLLIN)
        self._mail = zmq.Poller()  # the mailbox alone: what ends a hold early ([Note: fewer wake-ups])
        self._mail.register(self._posted.socket, zmq.POLLIN)
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
            self._follower.close()  # ends the watch thread's poll in flight
            self._thread.join(2 * _WATCH_POLL.total_seconds() + 1)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._rid_of.clear()
        self._worker_of.clear()
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
        old = self._rid_of.get(worker)
        sock = self._socket()
        if old is not None:
            if self._addresses[worker] == address:
                return
            del self._worker_of[old], self._rid_of[worker]
            previous = self._addresses.pop(worker)
            if previous not in self._addresses.values():  # disconnect() ends every connection to it
                with contextlib.suppress(zmq.ZMQError):  # already gone
                    sock.disconnect(previous)
            for request_id in [i for i, r in self._requests.items() if r.worker == worker]:
                del self._requests[request_id]
        rid = b"r%d" % next(self._rids)  # never reused, never a leading zero byte (libzmq's own ids)
        sock.setsockopt(zmq.CONNECT_ROUTING_ID, rid)
        sock.connect(address)  # the connection's pipe exists from here on: sends queue until it is up
        self._rid_of[worker] = rid
        self._worker_of[rid] = worker
        self._addresses[worker] = address

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            self._sock = make_socket(zmq.ROUTER, curve="client")
            self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable send raises, never vanishes
            self._poller.register(self._sock, zmq.POLLIN)
        return self._sock

    def send(self, worker: str, service: str, method: str,
             request: BaseModel | Mapping[str, Any] | PackedBody, reply_type: type[BaseModel], *,
             tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> int:
        """Send ``request`` to ``service.method`` on ``worker``; its answer arrives as a :class:`Reply`.

        ``request`` is a message, or a message already dumped (``model_dump(mode="python")``),
        which a caller sending the same large parts every step can build from cached pieces, or
        such a dump packed once (:class:`~comm.rpc.hot.PackedBody`, no tensors) for a request that goes
        to several services ([Note: a request packed once] in ``comm/rpc/hot.py``); the service
        validates it either way.

        A request the socket cannot queue (see [Note: one socket for every worker]) is answered at
        once by a failed :class:`Reply` with code ``unreachable``.

        Returns:
            The request id (``Reply.id``).

        Raises:
            KeyError: ``worker`` is not connected.
        """
        rid = self._rid_of[worker]
        assert self._sock is not None
        request_id = next(self._ids)
        sent = time.time()
        if type(request) is PackedBody:
            assert not tensors, "a packed request carries no tensors"
            frames = [self._heads.frame(request_id, service, method, request)]
        else:
            frames = request_frames(request_id, service, method, request, tensors)  # type: ignore[arg-type]
        try:  # copied into ZeroMQ's buffers: the caller may change its tensors as soon as this returns
            self._sock.send(rid, _MORE)  # all or nothing: only the routing id's part can be refused
            for frame in frames[:-1]:
                self._sock.send(frame, _MORE, copy=True)
            self._sock.send(frames[-1], _NOBLOCK, copy=True)
        except zmq.ZMQError as exc:
            why = ("its connection was refused (the CURVE handshake failed, or the address is not a "
                   "cellmesh service host)" if exc.errno == zmq.EHOSTUNREACH else
                   f"{CONTROL_HWM} requests to it are queued unread (it froze or died)")
            self._ready.append(Reply(
                id=request_id, worker=worker, service=service, method=method, ok=False, code="unreachable",
                message=f"the coordinator could not send {service}.{method} to worker {worker} at "
                        f"{self._addresses[worker]}: {why}; check that the worker runs and holds the job's "
                        "keys", sent=sent))
            return request_id
        self._requests[request_id] = _Request(worker, service, method, reply_type, sent)
        self.requests[method] += 1
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
            if self._hold:  # see [Note: fewer wake-ups]
                self._hold = False
                if self._gather_replies(left):
                    continue
            polled = time.monotonic()
            ready = self._poller.poll(int(left * 1000) + 1)
            self.poll_seconds += time.monotonic() - polled
            self.wakeups += 1
            for sock, _ in ready:
                if sock is self._posted.socket:
                    self._posted.clear_wakeups()
                else:
                    read = len(self._ready)
                    self._drain(sock)
                    self._hold = len(self._ready) > read and len(self._requests) >= self.coalesce_min > 0
        return self._ready.popleft()

    def _gather_replies(self, left: float) -> bool:
        """Sleep while replies gather (see [Note: fewer wake-ups]), at most ``left`` seconds; a registry
        event (the mailbox) ends it at once. False: too short a hold to take (under a millisecond)."""
        if not self._requests:
            return False
        waited = time.time() - next(iter(self._requests.values())).sent  # the oldest outstanding
        ms = int(min(left, self.coalesce.total_seconds(), self.coalesce_share * waited) * 1000)
        if ms < 1:
            return False
        polled = time.monotonic()
        if self._mail.poll(ms):
            self._posted.clear_wakeups()
        self.poll_seconds += time.monotonic() - polled
        self.wakeups += 1
        return True

    def _track(self, event: Event) -> Event:
        if isinstance(event, WorkerJoined):
            self.members[event.name] = event.card
        elif isinstance(event, WorkerLost):
            self.members.pop(event.name, None)
        return event

    def _drain(self, sock: zmq.Socket[bytes]) -> None:
        """Read the replies the ROUTER holds (up to :data:`_DRAIN_BATCH`: the poller comes back for more).

        [Note: how a wake-up ends] A drain stops at the first ``zmq.Again`` (one exception per drain), or,
        after its first reply, when ``ZMQ_EVENTS`` says nothing more is queued: a training step's replies
        come one per wake-up, and that read costs half the exception. Either way the poller reads
        ``ZMQ_EVENTS`` itself before it sleeps, so no reply is left behind.
        """
        recv, more = sock.recv, sock.get
        for n in range(_DRAIN_BATCH):
            try:  # one zmq.Again per drain (a drain reads several replies), not a ZMQ_EVENTS read per reply
                rid = recv(_NOBLOCK)  # small parts as bytes: no Frame objects ([Note: a cold step])
            except zmq.Again:
                return
            # the rest of a message is there once its first part is; a ROUTER's message has a second
            envelope = recv(_NOBLOCK) if more(_RCVMORE) else None
            tensors = []
            while envelope is not None and more(_RCVMORE):
                tensors.append(recv(_NOBLOCK, copy=False))
            worker = self._worker_of.get(rid)
            if worker is not None and envelope is not None:  # else a late reply on a connection dropped
                reply = self._decode(worker, envelope, tensors)
                if reply is not None:
                    self._ready.append(reply)
            if n == 0 and not int(sock.get(_EVENTS)) & _POLLIN:  # see [Note: how a wake-up ends]
                return

    def _decode(self, worker: str, frame: bytes, parts: list[zmq.Frame]) -> Reply | None:
        """The reply in ``frame`` (its envelope) and ``parts`` (its tensors' frames), or None: malformed
        (logged) or late."""
        # a plain successful step reply is read in one C call ([Note: why the step reply is decoded in C] in
        # services/protocol/hot.py); anything else, or what that declines, is validated by the models
        request = None
        if not parts:
            # a window's frame names its body's first field, "steps", in its first bytes (msgpack fixstr 0xa5)
            window = frame.find(b"\xa5steps", 0, 64) >= 0
            hot = read_window_frame(frame) if window else read_step_frame(frame)
            if hot is not None:
                request = self._requests.pop(hot[0], None)
                if request is None:
                    return None  # a late reply to a forgotten request
                if request.reply_type is (WindowReply if window else StepReply):
                    return Reply(id=hot[0], worker=worker, service=request.service, method=request.method,
                                 ok=True, body=hot[1], sent=request.sent)
        source = f"worker {worker} (coordinator of {self.job})"
        fields = reply_fields(frame, source)
        if fields is None:
            return None
        envelope = check_reply(fields, source)
        if envelope is None:
            return None
        if request is None:
            request = self._requests.pop(envelope.id, None)
            if request is None:
                return None  # a late reply to a forgotten request

        def failed(code: str, message: str) -> Reply:
            return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method,
                         ok=False, code=code, message=message, sent=request.sent)

        try:
            body, tensors = open_reply(envelope, parts, request.reply_type, request.service,
                                       request.method)
        except RpcError as exc:
            return failed(exc.code, exc.message)
        except ProtocolError as exc:
            return failed("bad_reply", str(exc))
        return Reply(id=envelope.id, worker=worker, service=request.service, method=request.method, ok=True,
                     body=body, tensors=tensors, sent=request.sent)
