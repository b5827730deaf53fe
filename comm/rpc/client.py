"""The blocking client of a :class:`~comm.rpc.host.ServiceHost`: one call in flight at a time.

Each call sends ``[envelope, *tensor frames]`` (:mod:`comm.rpc.framing`) on a DEALER socket
and waits for the reply that echoes its request id; a reply to an earlier call that timed
out arrives later with the old id and is dropped, so it is never taken for the answer to
the next one. A call waits in one poll on its socket and the client's wake pipe ([Note: a wake
pipe] in :mod:`comm.wake`), which :meth:`RpcClient.close` from another thread wakes: the close ends
a call in flight at once, and a long poll (a registry watch's, 5 s) costs one wake-up, not one every
slice (a client polled in 100 ms slices: each idle watch of a worker woke its thread 10 times a
second). For many calls in flight at once, see :mod:`comm.rpc.pipeline`.
"""

from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Any, TypeVar

import torch
import zmq
from pydantic import BaseModel

from comm.rpc.framing import NamedTensors, RpcError, open_reply, read_reply, request_frames
from comm.sockets import make_socket
from comm.wake import WakePipe

__all__ = ["RpcClient"]

R = TypeVar("R", bound=BaseModel)


class RpcClient:
    """Calls services on one :class:`~comm.rpc.host.ServiceHost`. Thread-safe (calls are serialized).

    Args:
        address: the host's ``tcp://host:port``.
        timeout: default per-call timeout.
    """

    def __init__(self, address: str, *, timeout: timedelta = timedelta(seconds=60)) -> None:
        self.address = address
        self.timeout = timeout
        self._sock: zmq.Socket[bytes] | None = make_socket(zmq.DEALER, curve="client")
        self._sock.connect(address)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closing = False
        self._wake = WakePipe()  # close() wakes a call's poll, which watches it with the socket
        self._pollers: dict[int, zmq.Poller] = {event: zmq.Poller() for event in (zmq.POLLIN, zmq.POLLOUT)}
        for event, poller in self._pollers.items():
            poller.register(self._sock, event)
            poller.register(self._wake.fd, zmq.POLLIN)

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

        ``tensors`` are sent zero-copy; the call returns once ZeroMQ no longer reads them.

        Raises:
            RpcError: the service answered with an error, or the client is closed (``closed``).
            ProtocolError: the reply does not fit ``reply_type``.
            TimeoutError: no answer within ``timeout``, naming the service and method.
        """
        limit = self.timeout if timeout is None else timeout
        what = f"{service}.{method} at {self.address}"
        with self._lock:
            sock = self._open(what)
            request_id = next(self._ids)
            deadline = time.monotonic() + limit.total_seconds()
            frames = request_frames(request_id, service, method, request, tensors)
            tracker = self._send(sock, frames, deadline, what, limit)
            while True:
                if not self._wait(sock, deadline, what):
                    raise TimeoutError(f"{what}: no reply within {limit.total_seconds():.1f}s")
                parts = sock.recv_multipart(copy=False)
                reply = read_reply(parts[0].bytes, self.address)
                if reply is not None and reply.id == request_id:
                    break  # else malformed (logged), or a late answer to an earlier call that timed out
            if isinstance(tracker, zmq.MessageTracker) and not tracker.done:
                tracker.wait(max(0.0, deadline - time.monotonic()))
        return open_reply(reply, parts[1:], reply_type, service, method)

    def send_raw(self, frames: list[bytes], *, timeout: timedelta = timedelta(seconds=10)) -> list[bytes]:
        """Send arbitrary frames and return the reply's frames (for tests of bad input)."""
        with self._lock:
            sock = self._open("a raw request")
            sock.send_multipart(frames)
            if not sock.poll(int(timeout.total_seconds() * 1000), zmq.POLLIN):
                raise TimeoutError(f"no reply from {self.address} within {timeout.total_seconds():.1f}s")
            return list(sock.recv_multipart())

    def close(self) -> None:
        """Close the socket; idempotent. A call in flight on another thread raises ``closed``."""
        self._closing = True
        self._wake.wake()  # a call's poll on another thread
        with self._lock:
            if self._sock is not None:
                for poller in self._pollers.values():
                    poller.unregister(self._sock)
                    poller.unregister(self._wake.fd)
                self._sock.close()
                self._sock = None
            self._wake.close()

    def __enter__(self) -> RpcClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _open(self, what: str) -> zmq.Socket[bytes]:
        if self._sock is None or self._closing:
            raise RpcError("closed", f"the client of {self.address} is closed; cannot send {what}")
        return self._sock

    def _send(self, sock: zmq.Socket[bytes], frames: list[Any], deadline: float, what: str,
              limit: timedelta) -> zmq.MessageTracker | None:
        """Queue the request, waiting (bounded by ``deadline``) while the send queue is full."""
        while True:
            try:
                return sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
            except zmq.Again:
                if not self._wait(sock, deadline, what, zmq.POLLOUT):
                    raise TimeoutError(f"{what}: the request could not be queued within "
                                       f"{limit.total_seconds():.1f}s (the host does not read)") from None

    def _wait(self, sock: zmq.Socket[bytes], deadline: float, what: str, event: int = zmq.POLLIN) -> bool:
        """Whether ``sock`` got ready for ``event`` before ``deadline``; a close() ends the wait at once."""
        poller = self._pollers[event]
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if self._closing:
                raise RpcError("closed", f"the client of {self.address} was closed during {what}")
            ready = dict(poller.poll(int(left * 1000) + 1))
            if ready.get(sock, 0) & event:
                return True
