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
import inspect
import itertools
import logging
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, ClassVar, TypeVar

import torch
import zmq
from pydantic import BaseModel, ValidationError

from comm import auth
from comm.codec import describe_validation_error, unpack_raw
from comm.errors import ProtocolError
from comm.logs import LogThrottle, log_context
from comm.refusals import peer_address, refuse
from comm.rpc.envelope import RequestEnvelope
from comm.rpc.framing import NamedTensors, RpcError, decode_tensors, error_frames, reply_frames
from comm.rpc.mailbox import Mailbox
from comm.sockets import bind_port, make_socket

__all__ = ["CONTROL", "Authorizer", "Call", "Handler", "Method", "OnTimeout", "Peer", "ServiceBase",
           "ServiceHost", "allow_all", "callable_by"]

log = logging.getLogger(__name__)

Handler = Callable[[Any, "Call"], BaseModel | None]
OnTimeout = Callable[[], tuple[str, str] | BaseModel]
"""What a deferred call answers when its time is up: an error ``(code, message)`` or a reply body."""

_BATCH = 64  # requests handled per wake-up before posted work and deadlines get a turn
_IDLE_WAIT_MS = 1000  # the longest sleep with nothing due (shutdown wakes the thread itself)
_STALE_COMPACT = 256  # answered calls left in the deadline heap before it is rebuilt
_ROLES_ATTR = "__cellmesh_rpc_roles__"

CONTROL: frozenset[str] = frozenset({"coordinator"})
"""Who may call a method that says nothing (:func:`callable_by`): the coordinator alone."""


_F = TypeVar("_F", bound=Callable[..., Any])


def callable_by(*roles: auth.Role) -> Callable[[_F], _F]:
    """Declare which roles may call an ``rpc_*`` method (default :data:`CONTROL`, the coordinator).

    Checked by the host against the role the job's keys authenticated the sender as (the
    connection's ``User-Id``), per request, before the body is read. Data methods that a
    worker's peers call (push/pull, barriers, the registry) name ``"worker"``.
    """
    if not roles or any(r not in auth.ROLES for r in roles):
        raise ValueError(f"callable_by needs one or more of {auth.ROLES}, got {roles}")

    def mark(fn: _F) -> _F:
        setattr(fn, _ROLES_ATTR, frozenset(roles))
        return fn

    return mark


@dataclass(frozen=True, slots=True)
class Method:
    """One ``rpc_*`` method of a hosted service: its handler, request type and the roles that may call it."""

    handler: Handler
    request_type: type[BaseModel]
    roles: frozenset[str]


@dataclass(frozen=True, slots=True)
class Peer:
    """Who sent a request.

    Attributes:
        identity: the ROUTER identity of the sender's connection (one per client socket).
        user: who the connection authenticated as (the ZAP handler's ``User-Id``); None
            while the host's sockets do not authenticate.
        address: the connection's peer address (an IP; "" when unknown). Unlike the
            identity it stays the same when a client reconnects, so faults are warned
            about per address.
    """

    identity: bytes
    user: str | None = None
    address: str = ""


Authorizer = Callable[[str, str, Peer], str | None]
"""``authorize(service, method, peer)``: None to serve the request, else the reason it is refused.

Called on the host thread for every request whose envelope is valid, before the service
is looked up (so a refused peer learns nothing about what is hosted); the refusal is
answered ``forbidden`` with the reason. It must be fast and must not block.
"""


def allow_all(service: str, method: str, peer: Peer) -> str | None:
    """The default :data:`Authorizer`: every peer may call every method (no authentication yet)."""
    return None


