"""Shared memory between peers on the same host: bodies in slots, headers in a ring, a doorbell.

Through a Unix socket a chunk is copied three times (into the kernel, out of it into
libzmq's buffer, then reduced or copied into place), every copy runs on one of the host's
few cores, and every message hops through two libzmq I/O threads. For a peer on the same
host the data channel instead hands messages over in shared memory: the sender copies the
body into a *slot* and appends the msgpack header naming the slot to a *ring*, then rings
a *doorbell*; the receiver reads the header from the ring, checks it like any header, and
reduces or copies straight out of the slot. No socket, no I/O thread, one copy.

[Note: the shared-memory inbox]
Each receiving rank creates one *inbox* per same-host peer (``/dev/shm/cellmesh-{pid}-*``,
mode 0600, allocated up front with ``posix_fallocate`` so a full ``/dev/shm`` is an error
at creation, never a SIGBUS later) and a FIFO beside it (``...-bell``, mode 0600, the
doorbell), and publishes the inbox's path in its rendezvous card; the peer maps it as its
*outbox* and opens the doorbell. The file holds, page-aligned:

- one state byte per slot (FREE or FULL);
- the ring's two counters: ``tail`` (records published, written by the sender only) and
  ``head`` (records consumed, written by the receiver only), and the receiver's ``asleep`` flag,
  each on its own cache line;
- the ring: :data:`RING` records of :data:`RECORD` bytes, each a 4-byte length and a msgpack
  tensor header (``comm/wire.py``), the same header a socket message carries;
- :data:`LARGE_SLOTS` slots of :data:`~comm.sockets.CHUNK_BYTES`, then :data:`SMALL_SLOTS`
  slots of :data:`SMALL_BYTES` (a body takes the smallest kind it fits).

The handover:

- the sender takes a FREE slot, copies the body in, sets it FULL, writes the header into
  record ``tail % RING`` (when ``tail - head < RING``) and only then stores ``tail + 1``, then
  (after a full fence) writes one byte to the doorbell if ``asleep`` is set (non-blocking; a full
  pipe already holds a wake-up);
- the receiver reads ``tail``, copies the record out, stores ``head + 1``, validates the
  header (:func:`comm.wire.decode_header`, a wrong source, a slot that does not exist, is
  too small or not FULL is refused and counted like a bad socket message), reads the slot
  and sets it FREE;
- a receiver about to sleep first sets ``asleep`` (then a full fence), empties the doorbell, looks
  at the ring once more, and only then waits on the doorbell (with the socket); it clears
  ``asleep`` once awake. The two fences order each side's store before its load (x86-64 may
  otherwise let a load overtake an earlier store: both would miss), so either the sender sees
  ``asleep`` and rings, or the receiver's last look sees the record. A byte written after its last
  look wakes it; a byte written before it was emptied was written after its record was
  published, and the pipe's lock orders that before the receiver's last look. A fence is an
  uncontended ``threading.Lock`` taken and let go (a locked instruction each, a full barrier on
  x86-64: about 0.1 us).

[Note: a doorbell only for a sleeping receiver]
A byte written to a FIFO is a system call, and when it wakes the receiver, a point at which the
scheduler may hand the sender's core to the woken thread. Ringing on every message cost a
pipeline stage 10-11% of its compute thread's samples (py-spy, 1F1B 2 x 8, two workers on a
loaded 2-core machine: ``os.write`` of the bell under ``isend``), most of them for receivers that
were computing and would find the record at their next look anyway. Now only a receiver that
is about to sleep is rung; one that never sleeps costs its senders no system call either.

Stores must become visible in program order and a store may not overtake earlier loads
(the receiver's FREE and ``head`` stores after its reads): on x86-64 (total store order)
they do, so shared memory is used there only; elsewhere :func:`available` is False and
messages go through the socket. A sender that finds no FREE slot, or a full ring, sends
through the socket instead (a slot it did get then travels by socket header, as before the
ring existed), so a slow receiver never blocks a sender, and a message a receiver stashes
(read early for another operation) is copied out and its slot freed at once, so no wait
can cycle.

[Note: which peers get an inbox]
An inbox costs :data:`INBOX_BYTES` (about 52 MiB) of ``/dev/shm`` up front, and a world of N ranks on
one host would hold N x (N - 1) of them: 3 GiB a rank at 64 ranks. So a rank makes inboxes for at most
:func:`inbox_budget` peers (``CELLMESH_SHM_PEERS``, default 8), chosen by :func:`inbox_peers` for the
traffic the collectives and schedules make: ring neighbours first (the ring all-reduce, a pipeline's
neighbouring stages, an interleaved schedule's wrap from the last rank to the first), then peers at
power-of-two distances (recursive doubling, trees), then the nearest others. The other same-host
peers send through the Unix socket, as a full inbox does; nothing else changes. A world of up to
nine ranks gives every peer an inbox, as before.

Trust: the ring and the slots are as trusted as the channel's socket is on one host: only
processes of the same user can open the 0600 files, and the receiver unlinks both once the
first message through them proves the peer mapped them (or when it closes); files of
processes that died (``kill -9``) are swept when the next inbox is created. A record is
still validated like any header, so a confused peer cannot make the receiver read outside
a slot or allocate anything.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import mmap
import os
import platform
import stat
import threading
import uuid
from typing import Any

import numpy as np

from comm.errors import ProtocolError
from comm.sockets import CHUNK_BYTES

__all__ = ["INBOX_BYTES", "LARGE_SLOTS", "MIN_BYTES", "RING", "SLOTS", "SMALL_BYTES", "SMALL_SLOTS", "Inbox",
           "Outbox", "ShmBody", "available", "inbox_budget", "inbox_peers", "ring_enabled"]

SHM_DIR = "/dev/shm"
ENABLE_ENV = "CELLMESH_SHM"
RING_ENV = "CELLMESH_SHM_RING"
# 48 MiB a peer: a 64 MiB all-reduce of two ranks keeps both ring phases in slots (measured:
# 3.1-3.9 GB/s with 12 slots, 2.2-3.1 with 6)
LARGE_SLOTS = 12
# 4 MiB a peer for bodies under 64 KiB: a pipeline's activations and gradients, 8 microbatches of
# several tensors in flight
SMALL_SLOTS = 64
SMALL_BYTES = 64 << 10
SLOTS = LARGE_SLOTS + SMALL_SLOTS  # slot indices: large ones first, then the small ones
RING = 256  # header records: more than the slots, so a ring is full only with socket-sent bodies in flight
RECORD = 256  # bytes of a record: a 4-byte length and the header (about 40-80 bytes; longer goes by socket)
# smaller bodies go through the socket (0, the default: every body through shared memory; a knob for
# tests and benchmarks)
MIN_BYTES = max(0, int(os.environ.get("CELLMESH_SHM_MIN_BYTES", "0")))
_PAGE = 4096
_STATE = 0  # state bytes, one page
_TAIL, _HEAD, _ASLEEP = _PAGE, _PAGE + 64, _PAGE + 128  # the ring's counters and the flag, a cache line each
_RING_AT = 2 * _PAGE
_LARGE_AT = _RING_AT + -(-RING * RECORD // _PAGE) * _PAGE
_SMALL_AT = _LARGE_AT + LARGE_SLOTS * CHUNK_BYTES
_SIZE = _SMALL_AT + SMALL_SLOTS * SMALL_BYTES
INBOX_BYTES = _SIZE
PEERS_ENV = "CELLMESH_SHM_PEERS"
DEFAULT_PEERS = 8
_FREE, _FULL = 0, 1
_PREFIX = "cellmesh-"
_BELL = "-bell"


def available() -> bool:
    """True where same-host messages may go through shared memory: x86-64 with a /dev/shm, unless
    ``CELLMESH_SHM=0`` turns it off (then every message goes through the socket)."""
    if os.environ.get(ENABLE_ENV, "1").strip() == "0":
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def inbox_budget() -> int:
    """How many peers a rank makes inboxes for (``CELLMESH_SHM_PEERS``, default :data:`DEFAULT_PEERS`).

    Raises:
        ValueError: The variable is not a whole number of at least 0.
    """
    raw = os.environ.get(PEERS_ENV, str(DEFAULT_PEERS)).strip()
    try:
        budget = int(raw)
    except ValueError:
        budget = -1
    if budget < 0:
        raise ValueError(f"{PEERS_ENV}={raw!r}: give how many same-host peers get a shared-memory inbox "
                         f"(a whole number >= 0; default {DEFAULT_PEERS})")
    return budget


def inbox_peers(rank: int, world_size: int, budget: int) -> list[int]:
    """The peers ``rank`` makes inboxes for, most wanted first ([Note: which peers get an inbox])."""
    def preference(peer: int) -> tuple[int, int, int]:
        ahead = (peer - rank) % world_size
        distance = min(ahead, world_size - ahead)
        power_of_two = distance & (distance - 1) == 0
        return (0 if distance == 1 else 1 if power_of_two else 2, distance, ahead)

    peers = sorted((p for p in range(world_size) if p != rank), key=preference)
    return peers[:budget]


def ring_enabled() -> bool:
    """Headers go through the ring unless ``CELLMESH_SHM_RING=0`` (then they go by socket, naming
    the slot: the path before the ring existed, kept for a full ring and for tests)."""
    return os.environ.get(RING_ENV, "1").strip() != "0"


def _slot_span(slot: int) -> tuple[int, int]:
    """The offset and size of ``slot`` in the file."""
    if slot < LARGE_SLOTS:
        return _LARGE_AT + slot * CHUNK_BYTES, CHUNK_BYTES
    return _SMALL_AT + (slot - LARGE_SLOTS) * SMALL_BYTES, SMALL_BYTES


def _sweep() -> None:
    """Unlink inboxes and doorbells whose creating process is gone."""
    for path in glob.glob(os.path.join(SHM_DIR, f"{_PREFIX}*")):
        pid = os.path.basename(path)[len(_PREFIX):].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except PermissionError:  # another user's process: alive
            pass


_FENCE = threading.Lock()


def _fence() -> None:
    """A full memory barrier: the lock's acquire and release are each a locked instruction on x86-64
    (a store before it is visible before any load after it; see [Note: the shared-memory inbox])."""
    _FENCE.acquire()
    _FENCE.release()


def _address(buffer: mmap.mmap) -> int:
    """The address of a mapping's first byte (valid while it stays mapped)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


