"""gloo and NCCL communicators: torch.distributed process groups behind the Communicator API.

Every communicator owns its own ``ProcessGroupGloo`` / ``ProcessGroupNCCL`` object and
never touches torch.distributed's global default group, so one process may hold several
communicators and any number of sub-groups.

Setup: rank 0 starts a ``TCPStore`` on a free port and puts its address on its
rendezvous card; the other ranks read it from :meth:`Rendezvous.gather` and connect. The
process group meets over a ``PrefixStore`` named after the communicator, so sub-groups
(made by :meth:`TorchCommunicator.new_group`) reuse the same store under fresh names.

[Note: never block in c10d's wait]
c10d's ``Work.wait()`` blocks until the backend gives up, which is 30 minutes for a
frozen gloo peer. Instead every operation is awaited in short slices: gloo's
collectives by ``wait(slice)`` (a slice that runs out leaves the operation alone), NCCL's
by polling ``is_completed()`` with short, growing sleeps. Between slices the rendezvous
is asked whether a member's liveness lease lapsed. The few gloo works that only progress
inside one unbounded ``wait()`` (send and recv, whose timed-out wait closes every
connection of the group, and reduce_scatter, which gloo implements as an all_reduce
whose slice is copied out in ``wait``) are waited for directly, while one watchdog
thread per process checks liveness and the deadline and, when either says stop, aborts
the group so the wait returns. So

* a member that is lost (killed, frozen, or closed) raises ``PeerLostError`` within
  about the liveness TTL;
* the per-call deadline raises ``CommTimeoutError`` naming the op and the seconds
  waited (and the peer, for point to point);
* an error from the backend itself (a killed gloo peer errors its neighbours in
  ~0.03 s) is attributed: the rendezvous gets ``liveness_ttl + margin`` (but never more
  than what is left of the call's timeout) to name the lost rank (``PeerLostError``);
  otherwise it is re-raised as ``CommError`` (``CommTimeoutError`` once the deadline
  passed) with the backend's message.

The backend is also given the call's timeout (plus ``_BACKEND_GRACE``) so it cleans up
after itself shortly after we gave up.

[Note: a failed communicator stays failed]
gloo tears down every connection of a process group when any operation of it times
out or fails ("Application timeout caused pair closure"), and NCCL communicators must
be aborted after an error. So after an operation raised a ``CommError`` (timeout, lost
peer, backend error) the communicator shuts its process group down and every later
call raises ``CommError`` at once. Build a new communicator (a new prefix) to go on.
Sub-groups are separate process groups: a failure in one leaves the others usable.

[Note: aborting a gloo process group]
gloo has no working abort (``abort()`` and ``shutdown()`` leave an operation that waits
on a frozen peer waiting until gloo's own timeout). But any gloo timeout makes the
context signal an error to every pair ("Application timeout caused pair closure"),
which fails every pending operation of the process group at once and closes its
connections, so peers learn of it immediately too. So a failed communicator (and one
closed while operations are still in flight) posts a receive on a reserved tag and
waits 1 ms for it. No work is left running in a gloo thread that could finish after
the interpreter began to shut down; that matters because a gloo thread completing a
work then touches Python objects (its future's callbacks, a waiting thread's GIL) and
Python 3.11 ends such threads with a forced unwind, which aborts the process
("terminate called after throwing an instance of 'gloo::IoException'"). For the same
reason no Python callback is ever attached to a c10d future here, and an ``atexit``
hook closes every communicator still open.
"""

from __future__ import annotations

import abc
import atexit
import contextlib
import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    BarrierOptions,
    BroadcastOptions,
    PrefixStore,
    ReduceScatterOptions,
    Store,
    TCPStore,
)
from torch._C._distributed_c10d import Work as _C10dWork

from comm.base import DEFAULT_TIMEOUT, Communicator, CompletedWork, ReduceOp, Work
from comm.errors import CommError, CommTimeoutError, PeerLostError
from comm.registry.base import Registry
from comm.rendezvous import DEFAULT_LIVENESS_TTL, Rendezvous
from comm.sockets import default_host

__all__ = ["GlooCommunicator", "NcclCommunicator", "TorchCommunicator"]

log = logging.getLogger(__name__)

_C = TypeVar("_C", bound="TorchCommunicator")
_E = TypeVar("_E", bound=BaseException)

