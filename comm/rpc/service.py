"""The one RPC layer of cellmesh's services: a ROUTER host with typed handlers, and its client.

A service is an object whose ``rpc_<method>(self, request, call)`` methods take a pydantic
request model (found from the annotation, as hivemind's ServicerBase does) and either
return a reply model (and ``call.tensors_out``) or ``None`` after ``call.defer(...)``, to
answer later (a barrier releasing, a pull waiting for the step's update). One
:class:`ServiceHost` serves any number of named services on one socket, from one thread,
so handlers never race each other and deferred replies are sent from that same thread.

Frames. A request is ``[envelope, *tensor frames]`` (see :mod:`comm.rpc.envelope`); each
tensor is split into frames of at most CHUNK_BYTES (4 MiB). The host validates the envelope, then the
body against the handler's model, then every tensor spec against its frames, before the
handler runs; anything wrong gets an error reply naming the field and the reason, and the
host serves the next message. Received tensors are read-only views of ZeroMQ's frames:
reduce from them or copy them, never write into them.
"""

from __future__ import annotations

import contextlib
import heapq
import inspect
import itertools
import logging
import threading
import time
import typing
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, TypeVar

import torch
import zmq
from pydantic import BaseModel, ValidationError

from comm.codec import describe_validation_error, pack, unpack_raw
from comm.errors import ProtocolError
from comm.logs import log_context
from comm.rpc.envelope import ErrorBody, ReplyEnvelope, RequestEnvelope, TensorSpec
from comm.sockets import CHUNK_BYTES, bind_port, make_socket
from comm.wire import DTYPES, dtype_name, tensor_bytes

__all__ = [
    "Call",
    "RpcClient",
    "RpcError",
    "ServiceBase",
    "ServiceHost",
    "decode_tensors",
    "encode_tensors",
    "read_reply",
    "reply_error",
    "request_frames",
]

log = logging.getLogger(__name__)

R = TypeVar("R", bound=BaseModel)
NamedTensors = Sequence[tuple[str, torch.Tensor]]
Handler = Callable[[Any, "Call"], BaseModel | None]


class RpcError(RuntimeError):
    """A service answered with an error (``code`` says which kind: bad_request, not_owner, ...)."""

    def __init__(self, code: str, message: str, *, service: str = "", method: str = "") -> None:
        where = f"{service}.{method}: " if service else ""
        super().__init__(f"{where}[{code}] {message}")
        self.code = code
        self.message = message


# -- tensors as frames -------------------------------------------------------------------


def encode_tensors(tensors: NamedTensors) -> tuple[list[TensorSpec], list[Any]]:
    """Specs and frames (zero-copy views, at most CHUNK_BYTES each) for ``tensors``.

    The frames view the tensors' memory: keep the tensors unchanged until the send completed.
    """
    specs: list[TensorSpec] = []
    frames: list[Any] = []
    for name, t in tensors:
        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        data = tensor_bytes(t)
        pieces = [data[o:o + CHUNK_BYTES] for o in range(0, data.nbytes, CHUNK_BYTES)] or [data[:0]]
        specs.append(TensorSpec(name=name, dtype=dtype_name(t.dtype), shape=list(t.shape),
                                frames=len(pieces)))
        frames.extend(pieces)
    return specs, frames


