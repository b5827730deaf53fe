"""The one communication front end every backend implements: point to point, collectives, groups.

Semantics follow ``torch.distributed`` where it has them, so a user of it meets no surprise:

* Collectives work in place (``all_reduce``, ``broadcast``) or into a given output
  tensor, and every rank of the communicator must call them in the same order.
* Every blocking call takes ``timeout`` (a :class:`datetime.timedelta`); ``None`` means the
  communicator's default (:data:`DEFAULT_TIMEOUT`, 300 s, settable per communicator).
  A timeout raises :class:`~comm.errors.CommTimeoutError`; a peer that died or stopped
  renewing its liveness lease raises :class:`~comm.errors.PeerLostError` naming its rank.
* ``async_op=True`` returns a :class:`Work` handle at once; its ``wait`` has the same
  timeout rules. ``async_op=False`` returns a completed handle.
* Tensors may be non-contiguous; results land in the caller's tensor either way.
"""

from __future__ import annotations

import abc
import enum
from collections.abc import Sequence
from datetime import timedelta

import torch

from comm.errors import CommTimeoutError

__all__ = [
    "DEFAULT_TIMEOUT",
    "Communicator",
    "CompletedWork",
    "ReduceOp",
    "Work",
    "bound",
    "check_sizes",
    "timeout_error",
]

DEFAULT_TIMEOUT = timedelta(seconds=300)


class ReduceOp(str, enum.Enum):
    SUM = "sum"
    MEAN = "mean"
    MAX = "max"
    MIN = "min"


class Work(abc.ABC):
    """A handle on an operation in flight."""

    @abc.abstractmethod
    def wait(self, timeout: timedelta | None = None) -> None:
        """Block until the operation finished (raising its error, if it failed)."""

    @abc.abstractmethod
    def is_completed(self) -> bool:
        """True once the operation finished, successfully or not."""


class CompletedWork(Work):
    """The handle a synchronous call returns."""

    def wait(self, timeout: timedelta | None = None) -> None:
        return None

    def is_completed(self) -> bool:
        return True


class Communicator(abc.ABC):
    """A group of ``world_size`` ranks that exchange tensors.

    Backends: ``comm.zmq.communicator.ZmqCommunicator``, ``comm.torch.gloo.GlooCommunicator``
    and ``comm.torch.nccl.NcclCommunicator``; build one with :func:`comm.init_communicator`.

    A backend sets ``_members`` (the global ranks of the group, indexed by group rank) and
    ``_rank`` (this process's group rank); the checks below are the ones every backend
    makes on the calling rank before anything is sent, so bad arguments raise the same
    ``ValueError`` everywhere.
    """

    backend: str
    timeout: timedelta
    _members: tuple[int, ...]
    _rank: int

    @property
    def rank(self) -> int:
        """This process's rank in the communicator (0-based)."""
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._members)

    # -- point to point -------------------------------------------------------------

    @abc.abstractmethod
    def isend(self, tensor: torch.Tensor, dst: int, *, tag: int = 0) -> Work:
        """Start sending ``tensor`` to rank ``dst``; do not modify it until the handle completes.

        Messages between one pair with one tag arrive in the order they were sent.
        """

    @abc.abstractmethod
    def irecv(self, tensor: torch.Tensor, src: int, *, tag: int = 0) -> Work:
        """Start receiving from rank ``src`` into ``tensor`` (shape and dtype must match the send)."""

    def send(
        self, tensor: torch.Tensor, dst: int, *, tag: int = 0, timeout: timedelta | None = None
    ) -> None:
        self.isend(tensor, dst, tag=tag).wait(timeout)

    def recv(
        self, tensor: torch.Tensor, src: int, *, tag: int = 0, timeout: timedelta | None = None
    ) -> None:
        self.irecv(tensor, src, tag=tag).wait(timeout)

    # -- collectives ----------------------------------------------------------------

    @abc.abstractmethod
    def all_reduce(
        self,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        """Reduce ``tensor`` across ranks in place; every rank ends with the same result.

        ``MEAN`` is defined for floating-point tensors only (ValueError otherwise).
        """

    @abc.abstractmethod
    def broadcast(
        self,
        tensor: torch.Tensor,
        src: int,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        """Copy rank ``src``'s ``tensor`` into ``tensor`` on every rank."""

    @abc.abstractmethod
    def all_gather_into_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        """Gather every rank's ``tensor`` into ``output``, concatenated along dim 0 in rank order.

        ``output.numel()`` must be ``world_size * tensor.numel()``.
        """

    @abc.abstractmethod
    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
        reuse_input: bool = False,
    ) -> Work:
        """Reduce ``tensor`` across ranks and give rank r the r-th of ``world_size`` equal parts.

        ``tensor.numel()`` must be ``world_size * output.numel()``. ``reuse_input``: the caller is done
        with ``tensor`` (a packed buffer it drops after the call), so the backend may reduce in it instead
        of in a copy; its values are unspecified once the work completed. ``tensor`` is left as it was
        otherwise.
        """

    @abc.abstractmethod
    def barrier(self, *, timeout: timedelta | None = None) -> None:
        """Return once every rank has entered the barrier."""

    def all_gather(
        self,
        outputs: Sequence[torch.Tensor],
        tensor: torch.Tensor,
        *,
        timeout: timedelta | None = None,
    ) -> None:
        """torch.distributed's list form: ``outputs[r]`` receives rank r's ``tensor``."""
        _check_list(outputs, tensor, self.world_size, "all_gather", "outputs")
        flat = torch.empty((self.world_size, tensor.numel()), dtype=tensor.dtype, device=tensor.device)
        self.all_gather_into_tensor(flat, tensor, timeout=timeout)
        for r, out in enumerate(outputs):
            out.copy_(flat[r].view(out.shape))

    def reduce_scatter(
        self,
        output: torch.Tensor,
        inputs: Sequence[torch.Tensor],
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
    ) -> None:
        """torch.distributed's list form: rank r receives the reduction of every rank's ``inputs[r]``."""
        _check_list(inputs, output, self.world_size, "reduce_scatter", "inputs")
        flat = torch.stack([t.reshape(-1) for t in inputs]) if inputs else torch.empty(0)
        self.reduce_scatter_tensor(output, flat, op, timeout=timeout)

    # -- groups and lifecycle ---------------------------------------------------------

    @abc.abstractmethod
    def new_group(self, ranks: Sequence[int]) -> Communicator | None:
        """A communicator over a subset of this one's ranks (renumbered 0..len-1 in the given order).

        Every rank of this communicator must call ``new_group`` with the same ``ranks``
        in the same order (as with torch.distributed); ranks outside the subset get None.
        Groups are independent: collectives on disjoint groups may run at the same time.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Release sockets, threads and the liveness lease. Idempotent."""

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size})"

    # -- argument checks shared by the backends ------------------------------------------

    def _peer(self, group_rank: int, op: str) -> int:
        """The global rank of point-to-point peer ``group_rank`` (ValueError: outside, or this rank)."""
        if not 0 <= group_rank < self.world_size:
            raise ValueError(f"{op}: rank {group_rank} is outside 0..{self.world_size - 1}")
        if group_rank == self._rank:
            raise ValueError(f"{op}: rank {group_rank} is this rank; sending to oneself is not supported")
        return self._members[group_rank]

    def _check_root(self, src: int, op: str) -> None:
        if not 0 <= src < self.world_size:
            raise ValueError(f"{op}: src {src} is outside 0..{self.world_size - 1}")

    def _subgroup(self, ranks: Sequence[int]) -> list[int]:
        """``new_group``'s ranks, checked: distinct, non-empty, each a rank of this communicator."""
        chosen = [int(r) for r in ranks]
        if not chosen or len(set(chosen)) != len(chosen):
            raise ValueError(f"new_group: ranks {chosen} must be distinct and non-empty")
        for r in chosen:
            if not 0 <= r < self.world_size:
                raise ValueError(f"new_group: rank {r} is outside 0..{self.world_size - 1}")
        return chosen