# How often a waiting operation asks the rendezvous whether a member was lost.
_LIVENESS_POLL_S = 0.05
# The backend's own timeout runs this much past ours, so our CommTimeoutError comes first.
_BACKEND_GRACE = timedelta(seconds=2)
# After a backend error, how long beyond the liveness TTL to wait for the rendezvous to
# name the lost rank (lease expiry is checked periodically, and the watch adds latency).
_LOSS_MARGIN = timedelta(seconds=1.5)
# Bound on tearing a process group down (shutdown/abort run on a helper thread).
_TEARDOWN_S = 5.0
# How long close() waits for operations failed by an abort to report back.
_DRAIN_S = 2.0
# The receive that aborts a gloo process group uses this tag; user tags stay below it.
_ABORT_TAG = (1 << 31) - 1

_NATIVE_OPS = {
    ReduceOp.SUM: dist.ReduceOp.SUM,
    ReduceOp.MAX: dist.ReduceOp.MAX,
    ReduceOp.MIN: dist.ReduceOp.MIN,
}


class _ProcessGroup(Protocol):
    """The c10d backend methods used here (torch's stub of ``Backend`` does not list them)."""

    def allreduce(self, tensors: list[torch.Tensor], opts: AllreduceOptions, /) -> _C10dWork: ...
    def broadcast(self, tensors: list[torch.Tensor], opts: BroadcastOptions, /) -> _C10dWork: ...
    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: AllgatherOptions, /
    ) -> _C10dWork: ...
    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: ReduceScatterOptions, /
    ) -> _C10dWork: ...
    def barrier(self, opts: BarrierOptions, /) -> _C10dWork: ...
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, /) -> _C10dWork: ...
    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, /) -> _C10dWork: ...
    def shutdown(self) -> None: ...
    def abort(self) -> None: ...


# -- completion tracking (see [Note: never block in c10d's wait]) --------------------------


class _Completion(abc.ABC):
    """Notices that a c10d ``Work`` finished without blocking in its ``wait()``."""

    @abc.abstractmethod
    def wait(self, seconds: float) -> bool:
        """Block at most ``seconds``; True once the operation finished (ok or not)."""

    @abc.abstractmethod
    def done(self) -> bool:
        """Whether the operation is known to have finished (never blocks, never starts work)."""

    def poll(self) -> bool:
        """``Work.is_completed``: like :meth:`done`, but may start watching the operation."""
        return self.done()

    def blocking(self) -> bool:
        """True while the only way to finish is :meth:`block` (see :class:`_WaitOnlyCompletion`)."""
        return False

    def block(self) -> None:
        """Wait in this thread until the operation finished (only while :meth:`blocking`)."""
        raise NotImplementedError

    @abc.abstractmethod
    def result(self) -> None:
        """Raise the operation's error, if it failed. Only call once ``done()``."""


class _WaitOnlyCompletion(_Completion):
    """gloo works that progress only inside an unbounded ``wait()``: send and recv (a
    timed-out ``wait`` of theirs closes every connection of the group) and reduce_scatter
    (a wrapper that ignores the wait's timeout).

    The caller blocks in ``wait()`` itself, guarded by :data:`_WATCHDOG`, which aborts the
    process group when a peer is lost or the deadline passes. Only ``is_completed()`` on a
    handle nobody waits for yet moves the wait to a daemon thread.
    """

    def __init__(self, work: _C10dWork, timeout: timedelta, name: str) -> None:
        self._work = work
        self._timeout = timeout  # the backend's bound (ours plus grace)
        self._name = name
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def blocking(self) -> bool:
        with self._lock:
            return self._thread is None and not self._event.is_set()

    def block(self) -> None:
        self._run()

    def _run(self) -> None:
        try:
            self._work.wait(self._timeout)
        except BaseException as exc:  # handed to the waiting caller
            self._error = exc
        finally:
            self._event.set()

    def poll(self) -> bool:
        with self._lock:
            if self._thread is None and not self._event.is_set():
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
        return self._event.is_set()

    def wait(self, seconds: float) -> bool:
        return self._event.wait(seconds)

    def done(self) -> bool:
        return self._event.is_set()

    def result(self) -> None:
        if self._error is not None:
            raise self._error