class Call:
    """One request in a handler's hands: its sender, its tensors, and the means to answer it."""

    def __init__(self, host: ServiceHost, peer: Peer, envelope: RequestEnvelope,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.host = host
        self.peer = peer
        self.envelope = envelope
        self.tensors = tensors
        self.tensors_out: list[tuple[str, torch.Tensor]] = []
        self.answered = False  # read and written on the host thread only
        self.deferred = False
        self.in_heap = False  # its deadline is still in the host's heap

    def defer(self, timeout: timedelta, on_timeout: OnTimeout) -> None:
        """Answer later with :meth:`reply`/:meth:`fail`; unanswered after ``timeout``, the host
        answers what ``on_timeout()`` returns (called on the host thread)."""
        self.deferred = True
        self.host._defer(self, timeout, on_timeout)

    def reply(self, body: BaseModel, tensors: NamedTensors = ()) -> None:
        """Answer the call; from any thread (the frames are built here, sent by the host thread).

        The tensors are sent zero-copy: keep them unchanged until the reply is on its way.
        """
        frames = reply_frames(self.envelope.id, body, tensors)
        self.host.post(lambda: self.host._answer(self, frames))

    def fail(self, code: str, message: str) -> None:
        """Answer the call with an error; from any thread."""
        frames = error_frames(self.envelope.id, code, message)
        self.host.post(lambda: self.host._answer(self, frames))


class ServiceBase:
    """Base of every service: ``rpc_*`` methods are found by reflection with their request types.

    Attributes:
        error_codes: exceptions a handler raises as an answer rather than as a bug, each with
            the error code it is answered with (the first match wins; ``str(exc)`` is the
            message). Any other exception is logged with its traceback and answered
            ``internal``; :class:`RpcError` always answers its own code.
    """

    error_codes: ClassVar[tuple[tuple[type[Exception], str], ...]] = ()

    def rpc_methods(self) -> dict[str, Method]:
        methods: dict[str, Method] = {}
        for name, fn in inspect.getmembers(self, predicate=inspect.ismethod):
            if not name.startswith("rpc_") or name == "rpc_methods":
                continue
            hints = typing.get_type_hints(fn)
            params = [p for p in inspect.signature(fn).parameters if p != "self"]
            request_type = hints.get(params[0]) if params else None
            if not (isinstance(request_type, type) and issubclass(request_type, BaseModel)):
                raise ValueError(
                    f"{type(self).__name__}.{name} must be annotated "
                    "`def rpc_x(self, request: SomeMessage, call: Call) -> Reply | None`"
                )
            methods[name[4:]] = Method(fn, request_type, getattr(fn, _ROLES_ATTR, CONTROL))
        return methods

    def on_close(self) -> None:
        """Called once when the service is removed or the host stops."""


@dataclass(order=True)
class _Deferred:
    deadline: float
    order: int
    call: Call = field(compare=False)
    on_timeout: OnTimeout = field(compare=False)


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
        self.address = bind_port(self._sock, host, port)
        self._mailbox: Mailbox[Callable[[], None]] = Mailbox("service-host")
        self._deferred: list[_Deferred] = []
        self._stale = 0  # answered calls whose deadline is still in _deferred
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
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

    def start(self) -> ServiceHost:
        self._thread = threading.Thread(target=self._serve, name=f"service-host-{self.address}", daemon=True)
        self._thread.start()
        return self

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
        self._sock.close()
        self._mailbox.close()

    # -- the loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        self._thread_id = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._mailbox.socket, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(self._wait_ms()))
            if self._mailbox.socket in ready:
                self._mailbox.clear_wakeups()
            for fn in self._mailbox.take():
                self._run(fn)
            if self._sock in ready:
                for _ in range(_BATCH):
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._expire()

    def _wait_ms(self) -> int:
        if self._mailbox:
            return 0
        if not self._deferred:
            return _IDLE_WAIT_MS
        until_next = int((self._deferred[0].deadline - time.monotonic()) * 1000) + 1
        return max(0, min(_IDLE_WAIT_MS, until_next))

    def _run(self, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:  # a bug in posted work must not stop the host
            log.exception("work posted to the service host at %s failed", self.address)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deferred and self._deferred[0].deadline <= now:
            item = heapq.heappop(self._deferred)
            call = item.call
            call.in_heap = False
            if call.answered:
                self._stale -= 1
                continue
            try:
                outcome = item.on_timeout()
            except Exception as exc:
                log.exception("%s.%s: on_timeout failed", call.envelope.service, call.envelope.method)
                outcome = ("internal", f"{type(exc).__name__}: {exc}")
            if isinstance(outcome, BaseModel):
                self._answer(call, reply_frames(call.envelope.id, outcome))
            else:
                self._answer(call, error_frames(call.envelope.id, *outcome))
        if self._stale > _STALE_COMPACT and 2 * self._stale > len(self._deferred):
            self._deferred = [d for d in self._deferred if not d.call.answered]
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
        call.in_heap = True
        heapq.heappush(self._deferred, _Deferred(time.monotonic() + timeout.total_seconds(),
                                                 next(self._order), call, on_timeout))

    def _answer(self, call: Call, frames: list[Any]) -> None:
        """Send ``frames`` as the one answer to ``call`` (later answers are dropped)."""
        if call.answered:
            return
        call.answered = True
        if call.in_heap:
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
