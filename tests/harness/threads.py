"""Ranks as threads of the test process: run one function per rank at once, bounded, first error raised;
a pair of zmq ranks made that way."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

from comm.registry.memory import MemoryRegistry
from comm.zmq.communicator import ZmqCommunicator

__all__ = ["run_ranks", "zmq_pair"]


def run_ranks(fns: list[Callable[[], None]], timeout: float = 30.0) -> None:
    """Run each of ``fns`` on a thread of its own, wait for all (``timeout`` seconds each), then raise the
    first exception any of them raised.

    Raises:
        AssertionError: A thread was still running after ``timeout``.
    """
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish in time"
    if errors:
        raise errors[0]


@contextmanager
def zmq_pair(prefix: str, timeout: timedelta) -> Iterator[list[ZmqCommunicator]]:
    """Two zmq ranks of one world (threads of this process, an in-memory registry), closed on the way out."""
    registry = MemoryRegistry()
    comms: list[ZmqCommunicator] = []

    def make(rank: int) -> Callable[[], None]:
        return lambda: comms.append(ZmqCommunicator.create(rank=rank, world_size=2, registry=registry,
                                                           prefix=prefix, timeout=timeout))

    try:
        run_ranks([make(0), make(1)])
        comms.sort(key=lambda c: c.rank)
        yield comms
    finally:
        for c in comms:
            c.close()
        registry.close()
