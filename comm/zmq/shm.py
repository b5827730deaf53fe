"""Shared-memory bodies for peers on the same host: a tensor chunk crosses in one copy, not through a socket.

Through a Unix socket a chunk is copied three times (into the kernel, out of it into
libzmq's buffer, then reduced or copied into place) and every copy runs on one of the
host's few cores. For a peer on the same host the data channel can instead hand the
chunk over in shared memory: the sender copies it into a *slot*, the ZeroMQ message
carries only the header naming the slot, and the receiver reduces or copies straight
out of the slot.

[Note: the shared-memory inbox]
Each receiving rank creates one *inbox* per same-host peer (``/dev/shm/cellmesh-{pid}-*``,
mode 0600, allocated up front with ``posix_fallocate`` so a full ``/dev/shm`` is an error
at creation, never a SIGBUS later) and publishes its path in its rendezvous card; the
peer maps it as its *outbox*. The file starts with one state byte per slot, then
:data:`SLOTS` slots of :data:`~comm.sockets.CHUNK_BYTES`:

- the sender takes a slot whose state is FREE, copies the chunk in, sets it FULL and
  sends the header with the slot's index (the ZeroMQ message passing orders the writes
  before the receiver's reads);
- the receiver checks the slot is FULL, reads it, and sets it FREE again. That last
  store must not overtake the reads: on x86-64 (total store order) it cannot, so the
  inbox is used there only; elsewhere :func:`available` is False and bodies go through
  the socket as before;
- a sender that finds no FREE slot sends the body through the socket: a slow receiver
  never blocks a sender, and a message a receiver stashes (read early for another
  operation) is copied out and its slot freed at once, so no wait can cycle.

The receiver unlinks the file once the first message through it proves the peer
mapped it, or when it closes; files of processes that died (``kill -9``) are swept when
the next inbox is created.
"""

from __future__ import annotations

import contextlib
import glob
import mmap
import os
import platform
import uuid
from typing import Any

import numpy as np

from comm.errors import ProtocolError
from comm.sockets import CHUNK_BYTES

__all__ = ["MIN_BYTES", "SLOTS", "Inbox", "Outbox", "ShmBody", "available"]

SHM_DIR = "/dev/shm"
ENABLE_ENV = "CELLMESH_SHM"
# 48 MiB a peer: a 64 MiB all-reduce of two ranks keeps both ring phases in slots (measured:
# 3.1-3.9 GB/s with 12 slots, 2.2-3.1 with 6)
SLOTS = 12
# smaller bodies go through the socket, where the copy would not pay for itself (a knob for tests:
# CELLMESH_SHM_MIN_BYTES=1 sends every body through shared memory)
MIN_BYTES = max(1, int(os.environ.get("CELLMESH_SHM_MIN_BYTES", str(64 << 10))))
_HEADER = 4096  # state bytes, page-aligned so slots start on a page
_FREE, _FULL = 0, 1
_PREFIX = "cellmesh-"


def available() -> bool:
    """True where same-host bodies may go through shared memory: x86-64 with a /dev/shm, unless
    ``CELLMESH_SHM=0`` turns it off (then every body goes through the socket)."""
    if os.environ.get(ENABLE_ENV, "1").strip() == "0":
        return False
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir(SHM_DIR)


def _size() -> int:
    return _HEADER + SLOTS * CHUNK_BYTES


def _sweep() -> None:
    """Unlink inboxes whose creating process is gone."""
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


class ShmBody:
    """A received body that lives in an inbox slot until :meth:`Inbox.release`."""

    __slots__ = ("buffer", "slot")

    def __init__(self, buffer: memoryview, slot: int) -> None:
        self.buffer = buffer
        self.slot = slot


class Inbox:
    """The receiving side of one peer's shared-memory channel (see [Note: the shared-memory inbox]).

    Raises:
        OSError: The file cannot be created or allocated (``/dev/shm`` full or missing).
    """

    def __init__(self) -> None:
        _sweep()
        self.path = os.path.join(SHM_DIR, f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:16]}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, _size())
            self._map = mmap.mmap(fd, _size())
        except BaseException:
            os.close(fd)
            self.unlink()
            raise
        os.close(fd)
        self._state = np.frombuffer(self._map, dtype=np.uint8, count=SLOTS)
        self._view = memoryview(self._map)
        self._linked = True

    def take(self, slot: int, nbytes: int) -> ShmBody:
        """The body a header names; the first message also proves the peer mapped the file.

        Raises:
            ProtocolError: A slot that does not exist, a body larger than a slot, or a slot
                not marked full (nothing is read then).
        """
        if not 0 <= slot < SLOTS:
            raise ProtocolError(f"shared-memory slot {slot} does not exist (0..{SLOTS - 1})")
        if not 0 <= nbytes <= CHUNK_BYTES:
            raise ProtocolError(f"a shared-memory body of {nbytes} bytes is over the {CHUNK_BYTES}-byte slot")
        if self._state[slot] != _FULL:
            raise ProtocolError(f"shared-memory slot {slot} is not marked full")
        if self._linked:
            self.unlink()
        start = _HEADER + slot * CHUNK_BYTES
        return ShmBody(self._view[start:start + nbytes], slot)

    def release(self, body: ShmBody) -> None:
        """The body has been read (no tensor over it is used any more): its slot is the sender's again."""
        self._state[body.slot] = _FREE

    def unlink(self) -> None:
        self._linked = False
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    def close(self) -> None:
        """Unlink and unmap (a no-op for what is already gone). Bodies still held keep the map alive."""
        self.unlink()
        if hasattr(self, "_view"):
            del self._state
            with contextlib.suppress(BufferError):  # a body still referenced: the map goes with it
                self._view.release()
                self._map.close()


class Outbox:
    """The sending side: the peer's inbox, mapped.

    Raises:
        OSError: The peer's file is gone or not the expected size.
    """

    def __init__(self, path: str) -> None:
        if not os.path.basename(path).startswith(_PREFIX) or os.path.dirname(path) != SHM_DIR:
            raise OSError(f"{path!r} is not a cellmesh shared-memory inbox")
        fd = os.open(path, os.O_RDWR)
        try:
            if os.fstat(fd).st_size != _size():
                raise OSError(f"{path} is {os.fstat(fd).st_size} bytes, expected {_size()}")
            self._map = mmap.mmap(fd, _size())
        finally:
            os.close(fd)
        self._state = np.frombuffer(self._map, dtype=np.uint8, count=SLOTS)
        self._slots = np.frombuffer(self._map, dtype=np.uint8, offset=_HEADER)
        self._next = 0

    def put(self, body: np.ndarray[Any, Any]) -> int | None:
        """Copy ``body`` (uint8, at most one slot) into a free slot; its index, or None if none is free."""
        n = body.nbytes
        for i in range(SLOTS):
            slot = (self._next + i) % SLOTS
            if self._state[slot] == _FREE:
                start = slot * CHUNK_BYTES
                self._slots[start:start + n] = body
                self._state[slot] = _FULL
                self._next = (slot + 1) % SLOTS
                return slot
        return None

    def close(self) -> None:
        with contextlib.suppress(BufferError):
            del self._state, self._slots
            self._map.close()
