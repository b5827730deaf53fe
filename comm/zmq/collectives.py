"""The ZeroMQ backend's collective algorithms: chunked, pipelined rings and chains over per-pair channels.

Algorithms (n ranks, a tensor of S bytes, chunks of ``CHUNK_BYTES``):

* ``all_reduce``: tensors up to ``DOUBLING_MAX_BYTES`` take recursive doubling
  (``comm/zmq/doubling.py``: log2(n) exchanges of the whole tensor, every rank bitwise the
  same result); larger ones take the ring: reduce-scatter then all-gather, each rank
  sending 2(n-1)/n * S bytes. The ring is pipelined chunk by chunk: a chunk received in
  step s is reduced and forwarded in step s+1 at once, without waiting for the rest of its
  segment. The direct path (everyone sends everything to everyone; each rank reduces the n
  inputs in rank order) is kept for comparison (``algorithm="direct"``).
* ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are the ring's two halves.
* ``broadcast``: tensors up to ``SMALL_BYTES`` go directly from the root; large ones down a
  pipelined chain root -> root+1 -> ... so the root sends S bytes, not (n-1) * S.

Every function works in place on a flat, contiguous tensor; the communicator
(``comm/zmq/communicator.py``) checks arguments, stages non-contiguous tensors and runs
these on the caller's thread or its worker thread.

[Note: choosing an all-reduce]
A small all-reduce is paid in round trips: the ring's 2(n-1) dependent steps cost more than
its bytes save. Measured on one host (``bench/colls.py``, docs/benchmarks.md), recursive
doubling took half the ring's time from 16 B to 64 KiB on 2, 3 and 4 ranks, the two were
about even at 128-256 KiB, and the ring was up to 3x faster from 512 KiB (doubling sends
log2(n) * S bytes per rank, the ring 2(n-1)/n * S). Direct and doubling are the same
messages on 2 ranks; on 4, direct took 1.03-1.8x doubling's time (n-1 messages each way
per rank, and a copy of every input). So ``DOUBLING_MAX_BYTES`` is 64 KiB for every world
size. The two orders differ: the ring
sums segment s along the chain s, s+1, ..., doubling along a fixed tree (see
[Note: recursive doubling for any n]); both give every rank bitwise the same tensor.

[Note: the ring walk]
Segment indices are taken mod n. In step s (s = 0 .. steps-1) rank r sends segment
``r + d - s`` to its right neighbour and receives segment ``r + d - s - 1`` from its left.
The segment received in step s is the one sent in step s + 1, which is what lets a chunk
be forwarded as soon as it arrives. With d = 0, reduce-scatter leaves rank r owning the
full reduction of segment r + 1, which is exactly what all-gather step 0 sends; so
all_reduce is one walk of 2(n-1) steps. reduce_scatter_tensor uses d = -1 so that rank r
ends owning segment r; all_gather_into_tensor uses d = 0 for n-1 copy steps.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Literal

import torch
import zmq

from comm.base import ReduceOp
from comm.errors import CommError
from comm.sockets import CHUNK_BYTES
from comm.wire import KIND_COLLECTIVE, TensorHeader, dtype_name, tensor_bytes
from comm.zmq import doubling
from comm.zmq.group import ZmqGroup
from comm.zmq.transport import Body, Deadline

__all__ = ["ALGORITHMS", "DOUBLING_MAX_BYTES", "SMALL_BYTES", "Algorithm", "Reduce", "all_reduce",
           "broadcast", "choose", "reducer", "ring"]

SMALL_BYTES = 64 << 10
DOUBLING_MAX_BYTES = 64 << 10
Algorithm = Literal["auto", "direct", "doubling", "ring"]
ALGORITHMS: tuple[Algorithm, ...] = ("auto", "direct", "doubling", "ring")

Reduce = Callable[[torch.Tensor, torch.Tensor], object]
"""``reduce(acc, x)`` folds ``x`` into ``acc`` in place."""

# Reducing straight from libzmq's receive buffer needs a tensor over a read-only buffer;
# it is only ever read from, so torch's warning about non-writable buffers does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _frame_tensor(frame: Body, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(frame.buffer, dtype=dtype)


def reducer(op: ReduceOp, dtype: torch.dtype) -> Reduce:
    """The in-place reduction of ``op`` on ``dtype`` (MEAN sums; the caller divides)."""
    if op is ReduceOp.MEAN and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"all_reduce MEAN needs a floating-point tensor, got {dtype}; use SUM")
    if op in (ReduceOp.SUM, ReduceOp.MEAN):
        if dtype == torch.bool:
            return lambda acc, x: acc.logical_or_(x)
        return lambda acc, x: acc.add_(x)
    if op is ReduceOp.MAX:
        return lambda acc, x: torch.maximum(acc, x, out=acc)
    if op is ReduceOp.MIN:
        return lambda acc, x: torch.minimum(acc, x, out=acc)
    raise ValueError(f"unknown reduce op {op!r}")


def choose(n: int, nbytes: int) -> Algorithm:
    """The all-reduce algorithm for ``nbytes`` over ``n`` ranks (see [Note: choosing an all-reduce])."""
    return "doubling" if nbytes <= DOUBLING_MAX_BYTES else "ring"


def all_reduce(g: ZmqGroup, flat: torch.Tensor, reduce: Reduce, seq: int, deadline: Deadline,
               algorithm: Algorithm = "auto") -> None:
    """Reduce ``flat`` across the group in place by ``algorithm`` (``"auto"``: :func:`choose`'s)."""
    n = len(g.members)
    if n == 1 or flat.numel() == 0:
        return
    if algorithm == "auto":
        algorithm = choose(n, flat.numel() * flat.element_size())
    if algorithm == "direct":
        _direct_all_reduce(g, flat, reduce, seq, deadline)
    elif algorithm == "doubling":
        doubling.all_reduce(g, flat, reduce, seq, deadline)
    elif algorithm == "ring":
        ring(g, flat, seq, deadline, d=0, steps=2 * (n - 1), reduce_steps=n - 1, reduce=reduce)
    else:
        raise ValueError(f"all_reduce: unknown algorithm {algorithm!r}; use one of {ALGORITHMS}")


def _direct_all_reduce(g: ZmqGroup, flat: torch.Tensor, reduce: Reduce, seq: int,
                       deadline: Deadline) -> None:
    trackers: list[zmq.MessageTracker] = []
    for r, peer in enumerate(g.members):
        if r != g.rank:
            trackers += g.send_tensor(peer, flat, KIND_COLLECTIVE, seq, 0, deadline)
    acc: torch.Tensor | None = None
    for r, peer in enumerate(g.members):
        if r == g.rank:
            x = flat
        else:
            header, body = g.recv(peer, KIND_COLLECTIVE, seq, 0, 0, deadline)
            _check_dtype(g, header, flat, deadline, r)
            x = _frame_tensor(body, flat.dtype)
        if acc is None:
            acc = x.clone()
        else:
            reduce(acc, x)
        if r != g.rank:
            del x
            g.release(peer, body)
    g.wait_sent(trackers, deadline)
    assert acc is not None
    flat.copy_(acc)


def _check_dtype(g: ZmqGroup, header: TensorHeader, flat: torch.Tensor, deadline: Deadline, r: int) -> None:
    if header.torch_dtype != flat.dtype:
        raise CommError(
            f"{deadline.op} on rank {g.rank}: rank {r} contributed {header.dtype}, this rank "
            f"{dtype_name(flat.dtype)}; every rank must pass the same dtype and size"
        )


def _segments(numel: int, n: int) -> list[tuple[int, int]]:
    """(start, size) of n near-equal segments of ``numel`` elements, the larger ones first."""
    base, extra = divmod(numel, n)
    bounds = []
    start = 0
    for i in range(n):
        size = base + (1 if i < extra else 0)
        bounds.append((start, size))
        start += size
    return bounds


def ring(g: ZmqGroup, flat: torch.Tensor, seq: int, deadline: Deadline, *, d: int, steps: int,
         reduce_steps: int, reduce: Reduce | None, segments: list[tuple[int, int]] | None = None) -> None:
    """Walk the ring over ``flat`` (see [Note: the ring walk]); reduce in the first reduce_steps."""
    n, r = len(g.members), g.rank
    right, left = g.members[(r + 1) % n], g.members[(r - 1) % n]
    segs = segments or _segments(flat.numel(), n)
    elems = max(1, CHUNK_BYTES // flat.element_size())
    chunks = [[(s + o, min(elems, size - o)) for o in range(0, size, elems)] for s, size in segs]
    sent: dict[tuple[int, int], list[zmq.MessageTracker]] = {}
    all_trackers: list[zmq.MessageTracker] = []
    data = tensor_bytes(flat)
    item = flat.element_size()

    def send(step: int, seg: int, k: int) -> None:
        start, count = chunks[seg][k]
        header = g.header(KIND_COLLECTIVE, seq, step, k, flat, start * item, count * item,
                          shape=(flat.numel(),))
        tracker = g.send(right, header, data[start * item:(start + count) * item], deadline)
        if tracker is not None:
            sent.setdefault((seg, k), []).append(tracker)
            all_trackers.append(tracker)

    first = (r + d) % n
    for k in range(len(chunks[first])):
        send(0, first, k)
    for step in range(steps):
        seg = (r + d - step - 1) % n
        for k in range(len(chunks[seg])):
            header, body = g.recv(left, KIND_COLLECTIVE, seq, step, k, deadline)
            _check_dtype(g, header, flat, deadline, (r - 1) % n)
            start, count = chunks[seg][k]
            if header.nbytes != count * item:
                raise CommError(
                    f"{deadline.op} on rank {r}: rank {(r - 1) % n} sent {header.nbytes} bytes "
                    f"for a {count * item}-byte chunk; every rank must pass the same size"
                )
            target = flat[start:start + count]
            incoming = _frame_tensor(body, flat.dtype)
            if step < reduce_steps:
                assert reduce is not None
                reduce(target, incoming)
            else:
                pending = sent.pop((seg, k), None)
                if pending:  # an earlier send still reads this region
                    g.wait_sent(pending, deadline)
                target.copy_(incoming)
            del incoming
            g.release(left, body)
            if step + 1 < steps:
                send(step + 1, seg, k)
    g.wait_sent(all_trackers, deadline)


def broadcast(g: ZmqGroup, work: torch.Tensor, src: int, seq: int, deadline: Deadline) -> None:
    """Copy group rank ``src``'s ``work`` (contiguous) into every rank's: direct when small, else a chain."""
    if work.numel() * work.element_size() > SMALL_BYTES:
        _chain_broadcast(g, work, src, seq, deadline)
    elif g.rank == src:
        trackers = []
        for r, peer in enumerate(g.members):
            if r != src:
                trackers += g.send_tensor(peer, work, KIND_COLLECTIVE, seq, 0, deadline)
        g.wait_sent(trackers, deadline)
    else:
        g.recv_tensor(g.members[src], work, KIND_COLLECTIVE, seq, 0, deadline, check_shape=True)


def _chain_broadcast(g: ZmqGroup, work: torch.Tensor, src: int, seq: int, deadline: Deadline) -> None:
    """Pipelined chain src -> src+1 -> ...: each chunk is forwarded as soon as it lands."""
    n, r = len(g.members), g.rank
    pos = (r - src) % n  # position in the chain; 0 is the root
    left, right = g.members[(r - 1) % n], g.members[(r + 1) % n]
    data = tensor_bytes(work)
    total = data.nbytes
    trackers: list[zmq.MessageTracker] = []
    for part, offset in enumerate(range(0, total, CHUNK_BYTES)):
        count = min(CHUNK_BYTES, total - offset)
        if pos > 0:
            header, body = g.recv(left, KIND_COLLECTIVE, seq, 0, part, deadline)
            if header.offset != offset or header.nbytes != count or header.torch_dtype != work.dtype:
                raise CommError(
                    f"{deadline.op} on rank {r}: the root's tensor differs from this rank's "
                    f"({header.dtype}{list(header.shape)} vs {dtype_name(work.dtype)}{list(work.shape)})"
                )
            data[offset:offset + count] = body.buffer
            g.release(left, body)
        if pos < n - 1:
            header = g.header(KIND_COLLECTIVE, seq, 0, part, work, offset, count)
            tracker = g.send(right, header, data[offset:offset + count], deadline)
            if tracker is not None:
                trackers.append(tracker)
    g.wait_sent(trackers, deadline)
