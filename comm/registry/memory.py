"""The embedded registry: an in-process, thread-safe :class:`Registry` with etcd's semantics.

:class:`MemoryRegistry` is what the coordinator serves to its workers (through
:mod:`comm.registry.server`) and what single-process tests use directly. It keeps:

* the keys, each with the revision of its last change and its lease, if any;
* one store-wide revision, bumped once per change (a lease that lapses with three
  keys deletes all three in one revision, as etcd does);
* a bounded history of events (``history`` events, 100k by default) from which
  watches are served, so a watch can start at an older revision and resume after a
  gap. A revision that fell out of the history is *compacted*: asking for it raises
  :class:`RegistryError`, as etcd does for compacted revisions;
* leases with a deadline; a reaper thread sleeps until the earliest deadline and
  deletes the keys of every lapsed lease, so watchers see their ``DELETE`` events
  within milliseconds of expiry. Any positive TTL is allowed, sub-second ones too.
  The deadlines wait in a heap, an entry pushed per grant and refresh and an outdated one
  skipped when it comes up: finding the lapsed leases costs a refresh ``log L``, not a pass
  over all ``L`` leases (a served registry refreshes every worker's and every communicator
  rank's lease, so that pass made the refreshes' cost grow as ``L^2``).

[Note: leases of a stalled server] A served registry lives in the coordinator's process. When that
process stalls (a long garbage collection, a call that holds the GIL, the machine's load), the
workers' refreshes wait unread in the server's socket while the clock runs on; had the leases lapsed
on the clock alone, the first thread to run after the stall would expire every lease whose refresh
sat in the queue, and the coordinator would take its live workers for dead. So each server attached
(:meth:`MemoryRegistry.attach_server`) says up to which instant it has read its requests
(:meth:`comm.rpc.host.ServiceHost.read_up_to`), and a lease lapses only once every server has read
past its deadline: a refresh sent in time is always applied first. (etcd does the like when a new
leader takes over: it extends every lease rather than expire them for the time without one.) A lease
whose deadline passed while a server was idle costs one wake-up of that server, milliseconds.

[Note: revision cursors] A reader of the history (a :class:`MemoryWatch`, or a remote
watch's long poll through the server) remembers the next revision it wants. A read
never splits a revision: it returns whole revisions only, plus the revision it has
scanned through, so a reader that resumes at ``through + 1`` neither loses nor
repeats an event, and an idle reader's cursor still advances past unrelated changes.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta

from comm.errors import LeaseExpiredError, RegistryError
from comm.registry.base import EventType, KeyValue, Lease, Registry, Watch, WatchEvent

__all__ = ["DEFAULT_HISTORY", "MemoryLease", "MemoryRegistry", "MemoryWatch"]

logger = logging.getLogger(__name__)

DEFAULT_HISTORY = 100_000
"""Events kept for watches that start at an older revision or fall behind."""

DEFAULT_READ_LIMIT = 1000
"""Events handed out per read (a read may exceed it to finish a revision)."""

_CATCH_UP_POLL_S = 0.005
"""How often the reaper looks again at a due lease while a server catches up on its requests."""

Listener = Callable[[int], None]
"""Called with the new revision after every change, under the registry's lock: must not block."""


_Events = list[WatchEvent]  # (an alias: inside the class, ``list`` is Registry.list)


@dataclass(slots=True)
class _Entry:
    value: bytes
    revision: int
    lease_id: int | None


@dataclass(slots=True)
class _LeaseState:
    ttl: float
    deadline: float  # time.monotonic() at which the lease lapses
    keys: set[str] = field(default_factory=set)


def _revision_of(event: WatchEvent) -> int:
    return event.revision


class MemoryLease(Lease):
    """A handle on a lease of a :class:`MemoryRegistry` (only its id is state)."""

    def __init__(self, registry: MemoryRegistry, lease_id: int, ttl: timedelta) -> None:
        super().__init__(lease_id, ttl)
        self._registry = registry

    def refresh(self) -> None:
        self._registry.refresh_lease(self._id)

    def revoke(self) -> None:
        self._registry.revoke_lease(self._id)

    def __repr__(self) -> str:
        return f"MemoryLease(id={self._id}, ttl={self._ttl.total_seconds()}s)"


