"""Pipelined RPC: many requests in flight to many service hosts, replies handled as they arrive.

:class:`~comm.rpc.client.RpcClient` has one call in flight at a time. A parameter-service
client wants the opposite: send every part of a push or pull to every shard first, then
take the replies in whatever order they come, copying each one's tensors while ZeroMQ's
I/O threads are still moving the next ones. :func:`run_calls` does that with one DEALER
socket per host (:class:`PipelinedConnection`) and one poller, on the calling thread. It
speaks the one framing of :mod:`comm.rpc.framing` (same host, same validation).

Retries: when the deadline passes with calls unanswered, those are sent again (same
bodies, new request ids; a late reply under an old id still counts) up to ``retries``
times; only idempotent requests should be retried (pulls are; pushes carry ``(replica,
step, seq, part)`` for that).

Tensors sent are zero-copy views: they must stay unchanged until :func:`run_calls`
returns. After it raised ``TimeoutError``, a request may still be queued for an
unresponsive host and read the tensors later.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import zmq
from pydantic import BaseModel

from comm.rpc.framing import open_reply, read_reply, request_frames
from comm.sockets import make_socket

__all__ = ["PipelinedCall", "PipelinedConnection", "run_calls"]

log = logging.getLogger(__name__)

OnReply = Callable[[int, Any, dict[str, torch.Tensor]], None]


class PipelinedConnection:
    """One DEALER connection to one :class:`~comm.rpc.host.ServiceHost`; many requests in flight.

    Use from one thread at a time.
    """

    def __init__(self, address: str) -> None:
        self.address = address
        self._sock = make_socket(zmq.DEALER)
        self._sock.connect(address)
        self._ids = itertools.count(1)

    @property
    def socket(self) -> zmq.Socket[bytes]:
        return self._sock

    def send(self, service: str, method: str, request: BaseModel,
             tensors: Sequence[tuple[str, torch.Tensor]] = ()) -> int:
        """Queue one request (tensors as zero-copy frames); return its request id."""
        request_id = next(self._ids)
        self._sock.send_multipart(request_frames(request_id, service, method, request, tensors), copy=False)
        return request_id

    def close(self) -> None:
        self._sock.close()


@dataclass
class PipelinedCall:
    """One logical call: where it goes, what it says, and the model its reply must fit."""

    conn: PipelinedConnection
    service: str
    method: str
    request: BaseModel
    reply_type: type[BaseModel]
    tensors: Sequence[tuple[str, torch.Tensor]] = ()
    optional: bool = False  # no longer awaited once another call failed (e.g. a pull behind a push)
    done: bool = field(default=False, init=False)

    def describe(self) -> str:
        return f"{self.service}.{self.method} at {self.conn.address}"


def run_calls(calls: Sequence[PipelinedCall], on_reply: OnReply, *, timeout: timedelta,
              retries: int = 0) -> None:
    """Send every call, then hand each validated reply to ``on_reply(index, body, tensors)``.

    ``on_reply`` runs on this thread, once per call, as replies arrive; its tensors are
    read-only views of the received frames (copy what you keep). After a call failed, every
    call not marked ``optional`` is still waited for (so no request still reads its
    tensors when this returns); a reply that comes after is dropped by the next run.

    Raises:
        RpcError: a host answered a call with an error (the first such error).
        TimeoutError: calls still unanswered after ``retries + 1`` attempts of ``timeout``,
            naming them.
        Exception: whatever ``on_reply`` raised (the first one).
    """
    pending: dict[tuple[int, int], int] = {}  # (connection, request id) -> call index
    conns = list({id(c.conn): c.conn for c in calls}.values())
    poller = zmq.Poller()
    for conn in conns:
        poller.register(conn.socket, zmq.POLLIN)
    first_error: BaseException | None = None

    def send(index: int) -> None:
        c = calls[index]
        pending[(id(c.conn), c.conn.send(c.service, c.method, c.request, c.tensors))] = index

    def awaited() -> list[int]:
        return [i for i, c in enumerate(calls) if not c.done and not (first_error and c.optional)]

    for index in range(len(calls)):
        send(index)
    for attempt in range(retries + 1):
        deadline = time.monotonic() + timeout.total_seconds()
        while awaited():
            wait = deadline - time.monotonic()
            if wait <= 0:
                break
            for sock, _ in poller.poll(int(wait * 1000) + 1):
                conn = next(c for c in conns if c.socket is sock)
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    error = _handle(frames, conn, pending, calls, on_reply)
                    first_error = first_error or error
        unanswered = awaited()
        if not unanswered:
            break
        if attempt < retries:
            log.warning("%d calls unanswered after %.1fs (attempt %d of %d), sending again: %s",
                        len(unanswered), timeout.total_seconds(), attempt + 1, retries + 1,
                        [calls[i].describe() for i in unanswered[:4]])
            for index in unanswered:
                send(index)
    unanswered = awaited()
    if unanswered:
        names = [calls[i].describe() for i in unanswered]
        more = "..." if len(names) > 4 else ""
        raise TimeoutError(f"{len(names)} calls got no reply in {retries + 1} attempts of "
                           f"{timeout.total_seconds():.1f}s: {names[:4]}{more}")
    if first_error is not None:
        raise first_error


def _handle(frames: list[zmq.Frame], conn: PipelinedConnection, pending: dict[tuple[int, int], int],
            calls: Sequence[PipelinedCall], on_reply: OnReply) -> BaseException | None:
    """Match one reply to its call and hand it over; return the call's error, if any."""
    reply = read_reply(frames[0].bytes, conn.address)
    if reply is None:
        return None
    index = pending.pop((id(conn), reply.id), None)
    if index is None or calls[index].done:
        return None  # a late duplicate of a call already answered
    call = calls[index]
    call.done = True
    try:
        body, tensors = open_reply(reply, frames[1:], call.reply_type, call.service, call.method)
        on_reply(index, body, tensors)
    except Exception as exc:
        return exc
    return None
