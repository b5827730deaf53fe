"""The one way another thread hands work to a thread that sleeps in a ZeroMQ poller.

A thread that serves sockets sleeps in exactly one place, ``zmq.Poller.poll``. Work from
other threads (a reply computed on a worker pool, a registry watch event, a registry
change that may answer a parked poll) goes into a :class:`Mailbox`: a queue plus an
inproc PAIR pair whose receiving end sits in that poller, so a put wakes the sleeper at
once. The service host and the coordinator's event loop both use it.

Usage, on the polling thread::

    poller.register(mailbox.socket, zmq.POLLIN)
    ready = dict(poller.poll(0 if mailbox else wait_ms))
    if mailbox.socket in ready:
        mailbox.clear_wakeups()
    for item in mailbox.take():
        ...
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from typing import Generic, TypeVar

import zmq

from comm.sockets import make_socket

__all__ = ["Mailbox"]

T = TypeVar("T")

_names = itertools.count()


class Mailbox(Generic[T]):
    """A thread-safe queue whose :attr:`socket` turns readable when something is put in it.

    Args:
        name: names the inproc endpoint (a number is appended, so names may repeat).
    """

    def __init__(self, name: str) -> None:
        endpoint = f"inproc://{name}-{next(_names)}"
        self._items: deque[T] = deque()
        self._in = make_socket(zmq.PAIR)
        self._in.bind(endpoint)
        self._out = make_socket(zmq.PAIR)
        self._out.connect(endpoint)
        self._lock = threading.Lock()  # a ZeroMQ socket is not thread-safe: one sender at a time
        self._closed = False

    @property
    def socket(self) -> zmq.Socket[bytes]:
        """The end to register (POLLIN) in the polling thread's poller."""
        return self._in

    def put(self, item: T) -> None:
        """Queue ``item`` and wake the polling thread; from any thread, never blocks.

        A put after :meth:`close` is dropped (the consumer is gone).
        """
        self._items.append(item)
        with self._lock:
            if self._closed:
                return
            # a full queue of wake-ups (Again) means the sleeper will wake anyway
            with contextlib.suppress(zmq.Again):
                self._out.send(b"", zmq.NOBLOCK)

    def __len__(self) -> int:
        return len(self._items)

    def take(self) -> list[T]:
        """Everything put so far, oldest first (no system call when it is empty)."""
        items = self._items
        out: list[T] = []
        while items:
            out.append(items.popleft())
        return out

    def clear_wakeups(self) -> None:
        """Read the pending wake-ups (call when the poller reports :attr:`socket` readable)."""
        with contextlib.suppress(zmq.Again):
            while True:
                self._in.recv(zmq.NOBLOCK)

    def close(self) -> None:
        """Close both ends; idempotent. Call from the polling thread once it stopped polling."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._out.close()
        self._in.close()