class ShmBody:
    """A received body that lives in an inbox slot until :meth:`Inbox.release`: ``buffer`` is a uint8 view
    of it, ``address`` where it starts (for a copy that needs no view)."""

    __slots__ = ("address", "buffer", "slot")

    def __init__(self, buffer: np.ndarray[Any, Any], slot: int, address: int) -> None:
        self.buffer = buffer
        self.slot = slot
        self.address = address


class Inbox:
    """The receiving side of one peer's shared-memory channel (see [Note: the shared-memory inbox]).

    Not thread-safe: the transport calls it under the channel's receive lock.

    Raises:
        OSError: The file or the doorbell cannot be created (``/dev/shm`` full or missing).
    """

    def __init__(self) -> None:
        _sweep()
        self.path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}")
        self._linked = True
        self.bell = -1
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _SIZE)
            self._map = mmap.mmap(fd, _SIZE)
            os.mkfifo(self.path + _BELL, 0o600)
            # read and write: the open never blocks and the pipe never reports end-of-file
            self.bell = os.open(self.path + _BELL, os.O_RDWR | os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            self.close()
            raise
        os.close(fd)
        self._state = np.frombuffer(self._map, dtype=np.uint8, count=SLOTS)
        self._tail = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_TAIL)
        self._head = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_HEAD)
        self._asleep = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_ASLEEP)
        self._lengths = np.frombuffer(self._map, dtype=np.uint32, count=RING * RECORD // 4, offset=_RING_AT)
        self._view = memoryview(self._map)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._base = _address(self._map)
        self._consumed = 0  # == head, kept here to skip a read of shared memory

    def pending(self) -> bool:
        """True if the ring holds a record not yet popped."""
        return int(self._tail[0]) != self._consumed

    def pop(self) -> bytes:
        """The next header record, copied out (the sender may reuse the record at once).

        Call only when :meth:`pending`. Raises:
            ProtocolError: A record whose length does not fit it (the record is consumed).
        """
        index = self._consumed % RING
        n = int(self._lengths[index * (RECORD // 4)])
        start = _RING_AT + index * RECORD + 4
        record = bytes(self._view[start:start + min(n, RECORD - 4)])
        self._consumed += 1
        self._head[0] = self._consumed
        if self._linked:  # the first message proves the peer mapped the file and opened the doorbell
            self.unlink()
        if n > RECORD - 4:
            raise ProtocolError(f"a ring record of {n} bytes is over the {RECORD - 4}-byte limit")
        return record

    def sleeping(self) -> None:
        """About to sleep on the doorbell: ask senders to ring it, then empty it (look at the ring once
        more after this, then sleep; :meth:`awake` once up)."""
        self._asleep[0] = 1
        _fence()
        self.drain_bell()

    def awake(self) -> None:
        """No longer sleeping on the doorbell: senders need not ring it."""
        self._asleep[0] = 0

    def drain_bell(self) -> None:
        """Empty the doorbell (before looking at the ring a last time and sleeping on it)."""
        with contextlib.suppress(BlockingIOError):
            while len(os.read(self.bell, 4096)) == 4096:  # a short read emptied it
                pass

    def take(self, slot: int, nbytes: int) -> ShmBody:
        """The body a header names; the first message also proves the peer mapped the file.

        Raises:
            ProtocolError: A slot that does not exist, a body larger than its slot, or a slot
                not marked full (nothing is read then).
        """
        if not 0 <= slot < SLOTS:
            raise ProtocolError(f"shared-memory slot {slot} does not exist (0..{SLOTS - 1})")
        start, size = _slot_span(slot)
        if not 0 <= nbytes <= size:
            raise ProtocolError(f"a shared-memory body of {nbytes} bytes is over the {size}-byte slot {slot}")
        if self._state[slot] != _FULL:
            raise ProtocolError(f"shared-memory slot {slot} is not marked full")
        if self._linked:
            self.unlink()
        return ShmBody(self._bytes[start:start + nbytes], slot, self._base + start)

    def release(self, body: ShmBody) -> None:
        """The body has been read (no tensor over it is used any more): its slot is the sender's again."""
        self._state[body.slot] = _FREE

    def unlink(self) -> None:
        self._linked = False
        for path in (self.path, self.path + _BELL):
            with contextlib.suppress(OSError):
                os.unlink(path)

    def close(self) -> None:
        """Unlink, close the doorbell and unmap (a no-op for what is already gone). Bodies still held
        keep the map alive."""
        self.unlink()
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
        if hasattr(self, "_view"):
            del self._state, self._tail, self._head, self._asleep, self._lengths, self._bytes
            with contextlib.suppress(BufferError):  # a body still referenced: the map goes with it
                self._view.release()
                self._map.close()


class Outbox:
    """The sending side: the peer's inbox, mapped, and its doorbell.

    Not thread-safe: the transport calls it under the channel's send lock.

    Raises:
        OSError: The peer's file is gone or not the expected size, or its doorbell is not a FIFO.
    """

    def __init__(self, path: str) -> None:
        if not os.path.basename(path).startswith(_PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise OSError(f"{path!r} is not a cellmesh shared-memory inbox")
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _SIZE:
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, expected {_SIZE}")
            self._map = mmap.mmap(fd, _SIZE)
        finally:
            os.close(fd)
        try:
            self.bell = os.open(path + _BELL, os.O_WRONLY | os.O_NONBLOCK)
            if not stat.S_ISFIFO(os.fstat(self.bell).st_mode):
                os.close(self.bell)
                raise OSError(f"{path}{_BELL} is not a doorbell (FIFO)")
        except BaseException:
            self._map.close()
            raise
        self._view = memoryview(self._map)
        self._state = self._view[:SLOTS]  # one byte per slot; a memoryview reads and writes them fastest
        self._tail = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_TAIL)
        self._head = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_HEAD)
        self._asleep = np.frombuffer(self._map, dtype=np.int64, count=1, offset=_ASLEEP)
        self._lengths = np.frombuffer(self._map, dtype=np.uint32, count=RING * RECORD // 4, offset=_RING_AT)
        self._bytes = np.frombuffer(self._map, dtype=np.uint8)
        self._base = _address(self._map)
        self._published = 0  # == tail, kept here to skip a read of shared memory
        self._next = [0, 0]  # where the search for a free large / small slot starts

    def put(self, body: np.ndarray[Any, Any]) -> int | None:
        """Copy ``body`` (uint8, at most one large slot) into a free slot of the smallest kind it fits
        (a small one, else a large one); its index, or None if none is free."""
        n = body.nbytes
        found = self._free(n)
        if found is None:
            return None
        slot, at = found
        self._bytes[at:at + n] = body
        self._state[slot] = _FULL
        return slot

    def put_from(self, address: int, n: int) -> int | None:
        """:meth:`put` for ``n`` bytes at ``address`` (a contiguous CPU tensor's ``data_ptr()``, alive for
        the call): one ``memmove``, no view to build."""
        found = self._free(n)
        if found is None:
            return None
        slot, at = found
        if n:
            ctypes.memmove(self._base + at, address, n)
        self._state[slot] = _FULL
        return slot

    def _free(self, n: int) -> tuple[int, int] | None:
        """A FREE slot of the smallest kind ``n`` bytes fit, and its offset in the file; None if none."""
        small = n <= SMALL_BYTES
        if small:
            first, count, base, size = LARGE_SLOTS, SMALL_SLOTS, _SMALL_AT, SMALL_BYTES
        else:
            first, count, base, size = 0, LARGE_SLOTS, _LARGE_AT, CHUNK_BYTES
        state = self._state
        start = self._next[small]
        for i in range(count):
            k = (start + i) % count
            if state[first + k] == _FREE:
                self._next[small] = (k + 1) % count
                return first + k, base + k * size
        return None

    def unput(self, slot: int) -> None:
        """Give back a slot :meth:`put` filled whose header was never sent (the receiver never saw it)."""
        self._state[slot] = _FREE

    def post(self, header: bytes) -> bool:
        """Append ``header`` to the ring and ring the doorbell if the receiver sleeps ([Note: a doorbell
        only for a sleeping receiver]); False (nothing done) if the ring is full or the header too long
        for a record."""
        n = len(header)
        if n > RECORD - 4 or self._published - int(self._head[0]) >= RING:
            return False
        index = self._published % RING
        at = _RING_AT + index * RECORD
        self._view[at + 4:at + 4 + n] = header
        self._lengths[index * (RECORD // 4)] = n
        self._published += 1
        self._tail[0] = self._published  # publishes the record: x86-64 keeps the stores above before it
        _fence()  # the store above before the load below ([Note: the shared-memory inbox])
        if self._asleep[0]:
            # a full pipe already holds a wake-up; a closed one means the receiver is gone (its lease says so)
            with contextlib.suppress(BlockingIOError, BrokenPipeError):
                os.write(self.bell, b"\1")
        return True

    def close(self) -> None:
        if self.bell >= 0:
            os.close(self.bell)
            self.bell = -1
        with contextlib.suppress(BufferError):
            self._state.release()
            del self._state, self._tail, self._head, self._asleep, self._lengths, self._bytes
            self._view.release()
            self._map.close()
