"""A rank's door: the one address its card gives, where a peer asks for the channel it sends on.

[Note: one door per rank, channels on demand]
A channel (i -> j) is a PULL socket that j binds for i alone (``comm/zmq/transport.py``): a reader then
reads exactly the peer it waits for, and the connection is the source check. Binding one per peer at the
start made each rank of N hold N - 1 listening sockets (about three descriptors each) and put N - 1 pairs
of addresses in its card, which every rank reads: a 1,024-rank group held ~6,000 descriptors a rank and
read ~70 GB of cards through the registry to start. The collectives and the pipelines send to few peers
(a ring's neighbour, doubling's log2 N partners, a stage's neighbours), so a rank now binds a channel only
for a peer that sends to it, or that it receives from:

* the card gives the door (a ROUTER socket, on TCP and on IPC) and the host key, a few hundred bytes
  whatever the group's size;
* a sender's first message to a peer asks the peer's door for the channel (:func:`ask`: one request,
  one reply, on a socket closed after it), then connects its PUSH socket to the address it got;
* the door's thread binds the channel when asked (:class:`Door` calls the transport back), and a reader
  binds it when it first waits on the peer, whichever comes first; the reply names the same channel
  either way.

The door serves from its own thread, so a sender never waits for the receiver to reach a receive (a
symmetric exchange of first sends would otherwise deadlock). Garbage at the door is refused, counted
(``comm/refusals.py``, reason ``door/...``) and answered with an error where it can be; the door keeps
serving. A request names its source rank, as a data header does: any member of the job may ask for any
channel, exactly as any member could read any channel's address from the cards before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import zmq
from pydantic import Field

from comm.codec import Message, pack, unpack
from comm.errors import CommError, ProtocolError
from comm.refusals import peer_address, refuse
from comm.sockets import SocketLimits, bind_port, ipc_endpoint, make_socket, shared_context

__all__ = ["ChannelAddress", "ChannelRequest", "Door", "ask"]

log = logging.getLogger(__name__)

DOOR_MAX_MESSAGE = 4096  # a request is a few dozen bytes
_SERVE_SLICE_MS = 5000  # how often the door's thread looks whether it was closed (close() also wakes it)
_JOIN_S = 2.0


class ChannelRequest(Message):
    """Asks a rank for the channel ``src`` sends it messages on."""

    src: int = Field(ge=0)
    host_key: str = Field(max_length=512)  # the sender's host (a shared-memory inbox only on the same one)


class ChannelAddress(Message):
    """Where the channel's PULL socket listens: TCP, IPC ("" without) and the shared-memory inbox ("" none);
    or, with ``error``, why there is none."""

    tcp: str = Field(default="", max_length=512)
    ipc: str = Field(default="", max_length=512)
    shm: str = Field(default="", max_length=512)
    error: str = Field(default="", max_length=2048)


class Door:
    """The ROUTER socket a rank's peers ask for their channels on, served by its own thread.

    Args:
        rank, world_size: the rank the door opens channels to, and its group's size.
        host: the interface to bind on.
        ipc: bind an IPC address too (for peers on the same host).
        open_channel: binds (or finds) the channel from a peer and returns its address; raises
            :class:`CommError` when it cannot.
    """

    def __init__(self, rank: int, world_size: int, host: str, *, ipc: bool,
                 open_channel: Callable[[ChannelRequest], ChannelAddress]) -> None:
        self.rank, self.world_size = rank, world_size
        self._open = open_channel
        self._sock = make_socket(zmq.ROUTER, SocketLimits(max_message=DOOR_MAX_MESSAGE), curve="server",
                                 plane="data")
        self._path: str | None = None
        try:
            self.tcp = bind_port(self._sock, host)
            self.ipc = ""
            if ipc:
                self.ipc, self._path = ipc_endpoint(f"door{rank}")
                self._sock.bind(self.ipc)
        except BaseException:
            self._sock.close(linger=0)
            raise
        self.served = 0
        self._stop = threading.Event()
        # close() wakes the thread through this (an idle door then costs no wake-ups: a process may hold
        # hundreds of them, the hollow fleet thousands)
        self._bell_address = f"inproc://cm-door-bell-{uuid.uuid4().hex}"
        self._bell = shared_context().socket(zmq.PULL)
        self._bell.bind(self._bell_address)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._bell, zmq.POLLIN)
        self._thread = threading.Thread(target=self._serve, name=f"zmq-door-{rank}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        sock = self._sock
        while not self._stop.is_set():
            try:
                if not dict(self._poller.poll(_SERVE_SLICE_MS)).get(sock):
                    continue
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                continue
            except zmq.ZMQError:  # closed under the thread: only after close() gave up waiting for it
                return
            reply = self._answer(frames)
            if reply is None:
                continue
            # the asker gone (ROUTER drops what it cannot route): nothing to tell
            with contextlib.suppress(zmq.ZMQError):
                sock.send_multipart([frames[0], pack(reply)], flags=zmq.NOBLOCK)

    def _answer(self, frames: list[zmq.Frame]) -> ChannelAddress | None:
        """The reply to one request (None: none can be routed back)."""
        if len(frames) != 2:  # a DEALER sends [payload]; the ROUTER puts the asker's routing id first
            self._refused("frames", f"{len(frames) - 1} frames, not one", frames[-1])
            return None if len(frames) < 2 else ChannelAddress(error="a request is one frame")
        try:
            request = unpack(frames[1].bytes, ChannelRequest, what="channel request")
            if not request.src < self.world_size or request.src == self.rank:
                raise ProtocolError(f"channel request: src={request.src} is not another rank of this group "
                                    f"of {self.world_size} (this is rank {self.rank})")
        except ProtocolError as exc:
            self._refused("request", str(exc), frames[1])
            return ChannelAddress(error=str(exc)[:2000])
        try:
            address = self._open(request)
        except CommError as exc:
            return ChannelAddress(error=str(exc)[:2000])
        except Exception as exc:  # a bug here must not end the door: the peer hears of it, the log has it
            log.exception("[rank %d] the channel door failed to open the channel from rank %d", self.rank,
                          request.src)
            return ChannelAddress(error=f"rank {self.rank} failed to open the channel: "
                                        f"{type(exc).__name__}: {exc}"[:2000])
        self.served += 1
        return address

    def _refused(self, reason: str, detail: str, frame: zmq.Frame) -> None:
        sender = peer_address(frame) or "?"
        if refuse("frame", f"door/{reason}", sender) is not None:
            log.warning("[rank %d] refused a request at its channel door from %s: %s", self.rank, sender,
                        detail)

    def close(self) -> None:
        """Stop serving and close the socket."""
        self._stop.set()
        ring = shared_context().socket(zmq.PUSH)
        try:
            ring.connect(self._bell_address)
            ring.send(b"", flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the thread still stops within its slice
            pass
        finally:
            ring.close(linger=0)
        if threading.current_thread() is not self._thread:
            self._thread.join(_JOIN_S)
        if self._thread.is_alive():
            log.warning("[rank %d] the channel door's thread did not stop within %.0fs; its socket is left "
                        "to garbage collection", self.rank, _JOIN_S)
        else:
            self._sock.close(linger=0)
            self._bell.close(linger=0)
        if self._path:
            with contextlib.suppress(OSError):
                os.unlink(self._path)


def ask(address: str, request: ChannelRequest, *, deadline_at: float, slice_ms: int,
        check: Callable[[], None], what: str) -> ChannelAddress:
    """Ask the door at ``address`` for a channel; ``check`` runs between waits (it raises when the peer is
    lost or time is up); the reply's ``error`` is raised as :class:`CommError`.

    Raises:
        CommError: The door refused, answered garbage, or ZeroMQ cannot take the address.
    """
    sock = make_socket(zmq.DEALER, SocketLimits(max_message=DOOR_MAX_MESSAGE), curve="client", plane="data")
    try:
        try:
            sock.connect(address)
            sock.send(pack(request), flags=zmq.NOBLOCK)  # queued until the connection is up
        except zmq.ZMQError as exc:
            raise CommError(f"{what}: cannot reach the door at {address!r}: {exc}") from exc
        while not sock.poll(max(1, min(slice_ms, int((deadline_at - time.monotonic()) * 1000) + 1)),
                            zmq.POLLIN):
            check()
        data: Any = sock.recv(flags=zmq.NOBLOCK)
    finally:
        sock.close(linger=0)
    try:
        reply = unpack(data, ChannelAddress, what="channel address")
    except ProtocolError as exc:
        raise CommError(f"{what}: the door at {address} answered garbage: {exc}") from None
    if reply.error:
        raise CommError(f"{what}: the door at {address} refused: {reply.error}")
    if not reply.tcp:
        raise CommError(f"{what}: the door at {address} gave no address")
    return reply
