"""A wake-up for a thread asleep in a ZeroMQ poll: a pipe whose read end the poll watches.

[Note: a wake pipe] A thread that sleeps in ``zmq.Poller.poll`` until a message or its deadline can
only be woken early by something the poll watches. Three sleepers use one: an RPC call (woken by
``close()`` from another thread), the ZAP handler (woken by ``stop()``) and a transport's receiver
(woken by ``close()`` and by the rendezvous finding a rank gone). :class:`WakePipe` is that pipe:

* both ends non-blocking: a wake never blocks (a full pipe is awake already) and a drain stops
  at empty;
* never inherited by a child process (``os.pipe``'s default);
* a wake after :meth:`WakePipe.close` does nothing, and the two cannot interleave (one lock): a
  write never goes to a descriptor closed and reused by another open since;
* the descriptors are closed when the object is collected, if nobody closed it (a transport's
  channel left open at close, [Note: closing under the channel's locks]), so an abandoned pipe
  does not leak two descriptors for the life of the process.
"""

from __future__ import annotations

import contextlib
import os
import threading
import weakref

__all__ = ["WakePipe"]


def _close(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class WakePipe:
    """A pipe to wake a poll from any thread (see [Note: a wake pipe]); register :attr:`fd` for ``POLLIN``."""

    def __init__(self) -> None:
        read, write = os.pipe()
        for end in (read, write):
            os.set_blocking(end, False)
        self.fd = read
        self._write = write
        self._lock = threading.Lock()
        self._fds = weakref.finalize(self, _close, read, write)

    @property
    def closed(self) -> bool:
        return not self._fds.alive

    def wake(self) -> None:
        """Make :attr:`fd` readable (until :meth:`drain`); any thread, never blocks, nothing once closed."""
        with self._lock:
            if self._fds.alive:
                with contextlib.suppress(BlockingIOError):  # full: awake already
                    os.write(self._write, b"\0")

    def drain(self) -> None:
        """Read the pipe empty (the sleeper, once woken, before it sleeps again)."""
        with self._lock:
            if self._fds.alive:
                with contextlib.suppress(BlockingIOError):
                    while os.read(self.fd, 4096):
                        pass

    def close(self) -> None:
        """Close both ends; idempotent. No poll may watch :attr:`fd` afterwards (its number may be reused):
        unregister it, or close once its sleeper is gone."""
        with self._lock:
            self._fds()
