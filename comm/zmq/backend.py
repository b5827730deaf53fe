"""cellmesh's own ZeroMQ backend: chunked, pipelined ring collectives over per-pair channels.

Algorithms (n ranks, a tensor of S bytes, chunks of ``CHUNK_BYTES``):

* ``all_reduce``: tensors up to ``SMALL_BYTES`` take the direct path (everyone sends
  everything to everyone; each rank reduces the n inputs in rank order, so every rank
  gets bitwise the same result). Larger ones take the ring: reduce-scatter then
  all-gather, each rank sending 2(n-1)/n * S bytes. The ring is pipelined chunk by
  chunk: a chunk received in step s is reduced and forwarded in step s+1 at once,
  without waiting for the rest of its segment.
* ``reduce_scatter_tensor`` and ``all_gather_into_tensor`` are the ring's two halves.
* ``broadcast``: small tensors go directly from the root; large ones down a pipelined
  chain root -> root+1 -> ... so the root sends S bytes, not (n-1) * S.

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

import itertools
import threading
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta
from typing import Any, Literal

import numpy as np
import torch
import zmq

from comm.base import DEFAULT_TIMEOUT, Communicator, CompletedWork, ReduceOp, Work
from comm.errors import CommError, CommTimeoutError
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL, Rendezvous
from comm.sockets import CHUNK_BYTES
from comm.wire import KIND_COLLECTIVE, KIND_P2P, TensorHeader, dtype_name, tensor_bytes
from comm.zmq.transport import Body, Deadline, Transport, wait_trackers

__all__ = ["SMALL_BYTES", "ZmqCommunicator"]

SMALL_BYTES = 64 << 10

# Reducing straight from libzmq's receive buffer needs a tensor over a read-only buffer;
# it is only ever read from, so torch's warning about non-writable buffers does not apply.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


def _frame_tensor(frame: Body, dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(frame.buffer, dtype=dtype)


def _reducer(op: ReduceOp, dtype: torch.dtype) -> Callable[[torch.Tensor, torch.Tensor], object]:
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


class _FutureWork(Work):
    def __init__(self, future: Future[None], timeout: timedelta, op: str) -> None:
        self._future = future
        self._timeout = timeout
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> None:
        limit = (self._timeout if timeout is None else timeout).total_seconds()
        try:
            self._future.result(timeout=limit)
        except FutureTimeout:
            raise CommTimeoutError(
                f"{self._op}: async operation not finished after {limit:.1f}s",
                op=self._op.split("(", 1)[0], peer=None, waited=limit,
            ) from None

    def is_completed(self) -> bool:
        return self._future.done()


class _SendWork(Work):
    def __init__(self, trackers: list[zmq.MessageTracker], timeout: timedelta, op: str, keep: object,
                 wait: Callable[[list[zmq.MessageTracker], Deadline], None]) -> None:
        self._wait = wait
        self._trackers = trackers
        self._timeout = timeout
        self._op = op
        self._keep = keep  # the tensor stays alive while libzmq may read it

    def wait(self, timeout: timedelta | None = None) -> None:
        self._wait(self._trackers, Deadline(self._timeout if timeout is None else timeout, self._op))
        self._keep = None

    def is_completed(self) -> bool:
        return all(t.done for t in self._trackers)


class _RecvWork(Work):
    """A receive completed by the thread that waits for (or polls) it; bytes arrive meanwhile.

    ``step(deadline)`` receives the next part and returns True once every part is in, so a
    receive can make progress in short polls (``is_completed``) and finish in ``wait``.
    """

    def __init__(self, step: Callable[[Deadline], bool], timeout: timedelta, op: str) -> None:
        self._step = step
        self._timeout = timeout
        self._op = op
        self._done = False
        self._error: BaseException | None = None
        self._lock = threading.Lock()

    def _progress(self, deadline: Deadline) -> None:
        while not self._done:
            self._done = self._step(deadline)

    def wait(self, timeout: timedelta | None = None) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            try:
                self._progress(Deadline(self._timeout if timeout is None else timeout, self._op))
            except CommTimeoutError:
                raise
            except BaseException as exc:
                self._error = exc
                raise

    def is_completed(self) -> bool:
        with self._lock:
            if self._done or self._error is not None:
                return True
            try:
                self._progress(Deadline(timedelta(0), self._op))
            except CommTimeoutError:
                return False
            except BaseException as exc:
                self._error = exc
                return True
            return True


class ZmqCommunicator(Communicator):
    """A communicator on cellmesh's ZeroMQ transport. Build it with :meth:`create`.

    Sub-groups share the parent's sockets; their messages carry the group's name, so
    operations of different groups never mix.
    """

    backend = "zmq"

    def __init__(
        self,
        transport: Transport,
        members: tuple[int, ...],
        group: str,
        timeout: timedelta,
        executor: ThreadPoolExecutor,
        owns_transport: bool,
    ) -> None:
        self._transport = transport
        self._members = members  # global ranks, indexed by group rank
        self._group = group
        self.timeout = timeout
        self._rank = members.index(transport.rank)
        self._executor = executor
        self._owns = owns_transport
        self._coll_seq = itertools.count()
        self._p2p_send_seq: dict[tuple[int, int], itertools.count[int]] = {}
        self._p2p_recv_seq: dict[tuple[int, int], itertools.count[int]] = {}
        self._p2p_lock = threading.Lock()
        self._groups = itertools.count()
        self._pending: list[Future[None]] = []
        self._closed = False
        # reduce_scatter_tensor's working copy of its input, kept between calls: fresh memory of
        # that size (above tune_malloc's mmap threshold) would be faulted in on every call
        self._scratch = torch.empty(0, dtype=torch.uint8)
        self._scratch_lock = threading.Lock()

    @classmethod
    def create(
        cls,
        *,
        rank: int,
        world_size: int,
        registry: Registry,
        prefix: str,
        timeout: timedelta = DEFAULT_TIMEOUT,
        liveness_ttl: timedelta = DEFAULT_LIVENESS_TTL,
        host: str | None = None,
        transport: Literal["auto", "tcp"] = "auto",
    ) -> ZmqCommunicator:
        """Bind this rank's channels, meet the other ranks under ``prefix`` and connect to them.

        Args:
            host: the interface data sockets bind on (:func:`comm.sockets.default_host`
                by default).
            transport: ``"auto"`` connects peers on the same host over Unix domain sockets
                and others over TCP; ``"tcp"`` always uses TCP.
        """
        rendezvous = Rendezvous(registry, prefix, rank, world_size, liveness_ttl=liveness_ttl)
        channels = Transport(rendezvous, host=host, transport=transport)
        try:
            rendezvous.publish(channels.bind())
            cards = rendezvous.gather(timeout)
            channels.connect(cards)
        except BaseException:
            channels.close()
            rendezvous.close()
            raise
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zmq-comm-{rank}")
        return cls(channels, tuple(range(world_size)), "w", timeout, executor, owns_transport=True)

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._members)

    @property
    def bad_messages(self) -> int:
        """How many malformed data messages this rank has dropped (each was logged)."""
        return self._transport.bad_messages

    # -- plumbing -------------------------------------------------------------------

    def _wait_sent(self, trackers: list[zmq.MessageTracker], deadline: Deadline) -> None:
        wait_trackers(trackers, deadline, self._transport.rendezvous, self._members)

    def _deadline(self, timeout: timedelta | None, op: str) -> Deadline:
        return Deadline(self.timeout if timeout is None else timeout, op)

    def _header(self, kind: int, seq: int, tag: int, part: int, t: torch.Tensor, offset: int,
                nbytes: int, shape: Sequence[int] | None = None) -> TensorHeader:
        return TensorHeader(
            group=self._group, src=self._transport.rank, kind=kind, seq=seq, tag=tag, part=part,
            dtype=dtype_name(t.dtype), shape=tuple(t.shape if shape is None else shape),
            offset=offset, nbytes=nbytes,
        )

    def _peer(self, group_rank: int, what: str) -> int:
        if not 0 <= group_rank < len(self._members):
            raise ValueError(f"{what}: rank {group_rank} is outside 0..{len(self._members) - 1}")
        if group_rank == self._rank:
            raise ValueError(f"{what}: rank {group_rank} is this rank; sending to oneself is not supported")
        return self._members[group_rank]

    def _run(self, op: str, fn: Callable[[], None], async_op: bool) -> Work:
        """Run a collective inline, or on the communicator's worker thread for async_op.

        Collectives keep their call order: while async ones are pending, a blocking one queues
        behind them.
        """
        self._pending = [f for f in self._pending if not f.done()]
        if not async_op and not self._pending:
            fn()
            return CompletedWork()
        future = self._executor.submit(fn)
        self._pending.append(future)
        work = _FutureWork(future, self.timeout, op)
        if not async_op:
            work.wait(timeout=self.timeout * 2)
            return CompletedWork()
        return work

    # -- point to point ---------------------------------------------------------------

    def _next_seq(self, table: dict[tuple[int, int], itertools.count[int]], peer: int, tag: int) -> int:
        with self._p2p_lock:
            return next(table.setdefault((peer, tag), itertools.count()))

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> Work:
        peer = self._peer(dst, "isend")
        src = tensor.detach().contiguous()
        seq = self._next_seq(self._p2p_send_seq, peer, tag)
        deadline = self._deadline(None, f"isend(dst={dst}, tag={tag})")
        trackers = self._send_tensor(peer, src, KIND_P2P, seq, tag, deadline)
        rendezvous = self._transport.rendezvous

        def wait(pending: list[zmq.MessageTracker], dl: Deadline) -> None:
            wait_trackers(pending, dl, rendezvous, (peer,))

        return _SendWork(trackers, self.timeout, deadline.op, src, wait)

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> Work:
        peer = self._peer(src, "irecv")
        seq = self._next_seq(self._p2p_recv_seq, peer, tag)
        op = f"recv(src={src}, tag={tag})"
        contiguous = tensor.is_contiguous()
        dst = tensor if contiguous else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        data = tensor_bytes(dst)
        parts = max(1, -(-data.nbytes // CHUNK_BYTES))
        received = [0]

        def step(deadline: Deadline) -> bool:
            part = received[0]
            self._recv_part(peer, dst, data, KIND_P2P, seq, tag, part, deadline, check_shape=True)
            received[0] = part + 1
            if received[0] < parts:
                return False
            if not contiguous:
                tensor.copy_(dst)
            return True

        return _RecvWork(step, self.timeout, op)

    def _send_tensor(self, peer: int, t: torch.Tensor, kind: int, seq: int, tag: int,
                     deadline: Deadline) -> list[zmq.MessageTracker]:
        data = tensor_bytes(t)
        total = data.nbytes
        trackers = []
        for part, offset in enumerate(range(0, max(total, 1), CHUNK_BYTES)):
            n = min(CHUNK_BYTES, total - offset)
            header = self._header(kind, seq, tag, part, t, offset, n)
            tracker = self._transport.send(peer, header, data[offset:offset + n], deadline, self._members)
            if tracker is not None:
                trackers.append(tracker)
        return trackers

    def _recv_tensor(self, peer: int, t: torch.Tensor, kind: int, seq: int, tag: int,
                     deadline: Deadline, *, check_shape: bool) -> None:
        data = tensor_bytes(t)
        for part in range(max(1, -(-data.nbytes // CHUNK_BYTES))):
            self._recv_part(peer, t, data, kind, seq, tag, part, deadline, check_shape=check_shape)

    def _recv_part(self, peer: int, t: torch.Tensor, data: np.ndarray[Any, Any], kind: int, seq: int,
                   tag: int, part: int, deadline: Deadline, *, check_shape: bool) -> None:
        offset = part * CHUNK_BYTES
        header, body = self._transport.recv(peer, (self._group, kind, seq, tag, part), deadline,
                                            self._members)
        if check_shape and (header.torch_dtype != t.dtype or header.total_bytes != data.nbytes
                            or header.offset != offset):
            raise CommError(
                f"{deadline.op} on rank {self._rank}: rank {self._members.index(peer)} sent "
                f"{header.dtype}{list(header.shape)}, but the receive buffer is "
                f"{dtype_name(t.dtype)}{list(t.shape)}"
            )
        if header.nbytes:
            data[offset:offset + header.nbytes] = memoryview(body.buffer)
        self._transport.release(peer, body)

    # -- collectives ----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: timedelta | None = None, async_op: bool = False) -> Work:
        reduce = _reducer(ReduceOp(op), tensor.dtype)
        seq = next(self._coll_seq)
        deadline_op = f"all_reduce({ReduceOp(op).value}, {dtype_name(tensor.dtype)}{list(tensor.shape)})"

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            n = self.world_size
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            flat = work.view(-1)
            if n > 1 and flat.numel() > 0:
                if flat.numel() * flat.element_size() <= SMALL_BYTES:
                    self._direct_all_reduce(flat, reduce, seq, deadline)
                else:
                    self._ring(flat, seq, deadline, d=0, steps=2 * (n - 1), reduce_steps=n - 1,
                               reduce=reduce)
            if ReduceOp(op) is ReduceOp.MEAN:
                flat.div_(n)
            if work is not tensor:
                tensor.copy_(work)

        return self._run(deadline_op, run, async_op)

    def _direct_all_reduce(self, flat: torch.Tensor, reduce: Callable[[torch.Tensor, torch.Tensor], object],
                           seq: int, deadline: Deadline) -> None:
        trackers: list[zmq.MessageTracker] = []
        for r, peer in enumerate(self._members):
            if r != self._rank:
                trackers += self._send_tensor(peer, flat, KIND_COLLECTIVE, seq, 0, deadline)
        acc: torch.Tensor | None = None
        for r, peer in enumerate(self._members):
            if r == self._rank:
                x = flat
            else:
                header, body = self._transport.recv(peer, (self._group, KIND_COLLECTIVE, seq, 0, 0),
                                                    deadline, self._members)
                self._check_coll(header, flat, deadline, r)
                x = _frame_tensor(body, flat.dtype)
            if acc is None:
                acc = x.clone()
            else:
                reduce(acc, x)
            if r != self._rank:
                del x
                self._transport.release(peer, body)
        self._wait_sent(trackers, deadline)
        assert acc is not None
        flat.copy_(acc)

    def _check_coll(self, header: TensorHeader, flat: torch.Tensor, deadline: Deadline, r: int) -> None:
        if header.torch_dtype != flat.dtype:
            raise CommError(
                f"{deadline.op} on rank {self._rank}: rank {r} contributed {header.dtype}, this rank "
                f"{dtype_name(flat.dtype)}; every rank must pass the same dtype and size"
            )

    def _segments(self, numel: int) -> list[tuple[int, int]]:
        n = self.world_size
        base, extra = divmod(numel, n)
        bounds = []
        start = 0
        for i in range(n):
            size = base + (1 if i < extra else 0)
            bounds.append((start, size))
            start += size
        return bounds

    def _ring(self, flat: torch.Tensor, seq: int, deadline: Deadline, *, d: int, steps: int,
              reduce_steps: int, reduce: Callable[[torch.Tensor, torch.Tensor], object] | None,
              segments: list[tuple[int, int]] | None = None) -> None:
        """Walk the ring over ``flat`` (see [Note: the ring walk]); reduce in the first reduce_steps."""
        n, r = self.world_size, self._rank
        right, left = self._members[(r + 1) % n], self._members[(r - 1) % n]
        segs = segments or self._segments(flat.numel())
        elems = max(1, CHUNK_BYTES // flat.element_size())
        chunks = [[(s + o, min(elems, size - o)) for o in range(0, size, elems)] for s, size in segs]
        sent: dict[tuple[int, int], list[zmq.MessageTracker]] = {}
        all_trackers: list[zmq.MessageTracker] = []
        data = tensor_bytes(flat)
        item = flat.element_size()

        def send(step: int, seg: int, k: int) -> None:
            start, count = chunks[seg][k]
            header = self._header(KIND_COLLECTIVE, seq, step, k, flat, start * item, count * item,
                                  shape=(flat.numel(),))
            tracker = self._transport.send(right, header, data[start * item:(start + count) * item],
                                           deadline, self._members)
            if tracker is not None:
                sent.setdefault((seg, k), []).append(tracker)
                all_trackers.append(tracker)

        first = (r + d) % n
        for k in range(len(chunks[first])):
            send(0, first, k)
        for step in range(steps):
            seg = (r + d - step - 1) % n
            for k in range(len(chunks[seg])):
                header, body = self._transport.recv(left, (self._group, KIND_COLLECTIVE, seq, step, k),
                                                    deadline, self._members)
                self._check_coll(header, flat, deadline, (r - 1) % n)
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
                        self._wait_sent(pending, deadline)
                    target.copy_(incoming)
                del incoming
                self._transport.release(left, body)
                if step + 1 < steps:
                    send(step + 1, seg, k)
        self._wait_sent(all_trackers, deadline)

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM, *, timeout: timedelta | None = None,
                              async_op: bool = False) -> Work:
        n = self.world_size
        if tensor.numel() != n * output.numel() or tensor.dtype != output.dtype:
            raise ValueError(
                f"reduce_scatter_tensor: input has {tensor.numel()} {tensor.dtype} elements, expected "
                f"world_size * output.numel() = {n * output.numel()} of {output.dtype}"
            )
        reduce = _reducer(ReduceOp(op), tensor.dtype)
        seq = next(self._coll_seq)
        deadline_op = f"reduce_scatter_tensor({ReduceOp(op).value}, {dtype_name(tensor.dtype)})"

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            owned = self._scratch_lock.acquire(blocking=False)  # another thread's call uses it: a copy
            try:
                work = self._working_copy(tensor) if owned else tensor.detach().reshape(-1).clone()
                m = output.numel()
                if n > 1 and m > 0:
                    self._ring(work, seq, deadline, d=-1, steps=n - 1, reduce_steps=n - 1, reduce=reduce,
                               segments=[(i * m, m) for i in range(n)])
                mine = work[self._rank * m:(self._rank + 1) * m]
                if ReduceOp(op) is ReduceOp.MEAN:
                    mine.div_(n)
                output.copy_(mine.view(output.shape))
            finally:
                if owned:
                    self._scratch_lock.release()

        return self._run(deadline_op, run, async_op)

    def _working_copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` flattened into the kept scratch buffer (grown when too small)."""
        nbytes = tensor.numel() * tensor.element_size()
        if self._scratch.numel() < nbytes:
            self._scratch = torch.empty(nbytes, dtype=torch.uint8)
        work = self._scratch[:nbytes].view(tensor.dtype)
        work.copy_(tensor.detach().reshape(-1))
        return work

    def all_gather_into_tensor(self, output: torch.Tensor, tensor: torch.Tensor, *,
                               timeout: timedelta | None = None, async_op: bool = False) -> Work:
        n = self.world_size
        if output.numel() != n * tensor.numel() or tensor.dtype != output.dtype:
            raise ValueError(
                f"all_gather_into_tensor: output has {output.numel()} {output.dtype} elements, expected "
                f"world_size * input.numel() = {n * tensor.numel()} of {tensor.dtype}"
            )
        seq = next(self._coll_seq)
        deadline_op = f"all_gather_into_tensor({dtype_name(tensor.dtype)}{list(tensor.shape)})"

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            work = output if output.is_contiguous() else torch.empty_like(
                output, memory_format=torch.contiguous_format)
            flat = work.view(-1)
            m = tensor.numel()
            flat[self._rank * m:(self._rank + 1) * m].copy_(tensor.reshape(-1))
            if n > 1 and m > 0:
                self._ring(flat, seq, deadline, d=0, steps=n - 1, reduce_steps=0, reduce=None,
                           segments=[(i * m, m) for i in range(n)])
            if work is not output:
                output.copy_(work)

        return self._run(deadline_op, run, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: timedelta | None = None,
                  async_op: bool = False) -> Work:
        n = self.world_size
        if not 0 <= src < n:
            raise ValueError(f"broadcast: src {src} is outside 0..{n - 1}")
        seq = next(self._coll_seq)
        deadline_op = f"broadcast(src={src}, {dtype_name(tensor.dtype)}{list(tensor.shape)})"

        def run() -> None:
            if n == 1:
                return
            deadline = self._deadline(timeout, deadline_op)
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            small = work.numel() * work.element_size() <= SMALL_BYTES
            if small:
                if self._rank == src:
                    trackers = []
                    for r, peer in enumerate(self._members):
                        if r != src:
                            trackers += self._send_tensor(peer, work, KIND_COLLECTIVE, seq, 0, deadline)
                    self._wait_sent(trackers, deadline)
                else:
                    self._recv_tensor(self._members[src], work, KIND_COLLECTIVE, seq, 0, deadline,
                                      check_shape=True)
            else:
                self._chain_broadcast(work, src, seq, deadline)
            if work is not tensor:
                tensor.copy_(work)

        return self._run(deadline_op, run, async_op)

    def _chain_broadcast(self, work: torch.Tensor, src: int, seq: int, deadline: Deadline) -> None:
        """Pipelined chain src -> src+1 -> ...: each chunk is forwarded as soon as it lands."""
        n, r = self.world_size, self._rank
        pos = (r - src) % n  # position in the chain; 0 is the root
        left, right = self._members[(r - 1) % n], self._members[(r + 1) % n]
        data = tensor_bytes(work)
        total = data.nbytes
        trackers: list[zmq.MessageTracker] = []
        for part, offset in enumerate(range(0, total, CHUNK_BYTES)):
            count = min(CHUNK_BYTES, total - offset)
            if pos > 0:
                header, body = self._transport.recv(left, (self._group, KIND_COLLECTIVE, seq, 0, part),
                                                    deadline, self._members)
                if header.offset != offset or header.nbytes != count or header.torch_dtype != work.dtype:
                    raise CommError(
                        f"{deadline.op} on rank {r}: the root's tensor differs from this rank's "
                        f"({header.dtype}{list(header.shape)} vs {dtype_name(work.dtype)}{list(work.shape)})"
                    )
                data[offset:offset + count] = memoryview(body.buffer)
                self._transport.release(left, body)
            if pos < n - 1:
                header = self._header(KIND_COLLECTIVE, seq, 0, part, work, offset, count)
                tracker = self._transport.send(right, header, data[offset:offset + count], deadline,
                                               self._members)
                if tracker is not None:
                    trackers.append(tracker)
        self._wait_sent(trackers, deadline)

    def barrier(self, *, timeout: timedelta | None = None) -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.uint8), timeout=timeout)

    # -- groups and lifecycle ---------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> ZmqCommunicator | None:
        members = list(ranks)
        if len(set(members)) != len(members) or not members:
            raise ValueError(f"new_group: ranks {members} must be distinct and non-empty")
        for r in members:
            if not 0 <= r < self.world_size:
                raise ValueError(f"new_group: rank {r} is outside 0..{self.world_size - 1}")
        name = f"{self._group}.{next(self._groups)}"
        if self._rank not in members:
            return None
        global_members = tuple(self._members[r] for r in members)
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"zmq-comm-{name}")
        return ZmqCommunicator(self._transport, global_members, name, self.timeout, executor,
                               owns_transport=False)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True, cancel_futures=True)
        if self._owns:
            self._transport.rendezvous.close()
            self._transport.close()

    def stats(self) -> dict[str, Any]:
        return {"bad_messages": self._transport.bad_messages, "group": self._group}
