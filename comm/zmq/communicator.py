"""cellmesh's own ZeroMQ backend: the Communicator over a rank's transport.

This module is the API: it checks arguments, numbers operations (every rank issues
collectives in the same order, so a sequence number matches them up), stages
non-contiguous tensors, and runs each operation inline or, for ``async_op``, on the
communicator's worker thread. The bytes move in ``comm/zmq/transport.py``; the
algorithms are in ``comm/zmq/collectives.py``.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any, Literal

import torch
import zmq

from comm.base import DEFAULT_TIMEOUT, Communicator, CompletedWork, ReduceOp, Work, bound, check_sizes
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL, Rendezvous
from comm.sockets import CHUNK_BYTES
from comm.wire import KIND_P2P, dtype_name, tensor_bytes
from comm.zmq import collectives
from comm.zmq.group import ZmqGroup
from comm.zmq.transport import Deadline, Transport, wait_trackers
from comm.zmq.work import FutureWork, RecvWork, SendWork

__all__ = ["ZmqCommunicator"]

_POSTED = CompletedWork()  # a send handed over in shared memory: nothing is left to wait for


class ZmqCommunicator(Communicator):
    """A communicator on cellmesh's ZeroMQ transport. Build it with :meth:`create`.

    Sub-groups share the parent's sockets; their messages carry the group's name, so
    operations of different groups never mix.
    """

    backend = "zmq"
    all_reduce_algorithm: collectives.Algorithm = "auto"
    """``"auto"`` picks by size (``collectives.choose``: doubling up to 64 KiB, the ring above); benchmarks
    and tests pin ``"direct"``, ``"doubling"`` or ``"ring"`` to compare them. Every rank must set the same."""

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
        self._g = ZmqGroup(transport, members, group)
        self._members = members  # global ranks, indexed by group rank
        self._rank = self._g.rank
        self.timeout = timeout
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
    def bad_messages(self) -> int:
        """How many malformed data messages this rank has dropped (counted by reason in comm.refusals)."""
        return self._transport.bad_messages

    def _in_group(self, call: str) -> str:
        """A collective's name for its errors: the call, and on a sub-group the group and its global ranks
        (several groups run the same collective at once; a timeout must say which one waited)."""
        if self._owns:  # the world communicator (it owns the transport)
            return call
        return f"{call} in group {self._g.name!r} of ranks {list(self._members)}"

    def _deadline(self, timeout: timedelta | None, op: str) -> Deadline:
        return Deadline(bound(timeout, self.timeout), op)

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
        work = FutureWork(future, self.timeout, op)
        if not async_op:
            work.wait(timeout=self.timeout * 2)
            return CompletedWork()
        return work

    # -- point to point ---------------------------------------------------------------

    def _next_seq(self, table: dict[tuple[int, int], itertools.count[int]], peer: int, tag: int) -> int:
        with self._p2p_lock:
            return next(table.setdefault((peer, tag), itertools.count()))

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> Work:
        """Post a send; a same-host send of one part goes through shared memory and is complete on return
        (its bytes are copied out), others complete once libzmq let go of the tensor's memory."""
        peer = self._peer(dst, "isend")
        seq = self._next_seq(self._p2p_send_seq, peer, tag)
        if (tensor.is_cpu and tensor.is_contiguous() and tensor.nbytes <= CHUNK_BYTES
                and self._transport.post(peer, self._g.name, KIND_P2P, seq, tag, tensor)):
            return _POSTED  # its bytes are in shared memory already: nothing refers to the tensor any more
        src = tensor.detach()
        if not src.is_contiguous():
            src = src.contiguous()
        deadline = self._deadline(None, f"isend(dst={dst}, tag={tag})")
        trackers = self._g.send_tensor(peer, src, KIND_P2P, seq, tag, deadline)
        rendezvous = self._transport.rendezvous

        def wait(pending: list[zmq.MessageTracker], dl: Deadline) -> None:
            wait_trackers(pending, dl, rendezvous, (peer,))

        return SendWork(trackers, self.timeout, deadline.op, src, wait)

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> Work:
        peer = self._peer(src, "irecv")
        seq = self._next_seq(self._p2p_recv_seq, peer, tag)
        op = f"recv(src={src}, tag={tag})"
        contiguous = tensor.is_contiguous()
        dst = tensor if contiguous else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if dst.nbytes <= CHUNK_BYTES:  # one part: the common case, with the shortest path

            def one(deadline: Deadline) -> bool:
                self._g.recv_whole(peer, dst, KIND_P2P, seq, tag, deadline)
                if not contiguous:
                    tensor.copy_(dst)
                return True

            return RecvWork(one, self.timeout, op)
        data = tensor_bytes(dst)
        parts = max(1, -(-data.nbytes // CHUNK_BYTES))
        received = [0]

        def step(deadline: Deadline) -> bool:
            part = received[0]
            self._g.recv_part(peer, dst, data, KIND_P2P, seq, tag, part, deadline, check_shape=True)
            received[0] = part + 1
            if received[0] < parts:
                return False
            if not contiguous:
                tensor.copy_(dst)
            return True

        return RecvWork(step, self.timeout, op)

    # -- collectives ----------------------------------------------------------------

    def all_reduce(self, tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   timeout: timedelta | None = None, async_op: bool = False) -> Work:
        reduce = collectives.reducer(ReduceOp(op), tensor.dtype)
        seq = next(self._coll_seq)
        deadline_op = self._in_group(
            f"all_reduce({ReduceOp(op).value}, {dtype_name(tensor.dtype)}{list(tensor.shape)})")

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            flat = work.view(-1)
            collectives.all_reduce(self._g, flat, reduce, seq, deadline, self.all_reduce_algorithm)
            if ReduceOp(op) is ReduceOp.MEAN:
                flat.div_(self.world_size)
            if work is not tensor:
                tensor.copy_(work)

        return self._run(deadline_op, run, async_op)

    def reduce_scatter_tensor(self, output: torch.Tensor, tensor: torch.Tensor,
                              op: ReduceOp = ReduceOp.SUM, *, timeout: timedelta | None = None,
                              async_op: bool = False, reuse_input: bool = False) -> Work:
        n = self.world_size
        check_sizes("reduce_scatter_tensor", "tensor", tensor, "output", output, n)
        reduce = collectives.reducer(ReduceOp(op), tensor.dtype)
        seq = next(self._coll_seq)
        deadline_op = self._in_group(
            f"reduce_scatter_tensor({ReduceOp(op).value}, {dtype_name(tensor.dtype)})")

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            # the ring reduces in its buffer: the input itself when the caller gave it up
            # (``reuse_input``), else a copy in the kept scratch (a fresh one while another thread's
            # call holds the scratch)
            in_place = reuse_input and tensor.is_contiguous()
            owned = not in_place and self._scratch_lock.acquire(blocking=False)
            try:
                work = (tensor.detach().view(-1) if in_place else self._working_copy(tensor) if owned
                        else tensor.detach().reshape(-1).clone())
                m = output.numel()
                if n > 1 and m > 0:
                    collectives.ring(self._g, work, seq, deadline, d=-1, steps=n - 1, reduce_steps=n - 1,
                                     reduce=reduce, segments=[(i * m, m) for i in range(n)])
                mine = work[self._rank * m:(self._rank + 1) * m].view(output.shape)
                if ReduceOp(op) is ReduceOp.MEAN:
                    torch.div(mine, n, out=output)
                else:
                    output.copy_(mine)
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
        check_sizes("all_gather_into_tensor", "output", output, "tensor", tensor, n)
        seq = next(self._coll_seq)
        deadline_op = self._in_group(
            f"all_gather_into_tensor({dtype_name(tensor.dtype)}{list(tensor.shape)})")

        def run() -> None:
            deadline = self._deadline(timeout, deadline_op)
            work = output if output.is_contiguous() else torch.empty_like(
                output, memory_format=torch.contiguous_format)
            flat = work.view(-1)
            m = tensor.numel()
            flat[self._rank * m:(self._rank + 1) * m].copy_(tensor.reshape(-1))
            if n > 1 and m > 0:
                collectives.ring(self._g, flat, seq, deadline, d=0, steps=n - 1, reduce_steps=0, reduce=None,
                                 segments=[(i * m, m) for i in range(n)])
            if work is not output:
                output.copy_(work)

        return self._run(deadline_op, run, async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: timedelta | None = None,
                  async_op: bool = False) -> Work:
        self._check_root(src, "broadcast")
        seq = next(self._coll_seq)
        deadline_op = self._in_group(
            f"broadcast(src={src}, {dtype_name(tensor.dtype)}{list(tensor.shape)})")

        def run() -> None:
            if self.world_size == 1:
                return
            deadline = self._deadline(timeout, deadline_op)
            work = tensor if tensor.is_contiguous() else tensor.contiguous()
            collectives.broadcast(self._g, work, src, seq, deadline)
            if work is not tensor:
                tensor.copy_(work)

        return self._run(deadline_op, run, async_op)

    def barrier(self, *, timeout: timedelta | None = None) -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.uint8), timeout=timeout)

    # -- groups and lifecycle ---------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> ZmqCommunicator | None:
        members = self._subgroup(ranks)
        name = f"{self._g.name}.{next(self._groups)}"
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
        return {"bad_messages": self._transport.bad_messages, "group": self._g.name}