class _SliceCompletion(_Completion):
    """gloo's asynchronous collectives: ``wait(slice)`` wakes at completion; a slice that runs
    out raises "Operation timed out!" and leaves the operation untouched."""

    def __init__(self, work: _C10dWork) -> None:
        self._work = work

    def wait(self, seconds: float) -> bool:
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError:
            return self._work.is_completed()  # completed means failed; result() re-raises
        return True

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self) -> None:
        self._work.wait()


class _PollCompletion(_Completion):
    """Polls ``is_completed()`` with sleeps growing from 20 us to 1 ms, so a short op is
    noticed within a fraction of its own duration (NCCL: it queries the CUDA event)."""

    def __init__(self, work: _C10dWork) -> None:
        self._work = work
        self._nap = 2e-5

    def wait(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while not self._work.is_completed():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(self._nap, left))
            self._nap = min(self._nap * 1.5, 1e-3)
        return True

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self) -> None:
        self._work.wait()


class TorchWork(Work):
    """A handle on one c10d operation; ``wait`` follows [Note: never block in c10d's wait].

    Results (copies back into non-contiguous tensors, MEAN's division) land in the
    caller's tensors when ``wait`` returns, not merely when ``is_completed`` turns True.
    """

    def __init__(
        self,
        comm: TorchCommunicator,
        op: str,
        completion: _Completion,
        *,
        peers: Sequence[int],
        waiting_for: int | None,
        timeout: timedelta,
        finish: Callable[[], None] | None,
    ) -> None:
        self._comm = comm
        self._op = op
        self._completion = completion
        self._peers = peers
        self._waiting_for = waiting_for
        self._timeout = timeout
        self._finish = finish
        self._waited = False
        self._error: BaseException | None = None

    def wait(self, timeout: timedelta | None = None) -> None:
        if self._waited:
            if self._error is not None:
                raise self._error
            return
        try:
            self._comm._await(
                self._completion, self._op, self._peers, timeout or self._timeout, self._waiting_for
            )
            if self._finish is not None:
                self._finish()
        except BaseException as exc:
            self._error = exc
            raise
        finally:
            self._waited = True

    def is_completed(self) -> bool:
        return self._waited or self._completion.poll()


# -- the communicator ---------------------------------------------------------------------


