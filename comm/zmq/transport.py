"""Point-to-point channels of the ZeroMQ backend: sockets, message matching, deadlines, liveness.

Every ordered pair of ranks (i -> j) that exchanges messages has its own channel: i owns a
PUSH socket connected to a PULL socket that j bound for i alone. So a receiver reads exactly
the peer it waits for, and ZeroMQ's per-connection ordering gives per-pair FIFO order. A
channel is made when it is first used: the card gives only the rank's door, which a sender
asks for the channel's address at its first message ([Note: one door per rank, channels on
demand] in ``comm/zmq/door.py``).

Matching. A reader wants one message key ``(group, kind, seq, tag, part)``. It first
looks in the channel's stash (messages read earlier that belonged to another
operation), then reads the socket; a message with another key is stashed for its
owner. Readers hold the channel's lock only while reading one message, so two threads
waiting on the same peer (a blocking recv and an async collective) never deadlock.

Progress. Sends go to libzmq at once (its I/O threads move the bytes in the
background); receives are completed by whichever thread waits for them. Bytes in flight
arrive into libzmq's queue meanwhile, so transfers overlap the caller's compute.

Zero copy. Sends hand libzmq a view of the tensor's memory (``copy=False``) and keep
the tracker: a region must not be written until its tracker is done (see
:meth:`Transport.send`). Receives hand back libzmq's frame, which callers reduce
from or copy into place.

Shared memory. Between two ranks on the same host a body goes through a slot of the
receiver's shared-memory inbox when one is free, and its header through the inbox's ring
(see [Note: the shared-memory inbox] in ``comm/zmq/shm.py``): the send copies once, needs
no tracker and makes no socket call, and the receiver reads the header from the ring, the
body from the slot, and hands the slot back with :meth:`Transport.release` once it has
reduced or copied it. With a full ring the header goes by socket, naming the slot; with no
free slot the whole message goes by socket. A reader looks at the ring first, then the
socket, and sleeps on both (the socket and the inbox's doorbell).

[Note: the socket read while the ring feeds]
A receiver whose messages are always in the ring when it asks never sleeps, so it would never read its
socket: whatever waits there (a header naming a slot, sent while the ring was full, or a stranger's
garbage) would wait unread for as long as the ring keeps up, and garbage would be refused and counted
only when the receiver happens to fall behind. So every look first asks the socket whether a message is
queued (``ZMQ_EVENTS``, one cheap call) and reads one if so: a socket never holds an unread message
for longer than the receiver's next receive.

[Note: a receiver woken, not polling]
A receiver blocked on a peer sleeps in one poll on its socket, its inbox's doorbell and its channel's
wake pipe, until the message, its deadline, or a wake-up: :meth:`Transport.close` and a rank found gone
(:meth:`Rendezvous.on_loss`) write to every channel's pipe, and the receiver then looks at the
rendezvous and its deadline. (It used to wake every 100 ms to look: a pipeline's blocked ranks cost
ten wake-ups a second each, thousands a second in a process of many hollow workers.) A look a second
(:data:`_LONGEST_SLEEP_MS`) stays, in case a wake-up is missed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import zmq

from comm.base import timeout_error
from comm.errors import CommError, CommTimeoutError, PeerLostError, ProtocolError
from comm.refusals import peer_address, refuse
from comm.rendezvous import Rendezvous
from comm.sockets import SocketLimits, bind_port, default_host, ipc_endpoint, make_socket
from comm.traffic import SENT, ZMQ
from comm.wake import WakePipe
from comm.wire import (
    MessageKey,
    TensorHeader,
    WireError,
    decode_header,
    dtype_name,
    encode_header,
)
from comm.zmq import shm
from comm.zmq.door import ChannelAddress, ChannelRequest, Door, ask

__all__ = ["Body", "Deadline", "Transport"]

log = logging.getLogger(__name__)

_POLL_SLICE_MS = 100  # how often a blocked sender (or a channel's opening) checks its deadline and liveness
_LONGEST_SLEEP_MS = 1000  # the longest a blocked reader sleeps unwoken ([Note: a receiver woken, ...])
_CLOSE_WAIT_S = 2.0  # how long close() waits for a thread inside a channel ([Note: closing under ...])
_CLOSED_GRACE_S = 1.0  # a peer that closed cleanly may still have messages on the wire
STASH_LIMIT_BYTES = 4 << 30
ZERO_COPY_MIN_BYTES = 64 << 10  # smaller bodies are copied into the message: cheaper than tracking them


class Deadline:
    """A point in time by which an operation must finish, with the operation's name for errors."""

    __slots__ = ("at", "op", "timeout")

    def __init__(self, timeout: timedelta, op: str) -> None:
        self.timeout = timeout.total_seconds()
        self.at = time.monotonic() + self.timeout
        self.op = op  # the call with its arguments, for messages: "recv(src=0, tag=3)"

    def left_ms(self) -> int:
        return max(0, int((self.at - time.monotonic()) * 1000))

    def expired(self) -> bool:
        return time.monotonic() >= self.at

    def timed_out(self, rank: int | None, whom: str, *, peer: int | None) -> CommTimeoutError:
        """The error of this deadline's operation, which gave up waiting for ``whom``."""
        return timeout_error(self.op, rank, self.timeout, whom, peer=peer)


