"""gloo and NCCL communicators: torch.distributed process groups behind the Communicator API.

:class:`TorchCommunicator` is the API both share: argument checks, staging of
non-contiguous tensors, MEAN, sub-groups and closing. The rest, by concept:
``group.py`` builds process groups (store, rendezvous); ``completion.py`` notices that
an operation finished without blocking in c10d's wait; ``watchdog.py`` releases the
waits that can only block; ``guard.py`` decides what a waiting operation raises and
tears a failed group down; ``work.py`` is the handle; ``gloo.py`` and ``nccl.py`` are
the backends. Failure semantics: [Note: never block in c10d's wait] and [Note: a failed
communicator stays failed].
"""

from __future__ import annotations

import abc
import atexit
import logging
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    ReduceScatterOptions,
    Store,
)

from comm.base import (
    DEFAULT_TIMEOUT,
    Communicator,
    CompletedWork,
    ReduceOp,
    Work,
    bound,
    check_sizes,
)
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL, Rendezvous
from comm.torch.completion import Completion
from comm.torch.group import ABORT_TAG, BACKEND_GRACE, WORLD, C10dWork, ProcessGroup, build, join
from comm.torch.guard import GroupGuard
from comm.torch.work import TorchWork, copier, finisher
from comm.traffic import BACKENDS, SENT

__all__ = ["TorchCommunicator"]

log = logging.getLogger(__name__)

_C = TypeVar("_C", bound="TorchCommunicator")