def bound(timeout: timedelta | None, default: timedelta) -> timedelta:
    """A call's time limit: ``timeout``, or ``default`` when it is None (zero means zero)."""
    return default if timeout is None else timeout


def timeout_error(
    call: str, rank: int | None, waited: float, whom: str, *, peer: int | None, detail: str = ""
) -> CommTimeoutError:
    """The error of a call that ran out of time, worded alike by every backend.

    Args:
        call: the call, with its arguments when known (``"recv(src=0, tag=3)"``); the bare
            name before ``(`` becomes the error's ``op``.
        rank: the global rank that gave up (None: not known here).
        waited: seconds waited.
        whom: what it waited for (``"peer rank 2"``, ``"a send to complete"``).
        peer: the global rank waited for, when there is one.
        detail: the backend's own words, appended.
    """
    where = "" if rank is None else f" on rank {rank}"
    said = f"; {detail}" if detail else ""
    return CommTimeoutError(
        f"{call}{where} timed out after {waited:.2f}s waiting for {whom}{said}",
        op=call.split("(", 1)[0], peer=peer, waited=waited,
    )


def check_sizes(
    op: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor, world_size: int
) -> None:
    """ValueError unless ``big`` holds ``world_size`` times ``small``'s elements, of its dtype."""
    if big.dtype != small.dtype:
        raise ValueError(f"{op}: {big_name} is {big.dtype} but {small_name} is {small.dtype}")
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{op}: {big_name} has {big.numel()} elements, expected world_size * {small_name}.numel() "
            f"= {world_size} * {small.numel()} = {world_size * small.numel()}"
        )


def _check_list(
    tensors: Sequence[torch.Tensor], like: torch.Tensor, world_size: int, op: str, name: str
) -> None:
    if len(tensors) != world_size:
        raise ValueError(f"{op}: {name} has {len(tensors)} tensors, expected world_size={world_size}")
    for r, t in enumerate(tensors):
        if t.numel() != like.numel() or t.dtype != like.dtype:
            raise ValueError(
                f"{op}: {name}[{r}] is {tuple(t.shape)} {t.dtype}, expected {like.numel()} "
                f"elements of {like.dtype}"
            )