class MemoryRegistry(Registry):
    """An in-process registry: a dict, a revision counter, leases and an event history.

    Every method is thread-safe and returns without waiting on anything but the
    registry's own lock, except :meth:`events_since` and :meth:`MemoryWatch.get`, which
    wait at most their ``timeout``.

    Args:
        history: how many events to keep for watches (at least this many, at most a
            quarter more). Older revisions are compacted.

    Raises:
        ValueError: if ``history`` is not positive.
    """

    def __init__(self, *, history: int = DEFAULT_HISTORY) -> None:
        if history <= 0:
            raise ValueError(f"history must be a positive number of events, got {history}")
        self._history_size = history
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # readers wait for new revisions
        self._reaper_wakeup = threading.Condition(self._lock)  # a lease was granted / closing
        self._data: dict[str, _Entry] = {}
        self._leases: dict[int, _LeaseState] = {}
        self._deadlines: list[tuple[float, int]] = []  # (deadline, lease id), a heap; stale entries skipped
        self._lease_ids = itertools.count(1)
        self._revision = 1  # as etcd: an empty store is at revision 1
        self._events: list[WatchEvent] = []
        self._compacted = 0  # every revision <= this is no longer (fully) in the history
        self._listeners: dict[int, Listener] = {}
        self._listener_ids = itertools.count()
        self._closed = False
        self._servers: dict[int, tuple[Callable[[], float], Callable[[], None]]] = {}  # read_up_to, wake
        self._server_ids = itertools.count()
        self._reaper = threading.Thread(target=self._reap, name="memory-registry-reaper", daemon=True)
        self._reaper.start()

    # -- key-value ---------------------------------------------------------------------

    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        with self._lock:
            self._check_open()
            lease_id = self._live_lease_id(lease)
            revision = self._commit()
            self._store(key, value, lease_id, revision)
            self._record([WatchEvent(EventType.PUT, key, value, revision)])
            return revision

    def get(self, key: str) -> KeyValue | None:
        with self._lock:
            self._check_open()
            entry = self._data.get(key)
            return None if entry is None else KeyValue(key, entry.value, entry.revision)

    def delete(self, key: str) -> bool:
        with self._lock:
            self._check_open()
            if key not in self._data:
                return False
            revision = self._commit()
            self._remove(key)
            self._record([WatchEvent(EventType.DELETE, key, b"", revision)])
            return True

    def list(self, prefix: str) -> list[KeyValue]:
        with self._lock:
            self._check_open()
            return [
                KeyValue(key, entry.value, entry.revision)
                for key, entry in sorted(self._data.items())
                if key.startswith(prefix)
            ]

    def compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: Lease | None = None
    ) -> bool:
        with self._lock:
            self._check_open()
            entry = self._data.get(key)
            if expected is None:
                if entry is not None:
                    return False
            elif entry is None or entry.value != expected:
                return False
            lease_id = self._live_lease_id(lease)
            revision = self._commit()
            self._store(key, value, lease_id, revision)
            self._record([WatchEvent(EventType.PUT, key, value, revision)])
            return True

    def revision(self) -> int:
        with self._lock:
            self._check_open()
            return self._revision

    # -- leases ------------------------------------------------------------------------

    def lease(self, ttl: timedelta) -> MemoryLease:
        """Grant a lease of exactly ``ttl`` (any positive duration).

        Raises:
            ValueError: if ``ttl`` is not positive.
        """
        seconds = ttl.total_seconds()
        if seconds <= 0:
            raise ValueError(f"a lease needs a positive ttl, got {seconds}s")
        with self._lock:
            self._check_open()
            lease_id = next(self._lease_ids)
            self._leases[lease_id] = _LeaseState(seconds, time.monotonic() + seconds)
            self._push_deadline(lease_id)
            self._reaper_wakeup.notify()
        return MemoryLease(self, lease_id, ttl)

    def attach_server(self, read_up_to: Callable[[], float], wake: Callable[[], None]) -> Callable[[], None]:
        """Let leases lapse only up to ``read_up_to()``: the ``time.monotonic()`` instant before which the
        server has handled every request it received (see [Note: leases of a stalled server]). ``wake``
        (any thread, must not block) asks the server to read its requests soon. Returns the detach
        function; a server must detach when it stops, or no lease lapses past its last read.
        """
        with self._lock:
            server = next(self._server_ids)
            self._servers[server] = (read_up_to, wake)

        def detach() -> None:
            with self._lock:
                if self._servers.pop(server, None) is not None:
                    self._reaper_wakeup.notify()

        return detach

    def lease_handle(self, lease_id: int) -> MemoryLease:
        """A handle on an existing lease, by id (for the server, which receives ids).

        Raises:
            LeaseExpiredError: if no such lease is alive.
        """
        with self._lock:
            self._check_open()
            state = self._leases.get(lease_id)
            if state is None:
                raise LeaseExpiredError(f"lease {lease_id} not found (expired or revoked); grant a new one")
            return MemoryLease(self, lease_id, timedelta(seconds=state.ttl))

    def refresh_lease(self, lease_id: int) -> None:
        """Push the lease's deadline to ``now + ttl``.

        Raises:
            LeaseExpiredError: if the lease already expired or was revoked.
        """
        with self._lock:
            self._check_open()
            now = time.monotonic()
            self._expire_due(self._lapse_clock(now))  # a lapsed lease the reaper has not reached is lapsed
            state = self._leases.get(lease_id)
            if state is None:
                raise LeaseExpiredError(f"lease {lease_id} not found (expired or revoked); grant a new one")
            state.deadline = now + state.ttl
            self._push_deadline(lease_id)

    def revoke_lease(self, lease_id: int) -> None:
        """Delete the lease and its keys now; a lease that is already gone is a no-op."""
        with self._lock:
            self._check_open()
            self._end_lease(lease_id)

    # -- watches -----------------------------------------------------------------------

    def watch(self, prefix: str, *, start_revision: int | None = None) -> MemoryWatch:
        """Watch ``prefix``; see :meth:`Registry.watch`.

        Raises:
            ValueError: if ``start_revision`` is below 1.
            RegistryError: if ``start_revision`` is compacted out of the history.
        """
        with self._lock:
            self._check_open()
            if start_revision is None:
                start_revision = self._revision + 1
            self._check_start(start_revision)
        return MemoryWatch(self, prefix, start_revision)

    def events_since(
        self,
        prefix: str,
        from_revision: int,
        *,
        timeout: timedelta,
        limit: int = DEFAULT_READ_LIMIT,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[_Events, int]:
        """Events under ``prefix`` at revisions ``>= from_revision``, waiting up to ``timeout``.

        Returns ``(events, through)``: the events (whole revisions, about ``limit`` of
        them at most) and the revision the read has covered, so the next read starts at
        ``through + 1`` (see [Note: revision cursors]). Returns ``([], current revision)``
        when nothing arrived within ``timeout``, or as soon as ``cancelled()`` is true.

        Raises:
            ValueError: if ``from_revision`` is below 1.
            RegistryError: if ``from_revision`` is compacted, or the registry is closed.
        """
        deadline = time.monotonic() + max(0.0, timeout.total_seconds())
        with self._lock:
            while True:
                self._check_open()
                self._check_start(from_revision)
                if cancelled is not None and cancelled():
                    return [], self._revision
                if from_revision <= self._revision:
                    found = self._scan(prefix, from_revision, limit)
                    if found is not None:
                        return found
                    from_revision = self._revision + 1  # nothing under prefix so far: skip ahead
                left = deadline - time.monotonic()
                if left <= 0:
                    return [], self._revision
                self._changed.wait(left)

    def wake_readers(self) -> None:
        """Wake every reader blocked in :meth:`events_since` (to notice a cancellation)."""
        with self._lock:
            self._changed.notify_all()

    def subscribe(self, listener: Listener) -> Callable[[], None]:
        """Call ``listener(revision)`` after every change; returns the unsubscribe function.

        The listener runs on the writer's thread under the registry's lock: it must be
        quick and must not call back into the registry (the served registry uses it to
        queue one re-check of its parked watch polls).
        """
        with self._lock:
            token = next(self._listener_ids)
            self._listeners[token] = listener

        def unsubscribe() -> None:
            with self._lock:
                self._listeners.pop(token, None)

        return unsubscribe

    # -- lifecycle ---------------------------------------------------------------------

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reaper_wakeup.notify_all()
            self._changed.notify_all()
        self._reaper.join(timeout=5)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- internals (callers hold self._lock) -------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise RegistryError("the memory registry is closed")

    def _check_start(self, start_revision: int) -> None:
        if start_revision < 1:
            raise ValueError(f"start_revision must be >= 1, got {start_revision}")
        if start_revision <= self._compacted:
            raise RegistryError(
                f"revision {start_revision} is compacted: the history keeps the last "
                f"{self._history_size} events, the oldest complete revision is {self._compacted + 1}; "
                "re-read the current state with list() and watch from revision() + 1"
            )

    def _live_lease_id(self, lease: Lease | None) -> int | None:
        if lease is None:
            return None
        self._expire_due(self._lapse_clock(time.monotonic()))
        if lease.id not in self._leases:
            raise LeaseExpiredError(f"lease {lease.id} not found (expired or revoked); grant a new one")
        return lease.id

    def _commit(self) -> int:
        self._revision += 1
        return self._revision

    def _store(self, key: str, value: bytes, lease_id: int | None, revision: int) -> None:
        old = self._data.get(key)
        if old is not None and old.lease_id is not None and old.lease_id != lease_id:
            old_lease = self._leases.get(old.lease_id)
            if old_lease is not None:
                old_lease.keys.discard(key)
        self._data[key] = _Entry(value, revision, lease_id)
        if lease_id is not None:
            self._leases[lease_id].keys.add(key)

    def _remove(self, key: str) -> None:
        entry = self._data.pop(key)
        if entry.lease_id is not None:
            state = self._leases.get(entry.lease_id)
            if state is not None:
                state.keys.discard(key)

    def _record(self, events: _Events) -> None:
        self._events.extend(events)
        overflow = len(self._events) - self._history_size
        if overflow > self._history_size // 4:
            self._compacted = self._events[overflow - 1].revision
            del self._events[:overflow]
        self._changed.notify_all()
        for listener in list(self._listeners.values()):
            try:
                listener(self._revision)
            except Exception:  # a listener must not break a write
                logger.exception("registry listener failed")

    def _scan(self, prefix: str, from_revision: int, limit: int) -> tuple[_Events, int] | None:
        start = bisect.bisect_left(self._events, from_revision, key=_revision_of)
        out: _Events = []
        for i in range(start, len(self._events)):
            event = self._events[i]
            if len(out) >= limit and event.revision > out[-1].revision:
                return out, out[-1].revision  # stop at a revision boundary, never inside one
            if event.key.startswith(prefix):
                out.append(event)
        return (out, self._revision) if out else None

    def _end_lease(self, lease_id: int) -> None:
        state = self._leases.pop(lease_id, None)
        if state is None or not state.keys:
            return
        revision = self._commit()
        events = []
        for key in sorted(state.keys):
            del self._data[key]
            events.append(WatchEvent(EventType.DELETE, key, b"", revision))
        self._record(events)

    def _push_deadline(self, lease_id: int) -> None:
        """Queue the lease's current deadline (under the lock); older entries of it go stale."""
        heapq.heappush(self._deadlines, (self._leases[lease_id].deadline, lease_id))
        if len(self._deadlines) > 2 * len(self._leases) + 64:  # mostly stale: keep one entry per lease
            self._deadlines = [(s.deadline, i) for i, s in self._leases.items()]
            heapq.heapify(self._deadlines)

    def _expire_due(self, now: float) -> None:
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            deadline, lease_id = heapq.heappop(heap)
            state = self._leases.get(lease_id)
            if state is None or state.deadline != deadline:  # revoked, lapsed or refreshed since
                continue
            logger.debug("lease %d lapsed", lease_id)
            self._end_lease(lease_id)

    def _lapse_clock(self, now: float) -> float:
        """The instant up to which leases may lapse (under the lock): ``now``, or earlier while a server
        has not read its requests up to ``now`` ([Note: leases of a stalled server])."""
        for read_up_to, _ in self._servers.values():
            now = min(now, read_up_to())
        return now

    def _reap(self) -> None:
        woken_at: float | None = None  # the lapse clock when the servers were last asked to read
        with self._lock:
            while not self._closed:
                now = time.monotonic()
                upto = self._lapse_clock(now)
                self._expire_due(upto)
                # the earliest entry may be stale (a refreshed lease): then the reaper wakes early, once
                timeout = None if not self._deadlines else max(0.0, self._deadlines[0][0] - now)
                if timeout == 0.0:  # due, but a server has not read up to it: ask it to, look again soon
                    if woken_at != upto:
                        woken_at = upto
                        for _, wake in self._servers.values():
                            wake()
                    timeout = _CATCH_UP_POLL_S
                self._reaper_wakeup.wait(timeout)


class MemoryWatch(Watch):
    """A watch on a :class:`MemoryRegistry`: a revision cursor over its event history.

    It holds no queue of its own (memory stays bounded by the registry's history); a
    consumer that falls more than the history behind gets a compaction error.
    """

    def __init__(self, registry: MemoryRegistry, prefix: str, start_revision: int) -> None:
        self._registry = registry
        self._prefix = prefix
        self._next = start_revision
        self._buffer: deque[WatchEvent] = deque()
        self._cancelled = False

    def get(self, timeout: timedelta) -> WatchEvent | None:
        """The next event, or None if none arrived within ``timeout``.

        Raises:
            RegistryError: if the watch was cancelled, the registry closed, or this watch
                fell so far behind that its next revision was compacted.
        """
        if self._cancelled:
            raise RegistryError(f"the watch on {self._prefix!r} was cancelled")
        if not self._buffer:
            events, through = self._registry.events_since(
                self._prefix, self._next, timeout=timeout, cancelled=lambda: self._cancelled
            )
            if self._cancelled:
                raise RegistryError(f"the watch on {self._prefix!r} was cancelled")
            self._buffer.extend(events)
            self._next = max(self._next, through + 1)
        return self._buffer.popleft() if self._buffer else None

    def cancel(self) -> None:
        if self._cancelled:
            return
        self._cancelled = True
        self._buffer.clear()
        if not self._registry.closed:
            self._registry.wake_readers()
