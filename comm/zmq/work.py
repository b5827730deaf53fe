"""The handles of the ZeroMQ backend's operations in flight: async collectives, sends and receives."""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from datetime import timedelta

import zmq

from comm.base import Work, bound, timeout_error
from comm.errors import CommTimeoutError
from comm.zmq.transport import Deadline

__all__ = ["FutureWork", "RecvWork", "SendWork"]


class FutureWork(Work):
    """An async collective, run on the communicator's worker thread."""

    def __init__(self, future: Future[None], timeout: timedelta, op: str) -> None:
        self._future = future
        self._timeout = timeout
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> None:
        limit = bound(timeout, self._timeout).total_seconds()
        try:
            self._future.result(timeout=limit)
        except FutureTimeout:
            raise timeout_error(self._op, None, limit, "the async operation to finish", peer=None) from None

    def is_completed(self) -> bool:
        return self._future.done()


class SendWork(Work):
    """A send whose bytes libzmq may still read: ``wait`` waits for its trackers."""

    def __init__(self, trackers: list[zmq.MessageTracker], timeout: timedelta, op: str, keep: object,
                 wait: Callable[[list[zmq.MessageTracker], Deadline], None]) -> None:
        self._wait = wait
        self._trackers = trackers
        self._timeout = timeout
        self._op = op
        self._keep = keep  # the tensor stays alive while libzmq may read it

    def wait(self, timeout: timedelta | None = None) -> None:
        self._wait(self._trackers, Deadline(bound(timeout, self._timeout), self._op))
        self._keep = None

    def is_completed(self) -> bool:
        return all(t.done for t in self._trackers)


class RecvWork(Work):
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
                self._progress(Deadline(bound(timeout, self._timeout), self._op))
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