def host_key() -> str:
    """Identifies this host's filesystem namespace: hostname plus the kernel's boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


class _Copied:
    """A body held in private memory (a shared-memory body stashed for a later reader)."""

    __slots__ = ("buffer",)

    def __init__(self, data: bytes) -> None:
        self.buffer = memoryview(data)


Body = zmq.Frame | shm.ShmBody | _Copied  # what a receive hands back: all have ``.buffer``


class _Channel:
    def __init__(self, peer: int) -> None:
        self.peer = peer
        self.push: zmq.Socket[bytes] | None = None
        self.pull: zmq.Socket[bytes] | None = None
        self.send_lock = threading.Lock()
        self.recv_lock = threading.Lock()
        self.stash: dict[MessageKey, deque[tuple[TensorHeader, Body]]] = {}
        self.stash_bytes = 0
        self.address = ""  # where the PUSH socket connects (the peer's door tells, at the first send)
        self.inbox_path = ""  # the peer's shared-memory inbox for this rank ("" : none)
        self.bound = ChannelAddress(tcp="")  # where the PULL socket listens, once bound
        self.inbox: shm.Inbox | None = None  # messages from this peer in shared memory
        self.outbox: shm.Outbox | None = None  # messages to this peer in shared memory
        self.poller: zmq.Poller | None = None  # the PULL socket, the inbox's doorbell, the wake pipe
        self.wake: WakePipe | None = None  # the wake pipe, once bound ([Note: a wake pipe] in comm/wake.py)


class Transport:
    """The sockets of one rank of a ZeroMQ communicator, shared by its sub-groups.

    Args:
        rendezvous: the world's rendezvous (addresses and liveness).
        host: the address to bind data sockets on (:func:`comm.sockets.default_host` by default).
    """

    def __init__(self, rendezvous: Rendezvous, *, host: str | None = None,
                 transport: Literal["auto", "tcp"] = "auto") -> None:
        if transport not in ("auto", "tcp"):
            raise ValueError(f"transport must be 'auto' or 'tcp', got {transport!r}")
        self.transport = transport
        self._ipc_paths: list[str] = []
        self.rendezvous = rendezvous
        self.rank = rendezvous.rank
        self.world_size = rendezvous.world_size
        self.host = host or default_host()
        self.channels: dict[int, _Channel] = {}  # made as first used ([Note: one door per rank, ...])
        self.bad_messages = 0
        self._ring = shm.ring_enabled()
        self._closed = False
        self._lock = threading.Lock()  # makes channels and binds their PULL sockets
        rendezvous.on_loss(self._wake_receivers)
        self._door: Door | None = None
        self._cards: list[dict[str, Any]] = []
        self._with_inbox: set[int] = set()
        self._host_key = host_key()

    def bind(self) -> dict[str, Any]:
        """Open this rank's door; return the card entries peers find it with (a few hundred bytes, whatever
        the group's size: [Note: one door per rank, channels on demand] in ``comm/zmq/door.py``).

        The door is bound on TCP and, unless ``transport="tcp"``, also on a Unix domain socket
        (``ipc://``); so is each channel it opens: a peer on the same host (same hostname and boot id)
        connects over IPC, which skips the TCP stack (see docs/benchmarks.md), and writes large bodies
        into the shared-memory inbox made for it (``comm/zmq/shm.py``).
        """
        # at most a budget of same-host peers gets an inbox ([Note: which peers get an inbox], shm.py)
        if self.transport != "tcp" and shm.available():
            self._with_inbox = set(shm.inbox_peers(self.rank, self.world_size, shm.inbox_budget()))
        self._door = Door(self.rank, self.world_size, self.host, ipc=self.transport != "tcp",
                          open_channel=self._answer_door)
        return {"door": self._door.tcp, "door_ipc": self._door.ipc, "host_key": self._host_key}

    def connect(self, cards: list[dict[str, Any]]) -> None:
        """Keep the peers' cards: a channel's PUSH socket connects at its first message, to the address the
        peer's door gives (see [Note: connecting at the first message])."""
        self._cards = cards

    def _channel(self, peer: int) -> _Channel:
        ch = self.channels.get(peer)
        if ch is None:
            if not 0 <= peer < self.world_size or peer == self.rank:
                raise CommError(f"rank {self.rank}: rank {peer} is not a peer in a group of "
                                f"{self.world_size}")
            with self._lock:
                ch = self.channels.setdefault(peer, _Channel(peer))
        return ch

    def _answer_door(self, request: ChannelRequest) -> ChannelAddress:
        """The door's callback: the channel from ``request.src``, bound if it was not."""
        return self._inbound(self._channel(request.src), request.host_key).bound

    def _inbound(self, ch: _Channel, peer_host: str | None = None) -> _Channel:
        """``ch`` with its PULL socket bound (and the peer's shared-memory inbox made, if it gets one).

        ``peer_host``: the peer's host key (its card's when not given).
        """
        if ch.pull is not None:
            return ch
        with self._lock:
            if self._closed:  # [Note: closing under the channel's locks]
                raise self._closed_error(f"opening the channel from rank {ch.peer}")
            if ch.pull is not None:  # bound by another thread meanwhile
                return ch  # type: ignore[unreachable]  # mypy does not see the other thread
            if peer_host is None:
                peer_host = self._cards[ch.peer].get("host_key") if self._cards else None
            pull = make_socket(zmq.PULL, SocketLimits.data(), curve="server", plane="data")
            try:
                tcp, ipc, inbox = bind_port(pull, self.host), "", None
                if self.transport != "tcp":
                    ipc, path = ipc_endpoint(f"ch{self.rank}")
                    pull.bind(ipc)
                    if path is not None:
                        self._ipc_paths.append(path)
                    if ch.peer in self._with_inbox and peer_host == self._host_key:
                        try:
                            inbox = shm.Inbox()
                        except OSError as exc:  # /dev/shm full or missing: bodies go through the socket
                            log.warning("[rank %d] no shared-memory inbox for rank %d (%s); using the socket",
                                        self.rank, ch.peer, exc)
            except zmq.ZMQError as exc:
                pull.close(linger=0)
                raise CommError(f"rank {self.rank}: cannot bind the channel from rank {ch.peer}: "
                                f"{exc}") from exc
            ch.poller = zmq.Poller()
            ch.poller.register(pull, zmq.POLLIN)
            if inbox is not None:
                ch.inbox = inbox
                ch.poller.register(inbox.bell, zmq.POLLIN)
            wake = WakePipe()  # [Note: a receiver woken, not polling]
            ch.poller.register(wake.fd, zmq.POLLIN)
            ch.wake = wake
            ch.bound = ChannelAddress(tcp=tcp, ipc=ipc, shm=inbox.path if inbox is not None else "")
            ch.pull = pull  # last: a reader takes the channel as bound once it is set
        return ch

    def _opened(self, ch: _Channel, deadline: Deadline | None = None,
                members: tuple[int, ...] = ()) -> _Channel:
        """``ch`` with its PUSH socket connected (and the peer's inbox mapped), at its first message.

        [Note: connecting at the first message]
        A communicator's collectives and transfers send to few of its peers: a ring's next rank, recursive
        doubling's log2 N partners, a pipeline's neighbours. Connecting to every peer at the start made a
        rank of N open N - 1 sockets and CURVE handshakes it mostly never used (a data-parallel group of
        1,024 workers: about a million connections, see docs/benchmarks.md). A channel connects at its
        first message instead, to the address the peer's door gives for it (``comm/zmq/door.py``); ZeroMQ
        queues that message until the handshake is done, as it queued the first message of a connection
        made at the start. Until then the peer's liveness is the rendezvous's, as before.

        Raises:
            CommError: The peer's door refused or could not be reached; or ZeroMQ refuses its address.
            PeerLostError, CommTimeoutError: The peer was lost, or ``deadline`` passed, while asking.
        """
        if ch.push is not None:
            return ch
        with ch.send_lock:
            if self._closed:  # [Note: closing under the channel's locks]
                raise self._closed_error(f"connecting to rank {ch.peer}")
            if ch.push is None:
                if not ch.address:
                    self._ask(ch, deadline, members)
                push = make_socket(zmq.PUSH, SocketLimits.data(), curve="client", plane="data")
                try:
                    push.connect(ch.address)
                except zmq.ZMQError as exc:  # a card's address ZeroMQ cannot take: no socket left behind
                    push.close(linger=0)
                    raise CommError(f"rank {self.rank}: cannot connect to rank {ch.peer} at {ch.address!r}: "
                                    f"{exc}") from exc
                if ch.inbox_path:
                    try:
                        ch.outbox = shm.Outbox(ch.inbox_path)
                    except OSError as exc:
                        log.warning("[rank %d] cannot map rank %d's shared-memory inbox (%s); using the "
                                    "socket", self.rank, ch.peer, exc)
                ch.push = push
        return ch

    def _ask(self, ch: _Channel, deadline: Deadline | None, members: tuple[int, ...]) -> None:
        """Ask ``ch``'s peer's door for the channel's address (under the channel's send lock)."""
        if not self._cards:
            raise CommError(f"rank {self.rank}: sending to rank {ch.peer} before the ranks met (connect)")
        card = self._cards[ch.peer]
        same_host = self.transport != "tcp" and card.get("host_key") == self._host_key
        door = card.get("door_ipc") if same_host and card.get("door_ipc") else card.get("door")
        if not isinstance(door, str) or not door:
            raise CommError(f"rank {self.rank}: rank {ch.peer}'s card gives no door: {sorted(card)}")
        wait = deadline or Deadline(timedelta(seconds=60), f"opening the channel to rank {ch.peer}")

        def check() -> None:
            self._check_progress(ch.peer, wait, members or (self.rank, ch.peer), "to open its channel")

        got = ask(door, ChannelRequest(src=self.rank, host_key=self._host_key), deadline_at=wait.at,
                  slice_ms=_POLL_SLICE_MS, check=check, what=f"rank {self.rank}: opening the channel to "
                  f"rank {ch.peer}")
        ch.address = got.ipc if same_host and got.ipc else got.tcp
        ch.inbox_path = got.shm if same_host and got.ipc and got.shm and shm.available() else ""

    # -- sending ----------------------------------------------------------------------

    def send(
        self,
        peer: int,
        header: TensorHeader,
        body: np.ndarray[Any, Any] | bytes,
        deadline: Deadline,
        members: tuple[int, ...],
    ) -> zmq.MessageTracker | None:
        """Queue one message to ``peer``; return the tracker of a zero-copy body (None if copied).

        Through shared memory (same host, a free slot and room in the ring) it never blocks
        and never touches the socket. Otherwise it blocks only while the channel is at its
        high-water mark, bounded by ``deadline``. The body's bytes count as sent by ``zmq``
        (:data:`comm.traffic.SENT`) once shared memory or libzmq took them.
        """
        ch = self.channels.get(peer)
        if ch is None or ch.push is None:
            ch = self._opened(self._channel(peer), deadline, members)
        assert ch.push is not None
        size = body.nbytes if isinstance(body, np.ndarray) else len(body)
        box = ch.outbox
        frames: list[Any] | None = None
        if box is not None and isinstance(body, np.ndarray) and size >= shm.MIN_BYTES:
            with ch.send_lock:
                if self._closed:  # [Note: closing under the channel's locks]
                    raise self._closed_error(f"sending to rank {peer}")
                slot = box.put(body)
                if slot is not None:
                    encoded = header.encode(slot)
                    if self._ring and box.post(encoded):
                        SENT.add(ZMQ, size)
                        return None
                    frames = [encoded]  # the ring is full: the header goes by socket, naming the slot
        if frames is None:
            frames = [header.encode(), body]
        # a tracked zero-copy send costs ~0.1 ms of pyzmq bookkeeping: only a large body is worth it
        zero_copy = len(frames) == 2 and size >= ZERO_COPY_MIN_BYTES
        with ch.send_lock:
            if self._closed:  # [Note: closing under the channel's locks]
                raise self._closed_error(f"sending to rank {peer}")
            while True:
                try:
                    if zero_copy:
                        tracker = ch.push.send_multipart(frames, flags=zmq.NOBLOCK, copy=False, track=True)
                    else:
                        tracker = ch.push.send_multipart(frames, flags=zmq.NOBLOCK, copy=True)
                    break
                except zmq.Again:
                    self._check_progress(peer, deadline, members, "to take the message")
                    ch.push.poll(min(_POLL_SLICE_MS, deadline.left_ms() + 1), zmq.POLLOUT)
        SENT.add(ZMQ, size)  # the body, by socket or shared memory alike (see comm/traffic.py)
        return tracker if isinstance(tracker, zmq.MessageTracker) else None

    def post(self, peer: int, group: str, kind: int, seq: int, tag: int, t: torch.Tensor) -> bool:
        """Hand the contiguous CPU tensor ``t`` (one part: at most ``CHUNK_BYTES``) to a same-host ``peer``
        through shared memory: a slot and a ring record, no socket, never blocking.

        Returns False, having sent nothing, when that is not possible (no outbox, the ring off or
        full, no free slot, a body under ``shm.MIN_BYTES``): send it with :meth:`send` then.
        Raises ValueError for a dtype the wire does not carry (nothing sent).
        """
        ch = self._channel(peer)
        if ch.push is None:  # never blocking: the first message opens the channel in send()
            return False
        box = ch.outbox
        nbytes = t.nbytes
        if box is None or not self._ring or nbytes < shm.MIN_BYTES:
            return False
        dtype = dtype_name(t.dtype)
        assert t.is_cpu and t.is_contiguous(), "post needs a contiguous CPU tensor"
        with ch.send_lock:
            if self._closed:  # [Note: closing under the channel's locks]
                raise self._closed_error(f"sending to rank {peer}")
            slot = box.put_from(t.data_ptr(), nbytes)
            if slot is None:
                return False
            header = encode_header(group, self.rank, kind, seq, tag, 0, dtype, t.shape, 0, nbytes, slot)
            if not box.post(header):
                box.unput(slot)
                return False
        SENT.add(ZMQ, nbytes)
        return True

    # -- receiving --------------------------------------------------------------------

    def recv(
        self, peer: int, key: MessageKey, deadline: Deadline, members: tuple[int, ...]
    ) -> tuple[TensorHeader, Body]:
        """The message with ``key`` from ``peer``: its header and body (zero-copy).

        Hand the body back with :meth:`release` once it has been read.
        """
        ch = self.channels.get(peer)
        if ch is None or ch.pull is None:
            ch = self._inbound(self._channel(peer))
        pull = ch.pull
        assert pull is not None
        closed_since: float | None = None
        while True:
            with ch.recv_lock:
                if self._closed:  # [Note: closing under the channel's locks]
                    raise self._closed_error(f"receiving from rank {peer}")
                if ch.inbox is not None and int(pull.get(zmq.EVENTS)) & zmq.POLLIN:
                    # [Note: the socket read while the ring feeds]
                    got = self._read_one(ch)
                    if got is not None:
                        if got[0].key == key and key not in ch.stash:
                            return got
                        self._stash(ch, *got)
                got = self._find(ch, key)
                if got is not None:
                    return got
                inbox, poller, wake = ch.inbox, ch.poller, ch.wake
                assert poller is not None and wake is not None  # made with the PULL socket
                sleep_ms = min(_LONGEST_SLEEP_MS, deadline.left_ms() + 1)
                if closed_since is not None:  # a peer closed: its last messages get a grace, no more
                    grace_s = closed_since + _CLOSED_GRACE_S - time.monotonic()
                    sleep_ms = min(sleep_ms, int(grace_s * 1000) + 1)
                if inbox is not None:
                    inbox.sleeping()  # then one more look: see [Note: the shared-memory inbox]
                try:
                    if inbox is not None:
                        got = self._find(ch, key)
                        if got is not None:
                            return got
                    events = poller.poll(max(0, sleep_ms))
                finally:
                    if inbox is not None:
                        inbox.awake()
                socket_ready = woken = False
                for item, _ in events:
                    socket_ready = socket_ready or item is pull
                    woken = woken or item == wake.fd
                if woken:
                    wake.drain()
                if socket_ready:
                    got = self._read_one(ch)
                    if got is not None:
                        if got[0].key == key:
                            return got
                        self._stash(ch, *got)
                if events and not woken:
                    continue
            # woken, or nothing arrived: is the peer still there, is time up?
            try:
                self._check_progress(peer, deadline, members, "to send")
            except PeerLostError:
                # a peer that closed cleanly may still have this message in flight
                if self.rendezvous.lost().get(peer) != "closed":
                    raise
                closed_since = closed_since or time.monotonic()
                if time.monotonic() - closed_since > _CLOSED_GRACE_S:
                    raise

    def _find(self, ch: _Channel, key: MessageKey) -> tuple[TensorHeader, Body] | None:
        """The message with ``key`` if it is here without waiting: stashed or in the shared-memory ring.

        Every other message read from the ring on the way is stashed for its owner. The socket is
        left to :meth:`recv`'s poll, which reports a queued message at once. Call under the receive
        lock.
        """
        queue = ch.stash.get(key)
        if queue:
            header, body = queue.popleft()
            if not queue:
                del ch.stash[key]
            ch.stash_bytes -= header.nbytes
            return header, body
        inbox = ch.inbox
        if inbox is not None:
            while inbox.pending():
                got = self._read_record(ch, inbox)
                if got is not None:
                    if got[0].key == key:
                        return got
                    self._stash(ch, *got)
        return None

    def _read_record(self, ch: _Channel, inbox: shm.Inbox) -> tuple[TensorHeader, Body] | None:
        """The next message of the shared-memory ring (None: it was bad, and was dropped and counted)."""
        try:
            record = inbox.pop()
        except ProtocolError as exc:
            self._dropped(ch, "shared memory", WireError("size", str(exc)))
            return None
        try:
            header = decode_header(1, record, -1)
            if header.src != ch.peer:
                raise WireError("source", f"message claims src={header.src} on the channel from rank "
                                          f"{ch.peer}")
            try:
                return header, inbox.take(header.slot, header.nbytes)
            except ProtocolError as exc:
                raise WireError("slot", str(exc)) from None
        except WireError as exc:
            self._dropped(ch, "shared memory", exc)
            return None

    def _read_one(self, ch: _Channel) -> tuple[TensorHeader, Body] | None:
        assert ch.pull is not None
        try:
            frames = ch.pull.recv_multipart(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        try:
            body_len = len(frames[1].buffer) if len(frames) == 2 else -1
            header = decode_header(len(frames), frames[0].bytes, body_len)
            if header.src != ch.peer:
                raise WireError("source", f"message claims src={header.src} on the channel from rank "
                                          f"{ch.peer}")
            if header.slot < 0:
                return header, frames[1]
            if ch.inbox is None:
                raise WireError("slot", f"a shared-memory body from rank {ch.peer}, which has no inbox here")
            try:
                return header, ch.inbox.take(header.slot, header.nbytes)
            except ProtocolError as exc:
                raise WireError("slot", str(exc)) from None
        except WireError as exc:
            self._dropped(ch, peer_address(frames[0]) or "?", exc)
            return None

    def _dropped(self, ch: _Channel, sender: str, exc: WireError) -> None:
        """Count a bad data message (here and in :data:`comm.refusals.REFUSALS`); warn once a minute.

        One warning per sender address and reason per minute: a peer that sends garbage at
        will must not flood the log, and the counts show how much there was.
        """
        self.bad_messages += 1
        held_back = refuse("frame", f"data/{exc.reason}", (ch.peer, sender))
        if held_back is not None:
            more = (f"{held_back} more like it since the last warning" if held_back
                    else "more like it are counted, and warned about once a minute")
            log.warning("[rank %d] dropped a bad data message (%s) on the channel from rank %d, sent from "
                        "%s: %s (%s)", self.rank, exc.reason, ch.peer, sender, exc, more)

    def release(self, peer: int, body: Body) -> None:
        """``body`` (from :meth:`recv`) has been read: a shared-memory slot goes back to ``peer``."""
        if isinstance(body, shm.ShmBody) and not self._closed:  # closed: the slot matters to nobody
            inbox = self._channel(peer).inbox
            assert inbox is not None
            # not under the receive lock, which a waiting reader holds for a poll slice: a close() meanwhile
            # drops the slot table (the write below goes to a mapping the body itself keeps alive)
            with contextlib.suppress(AttributeError):
                inbox.release(body)

    def _stash(self, ch: _Channel, header: TensorHeader, body: Body) -> None:
        ch.stash_bytes += header.nbytes
        if ch.stash_bytes > STASH_LIMIT_BYTES:
            raise CommError(
                f"rank {self.rank}: over {STASH_LIMIT_BYTES >> 30} GiB of unmatched messages from rank "
                f"{ch.peer}; the ranks' operations are out of step (every rank must issue "
                "collectives in the same order, and every send needs a matching recv)"
            )
        if isinstance(body, shm.ShmBody):  # a stashed body must not hold a slot the sender waits for
            copied = _Copied(bytes(body.buffer))
            assert ch.inbox is not None  # under the receive lock, open: the slot goes back at once
            ch.inbox.release(body)
            body = copied
        ch.stash.setdefault(header.key, deque()).append((header, body))

    def _closed_error(self, what: str) -> CommError:
        return CommError(f"rank {self.rank}: {what}: this rank's communicator was closed (its service "
                         "released the run, or a step failed and was abandoned)")

    def _check_progress(self, peer: int, deadline: Deadline, members: tuple[int, ...], what: str) -> None:
        if self._closed:  # [Note: closing under the channel's locks]
            raise self._closed_error(f"waiting for rank {peer} {what}")
        self.rendezvous.check(members, deadline.op)
        if deadline.expired():
            raise deadline.timed_out(self.rank, f"rank {peer} {what}", peer=peer)

    def _wake_receivers(self) -> None:
        """Wake every receiver blocked in this transport to look at its peers and its deadline ([Note: a
        receiver woken, not polling]); any thread, never blocks."""
        for ch in list(self.channels.values()):
            wake = ch.wake
            if wake is not None:
                wake.wake()  # nothing once closed

    def close(self) -> None:
        """Close every channel's sockets and shared memory, each once no other thread is inside it.

        [Note: closing under the channel's locks] A step that fails is abandoned from another thread
        than the one still sending or receiving for it, and a ZeroMQ socket or a shared-memory mapping
        closed under a thread that uses it fails that thread in ways no error names (a socket that is
        no socket, a missing attribute; libzmq may abort, and a ``memmove`` into an unmapped inbox kills
        the process). So ``_closed`` is set first (a thread waiting in a slice raises at its next look,
        within ``_POLL_SLICE_MS``; an operation that starts later raises at once), then each channel is
        closed holding both of its locks. A channel whose lock is not free within
        ``_CLOSE_WAIT_S`` (a thread stuck outside the transport's loops) is left open, to its garbage
        collection, with a warning: a leak, not a crash.
        """
        if self._closed:
            return
        with self._lock:  # no channel is made or bound after this
            self._closed = True
        self._wake_receivers()  # each raises at its next look, now rather than at its next timeout
        if self._door is not None:
            self._door.close()
        for ch in list(self.channels.values()):
            if not ch.send_lock.acquire(timeout=_CLOSE_WAIT_S):
                log.warning("[rank %d] the channel to rank %d is still sending; left open", self.rank,
                            ch.peer)
                continue
            try:
                if not ch.recv_lock.acquire(timeout=_CLOSE_WAIT_S):
                    log.warning("[rank %d] the channel from rank %d is still receiving; left open", self.rank,
                                ch.peer)
                    continue
                try:
                    for sock in (ch.push, ch.pull):
                        if sock is not None:
                            sock.close()
                    ch.stash.clear()
                    for box in (ch.inbox, ch.outbox):
                        if box is not None:
                            box.close()
                    wake, ch.wake = ch.wake, None
                    if wake is not None:
                        wake.close()
                finally:
                    ch.recv_lock.release()
            finally:
                ch.send_lock.release()
        for path in self._ipc_paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


def wait_trackers(trackers: list[zmq.MessageTracker], deadline: Deadline,
                  rendezvous: Rendezvous | None = None, members: tuple[int, ...] = ()) -> None:
    """Wait until libzmq has released every tracked zero-copy buffer.

    A send to a peer that died never completes, so the wait runs in slices and, between
    them, asks ``rendezvous`` whether one of ``members`` was lost (raising PeerLostError
    naming it) before the deadline's CommTimeoutError.
    """
    for tracker in trackers:
        while not tracker.done:
            left = deadline.at - time.monotonic()
            try:
                tracker.wait(max(0.0, min(left, _POLL_SLICE_MS / 1000)))
                continue
            except zmq.NotDone:
                pass
            # a whole slice without completion: is a member gone, is time up?
            if rendezvous is not None:
                rendezvous.check(members, deadline.op)
            if deadline.expired():
                rank = None if rendezvous is None else rendezvous.rank
                raise deadline.timed_out(rank, "a send to complete", peer=None)
    trackers.clear()
