"""Recursive doubling: the ZeroMQ backend's all-reduce for small tensors, ceil(log2 n) + 1 rounds at most.

A small all-reduce costs round trips, not bytes: the ring takes 2(n-1) steps, each a
message per rank, and the direct path (every rank sends to every other) costs each rank
n-1 sends and n-1 receives. Recursive doubling exchanges the whole tensor with one
partner per round, log2(n) rounds for a power of two, each rank sending log2(n) times
the tensor.

[Note: recursive doubling for any n]
Let p be the largest power of two <= n and e = n - p. The first 2e ranks pair up: rank
2i (even) sends its tensor to rank 2i+1 and waits (the *fold*); rank 2i+1 reduces it
into its own and takes part as virtual rank i. Ranks 2e.. take part as virtual ranks
r - e. The p virtual ranks then run log2(p) rounds: in round k, virtual rank v swaps its
partial result with virtual rank v XOR 2^k and reduces the partner's into its own. At the
end rank 2i+1 sends the result back to rank 2i (the *unfold*). So n = 3 and n = 6 take
three and four rounds, a power of two log2(n).

Every rank ends with bitwise the same tensor. Each round's partners reduce the same two
operands into the same value, because the reductions are commutative bit for bit (IEEE
addition and maximum/minimum are; ``a + b`` and ``b + a`` round alike), so the per-element
reduction tree is fixed: for n = 4, ``(x0 + x1) + (x2 + x3)``; for n = 3,
``(x1 + x0) + x2``. It is not the ring's order (the ring sums segment s along the chain
s, s+1, ...), so a float SUM/MEAN equals the ring's bit for bit only where the two
trees coincide (n = 2; n = 3 on segment 0) and within float rounding elsewhere;
MAX, MIN and integer SUM are exact on every path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from comm.errors import CommError
from comm.sockets import CHUNK_BYTES
from comm.wire import KIND_COLLECTIVE, TensorHeader, dtype_name
from comm.zmq.group import ZmqGroup
from comm.zmq.transport import Body, Deadline

__all__ = ["all_reduce", "rounds"]

Reduce = Callable[[torch.Tensor, torch.Tensor], object]
"""``reduce(acc, x)`` folds ``x`` into ``acc`` in place (as in ``comm/zmq/collectives.py``)."""

_FOLD, _UNFOLD = 0, 1  # message tags; round k uses tag 2 + k


def rounds(n: int) -> int:
    """How many rounds of messages an all-reduce over ``n`` ranks waits for: log2(p), plus 2 with a fold."""
    p = 1 << (n.bit_length() - 1)
    return (p.bit_length() - 1) + (2 if n > p else 0)


def all_reduce(g: ZmqGroup, flat: torch.Tensor, reduce: Reduce, seq: int, deadline: Deadline) -> None:
    """Reduce the contiguous ``flat`` across the group in place (see [Note: recursive doubling for any n])."""
    n, r = len(g.members), g.rank
    if n == 1 or flat.numel() == 0:
        return
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    if r < 2 * extra and r % 2 == 0:  # folded into r + 1, which sends the result back
        peer = g.members[r + 1]
        g.wait_sent(g.send_tensor(peer, flat, KIND_COLLECTIVE, seq, _FOLD, deadline), deadline)
        g.recv_tensor(peer, flat, KIND_COLLECTIVE, seq, _UNFOLD, deadline, check_shape=True)
        return
    if r < 2 * extra:
        _exchange(g, flat, reduce, seq, _FOLD, deadline, r - 1, send=False)
        v = r // 2
    else:
        v = r - extra
    mask, k = 1, 0
    while mask < p:
        pv = v ^ mask
        _exchange(g, flat, reduce, seq, 2 + k, deadline, 2 * pv + 1 if pv < extra else pv + extra, send=True)
        mask, k = mask << 1, k + 1
    if r < 2 * extra:
        g.wait_sent(g.send_tensor(g.members[r - 1], flat, KIND_COLLECTIVE, seq, _UNFOLD, deadline), deadline)


def _exchange(g: ZmqGroup, flat: torch.Tensor, reduce: Reduce, seq: int, tag: int, deadline: Deadline,
              partner: int, *, send: bool) -> None:
    """Send ``flat`` to group rank ``partner`` (if ``send``) and reduce the partner's tensor into it.

    A body large enough to go zero-copy is still read by libzmq after the send returns, so every
    part is received first and the send waited for before anything is written into ``flat``.
    """
    peer = g.members[partner]
    trackers = g.send_tensor(peer, flat, KIND_COLLECTIVE, seq, tag, deadline) if send else []
    item = flat.element_size()
    total = flat.numel() * item
    parts: list[tuple[TensorHeader, Body]] = []
    try:
        for part, offset in enumerate(range(0, total, CHUNK_BYTES)):
            header, body = g.recv(peer, KIND_COLLECTIVE, seq, tag, part, deadline)
            parts.append((header, body))
            if (header.torch_dtype != flat.dtype or header.total_bytes != total or header.offset != offset
                    or header.nbytes != min(CHUNK_BYTES, total - offset)):
                raise CommError(
                    f"{deadline.op} on rank {g.rank}: rank {partner} sent "
                    f"{header.dtype}{list(header.shape)}, "
                    f"this rank has {dtype_name(flat.dtype)}[{flat.numel()}]; every rank must pass the same "
                    "dtype and size"
                )
        g.wait_sent(trackers, deadline)
        for header, body in parts:
            start = header.offset // item
            reduce(flat[start:start + header.nbytes // item], torch.frombuffer(body.buffer, dtype=flat.dtype))
    finally:
        for _, body in parts:
            g.release(peer, body)

