"""A registry that can be made unreachable: an in-process :class:`MemoryRegistry` behind a switch.

While ``down`` is set, every call (a lease's refresh and a watch's ``get`` too) fails after
``delay`` with :class:`RegistryTimeoutError`, as calls to a stopped etcd time out; the store
behind it keeps its own clock, so leases lapse during the outage, as on a partitioned etcd.
:func:`wait_until` polls a condition, bounded, for the tests of this package.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from datetime import timedelta

from comm.errors import RegistryTimeoutError
from comm.registry import KeyValue, Lease, MemoryRegistry, Registry, Watch, WatchEvent

__all__ = ["FlakyRegistry"]


class FlakyRegistry(Registry):
    def __init__(self, delay: timedelta = timedelta(milliseconds=50)) -> None:
        self.inner = MemoryRegistry()
        self.down = threading.Event()
        self.delay = delay.total_seconds()

    def gate(self, what: str) -> None:
        if self.down.is_set():
            time.sleep(self.delay)
            raise RegistryTimeoutError(f"{what}: the registry is down (a test's outage)")

    @staticmethod
    def _inner(lease: Lease | None) -> Lease | None:
        return lease.inner if isinstance(lease, _FlakyLease) else lease

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        self.gate(f"put of {key}")
        return self.inner.put(key, value, lease=self._inner(lease))

    def get(self, key: str) -> KeyValue | None:
        self.gate(f"get of {key}")
        return self.inner.get(key)

    def delete(self, key: str) -> bool:
        self.gate(f"delete of {key}")
        return self.inner.delete(key)

    def list(self, prefix: str) -> list[KeyValue]:
        self.gate(f"list of {prefix}")
        return self.inner.list(prefix)

    def compare_and_set(self, key: str, expected: bytes | None, value: bytes, *,
                        lease: Lease | None = None) -> bool:
        self.gate(f"compare-and-set of {key}")
        return self.inner.compare_and_set(key, expected, value, lease=self._inner(lease))

    def lease(self, ttl: timedelta) -> Lease:
        self.gate("lease grant")
        return _FlakyLease(self, self.inner.lease(ttl))

    def watch(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        self.gate(f"watch of {prefix}")
        return _FlakyWatch(self, self.inner.watch(prefix, start_revision=start_revision))

    def revision(self) -> int:
        self.gate("revision")
        return self.inner.revision()

    def close(self) -> None:
        self.inner.close()


class _FlakyLease(Lease):
    def __init__(self, registry: FlakyRegistry, inner: Lease) -> None:
        super().__init__(inner.id, inner.ttl)
        self.registry = registry
        self.inner = inner

    def refresh(self) -> None:
        self.registry.gate(f"refresh of lease {self.id}")
        self.inner.refresh()

    def revoke(self) -> None:
        self.registry.gate(f"revoke of lease {self.id}")
        self.inner.revoke()


class _FlakyWatch(Watch):
    def __init__(self, registry: FlakyRegistry, inner: Watch) -> None:
        self.registry = registry
        self.inner = inner

    def get(self, timeout: timedelta) -> WatchEvent | None:
        self.registry.gate("watch poll")
        return self.inner.get(timeout)

    def cancel(self) -> None:
        self.inner.cancel()


def wait_until(condition: Callable[[], bool], seconds: float, what: str) -> float:
    """Seconds until ``condition()`` held (polled every 10 ms); fails naming ``what`` after ``seconds``."""
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < seconds, f"{what} did not happen within {seconds}s"
        time.sleep(0.01)
    return time.monotonic() - start