class TorchCommunicator(Communicator):
    """A Communicator on one torch.distributed process group; subclasses pick the backend.

    Build one with :meth:`create` (or :func:`comm.init_communicator`). Failure semantics:
    [Note: never block in c10d's wait] and [Note: a failed communicator stays failed].
    """

    backend: str = ""

    def __init__(
        self,
        *,
        pg: _ProcessGroup,
        store: Store,
        name: str,
        members: Sequence[int],
        rank: int,
        rendezvous: Rendezvous,
        owns_rendezvous: bool,
        timeout: timedelta,
        host: str,
    ) -> None:
        self._pg: _ProcessGroup | None = pg
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
        self._closed = False
        self._failed: str | None = None
        self._lock = threading.Lock()
        self._inflight: list[_Completion] = []  # issued, maybe not finished (pruned on issue)
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
        host = host or default_host()
        rendezvous = Rendezvous(registry, prefix, rank, world_size, liveness_ttl=liveness_ttl)
        try:
            master: TCPStore | None = None
            card: dict[str, Any] = {"backend": cls.backend}
            if rank == 0:
                master = _tcp_store(host, 0, world_size, is_master=True, timeout=timeout)
                card["store"] = f"{host}:{master.port}"
            rendezvous.publish(card)
            cards = rendezvous.gather(timeout)
            for r, other in enumerate(cards):
                if other.get("backend") != cls.backend:
                    raise ValueError(
                        f"rank {r} joined {prefix!r} with backend {other.get('backend')!r}, "
                        f"this rank uses {cls.backend!r}; every rank must use the same backend"
                    )
            if master is None:
                store_host, _, port = str(cards[0]["store"]).rpartition(":")
                store: Store = _tcp_store(
                    store_host, int(port), world_size, is_master=False, timeout=timeout
                )
            else:
                store = master
            name = "w"
            pg = _guarded(
                "create",
                lambda: cls._make_pg(PrefixStore(name, store), rank, world_size,
                                     timeout + _BACKEND_GRACE, host),
            )
        except BaseException:
            rendezvous.close()
            raise
        return cls(
            pg=pg, store=store, name=name, members=range(world_size), rank=rank,
            rendezvous=rendezvous, owns_rendezvous=True, timeout=timeout, host=host,
        )

    # -- backend hooks --------------------------------------------------------------------

    @classmethod
    @abc.abstractmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> _ProcessGroup:
        """Build the process group (blocks until every member connected)."""

    @abc.abstractmethod
    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        """Raise ValueError for a tensor on a device this backend cannot move."""

    @abc.abstractmethod
    def _collective_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion: ...

    @abc.abstractmethod
    def _p2p_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion: ...

    @abc.abstractmethod
    def _abort(self, pg: _ProcessGroup) -> None:
        """Fail every pending operation of ``pg`` now (and let peers see the connections go)."""

    def _native_mean(self) -> bool:
        """Whether the backend's AVG is used for MEAN (else SUM, then divide)."""
        return False

    # -- identity ---------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return len(self._members)

    @property
    def members(self) -> tuple[int, ...]:
        """The global ranks of this communicator, in group-rank order."""
        return self._members

    # -- waiting (see [Note: never block in c10d's wait]) ----------------------------------

    def _await(
        self,
        completion: _Completion,
        op: str,
        peers: Sequence[int],
        timeout: timedelta,
        waiting_for: int | None,
    ) -> None:
        start = time.monotonic()
        deadline = start + timeout.total_seconds()
        if completion.blocking():
            self._await_blocking(completion, op, peers, start, deadline, waiting_for)
            return
        while not completion.wait(max(0.0, min(_LIVENESS_POLL_S, deadline - time.monotonic()))):
            verdict = self._verdict(op, peers, start, deadline, waiting_for)
            if verdict is not None:
                raise self._fail(verdict)
        try:
            completion.result()
        except RuntimeError as exc:
            raise self._backend_failure(op, exc, peers, start, deadline, waiting_for) from exc

    def _await_blocking(
        self, completion: _Completion, op: str, peers: Sequence[int], start: float, deadline: float,
        waiting_for: int | None,
    ) -> None:
        """Block in the backend's wait; the watchdog aborts the group on a lost peer or the deadline."""
        watch = _Watch(self, op, peers, start, deadline, waiting_for)
        _WATCHDOG.add(watch)
        try:
            completion.block()
        finally:
            _WATCHDOG.discard(watch)
        try:
            completion.result()
        except RuntimeError as exc:
            if watch.verdict is not None:
                raise watch.verdict from exc
            raise self._backend_failure(op, exc, peers, start, deadline, waiting_for) from exc

    def _verdict(self, op: str, peers: Sequence[int], start: float, deadline: float,
                 waiting_for: int | None) -> CommError | None:
        """What a waiting operation should raise now (a lost member, the deadline), if anything."""
        lost = self._lost_member(peers)
        if lost is not None:
            return PeerLostError(self._rdzv.describe_loss(lost, op), op=op, peer=lost)
        now = time.monotonic()
        if now >= deadline:
            return CommTimeoutError(
                self._timeout_message(op, waiting_for, peers, now - start), op=op, peer=waiting_for,
                waited=now - start,
            )
        return None

    def _lost_member(self, peers: Sequence[int]) -> int | None:
        gone = self._rdzv.lost()
        if not gone:
            return None
        hit = [r for r in peers if r in gone]
        return min(hit) if hit else None

    def _timeout_message(self, op: str, waiting_for: int | None, peers: Sequence[int], waited: float) -> str:
        me = self._members[self._rank]
        if waiting_for is not None:
            whom = f"peer rank {waiting_for}"
        else:
            whom = f"ranks {list(peers)} (group {self._name!r})"
        return f"{op} on rank {me} timed out after {waited:.2f}s waiting for {whom}"

    def _backend_failure(
        self, op: str, exc: RuntimeError, peers: Sequence[int], start: float, deadline: float,
        waiting_for: int | None,
    ) -> CommError:
        detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        # Give the rendezvous time to name the lost rank, but never past the call's deadline.
        left = timedelta(seconds=max(0.0, deadline - time.monotonic()))
        within = min(self._rdzv.liveness_ttl + _LOSS_MARGIN, left)
        lost = self._rdzv.wait_for_loss(peers, within=within)
        if lost is not None:
            return self._fail(PeerLostError(
                f"{self._rdzv.describe_loss(lost, op)}; {self.backend} said: {detail}", op=op, peer=lost
            ))
        now = time.monotonic()
        if now >= deadline:
            return self._fail(CommTimeoutError(
                f"{self._timeout_message(op, waiting_for, peers, now - start)}; "
                f"{self.backend} said: {detail}",
                op=op, peer=waiting_for, waited=now - start,
            ))
        me = self._members[self._rank]
        return self._fail(CommError(
            f"{op} on rank {me} failed in {self.backend} (no member of {list(peers)} was declared "
            f"lost within {within.total_seconds():.1f}s): {exc}"
        ))

    def _fail(self, exc: _E) -> _E:
        """Record the failure and tear the process group down ([Note: a failed communicator ...])."""
        with self._lock:
            if self._failed is None:
                self._failed = f"{type(exc).__name__}: {exc}"
            pg, self._pg = self._pg, None
        if pg is not None:
            self._teardown_bounded(pg, abort=True)
        return exc

    def _track(self, completion: _Completion) -> None:
        self._inflight = [c for c in self._inflight if not c.done()]
        self._inflight.append(completion)

    def _teardown_bounded(self, pg: _ProcessGroup, *, abort: bool) -> None:
        """Abort (see [Note: aborting a gloo process group]) and shut ``pg`` down, bounded."""
        def run() -> None:
            steps = [pg.shutdown]
            if abort and self.world_size > 1:
                steps.insert(0, lambda: self._abort(pg))
            for step in steps:
                try:
                    step()
                except Exception:  # already failing or closing: nothing left to save
                    log.debug("[rank %d] %s teardown step raised", self._members[self._rank],
                              self.backend, exc_info=True)

        thread = threading.Thread(target=run, name=f"{self.backend}-teardown", daemon=True)
        thread.start()
        thread.join(_TEARDOWN_S)
        if thread.is_alive():
            log.warning("[rank %d] %s process group did not shut down within %.0fs; left behind",
                        self._members[self._rank], self.backend, _TEARDOWN_S)
        # Let the aborted operations report back while the interpreter is fully alive (a
        # wait-only work nobody waits on involves no thread: nothing to drain).
        deadline = time.monotonic() + _DRAIN_S
        for completion in self._inflight:
            if not completion.blocking():
                completion.wait(max(0.0, deadline - time.monotonic()))
        self._inflight = [c for c in self._inflight if not c.done()]

    def _live_pg(self, op: str) -> _ProcessGroup:
        pg = self._pg
        if self._closed:
            raise CommError(f"{op}: this {self.backend} communicator is closed")
        if pg is None:
            raise CommError(
                f"{op}: this {self.backend} communicator failed earlier ({self._failed}); "
                "build a new communicator (a new prefix) to go on"
            )
        return pg

    def _run(
        self,
        op: str,
        start: Callable[[_ProcessGroup], _C10dWork],
        *,
        timeout: timedelta | None,
        async_op: bool,
        finish: Callable[[], None] | None = None,
    ) -> Work:
        """Issue a collective over every member and either return its handle or wait for it."""
        pg = self._live_pg(op)
        limit = timeout or self.timeout
        self._rdzv.check(self._members, op)
        work = self._issue(op, lambda: start(pg), self._members, limit, None)
        completion = self._collective_completion(
            work, limit + _BACKEND_GRACE, f"{self.backend}-{op}-{self._members[self._rank]}"
        )
        self._track(completion)
        handle = TorchWork(
            self, op, completion, peers=self._members, waiting_for=None, timeout=limit, finish=finish
        )
        if async_op:
            return handle
        handle.wait(limit)
        return CompletedWork()

    def _issue(
        self, op: str, start: Callable[[], _C10dWork], peers: Sequence[int], limit: timedelta,
        waiting_for: int | None,
    ) -> _C10dWork:
        """Start the c10d op; an error already at issue (a peer's connection closed) is attributed."""
        begin = time.monotonic()
        try:
            return start()
        except RuntimeError as exc:
            deadline = begin + limit.total_seconds()
            raise self._backend_failure(op, exc, peers, begin, deadline, waiting_for) from exc

    def _backend_timeout(self, timeout: timedelta | None) -> timedelta:
        return (timeout or self.timeout) + _BACKEND_GRACE

    # -- point to point ---------------------------------------------------------------------

    def _p2p(
        self, op: str, tensor: torch.Tensor, peer: int, tag: int, timeout: timedelta | None
    ) -> TorchWork:
        self._check_device(tensor, op)
        if not 0 <= peer < self.world_size:
            raise ValueError(f"{op}: rank {peer} is outside 0..{self.world_size - 1}")
        if peer == self._rank:
            raise ValueError(f"{op}: rank {peer} is this rank; sending to oneself is not supported")
        if not 0 <= tag < _ABORT_TAG:
            raise ValueError(f"{op}: tag must be in 0..{_ABORT_TAG - 1}, got {tag}")
        pg = self._live_pg(op)
        limit = timeout or self.timeout
        target = self._members[peer]
        self._rdzv.check([target], op)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if op == "send":
            work = self._issue(op, lambda: pg.send([buf], peer, tag), [target], limit, target)
            finish = None
        else:
            work = self._issue(op, lambda: pg.recv([buf], peer, tag), [target], limit, target)
            finish = None if buf is tensor else _copier(tensor, buf)
        completion = self._p2p_completion(
            work, limit + _BACKEND_GRACE, f"{self.backend}-{op}-{self._members[self._rank]}-{target}"
        )
        self._track(completion)
        return TorchWork(self, op, completion, peers=[target], waiting_for=target, timeout=limit,
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
            "all_reduce", lambda pg: pg.allreduce([buf], opts), timeout=timeout, async_op=async_op,
            finish=_finisher(tensor, buf, self.world_size if divide else None),
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
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is outside 0..{self.world_size - 1}")
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        opts = BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "broadcast", lambda pg: pg.broadcast([buf], opts), timeout=timeout, async_op=async_op,
            finish=_finisher(tensor, buf, None),
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
        _check_sizes("all_gather_into_tensor", "output", output, "tensor", tensor, self.world_size)
        src = tensor.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        opts = AllgatherOptions()
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "all_gather_into_tensor", lambda pg: pg._allgather_base(out.view(-1), src, opts),
            timeout=timeout, async_op=async_op, finish=_finisher(output, out, None),
        )

    def reduce_scatter_tensor(
        self,
        output: torch.Tensor,
        tensor: torch.Tensor,
        op: ReduceOp = ReduceOp.SUM,
        *,
        timeout: timedelta | None = None,
        async_op: bool = False,
    ) -> Work:
        self._check_device(tensor, "reduce_scatter_tensor")
        self._check_device(output, "reduce_scatter_tensor")
        _check_sizes("reduce_scatter_tensor", "tensor", tensor, "output", output, self.world_size)
        native, divide = self._reduce_op(op, tensor.dtype, "reduce_scatter_tensor")
        src = tensor.contiguous().view(-1)
        out = output if output.is_contiguous() else torch.empty_like(
            output, memory_format=torch.contiguous_format)
        opts = ReduceScatterOptions()
        opts.reduceOp = native
        opts.timeout = self._backend_timeout(timeout)
        return self._run(
            "reduce_scatter_tensor", lambda pg: pg._reduce_scatter_base(out.view(-1), src, opts),
            timeout=timeout, async_op=async_op,
            finish=_finisher(output, out, self.world_size if divide else None),
        )

    def barrier(self, *, timeout: timedelta | None = None) -> None:
        opts = BarrierOptions()
        opts.timeout = self._backend_timeout(timeout)
        self._run("barrier", lambda pg: pg.barrier(opts), timeout=timeout, async_op=False)

    # -- groups and lifecycle -----------------------------------------------------------------

    def new_group(self, ranks: Sequence[int]) -> TorchCommunicator | None:
        """A sub-communicator (its own process group) over ``ranks`` of this one.

        Every rank of this communicator calls it with the same ``ranks`` in the same
        order; members block until all members connected (bounded by ``timeout``).
        The sub-group shares this communicator's store and liveness tracking; closing
        this communicator closes its sub-groups.
        """
        chosen = [int(r) for r in ranks]
        if not chosen or len(set(chosen)) != len(chosen):
            raise ValueError(f"new_group: ranks {chosen} must be distinct and non-empty")
        for r in chosen:
            if not 0 <= r < self.world_size:
                raise ValueError(f"new_group: rank {r} is outside 0..{self.world_size - 1}")
        self._live_pg("new_group")
        self._groups_made += 1
        name = f"{self._name}/{self._groups_made}"
        if self._rank not in chosen:
            return None
        members = [self._members[r] for r in chosen]
        self._rdzv.check(members, "new_group")
        sub_rank = chosen.index(self._rank)
        store = PrefixStore(name, self._store)
        pg = _guarded("new_group", lambda: self._make_pg(
            store, sub_rank, len(chosen), self.timeout + _BACKEND_GRACE, self._host))
        child = type(self)(
            pg=pg, store=self._store, name=name, members=members, rank=sub_rank,
            rendezvous=self._rdzv, owns_rendezvous=False, timeout=self.timeout, host=self._host,
        )
        self._children.append(child)
        return child

    def close(self) -> None:
        """Shut the process group (and sub-groups) down; the root also leaves the rendezvous."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pg, self._pg = self._pg, None
        for child in self._children:
            child.close()
        self._children.clear()
        if pg is not None:
            pending = any(not c.done() for c in self._inflight)
            self._teardown_bounded(pg, abort=pending)
        if self._owns_rdzv:
            self._rdzv.close()
        _LIVE.discard(self)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"group={self._name!r}, members={list(self._members)})")


class GlooCommunicator(TorchCommunicator):
    """CPU tensors over ``ProcessGroupGloo``.

    gloo (torch 2.13) runs every collective natively, bfloat16 included; MEAN is SUM
    followed by a division (portable to older gloo builds without AVG).
    """

    backend = "gloo"

    @classmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> _ProcessGroup:
        # The stub of ProcessGroupGloo lists only the timeout constructor; the options
        # one (to pin the device to ``host`` instead of resolving the hostname) is real.
        gloo: Any = dist.ProcessGroupGloo
        options = gloo._Options()
        options._timeout = timeout
        options._devices = [gloo.create_device(hostname=host)]
        return cast(_ProcessGroup, gloo(store, rank, size, options))

    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        if tensor.device.type != "cpu":
            raise ValueError(f"{op}: the gloo backend takes CPU tensors, got one on {tensor.device}; "
                             "use the nccl backend for CUDA tensors")
        if tensor.layout != torch.strided:
            raise ValueError(f"{op}: only dense (strided) tensors are supported, got {tensor.layout}")

    def _collective_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion:
        try:
            work.get_future()  # gloo's asynchronous works have one; only looked at, no callback
        except RuntimeError:
            # reduce_scatter is a wrapper in gloo (an all_reduce underneath, the slice
            # copied out inside wait()): no future, and is_completed() stays False.
            return _WaitOnlyCompletion(work, timeout, name)
        return _SliceCompletion(work)

    def _p2p_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion:
        return _WaitOnlyCompletion(work, timeout, name)

    def _abort(self, pg: _ProcessGroup) -> None:
        # [Note: aborting a gloo process group]: a receive nobody sends, timed out at once.
        peer = (self._rank + 1) % self.world_size
        with contextlib.suppress(RuntimeError):  # expected: the timeout is what closes the pairs
            pg.recv([torch.empty(1)], peer, _ABORT_TAG).wait(timedelta(milliseconds=1))


class NcclCommunicator(TorchCommunicator):
    """CUDA tensors over ``ProcessGroupNCCL``.

    Uses the current CUDA device (call ``torch.cuda.set_device`` first). Completion is
    polled on the host (``is_completed`` queries the op's CUDA event), so a call returns
    once the data has arrived; after a failure the NCCL communicator is aborted so no
    kernel keeps spinning on a lost peer.
    """

    backend = "nccl"

    @classmethod
    def _make_pg(
        cls, store: Store, rank: int, size: int, timeout: timedelta, host: str
    ) -> _ProcessGroup:
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise CommError("the nccl backend needs CUDA and a torch build with NCCL")
        nccl: Any = dist.ProcessGroupNCCL  # absent from CPU builds of torch
        options = nccl.Options()
        options._timeout = timeout
        return cast(_ProcessGroup, nccl(store, rank, size, options))

    def _check_device(self, tensor: torch.Tensor, op: str) -> None:
        if not tensor.is_cuda:
            raise ValueError(f"{op}: the nccl backend takes CUDA tensors, got one on {tensor.device}; "
                             "use the gloo backend for CPU tensors")
        if tensor.layout != torch.strided:
            raise ValueError(f"{op}: only dense (strided) tensors are supported, got {tensor.layout}")

    def _native_mean(self) -> bool:
        return True

    def _collective_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion:
        return _PollCompletion(work)

    def _p2p_completion(self, work: _C10dWork, timeout: timedelta, name: str) -> _Completion:
        return _PollCompletion(work)

    def _abort(self, pg: _ProcessGroup) -> None:
        pg.abort()  # frees kernels still waiting on a lost peer


# -- helpers ------------------------------------------------------------------------------


def _tcp_store(
    host: str, port: int, world_size: int, *, is_master: bool, timeout: timedelta
) -> TCPStore:
    try:
        return TCPStore(host, port, world_size, is_master, timeout=timeout, wait_for_workers=False)
    except RuntimeError as exc:
        role = "start" if is_master else f"reach rank 0's store at {host}:{port} for"
        raise CommError(f"could not {role} the rendezvous TCPStore: {exc}") from exc


_T = TypeVar("_T")


def _guarded(op: str, fn: Callable[[], _T]) -> _T:
    """Call into c10d; its RuntimeErrors become CommError naming the op."""
    try:
        return fn()
    except RuntimeError as exc:
        raise CommError(f"{op} failed: {exc}") from exc


def _copier(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], None]:
    def finish() -> None:
        dst.copy_(src)

    return finish


def _finisher(dst: torch.Tensor, buf: torch.Tensor, divide_by: int | None) -> Callable[[], None] | None:
    """What to do after the op: divide (emulated MEAN) and copy back into a staged tensor."""
    if divide_by is None and buf is dst:
        return None

    def finish() -> None:
        if divide_by is not None:
            buf.div_(divide_by)
        if buf is not dst:
            dst.copy_(buf)

    return finish


def _check_sizes(
    op: str, big_name: str, big: torch.Tensor, small_name: str, small: torch.Tensor, world_size: int
) -> None:
    if big.dtype != small.dtype:
        raise ValueError(f"{op}: {big_name} is {big.dtype} but {small_name} is {small.dtype}")
    if big.numel() != world_size * small.numel():
        raise ValueError(
            f"{op}: {big_name} has {big.numel()} elements, expected world_size * {small_name}.numel() "
            f"= {world_size} * {small.numel()} = {world_size * small.numel()}"
        )


@dataclasses.dataclass(eq=False)
class _Watch:
    """One caller blocked in a backend wait, watched by :data:`_WATCHDOG`."""

    comm: TorchCommunicator
    op: str
    peers: Sequence[int]
    start: float
    deadline: float
    waiting_for: int | None
    verdict: CommError | None = None


class _Watchdog:
    """One daemon thread per process that aborts the group of a blocked wait whose peer
    was lost or whose deadline passed (so the wait returns with the backend's error).

    It ticks every ``_LIVENESS_POLL_S`` while waits come and go, and sleeps after a second
    without any; adding a watch wakes it only then, so a short wait costs a set insertion.
    """

    _IDLE_TICKS = 20

    def __init__(self) -> None:
        self._watches: set[_Watch] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._asleep = False

    def add(self, watch: _Watch) -> None:
        with self._cond:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="comm-watchdog", daemon=True)
                self._thread.start()
            if self._asleep:
                self._cond.notify()

    def discard(self, watch: _Watch) -> None:
        with self._cond:
            self._watches.discard(watch)

    def _loop(self) -> None:
        idle = 0
        while True:
            with self._cond:
                idle = 0 if self._watches else idle + 1
                if idle >= self._IDLE_TICKS:
                    self._asleep = True
                    while not self._watches:
                        self._cond.wait()
                    self._asleep = False
                    idle = 0
                self._cond.wait(_LIVENESS_POLL_S)
                watches = list(self._watches)
            for watch in watches:
                if watch.verdict is not None:
                    continue
                try:
                    verdict = watch.comm._verdict(
                        watch.op, watch.peers, watch.start, watch.deadline, watch.waiting_for
                    )
                    if verdict is not None:
                        watch.verdict = verdict
                        watch.comm._fail(verdict)  # aborts the group: the blocked wait returns
                except Exception:  # the watchdog must survive anything
                    log.exception("comm watchdog failed on %s", watch.op)


_WATCHDOG = _Watchdog()

# Every communicator not yet closed; closed at interpreter exit (see [Note: aborting a gloo
# process group]) so no backend thread finishes a work while Python shuts down.
_LIVE: weakref.WeakSet[TorchCommunicator] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for comm in list(_LIVE):
        try:
            comm.close()
        except Exception:  # exiting anyway
            log.debug("closing %r at exit failed", comm, exc_info=True)