def decode_tensors(specs: Sequence[TensorSpec], frames: Sequence[zmq.Frame]) -> dict[str, torch.Tensor]:
    """Tensors for ``specs`` from ``frames``, checked; single-frame tensors are zero-copy views.

    Raises:
        ProtocolError: frame count or a frame's length disagrees with the specs.
    """
    expected = sum(s.frames for s in specs)
    if expected != len(frames):
        raise ProtocolError(f"tensors: specs announce {expected} frames, the message has {len(frames)}")
    out: dict[str, torch.Tensor] = {}
    pos = 0
    for spec in specs:
        parts = frames[pos:pos + spec.frames]
        pos += spec.frames
        lengths = [len(f.buffer) for f in parts]
        if sum(lengths) != spec.nbytes or any(n > CHUNK_BYTES for n in lengths):
            raise ProtocolError(
                f"tensor {spec.name!r}: {spec.dtype}{spec.shape} needs {spec.nbytes} bytes in frames of at "
                f"most {CHUNK_BYTES}, got {lengths[:4]}{'...' if len(lengths) > 4 else ''}"
            )
        if spec.name in out:
            raise ProtocolError(f"tensor {spec.name!r} appears twice")
        dtype = DTYPES[spec.dtype]
        if spec.nbytes == 0:
            t = torch.empty(spec.shape, dtype=dtype)
        elif len(parts) == 1:
            t = torch.frombuffer(parts[0].buffer, dtype=dtype).view(spec.shape)
        else:
            flat = torch.empty(spec.nbytes, dtype=torch.uint8)
            o = 0
            for f in parts:
                n = len(f.buffer)
                flat[o:o + n].copy_(torch.frombuffer(f.buffer, dtype=torch.uint8))
                o += n
            t = flat.view(dtype).view(spec.shape)
        out[spec.name] = t
    return out


# -- request and reply frames (shared by RpcClient and comm.rpc.pipeline) ------------


def request_frames(request_id: int, service: str, method: str, request: BaseModel,
                   tensors: NamedTensors = ()) -> list[Any]:
    """``[envelope, *tensor frames]`` of one request (the frames view the tensors' memory)."""
    specs, frames = encode_tensors(tensors)
    envelope = RequestEnvelope(id=request_id, service=service, method=method,
                               body=request.model_dump(mode="python"), tensors=specs)
    return [pack(envelope), *frames]


def read_reply(envelope: bytes, address: str) -> ReplyEnvelope | None:
    """The reply envelope, or None (logged) when a host sent something malformed."""
    try:
        return ReplyEnvelope.model_validate(unpack_raw(envelope, what="reply envelope"))
    except (ValidationError, ProtocolError) as exc:
        log.error("dropped a malformed reply from %s: %s", address, exc)
        return None


def reply_error(reply: ReplyEnvelope, service: str, method: str) -> RpcError:
    """The :class:`RpcError` an error reply stands for."""
    error = reply.error or ErrorBody(code="internal", message="error reply without error")
    return RpcError(error.code, error.message, service=service, method=method)


# -- the host ---------------------------------------------------------------------------


@dataclass(order=True)
class _Deferred:
    deadline: float
    order: int
    call: Call = field(compare=False)
    on_timeout: Callable[[], tuple[str, str]] = field(compare=False)


class Call:
    """One request in a handler's hands: its tensors, and the means to answer it (now or later)."""

    def __init__(self, host: ServiceHost, identity: bytes, envelope: RequestEnvelope,
                 tensors: dict[str, torch.Tensor]) -> None:
        self.host = host
        self.identity = identity
        self.envelope = envelope
        self.tensors = tensors
        self.tensors_out: list[tuple[str, torch.Tensor]] = []
        self.answered = False
        self.deferred = False

    def defer(self, timeout: timedelta, on_timeout: Callable[[], tuple[str, str]]) -> None:
        """Answer later with :meth:`reply`/:meth:`fail`; after ``timeout`` send ``on_timeout()``'s error."""
        self.deferred = True
        self.host._defer(self, timeout, on_timeout)

    def reply(self, body: BaseModel, tensors: NamedTensors = ()) -> None:
        """Answer the call; from any thread (off the host thread it is queued to the host)."""
        items = list(tensors)
        self.host.post(lambda: self.host._reply(self, body, items))

    def fail(self, code: str, message: str) -> None:
        """Answer the call with an error; from any thread."""

        def send() -> None:
            if not self.answered:
                self.answered = True
                self.host._fail(self.identity, self.envelope.id, code, message)

        self.host.post(send)


class ServiceBase:
    """Base of every service: ``rpc_*`` methods are found by reflection with their request types."""

    def rpc_methods(self) -> dict[str, tuple[Handler, type[BaseModel]]]:
        methods: dict[str, tuple[Handler, type[BaseModel]]] = {}
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
            methods[name[4:]] = (fn, request_type)
        return methods

    def on_close(self) -> None:
        """Called once when the host stops."""


