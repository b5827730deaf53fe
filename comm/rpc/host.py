"""The service host: named services with typed handlers on one ROUTER socket, served from one thread.

A service is an object whose ``rpc_<method>(self, request, call)`` methods take a pydantic
request model (found from the annotation, as hivemind's ServicerBase does) and either
return a reply model (and ``call.tensors_out``) or ``None`` after ``call.defer(...)``, to
answer later (a barrier releasing, a pull waiting for the step's update, a registry watch
waiting for a change). One :class:`ServiceHost` serves any number of named services on one
socket, from one thread, so handlers never race each other and deferred replies are sent
from that same thread; other threads hand it work through a :class:`~comm.rpc.mailbox.Mailbox`.

Before a handler runs, the host validates the envelope, asks its :data:`Authorizer` whether
the sender may call that method, finds the service and method, and validates the body
against the handler's model and every tensor spec against its frames (see
:mod:`comm.rpc.framing`). Anything wrong gets an error reply naming the field and the
reason (``bad_request``, ``forbidden``, ``unknown_service``, ``unknown_method``), and the
host serves the next message. This is the one place where a request's sender and method
are both known before dispatch: authentication (CURVE with a ZAP handler, which names the
peer in each frame's ``User-Id``) and per-role method checks plug in here.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import zmq
from pydantic import BaseModel, ValidationError
from zmq.utils.monitor import parse_monitor_message

from comm import auth
from comm.codec import describe_validation_error, unpack_raw
from comm.errors import ProtocolError
from comm.logs import LogThrottle, log_context
from comm.refusals import peer_address, refuse
from comm.rpc.envelope import RequestEnvelope
from comm.rpc.framing import RpcError, decode_tensors, error_frames, reply_frames
from comm.rpc.mailbox import Mailbox
from comm.rpc.service import Authorizer, Call, Method, OnTimeout, Peer, ServiceBase, allow_all
from comm.sockets import bind_port, make_socket

__all__ = ["ServiceHost"]

log = logging.getLogger(__name__)


_BATCH = 64  # requests handled per wake-up before posted work and deadlines get a turn
_IDLE_WAIT_MS = 1000  # the longest sleep with nothing due (shutdown wakes the thread itself)
_STALE_COMPACT = 256  # answered calls left in the deadline heap before it is rebuilt


def _nothing() -> None:
    """Posted by :meth:`ServiceHost.wake`: the turn of the loop is the point."""


_HANDSHAKE_FAILED = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_HANDSHAKE_REASONS = {
    int(zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH): "mechanism",
    int(zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC): "server_key",
}
_HANDSHAKE_TEXT = {
    "mechanism": "the peer does not speak CURVE (not one of the job's processes)",
    "server_key": "the peer does not hold the job's server key",
    "handshake": "the peer broke off the handshake (no CURVE, or not ZeroMQ at all)",
}

@dataclass(order=True)
class _Deferred:
    """A deferred call's deadline in the host's heap.

    [Note: an answered call leaves only its deadline] The heap drops an answered call's entry lazily: when
    its deadline comes up, or when the answered entries outnumber the rest (:data:`_STALE_COMPACT`).
    Until then the entry must not hold the call: a compute stage defers every step's request (its body,
    a window's sample lists: 1-2 MB for 4,096 samples a step over 10 steps) with a timeout of minutes, and
    the 256-512 answered entries a heap keeps held that many requests alive (hollow workers, 8 of them
    over 2,500 steps: 3 MiB each, measured). Answering a call empties its entry (``call`` and
    ``on_timeout`` None); the heap keeps the two numbers.
    """

    deadline: float
    order: int
    call: Call | None = field(compare=False)  # None once answered
    on_timeout: OnTimeout | None = field(compare=False)


class ServiceHost:
    """Serves named services on one ROUTER socket from one background thread.

    Args:
        host: interface to bind (:func:`comm.sockets.default_host` by default).
        port: the port to bind (0: one the OS chooses).
        authorize: who may call what (:func:`allow_all` by default; see :data:`Authorizer`).

    Attributes:
        address: the ``tcp://host:port`` clients connect to.
        bad_requests: requests answered ``bad_request`` so far.
        refused: requests answered ``forbidden`` so far.
    """

    def __init__(self, host: str | None = None, port: int = 0, *, authorize: Authorizer = allow_all) -> None:
        self._services: dict[str, tuple[ServiceBase, dict[str, Method]]] = {}
        self._authorize = authorize
        self._sock = make_socket(zmq.ROUTER, curve="server")
        self._secure = auth.is_curve_server(self._sock)  # then every request carries its sender's role
        # handshakes that fail before the ZAP handler is asked (no CURVE, or not the job's server key)
        self._monitor = self._sock.get_monitor_socket(_HANDSHAKE_FAILED) if self._secure else None
        self.address = bind_port(self._sock, host, port)
        self._mailbox: Mailbox[Callable[[], None]] = Mailbox("service-host")
        self._deferred: list[_Deferred] = []
        self._stale = 0  # answered calls whose deadline is still in _deferred
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._read_up_to = time.monotonic()  # see read_up_to; written by the host thread only
        self._lock = threading.Lock()  # guards _services; handlers run on the host thread
        self._closed = False
        self.bad_requests = 0
        self.refused = 0
        self._throttle = LogThrottle()

    def add(self, name: str, service: ServiceBase) -> None:
        """Serve ``service`` under ``name`` (its ``rpc_*`` methods are checked now)."""
        methods = service.rpc_methods()
        with self._lock:
            if name in self._services:
                raise ValueError(f"a service named {name!r} is already hosted here")
            self._services[name] = (service, methods)

    def remove(self, name: str) -> None:
        """Stop serving ``name`` and close it (requests for it then get ``unknown_service``)."""
        with self._lock:
            entry = self._services.pop(name, None)
        if entry is not None:
            entry[0].on_close()

    def names(self) -> list[str]:
        with self._lock:
            return sorted(self._services)

    def finished_steps(self) -> dict[str, int]:
        """Each hosted service's :attr:`~comm.rpc.service.ServiceBase.finished_step`, where it has one."""
        with self._lock:
            found = {name: entry[0].finished_step for name, entry in self._services.items()}
        return {name: step for name, step in found.items() if step is not None}

    def start(self) -> ServiceHost:
        self._thread = threading.Thread(target=self._serve, name=f"service-host-{self.address}", daemon=True)
        self._thread.start()
        return self

    def read_up_to(self) -> float:
        """A ``time.monotonic()`` instant before which every request that reached the socket has been
        handled (now, while the thread is not running). Callable from any thread.

        A registry served here lets leases lapse only up to this instant (see [Note: leases of a stalled
        server] in ``comm/registry/memory.py``): while this process is stalled (a long collection, a
        call that holds the GIL, a frozen process), refreshes wait in the socket unread, and the instant
        stays where the stall began.
        """
        if self._thread is None or not self._thread.is_alive():
            return time.monotonic()
        return self._read_up_to

    def wake(self) -> None:
        """Make the host thread run its loop once soon (it then reads its socket), from any thread."""
        self._mailbox.put(_nothing)

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the host thread: at once when called from it (or before start), else queued."""
        if self._thread is None or threading.get_ident() == self._thread_id:
            fn()
        else:
            self._mailbox.put(fn)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Queue ``fn`` to run on the host thread after the work at hand, from any thread.

        Unlike :meth:`post` it never runs ``fn`` in the caller, so it is safe from a callback
        that holds a lock ``fn`` needs (a registry listener, for one).
        """
        self._mailbox.put(fn)

    def shutdown(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        """Stop the thread, close every service, then the sockets. Idempotent.

        Deferred calls still waiting are dropped (their clients time out).

        Raises:
            TimeoutError: the thread did not stop within ``timeout`` (a handler blocks it);
                the services and sockets are left open then.
        """
        if self._closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._mailbox.put(lambda: None)  # wake it now rather than at its next timeout
            self._thread.join(timeout.total_seconds())
            if self._thread.is_alive():
                raise TimeoutError(f"service host at {self.address} did not stop within "
                                   f"{timeout.total_seconds():.1f}s: a handler of {self.names()} blocks it")
        self._closed = True
        for name in self.names():
            self.remove(name)
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close()
        self._mailbox.close()

    # -- the loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        self._thread_id = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mailbox.socket, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(self._wait_ms()))
            if self._mailbox.socket in ready:
                self._mailbox.clear_wakeups()
            self._run_posted()
            # read the socket at every turn (not only when it polled readable), so read_up_to advances
            # with each wake-up: a request queued before ``checked`` is handled before the read says Again
            for _ in range(_BATCH):
                checked = time.monotonic()
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    self._read_up_to = checked
                    break
                self._handle(frames)
            if self._monitor is not None and self._monitor in ready:
                self._count_failed_handshakes(self._monitor)
            self._expire()

    def _count_failed_handshakes(self, monitor: zmq.Socket[bytes]) -> None:
        """Count (and warn, throttled) connections refused before ZAP: they never reach a handler.

        libzmq reports these on the listening socket only, without the peer's address; a
        client retries its handshake every reconnect interval, so each attempt counts.
        """
        for _ in range(_BATCH):
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            reason = _HANDSHAKE_REASONS.get(int(event["value"]), "handshake")
            if int(event["event"]) == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                reason = "handshake"
            suppressed = refuse("connection", reason, self.address)
            if suppressed is not None:
                log.warning("refused a connection to %s: %s%s", self.address, _HANDSHAKE_TEXT[reason],
                            f" ({suppressed} more since the last warning)" if suppressed else "")

    def _wait_ms(self) -> int:
        if self._mailbox:
            return 0
        if not self._deferred:
            return _IDLE_WAIT_MS
        until_next = int((self._deferred[0].deadline - time.monotonic()) * 1000) + 1
        return max(0, min(_IDLE_WAIT_MS, until_next))

    def _run_posted(self) -> None:
        """Run the work other threads posted, in a frame of its own: the last of it (an answer, and the call
        it answers) is not kept by the loop's variable until the next."""
        for fn in self._mailbox.take():
            self._run(fn)

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug in posted work must not stop the host
            log.exception("work posted to the service host at %s failed", self.address)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deferred and self._deferred[0].deadline <= now:
            item = heapq.heappop(self._deferred)
            call, on_timeout = item.call, item.on_timeout
            if call is None or on_timeout is None:  # answered (its entry emptied)
                self._stale -= 1
                continue
            if call.answered:  # an older entry of a call deferred twice, answered since
                continue
            call.deadline = None
            try:
                outcome = on_timeout()
            except Exception as exc:
                log.exception("%s.%s: on_timeout failed", call.envelope.service, call.envelope.method)
                outcome = ("internal", f"{type(exc).__name__}: {exc}")
            if isinstance(outcome, BaseModel):
                self._answer(call, reply_frames(call.envelope.id, outcome))
            else:
                self._answer(call, error_frames(call.envelope.id, *outcome))
        if self._stale > _STALE_COMPACT and 2 * self._stale > len(self._deferred):
            self._deferred = [d for d in self._deferred if d.call is not None]
            heapq.heapify(self._deferred)
            self._stale = 0

    def _handle(self, frames: list[zmq.Frame]) -> None:
        peer = Peer(frames[0].bytes, self._role_of(frames), peer_address(frames[0]))
        request_id = 0
        try:
            if len(frames) < 2:
                raise ProtocolError("request has no envelope frame")
            raw = unpack_raw(frames[1].bytes, what="request envelope")
            rid = raw.get("id")
            request_id = rid if type(rid) is int and rid >= 0 else 0
            try:
                envelope = RequestEnvelope.model_validate(raw)
            except ValidationError as exc:
                raise ProtocolError(f"request envelope: {describe_validation_error(exc)}") from None
            if not self._allowed(envelope, peer):
                return
            with self._lock:
                entry = self._services.get(envelope.service)
            if entry is None:
                hosted = self.names()
                refuse("frame", "rpc/unknown_service", self.address)  # counted; the caller hears why
                self._send(peer, error_frames(request_id, "unknown_service",
                                              f"no service {envelope.service!r} here; hosted: {hosted}"))
                return
            service, methods = entry
            if envelope.method not in methods:
                refuse("frame", "rpc/unknown_method", self.address)
                self._send(peer, error_frames(request_id, "unknown_method",
                                              f"{envelope.service} has no method {envelope.method!r}; "
                                              f"it has {sorted(methods)}"))
                return
            method = methods[envelope.method]
            if self._secure and peer.user not in method.roles:
                self._forbid(envelope, peer, f"callable by {' and '.join(sorted(method.roles))} only, "
                                             f"not by a {peer.user}")
                return
            fn, request_type = method.handler, method.request_type
            try:
                request = request_type.model_validate(envelope.body)
            except ValidationError as exc:
                raise ProtocolError(f"{request_type.__name__}: {describe_validation_error(exc)}") from None
            tensors = decode_tensors(envelope.tensors, frames[2:])
        except ProtocolError as exc:
            self.bad_requests += 1
            self._warn(peer, "bad_request", "rejected a bad request on %s from %s: %s", self.address,
                       peer.address or repr(peer.identity), exc)
            self._send(peer, error_frames(request_id, "bad_request", str(exc)))
            return
        except Exception:  # a bug in reading one request: it must not end the host's thread
            if refuse("frame", "rpc/internal", (self.address, peer.address or peer.identity)) is not None:
                log.exception("reading a request on %s failed; answered internal (more from %s within a "
                              "minute are counted only)", self.address, peer.address or "this peer")
            self._send(peer, error_frames(request_id, "internal", "the server failed to read the request; "
                                                                  "its log has the details"))
            return
        call = Call(self, peer, envelope, tensors)
        try:
            with log_context(service=envelope.service, step=getattr(request, "step", None)):
                result = fn(request, call)
        except RpcError as exc:
            call.fail(exc.code, exc.message)
            return
        except Exception as exc:
            code = next((c for kind, c in service.error_codes if isinstance(exc, kind)), None)
            if code is None:  # a bug: the traceback goes to the log, never to the peer
                log.exception("%s.%s failed", envelope.service, envelope.method)
                call.fail("internal", f"{envelope.service}.{envelope.method} failed on the server; its log "
                                      "has the details")
            else:
                call.fail(code, str(exc))
            return
        if result is not None:
            call.reply(result, call.tensors_out)
        elif not call.deferred and not call.answered:
            call.fail("internal", f"{envelope.service}.{envelope.method} returned nothing and did not defer")

    def _allowed(self, envelope: RequestEnvelope, peer: Peer) -> bool:
        """Ask the authorizer; answer ``forbidden`` (and count it) when it refuses."""
        try:
            refusal = self._authorize(envelope.service, envelope.method, peer)
        except Exception as exc:  # a broken check refuses: it never lets a request through
            log.exception("the authorizer of %s failed on %s.%s", self.address, envelope.service,
                          envelope.method)
            refusal = f"the authorization check failed ({type(exc).__name__}: {exc})"
        if refusal is None:
            return True
        self._forbid(envelope, peer, refusal)
        return False

    def _forbid(self, envelope: RequestEnvelope, peer: Peer, reason: str) -> None:
        """Answer ``forbidden`` with the reason, count it, and warn (once per peer and reason a minute)."""
        self.refused += 1
        self._warn(peer, "forbidden", "refused %s.%s from %s at %s on %s: %s", envelope.service,
                   envelope.method, peer.user or "a peer without a role", peer.address or repr(peer.identity),
                   self.address, reason)
        self._send(peer, error_frames(envelope.id, "forbidden",
                                      f"{envelope.service}.{envelope.method}: {reason}"))

    def _warn(self, peer: Peer, reason: str, msg: str, *args: object) -> None:
        """Count a peer's fault in :data:`comm.refusals.REFUSALS`; warn once per peer address and reason a
        minute (the identity is new on each reconnect, so it would not bound the warnings)."""
        suppressed = refuse("frame", f"rpc/{reason}", (self.address, peer.address or peer.identity))
        if suppressed is not None:
            log.warning(msg + (f" ({suppressed} more like it since the last warning)" if suppressed else ""),
                        *args)

    def _role_of(self, frames: list[zmq.Frame]) -> str | None:
        """The role the job's keys authenticated the sender as (None on a socket without CURVE)."""
        if not self._secure or len(frames) < 2:
            return None
        try:
            return str(frames[1].get("User-Id"))
        except zmq.ZMQError:  # no ZAP user id: not an authenticated connection
            return None

    def _defer(self, call: Call, timeout: timedelta, on_timeout: OnTimeout) -> None:
        entry = _Deferred(time.monotonic() + timeout.total_seconds(), next(self._order), call, on_timeout)
        call.deadline = entry
        heapq.heappush(self._deferred, entry)

    def _answer(self, call: Call, frames: list[Any]) -> None:
        """Send ``frames`` as the one answer to ``call`` (later answers are dropped)."""
        if call.answered:
            return
        call.answered = True
        entry = call.deadline
        if entry is not None:  # the heap keeps the deadline, not the call
            call.deadline = entry.call = entry.on_timeout = None
            self._stale += 1
        self._send(call.peer, frames)

    def _send(self, peer: Peer, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart([peer.identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # a peer that never reads its replies: warn once per address a minute
            suppressed = self._throttle.admit((peer.address or peer.identity, "reply dropped"))
            if suppressed is not None:
                log.warning("dropped a reply to %s on %s: its queue is full (%d more since the last warning)",
                            peer.address or repr(peer.identity), self.address, suppressed)