_NATIVE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class TorchCommunicator(Communicator):
    """A Communicator on one torch.distributed process group; subclasses pick the backend.

    Build one with :meth:`create` (or :func:`comm.init_communicator`). Failure semantics:
    [Note: never block in c10d's wait] and [Note: a failed communicator stays failed].
    """

    backend: str = ""
    device_type: str = ""  # the device type of the tensors the backend moves
    other_devices: str = ""  # where to go for tensors on other devices, for the error

    def __init__(
        self,
        *,
        pg: ProcessGroup,
        store: Store,
        name: str,
        members: Sequence[int],
        rank: int,
        rendezvous: Rendezvous,
        owns_rendezvous: bool,
        timeout: timedelta,
        host: str,
    ) -> None:
        self._store = store
        self._name = name
        self._members = tuple(members)  # global ranks, indexed by this group's ranks
        self._rank = rank
        self._rdzv = rendezvous
        self._owns_rdzv = owns_rendezvous
        self.timeout = timeout
        self._host = host
        self._groups_made = 0
        self._children: list[TorchCommunicator] = []
        self._traffic = BACKENDS.index(self.backend)  # where its bytes sent count: "gloo" or "nccl"
        self._guard = GroupGuard(
            pg, backend=self.backend, name=name, members=self._members, rank=rank,
            rendezvous=rendezvous, abort=self._abort,
        )
        _LIVE.add(self)

    @classmethod
    def create(
        cls: type[_C],
        *,
        rank: int,
        world_size: int,
        registry: Registry,
        prefix: str,
        timeout: timedelta = DEFAULT_TIMEOUT,
        liveness_ttl: timedelta = DEFAULT_LIVENESS_TTL,
        host: str | None = None,
    ) -> _C:
        """Meet the other ranks under ``prefix`` and build the process group.

        Blocks until every rank arrived and connected (bounded by ``timeout``).

        Args:
            host: the address other ranks reach this process at (rank 0's store and
                every rank's gloo device bind to it).

        Raises:
            ValueError: bad rank, or ranks of another backend under the same prefix.
            RegistryTimeoutError: not every rank published its card within ``timeout``.
            CommError: the store or the process group could not be set up.
        """
        joined = join(
            cls.backend, cls._make_pg, rank=rank, world_size=world_size, registry=registry,
            prefix=prefix, timeout=timeout, liveness_ttl=liveness_ttl, host=host,
        )
        return cls(
            pg=joined.pg, store=joined.store, name=WORLD, members=range(world_size), rank=rank,
            rendezvous=joined.rendezvous, owns_rendezvous=True, timeout=timeout, host=joined.host,
        )

    # -- backend hooks --------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> ProcessGroup:
        """Build the process group (blocks until every member connected)."""

    @abc.abstractmethod
    def _collective_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion: ...

    @abc.abstractmethod
    def _p2p_completion(self, work: C10dWork, timeout: timedelta, name: str) -> Completion: ...

    @abc.abstractmethod
    def _abort(self, pg: ProcessGroup) -> None:
        """Fail every pending operation of ``pg`` now (and let peers see the connections go)."""

    def _native_mean(self) -> bool:
        """Whether the backend's AVG is used for MEAN (else SUM, then divide)."""
        return False

    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        """Raise ValueError for a tensor this backend cannot move (another device, not dense)."""
        if tensor.device.type != self.device_type:
            raise ValueError(f"{op}: the {self.backend} backend takes {self.device_type.upper()} tensors, "
                             f"got one on {tensor.device}; {self.other_devices}")
        if tensor.layout != torch.strided:
            raise ValueError(f"{op}: only dense (strided) tensors are supported, got {tensor.layout}")

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of this communicator, in group-rank order."""
        return self._members

    # -- issuing ----------------------------------------------------------------------------

    def _run(
        self,
        op: str,
        start: Callable[[ProcessGroup], C10dWork],
        *,
        timeout: timedelta | None,
        async_op: bool,
        sends: torch.Tensor | None,
        finish: Callable[[], None] | None = None,
    ) -> Work:
        """Issue a collective over every member and either return its handle or wait for it.

        ``sends``: what this rank contributes, counted as sent once issued (see [Note: what
        "bytes sent" counts] in ``comm/traffic.py``); None for nothing.
        """
        pg = self._guard.live(op)
        limit = bound(timeout, self.timeout)
        self._rdzv.check(self._members, op)
        work = self._guard.issue(op, lambda: start(pg), self._members, limit, None)
        if sends is not None:
            SENT.add(self._traffic, sends.numel() * sends.element_size())
        completion = self._collective_completion(
            work, limit + BACKEND_GRACE, f"{self.backend}-{op}-{self._members[self._rank]}"
        )
        self._guard.track(completion)
        handle = TorchWork(
            self._guard, op, completion, peers=self._members, waiting_for=None, timeout=limit, finish=finish
        )
        if async_op:
            return handle
        handle.wait(limit)
        return CompletedWork()

    def _backend_timeout(self, timeout: timedelta | None) -> timedelta:
        return bound(timeout, self.timeout) + BACKEND_GRACE

    # -- point to point ---------------------------------------------------------------------

    def _p2p(
        self, op: str, tensor: torch.Tensor, peer: int, tag: int, timeout: timedelta | None
    ) -> TorchWork:
        self._check_device(tensor, op)
        target = self._peer(peer, op)
        if not 0 <= tag < ABORT_TAG:
            raise ValueError(f"{op}: tag must be in 0..{ABORT_TAG - 1}, got {tag}")
        pg = self._guard.live(op)
        limit = bound(timeout, self.timeout)
        self._rdzv.check([target], op)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if op == "send":
            work = self._guard.issue(op, lambda: pg.send([buf], peer, tag), [target], limit, target)
            SENT.add(self._traffic, buf.numel() * buf.element_size())
            finish = None
        else:
            work = self._guard.issue(op, lambda: pg.recv([buf], peer, tag), [target], limit, target)
            finish = None if buf is tensor else copier(tensor, buf)
        completion = self._p2p_completion(
            work, limit + BACKEND_GRACE, f"{self.backend}-{op}-{self._members[self._rank]}-{target}"
        )
        self._guard.track(completion)
        return TorchWork(self._guard, op, completion, peers=[target], waiting_for=target, timeout=limit,
                         finish=finish)

    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> Work:
        return self._p2p("send", tensor, dst, tag, None)

    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> Work:
        return self._p2p("recv", tensor, src, tag, None)

    def send(
        self, tensor: torch.Tensor, dst: int, *, tag: int = 0, timeout: timedelta | None = None
    ) -> None:
        self._p2p("send", tensor, dst, tag, timeout).wait(timeout)

    def recv(
        self, tensor: torch.Tensor, src: int, *, tag: int = 0, timeout: timedelta | None = None
    ) -> None:
        self._p2p("recv", tensor, src, tag, timeout).wait(timeout)

    # -- collectives ------------------------------------------------------------------------

    def _reduce_op(self, op: ReduceOp, dtype: torch.dtype, what: str) -> tuple[Any, bool]:
        """The c10d op to run and whether to divide by world_size afterwards."""
        op = ReduceOp(op)
        if op is ReduceOp.MEAN:
            if not (dtype.is_floating_point or dtype.is_complex):
                raise ValueError(f"{what} MEAN needs a floating-point tensor, got {dtype}; use SUM")
            if self._native_mean():
                return dist.ReduceOp.AVG, False
            return dist.ReduceOp.SUM, True
        return _NATIVE_OPS[op], False

    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        self._check_device(tensor, "all_reduce")
        native, divide = self._reduce_op(op, tensor.dtype, "all_reduce")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        opts = AllreduceOptions()
        opts.reduceOp = native
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "all_reduce", lambda pg: pg.allreduce([buf], opts), timeout=timeout, async_op=async_op, sends=buf,
            finish=finisher(tensor, buf, self.world_size if divide else None),
        )

    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        self._check_device(tensor, "broadcast")
        self._check_root(src, "broadcast")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "broadcast", lambda pg: pg.broadcast([buf], opts), timeout=timeout, async_op=async_op,
            sends=buf if self._rank == src else None,
            finish=finisher(tensor, buf, None),
        )

    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        self._check_device(tensor, "all_gather_into_tensor")
        self._check_device(output, "all_gather_into_tensor")
        check_sizes("all_gather_into_tensor", "output", output, "tensor", tensor, self.world_size)
        src = tensor.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        opts = AllgatherOptions()
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "all_gather_into_tensor", lambda pg: pg._allgather_base(out.view(-1), src, opts),
            timeout=timeout, async_op=async_op, sends=src, finish=finisher(output, out, None),
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
        reuse_input: bool = False,  # the process group reduces out of place anyway
    ) -> Work:
        self._check_device(tensor, "reduce_scatter_tensor")
        self._check_device(output, "reduce_scatter_tensor")
        check_sizes("reduce_scatter_tensor", "tensor", tensor, "output", output, self.world_size)
        native, divide = self._reduce_op(op, tensor.dtype, "reduce_scatter_tensor")
        src = tensor.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        opts = ReduceScatterOptions()
        opts.reduceOp = native
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "reduce_scatter_tensor", lambda pg: pg._reduce_scatter_base(out.view(-1), src, opts),
            timeout=timeout, async_op=async_op, sends=src,
            finish=finisher(output, out, self.world_size if divide else None),
        )

    def barrier(self, *, timeout: timedelta | None = None) -> None:
        opts = BarrierOptions()
        opts.timeout = self._backend_timeout(timeout)
        self._run("barrier", lambda pg: pg.barrier(opts), timeout=timeout, async_op=False, sends=None)

    # -- groups and lifecycle -----------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> TorchCommunicator | None:
        """A sub-communicator (its own process group) over ``ranks`` of this one.

        Every rank of this communicator calls it with the same ``ranks`` in the same
        order; members block until all members connected (bounded by ``timeout``).
        The sub-group shares this communicator's store and liveness tracking; closing
        this communicator closes its sub-groups.
        """
        chosen = self._subgroup(ranks)
        self._guard.live("new_group")
        self._groups_made += 1
        name = f"{self._name}/{self._groups_made}"
        if self._rank not in chosen:
            return None
        members = [self._members[r] for r in chosen]
        self._rdzv.check(members, "new_group")
        sub_rank = chosen.index(self._rank)
        pg = build("new_group", self._make_pg, self._store, name, sub_rank, len(chosen), self.timeout,
                   self._host)
        child = type(self)(
            pg=pg, store=self._store, name=name, members=members, rank=sub_rank,
            rendezvous=self._rdzv, owns_rendezvous=False, timeout=self.timeout, host=self._host,
        )
        self._children.append(child)
        return child

    def close(self) -> None:
        """Shut the process group (and sub-groups) down; the root also leaves the rendezvous."""
        if not self._guard.close(self._close_children):
            return
        if self._owns_rdzv:
            self._rdzv.close()
        _LIVE.discard(self)

    def _close_children(self) -> None:
        for child in self._children:
            child.close()
        self._children.clear()

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"group={self._name!r}, members={list(self._members)})")


# Every communicator not yet closed; closed at interpreter exit (see [Note: aborting a gloo
# process group] in comm/torch/gloo.py) so no backend thread finishes a work while Python
# shuts down.
_LIVE: weakref.WeakSet[TorchCommunicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for comm in list(_LIVE):
        try:
            comm.close()
        except Exception:  # exiting anyway
            log.debug("closing %r at exit failed", comm, exc_info=True)
