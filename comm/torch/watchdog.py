"""The one thread per process that releases callers blocked in a backend's unbounded wait.

Some gloo works progress only inside one unbounded ``wait()`` (see [Note: never block in
c10d's wait] in ``comm/torch/completion.py``). The caller blocks there; the watchdog asks,
every :data:`LIVENESS_POLL_S`, whether a member was lost or the deadline passed, and if
so fails the group, which aborts it, so the blocked wait returns with the backend's error.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence
from typing import Protocol

from comm.errors import CommError

__all__ = ["LIVENESS_POLL_S", "WATCHDOG", "Judge", "Watch", "Watchdog"]

log = logging.getLogger(__name__)

# How often a waiting operation asks the rendezvous whether a member was lost.
LIVENESS_POLL_S = 0.05


class Judge(Protocol):
    """What decides the fate of a blocked wait (a process group's guard)."""

    def verdict(self, op: str, peers: Sequence[int], start: float, deadline: float,
                waiting_for: int | None) -> CommError | None:
        """What the wait should raise now (a lost member, the deadline), if anything."""

    def fail(self, exc: CommError) -> CommError:
        """Record the failure and abort the process group (the blocked wait returns)."""


@dataclasses.dataclass(eq=False)
class Watch:
    """One caller blocked in a backend wait, watched by :data:`WATCHDOG`."""

    judge: Judge
    op: str
    peers: Sequence[int]
    start: float
    deadline: float
    waiting_for: int | None
    verdict: CommError | None = None


class Watchdog:
    """One daemon thread per process that aborts the group of a blocked wait whose peer
    was lost or whose deadline passed (so the wait returns with the backend's error).

    It ticks every ``LIVENESS_POLL_S`` while waits come and go, and sleeps after a second
    without any; adding a watch wakes it only then, so a short wait costs a set insertion.
    """

    _IDLE_TICKS = 20

    def __init__(self) -> None:
        self._watches: set[Watch] = set()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._asleep = False

    def add(self, watch: Watch) -> None:
        with self._cond:
            self._watches.add(watch)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="comm-watchdog", daemon=True)
                self._thread.start()
            if self._asleep:
                self._cond.notify()

    def discard(self, watch: Watch) -> None:
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
                self._cond.wait(LIVENESS_POLL_S)
                watches = list(self._watches)
            for watch in watches:
                if watch.verdict is not None:
                    continue
                try:
                    verdict = watch.judge.verdict(
                        watch.op, watch.peers, watch.start, watch.deadline, watch.waiting_for
                    )
                    if verdict is not None:
                        watch.verdict = verdict
                        watch.judge.fail(verdict)  # aborts the group: the blocked wait returns
                except Exception:  # the watchdog must survive anything
                    log.exception("comm watchdog failed on %s", watch.op)


WATCHDOG = Watchdog()