class ServiceHost:
    """Serves named services on one ROUTER socket from one background thread.

    Args:
        host: interface to bind (:func:`comm.sockets.default_host` by default).
        port: the port to bind (0: one the OS chooses).
    """

    def __init__(self, host: str | None = None, port: int = 0) -> None:
        self._services: dict[str, tuple[ServiceBase, dict[str, Any]]] = {}
        self._sock = make_socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.address = bind_port(self._sock, host, port)
        self._deferred: list[_Deferred] = []
        self._order = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._thread_id: int | None = None
        self._lock = threading.Lock()  # guards _services; handlers run on the host thread
        self.bad_requests = 0
        # other threads hand work to the host thread through a queue and an inproc wake-up
        self._posted: deque[Callable[[], None]] = deque()
        wake = f"inproc://service-host-{id(self)}"
        self._wake_in = make_socket(zmq.PAIR)
        self._wake_in.bind(wake)
        self._wake_out = make_socket(zmq.PAIR)
        self._wake_out.connect(wake)
        self._wake_lock = threading.Lock()

    def add(self, name: str, service: ServiceBase) -> None:
        """Serve ``service`` under ``name`` (its ``rpc_*`` methods are checked now)."""
        methods = service.rpc_methods()
        with self._lock:
            if name in self._services:
                raise ValueError(f"a service named {name!r} is already hosted here")
            self._services[name] = (service, methods)

    def remove(self, name: str) -> None:
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
        """Run ``fn`` on the host thread (at once, if called from it)."""
        if threading.get_ident() == self._thread_id or self._thread is None:
            fn()
            return
        self._posted.append(fn)
        with self._wake_lock, contextlib.suppress(zmq.Again):  # a wake-up is already pending
            self._wake_out.send(b"", zmq.NOBLOCK)

    def shutdown(self, timeout: timedelta = timedelta(seconds=5)) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout.total_seconds())
        for name in self.names():
            self.remove(name)
        for sock in (self._sock, self._wake_in, self._wake_out):
            sock.close()

    # -- the loop ---------------------------------------------------------------------

    def _serve(self) -> None:
        self._thread_id = threading.get_ident()
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_in, zmq.POLLIN)
        while not self._stop.is_set():
            wait_ms = 100
            if self._deferred:
                until_next = int((self._deferred[0].deadline - time.monotonic()) * 1000) + 1
                wait_ms = max(0, min(wait_ms, until_next))
            ready = dict(poller.poll(wait_ms))
            if self._wake_in in ready:
                while True:
                    try:
                        self._wake_in.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
            while self._posted:
                self._posted.popleft()()
            if self._sock in ready:
                for _ in range(64):  # a batch, then deadlines get a turn
                    try:
                        frames = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._handle(frames)
            self._expire()

    def _expire(self) -> None:
        now = time.monotonic()
        while self._deferred and self._deferred[0].deadline <= now:
            item = heapq.heappop(self._deferred)
            if not item.call.answered:
                code, message = item.on_timeout()
                item.call.fail(code, message)

    def _handle(self, frames: list[zmq.Frame]) -> None:
        identity = frames[0].bytes
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
            with self._lock:
                entry = self._services.get(envelope.service)
            if entry is None:
                self._fail(identity, request_id, "unknown_service",
                           f"no service {envelope.service!r} here; hosted: {self.names()}")
                return
            _, methods = entry
            if envelope.method not in methods:
                self._fail(identity, request_id, "unknown_method",
                           f"{envelope.service} has no method {envelope.method!r}; it has {sorted(methods)}")
                return
            fn, request_type = methods[envelope.method]
            try:
                request = request_type.model_validate(envelope.body)
            except ValidationError as exc:
                raise ProtocolError(f"{request_type.__name__}: {describe_validation_error(exc)}") from None
            tensors = decode_tensors(envelope.tensors, frames[2:])
        except ProtocolError as exc:
            self.bad_requests += 1
            log.error("rejected a bad request on %s: %s", self.address, exc)
            self._fail(identity, request_id, "bad_request", str(exc))
            return
        call = Call(self, identity, envelope, tensors)
        try:
            with log_context(service=envelope.service, step=getattr(request, "step", None)):
                result = fn(request, call)
        except RpcError as exc:
            call.fail(exc.code, exc.message)
            return
        except Exception as exc:
            log.exception("%s.%s failed", envelope.service, envelope.method)
            call.fail("internal", f"{type(exc).__name__}: {exc}")
            return
        if result is not None:
            call.reply(result, call.tensors_out)
        elif not call.deferred and not call.answered:
            call.fail("internal", f"{envelope.service}.{envelope.method} returned nothing and did not defer")

    def _defer(self, call: Call, timeout: timedelta, on_timeout: Callable[[], tuple[str, str]]) -> None:
        heapq.heappush(self._deferred, _Deferred(time.monotonic() + timeout.total_seconds(),
                                                 next(self._order), call, on_timeout))

    def _reply(self, call: Call, body: BaseModel, tensors: list[tuple[str, torch.Tensor]]) -> None:
        if call.answered:
            return
        call.answered = True
        specs, frames = encode_tensors(tensors)
        envelope = ReplyEnvelope(id=call.envelope.id, ok=True, body=body.model_dump(mode="python"),
                                 tensors=specs)
        self._send(call.identity, [pack(envelope), *frames])

    def _fail(self, identity: bytes, request_id: int, code: str, message: str) -> None:
        envelope = ReplyEnvelope(id=request_id, ok=False, error=ErrorBody(code=code, message=message))
        self._send(identity, [pack(envelope)])

    def _send(self, identity: bytes, frames: list[Any]) -> None:
        try:
            self._sock.send_multipart([identity, *frames], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            log.warning("dropped a reply to a client whose queue is full")


# -- the client -------------------------------------------------------------------------


class RpcClient:
    """Calls services on one :class:`ServiceHost`. Thread-safe (one call in flight at a time).

    Args:
        address: the host's ``tcp://host:port``.
        timeout: default per-call timeout.
    """

    def __init__(self, address: str, *, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.address = address
        self.timeout = timeout
        self._sock = make_socket(zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def call(
        self,
        service: str,
        method: str,
        request: BaseModel,
        reply_type: type[R],
        *,
        tensors: NamedTensors = (),
        timeout: timedelta | None = None,
    ) -> tuple[R, dict[str, torch.Tensor]]:
        """Send ``request`` to ``service.method``; return the validated reply and its tensors.

        Raises:
            RpcError: the service answered with an error.
            TimeoutError: no answer within ``timeout``, naming the service and method.
        """
        limit = self.timeout if timeout is None else timeout
        with self._lock:
            request_id = next(self._ids)
            frames = request_frames(request_id, service, method, request, tensors)
            tracker = self._sock.send_multipart(frames, copy=False, track=True)
            deadline = time.monotonic() + limit.total_seconds()
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not self._sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                    if time.monotonic() >= deadline:
                        raise TimeoutError(
                            f"{service}.{method} at {self.address}: no reply within "
                            f"{limit.total_seconds():.1f}s"
                        )
                    continue
                parts = self._sock.recv_multipart(copy=False)
                reply = read_reply(parts[0].bytes, self.address)
                if reply is not None and reply.id == request_id:
                    break  # else malformed, or a late answer to an earlier call that timed out
            if isinstance(tracker, zmq.MessageTracker):
                tracker.wait(max(0.0, deadline - time.monotonic()))
        if not reply.ok:
            raise reply_error(reply, service, method)
        body = reply_type.model_validate(reply.body or {})
        return body, decode_tensors(reply.tensors, parts[1:])

    def send_raw(self, frames: list[bytes], *, timeout: timedelta = timedelta(seconds=10)) -> list[bytes]:
        """Send arbitrary frames and return the reply's frames (for tests of bad input)."""
        with self._lock:
            self._sock.send_multipart(frames)
            if not self._sock.poll(int(timeout.total_seconds() * 1000), zmq.POLLIN):
                raise TimeoutError(f"no reply from {self.address} within {timeout.total_seconds():.1f}s")
            return list(self._sock.recv_multipart())

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
