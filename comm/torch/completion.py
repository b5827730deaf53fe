"""Noticing that a c10d operation finished without blocking in its ``wait()``.

[Note: never block in c10d's wait]
c10d's ``Work.wait()`` blocks until the backend gives up, which is 30 minutes for a
frozen gloo peer. Instead every operation is awaited in short slices: gloo's
collectives by ``wait(slice)`` (a slice that runs out leaves the operation alone), NCCL's
by polling ``is_completed()`` with short, growing sleeps. Between slices the rendezvous
is asked whether a member's liveness lease lapsed. The few gloo works that only progress
inside one unbounded ``wait()`` (send and recv, whose timed-out wait closes every
connection of the group, and reduce_scatter, which gloo implements as an all_reduce
whose slice is copied out in ``wait``) are waited for directly, while one watchdog
thread per process (``comm/torch/watchdog.py``) checks liveness and the deadline and,
when either says stop, aborts the group so the wait returns. What a waiting operation
then raises is decided in ``comm/torch/guard.py``.
"""

from __future__ import annotations

import abc
import threading
import time
from datetime import timedelta

from comm.torch.group import C10dWork

__all__ = ["Completion", "PollCompletion", "SliceCompletion", "WaitOnlyCompletion"]


class Completion(abc.ABC):
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
        """True while the only way to finish is :meth:`block` (see :class:`WaitOnlyCompletion`)."""
        return False

    def block(self) -> None:
        """Wait in this thread until the operation finished (only while :meth:`blocking`)."""
        raise NotImplementedError

    @abc.abstractmethod
    def result(self) -> None:
        """Raise the operation's error, if it failed. Only call once ``done()``."""


class WaitOnlyCompletion(Completion):
    """gloo works that progress only inside an unbounded ``wait()``: send and recv (a
    timed-out ``wait`` of theirs closes every connection of the group) and reduce_scatter
    (a wrapper that ignores the wait's timeout).

    The caller blocks in ``wait()`` itself, guarded by the watchdog, which aborts the
    process group when a peer is lost or the deadline passes. Only ``is_completed()`` on a
    handle nobody waits for yet moves the wait to a daemon thread.
    """

    def __init__(self, work: C10dWork, timeout: timedelta, name: str) -> None:
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


class _WorkCompletion(Completion):
    """A work whose ``is_completed()`` turns True by itself; its ``wait()`` then re-raises its error."""

    def __init__(self, work: C10dWork) -> None:
        self._work = work

    def done(self) -> bool:
        return self._work.is_completed()

    def result(self) -> None:
        self._work.wait()


class SliceCompletion(_WorkCompletion):
    """gloo's asynchronous collectives: ``wait(slice)`` wakes at completion; a slice that runs
    out raises "Operation timed out!" and leaves the operation untouched."""

    def wait(self, seconds: float) -> bool:
        try:
            self._work.wait(timedelta(seconds=seconds))
        except RuntimeError:
            return self._work.is_completed()  # completed means failed; result() re-raises
        return True


class PollCompletion(_WorkCompletion):
    """Polls ``is_completed()`` with sleeps growing from 20 us to 1 ms, so a short op is
    noticed within a fraction of its own duration (NCCL: it queries the CUDA event)."""

    def __init__(self, work: C10dWork) -> None:
        super().__init__(work)
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
