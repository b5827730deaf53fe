"""Ranks as threads of the test process: run one function per rank at once, bounded, first error raised."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_ranks"]


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
