"""One group's share of a rank's ZeroMQ transport: its members, and tensors as chunked messages.

A communicator and each of its sub-groups share the rank's :class:`Transport`; a
:class:`ZmqGroup` puts the group's name into every message key, so operations of
different groups never mix. A tensor travels as parts of at most ``CHUNK_BYTES``, each a
:class:`TensorHeader` and a view of the tensor's bytes (see ``comm/zmq/transport.py``
for zero copy and shared memory).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
import zmq

from comm.errors import CommError
from comm.sockets import CHUNK_BYTES
from comm.wire import TensorHeader, dtype_name, tensor_bytes
from comm.zmq.shm import ShmBody
from comm.zmq.transport import Body, Deadline, Transport, wait_trackers

__all__ = ["ZmqGroup"]


class ZmqGroup:
    """The members of one group (global ranks, indexed by group rank) on ``transport``.

    Attributes:
        transport: the rank's sockets, shared with the other groups.
        members: the group's global ranks, in group-rank order.
        name: the group's name in message keys (``"w"``, ``"w.0"``, ...).
        rank: this process's group rank.
    """

    __slots__ = ("members", "name", "rank", "transport")

    def __init__(self, transport: Transport, members: tuple[int, ...], name: str) -> None:
        self.transport = transport
        self.members = members
        self.name = name
        self.rank = members.index(transport.rank)

    def header(self, kind: int, seq: int, tag: int, part: int, t: torch.Tensor, offset: int,
               nbytes: int, shape: Sequence[int] | None = None) -> TensorHeader:
        return TensorHeader(
            group=self.name, src=self.transport.rank, kind=kind, seq=seq, tag=tag, part=part,
            dtype=dtype_name(t.dtype), shape=tuple(t.shape if shape is None else shape),
            offset=offset, nbytes=nbytes,
        )

    def send(self, peer: int, header: TensorHeader, body: np.ndarray[Any, Any],
             deadline: Deadline) -> zmq.MessageTracker | None:
        """Queue one part to global rank ``peer`` (see :meth:`Transport.send`)."""
        return self.transport.send(peer, header, body, deadline, self.members)

    def recv(self, peer: int, kind: int, seq: int, tag: int, part: int,
             deadline: Deadline) -> tuple[TensorHeader, Body]:
        """This group's part ``(kind, seq, tag, part)`` from global rank ``peer``; hand it back with
        :meth:`release` once read."""
        return self.transport.recv(peer, (self.name, kind, seq, tag, part), deadline, self.members)

    def release(self, peer: int, body: Body) -> None:
        self.transport.release(peer, body)

    def wait_sent(self, trackers: list[zmq.MessageTracker], deadline: Deadline) -> None:
        """Wait until libzmq let go of every tracked body (a lost member raises PeerLostError)."""
        wait_trackers(trackers, deadline, self.transport.rendezvous, self.members)

    def send_tensor(self, peer: int, t: torch.Tensor, kind: int, seq: int, tag: int,
                    deadline: Deadline) -> list[zmq.MessageTracker]:
        """Queue ``t`` to global rank ``peer`` in parts; return the trackers of zero-copy parts."""
        data = tensor_bytes(t)
        total = data.nbytes
        trackers = []
        for part, offset in enumerate(range(0, max(total, 1), CHUNK_BYTES)):
            n = min(CHUNK_BYTES, total - offset)
            header = self.header(kind, seq, tag, part, t, offset, n)
            tracker = self.send(peer, header, data[offset:offset + n], deadline)
            if tracker is not None:
                trackers.append(tracker)
        return trackers

    def recv_tensor(self, peer: int, t: torch.Tensor, kind: int, seq: int, tag: int,
                    deadline: Deadline, *, check_shape: bool) -> None:
        """Receive every part of a tensor from global rank ``peer`` into ``t`` (contiguous)."""
        data = tensor_bytes(t)
        for part in range(max(1, -(-data.nbytes // CHUNK_BYTES))):
            self.recv_part(peer, t, data, kind, seq, tag, part, deadline, check_shape=check_shape)

    def recv_part(self, peer: int, t: torch.Tensor, data: np.ndarray[Any, Any], kind: int, seq: int,
                  tag: int, part: int, deadline: Deadline, *, check_shape: bool) -> None:
        """Receive part ``part`` from ``peer`` into its place in ``data`` (``t``'s bytes)."""
        offset = part * CHUNK_BYTES
        header, body = self.recv(peer, kind, seq, tag, part, deadline)
        try:
            if check_shape and (header.torch_dtype != t.dtype or header.total_bytes != data.nbytes
                                or header.offset != offset):
                raise self._mismatch(peer, header, t, deadline)
            if header.nbytes:
                data[offset:offset + header.nbytes] = body.buffer
        finally:
            self.release(peer, body)

    def recv_whole(self, peer: int, t: torch.Tensor, kind: int, seq: int, tag: int,
                   deadline: Deadline) -> None:
        """Receive a tensor of one part (at most ``CHUNK_BYTES``) from ``peer`` into ``t`` (contiguous,
        CPU), checking it is ``t``'s dtype and size; a body in shared memory is copied by one ``memmove``.

        Raises:
            CommError: The sender's tensor is not ``t``'s dtype and size (its message is consumed).
        """
        header, body = self.recv(peer, kind, seq, tag, 0, deadline)
        try:
            n = t.nbytes
            if (header.torch_dtype != t.dtype or header.total_bytes != n or header.offset != 0
                    or header.nbytes != n):
                raise self._mismatch(peer, header, t, deadline)
            if isinstance(body, ShmBody):
                if n:
                    ctypes.memmove(t.data_ptr(), body.address, n)
            elif n:
                tensor_bytes(t)[:] = body.buffer
        finally:
            self.release(peer, body)

    def _mismatch(self, peer: int, header: TensorHeader, t: torch.Tensor, deadline: Deadline) -> CommError:
        return CommError(
            f"{deadline.op} on rank {self.rank}: rank {self.members.index(peer)} sent "
            f"{header.dtype}{list(header.shape)}, but the receive buffer is "
            f"{dtype_name(t.dtype)}{list(t.shape)}"
        )
