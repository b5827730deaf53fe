"""The life of one process group: waiting with a deadline and liveness, naming what failed, tearing down.

Every operation of a torch communicator is issued and awaited through its group's
:class:`GroupGuard`, which follows [Note: never block in c10d's wait]
(``comm/torch/completion.py``), so

* a member that is lost (killed, frozen, or closed) raises ``PeerLostError`` within
  about the liveness TTL;
* the per-call deadline raises ``CommTimeoutError`` naming the op and the seconds
  waited (and the peer, for point to point);
* an error from the backend itself (a killed gloo peer errors its neighbours in
  ~0.03 s) is attributed: the rendezvous gets ``liveness_ttl + margin`` (but never more
  than what is left of the call's timeout) to name the lost rank (``PeerLostError``);
  otherwise it is re-raised as ``CommError`` (``CommTimeoutError`` once the deadline
  passed) with the backend's message.

[Note: a failed communicator stays failed]
gloo tears down every connection of a process group when any operation of it times
out or fails ("Application timeout caused pair closure"), and NCCL communicators must
be aborted after an error. So after an operation raised a ``CommError`` (timeout, lost
peer, backend error) the communicator shuts its process group down and every later
call raises ``CommError`` at once. Build a new communicator (a new prefix) to go on.
Sub-groups are separate process groups: a failure in one leaves the others usable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TypeVar

from comm.base import timeout_error
from comm.errors import CommError, PeerLostError
from comm.rendezvous import Rendezvous
from comm.torch.completion import Completion
from comm.torch.group import C10dWork, ProcessGroup
from comm.torch.watchdog import LIVENESS_POLL_S, WATCHDOG, Watch

__all__ = ["GroupGuard"]

log = logging.getLogger(__name__)

_E = TypeVar("_E", bound=BaseException)

# After a backend error, how long beyond the liveness TTL to wait for the rendezvous to
# name the lost rank (lease expiry is checked periodically, and the watch adds latency).
_LOSS_MARGIN = timedelta(seconds=1.5)
# Bound on tearing a process group down (shutdown/abort run on a helper thread).
_TEARDOWN_S = 5.0
# How long close() waits for operations failed by an abort to report back.
_DRAIN_S = 2.0


class GroupGuard:
    """Owns one process group: hands it out while it is healthy, awaits its operations, fails it.

    Args:
        pg: the process group.
        backend: ``"gloo"`` or ``"nccl"``, for messages.
        name: the group's name in the store (``"w"``, ``"w/1"``, ...), for messages.
        members: the group's global ranks, in group-rank order.
        rank: this process's group rank.
        rendezvous: tells which members were lost.
        abort: the backend's way to fail every pending operation of the group now.
    """

    def __init__(
        self,
        pg: ProcessGroup,
        *,
        backend: str,
        name: str,
        members: tuple[int, ...],
        rank: int,
        rendezvous: Rendezvous,
        abort: Callable[[ProcessGroup], None],
    ) -> None:
        self._pg: ProcessGroup | None = pg
        self._backend = backend
        self._name = name
        self._members = members
        self._me = members[rank]  # this process's global rank, for messages
        self._rdzv = rendezvous
        self._abort = abort
        self._closed = False
        self._failed: str | None = None
        self._lock = threading.Lock()
        self._inflight: list[Completion] = []  # issued, maybe not finished (pruned on issue)

    # -- issuing ----------------------------------------------------------------------------

    def live(self, op: str) -> ProcessGroup:
        """The process group, or CommError if the communicator is closed or failed earlier."""
        pg = self._pg
        if self._closed:
            raise CommError(f"{op}: this {self._backend} communicator is closed")
        if pg is None:
            raise CommError(
                f"{op}: this {self._backend} communicator failed earlier ({self._failed}); "
                "build a new communicator (a new prefix) to go on"
            )
        return pg

    def issue(
        self, op: str, start: Callable[[], C10dWork], peers: Sequence[int], limit: timedelta,
        waiting_for: int | None,
    ) -> C10dWork:
        """Start the c10d op; an error already at issue (a peer's connection closed) is attributed."""
        begin = time.monotonic()
        try:
            return start()
        except RuntimeError as exc:
            deadline = begin + limit.total_seconds()
            raise self._backend_failure(op, exc, peers, begin, deadline, waiting_for) from exc

    def track(self, completion: Completion) -> None:
        """Remember an issued operation, so a teardown lets it report back first."""
        self._inflight = [c for c in self._inflight if not c.done()]
        self._inflight.append(completion)

    # -- waiting (see [Note: never block in c10d's wait]) ----------------------------------

    def wait(
        self,
        completion: Completion,
        op: str,
        peers: Sequence[int],
        timeout: timedelta,
        waiting_for: int | None,
    ) -> None:
        """Wait for ``completion`` in slices, raising what the first failed check or the backend says."""
        start = time.monotonic()
        deadline = start + timeout.total_seconds()
        if completion.blocking():
            self._wait_blocking(completion, op, peers, start, deadline, waiting_for)
            return
        while not completion.wait(max(0.0, min(LIVENESS_POLL_S, deadline - time.monotonic()))):
            verdict = self.verdict(op, peers, start, deadline, waiting_for)
            if verdict is not None:
                raise self.fail(verdict)
        try:
            completion.result()
        except RuntimeError as exc:
            raise self._backend_failure(op, exc, peers, start, deadline, waiting_for) from exc

    def _wait_blocking(
        self, completion: Completion, op: str, peers: Sequence[int], start: float, deadline: float,
        waiting_for: int | None,
    ) -> None:
        """Block in the backend's wait; the watchdog aborts the group on a lost peer or the deadline."""
        watch = Watch(self, op, peers, start, deadline, waiting_for)
        WATCHDOG.add(watch)
        try:
            completion.block()
        finally:
            WATCHDOG.discard(watch)
        try:
            completion.result()
        except RuntimeError as exc:
            if watch.verdict is not None:
                raise watch.verdict from exc
            raise self._backend_failure(op, exc, peers, start, deadline, waiting_for) from exc

    def verdict(self, op: str, peers: Sequence[int], start: float, deadline: float,
                waiting_for: int | None) -> CommError | None:
        """What a waiting operation should raise now (a lost member, the deadline), if anything."""
        lost = self._lost_member(peers)
        if lost is not None:
            return PeerLostError(self._rdzv.describe_loss(lost, op), op=op, peer=lost)
        now = time.monotonic()
        if now >= deadline:
            return timeout_error(op, self._me, now - start, self._whom(waiting_for, peers), peer=waiting_for)
        return None

    def _lost_member(self, peers: Sequence[int]) -> int | None:
        gone = self._rdzv.lost()
        if not gone:
            return None
        hit = [r for r in peers if r in gone]
        return min(hit) if hit else None

    def _whom(self, waiting_for: int | None, peers: Sequence[int]) -> str:
        if waiting_for is not None:
            return f"peer rank {waiting_for}"
        return f"ranks {list(peers)} (group {self._name!r})"

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
            return self.fail(PeerLostError(
                f"{self._rdzv.describe_loss(lost, op)}; {self._backend} said: {detail}", op=op, peer=lost
            ))
        now = time.monotonic()
        if now >= deadline:
            return self.fail(timeout_error(
                op, self._me, now - start, self._whom(waiting_for, peers), peer=waiting_for,
                detail=f"{self._backend} said: {detail}",
            ))
        return self.fail(CommError(
            f"{op} on rank {self._me} failed in {self._backend} (no member of {list(peers)} was declared "
            f"lost within {within.total_seconds():.1f}s): {exc}"
        ))

    # -- failing and closing ----------------------------------------------------------------

    def fail(self, exc: _E) -> _E:
        """Record the failure and tear the process group down ([Note: a failed communicator ...])."""
        with self._lock:
            if self._failed is None:
                self._failed = f"{type(exc).__name__}: {exc}"
            pg, self._pg = self._pg, None
        if pg is not None:
            self._teardown(pg, abort=True)
        return exc

    def close(self, first: Callable[[], None]) -> bool:
        """Close once: take the group, run ``first`` (closing the sub-groups), then tear the group
        down, aborting operations still in flight. False if it was closed already."""
        with self._lock:
            if self._closed:
                return False
            self._closed = True
            pg, self._pg = self._pg, None
        first()
        if pg is not None:
            pending = any(not c.done() for c in self._inflight)
            self._teardown(pg, abort=pending)
        return True

    def _teardown(self, pg: ProcessGroup, *, abort: bool) -> None:
        """Abort (see [Note: aborting a gloo process group]) and shut ``pg`` down, bounded."""
        def run() -> None:
            steps = [pg.shutdown]
            if abort and len(self._members) > 1:
                steps.insert(0, lambda: self._abort(pg))
            for step in steps:
                try:
                    step()
                except Exception:  # already failing or closing: nothing left to save
                    log.debug("[rank %d] %s teardown step raised", self._me, self._backend, exc_info=True)

        thread = threading.Thread(target=run, name=f"{self._backend}-teardown", daemon=True)
        thread.start()
        thread.join(_TEARDOWN_S)
        if thread.is_alive():
            log.warning("[rank %d] %s process group did not shut down within %.0fs; left behind",
                        self._me, self._backend, _TEARDOWN_S)
        # Let the aborted operations report back while the interpreter is fully alive (a
        # wait-only work nobody waits on involves no thread: nothing to drain).
        deadline = time.monotonic() + _DRAIN_S
        for completion in self._inflight:
            if not completion.blocking():
                completion.wait(max(0.0, deadline - time.monotonic()))
        self._inflight = [c for c in self._inflight if not c.done()]
