"""Following the keys under a prefix through registry outages: what changed for real.

The coordinator's membership watch (``coordinator/runtime/loop.py``), a rendezvous's liveness
watch (``comm/rendezvous.py``) and a worker's watch on its coordinator
(``comm/registry/presence.py``) all read a vanished leased key as "that process is gone". A
:class:`Follower` hands them the changes under a prefix without an outage's noise (see
[Note: registry outages] in ``comm/registry/keepalive.py``):

* a key that appeared, or whose value changed, is a :class:`Change` with its value; a key put
  again with the value it had (its holder publishing again after an outage) is no change;
* a key that vanished is a :class:`Change` without a value: at once while the registry is not
  in doubt; while it is (the caller's ``in_doubt()``, or this follower's own watch failed within
  the grace), the deletion is held and reported only if the key is not back within the grace;
* when the watch fails (etcd stayed away longer than the watch retries, a served registry did
  not answer a poll), the follower lists the prefix again once the registry answers, watches
  from there and reports the difference from what it knew (a key missing then is held as above).

Use from one thread: :meth:`Follower.poll` in a loop, :meth:`Follower.close` at the end; ``close``
may come from another thread, and ends a poll waiting in the loop's thread at once.

[Note: a follower's long poll]
A follower's thread polls with :data:`FOLLOW_POLL`, seconds, not a fraction of one. A watch answers
at its first event whatever the wait (a served registry's long poll, etcd's stream, the memory
registry's condition), so a long wait costs a change no latency; what a short one costs is requests:
each poll of a served registry (``comm/registry/remote.py``) is one RPC to the coordinator's one
registry thread. With every worker's watch on its coordinator polling every 0.25 s and every
communicator rank's liveness watch every 0.2 s, 256 hollow workers in pipelines sent it ~2,300
requests a second, 0.4-0.6 of a core, and at 512 it fell behind until leases lapsed
(docs/benchmarks.md, "Hollow workers"). The threads stop by closing their follower, not by waking to
check a flag. What a long poll delays is only a deletion held through a registry outage, reported at
the first poll after its grace: up to one poll late.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta

from comm.registry.base import EventType, Registry, Watch, WatchEvent
from comm.registry.keepalive import OUTAGE_GRACE

__all__ = ["FOLLOW_POLL", "Change", "Follower"]

log = logging.getLogger(__name__)

FOLLOW_POLL = timedelta(seconds=5)
"""How long a following thread's :meth:`Follower.poll` waits ([Note: a follower's long poll])."""


@dataclass(frozen=True, slots=True)
class Change:
    """A key that appeared or changed (``value``), or vanished (``value`` is None).

    Attributes:
        previous: the value it had before (None: it is new).
        after_outage: a vanished key whose deletion was held during an outage and that did not come back.
    """

    key: str
    value: bytes | None
    previous: bytes | None
    after_outage: bool = False


class Follower:
    """The real changes under ``prefix`` (see the module docstring).

    Args:
        registry: where the keys live.
        prefix: the keys followed (with ``exact``, only the key ``prefix`` itself).
        in_doubt: whether the registry is, or just was, unreachable as the caller sees it
            (:meth:`comm.registry.keepalive.KeepAlive.in_doubt`).
        grace: how long a deletion is held while the registry is in doubt.
    """

    def __init__(self, registry: Registry, prefix: str, *, in_doubt: Callable[[], bool], exact: bool = False,
                 grace: timedelta = OUTAGE_GRACE) -> None:
        self._registry = registry
        self._prefix = prefix
        self._exact = exact
        self._in_doubt = in_doubt
        self._grace = grace.total_seconds()
        self._values: dict[str, bytes] = {}
        self._held: dict[str, float] = {}  # key -> when its deletion was held
        self._watch: Watch | None = None
        self._failed_at: float | None = None  # the last failure of this follower's own watch
        self._failing = False
        self._closed = threading.Event()  # set by close(), from any thread

    @property
    def values(self) -> dict[str, bytes]:
        """The keys known now (held deletions included) and their values."""
        return dict(self._values)

    def begin(self, known: Mapping[str, bytes], start_revision: int) -> None:
        """Follow from ``start_revision`` on, knowing ``known`` (a listing read before it).

        Raises:
            RegistryError: the watch cannot start (the registry does not answer, a compacted revision).
        """
        self._values = {k: v for k, v in known.items() if self._accepts(k)}
        self._watch = self._registry.watch(self._prefix, start_revision=start_revision)

    def begin_now(self) -> dict[str, bytes]:
        """List the keys now and follow from there; returns the listing.

        Raises:
            RegistryError: the registry does not answer.
        """
        self._resync()
        return dict(self._values)

    def poll(self, timeout: timedelta) -> list[Change]:
        """The changes that came within ``timeout`` (often none). Never raises for a failing registry:
        it waits ``timeout`` and tries again at the next call."""
        changes: list[Change] = []
        if self._closed.is_set():
            return changes
        try:
            if self._watch is None:
                changes += self._resync()
            else:
                event = self._watch.get(timeout)
                if event is not None and self._accepts(event.key):
                    changes += self._apply(event)
        except Exception as exc:  # the registry's failures, whatever their kind: list again when it answers
            if self._closed.is_set():  # close() from another thread cancelled the watch this poll waited on
                return []
            self._lose_watch(exc)
            time.sleep(timeout.total_seconds())
        return changes + self._due()

    def close(self) -> None:
        """Cancel the watch; a :meth:`poll` waiting on it in another thread returns at once (no change).
        Idempotent."""
        self._closed.set()
        watch, self._watch = self._watch, None
        if watch is not None:
            watch.cancel()

    # -- internals ---------------------------------------------------------------------

    def _accepts(self, key: str) -> bool:
        return key == self._prefix if self._exact else key.startswith(self._prefix)

    def _doubt(self) -> bool:
        own = self._failed_at is not None and time.monotonic() - self._failed_at <= self._grace
        return own or self._in_doubt()

    def _apply(self, event: WatchEvent) -> list[Change]:
        key = event.key
        if event.type is EventType.PUT:
            if self._held.pop(key, None) is not None:
                log.info("%s is back after the registry outage", key)
            previous = self._values.get(key)
            self._values[key] = event.value
            return [] if previous == event.value else [Change(key, event.value, previous)]
        if key not in self._values or key in self._held:
            return []
        return self._vanished(key)

    def _vanished(self, key: str) -> list[Change]:
        if self._doubt():
            self._held[key] = time.monotonic()
            log.info("%s vanished while the registry was unreachable or just back; giving it %.0fs to come "
                     "back", key, self._grace)
            return []
        return [Change(key, None, self._values.pop(key))]

    def _due(self) -> list[Change]:
        if not self._held:
            return []
        now = time.monotonic()
        due = [key for key, since in self._held.items() if now - since >= self._grace]
        for key in due:
            del self._held[key]
        return [Change(key, None, self._values.pop(key), after_outage=True) for key in due]

    def _resync(self) -> list[Change]:
        revision = self._registry.revision()
        listed = {kv.key: kv.value for kv in self._registry.list(self._prefix) if self._accepts(kv.key)}
        self._watch = self._registry.watch(self._prefix, start_revision=revision + 1)
        if self._closed.is_set():  # closed from another thread meanwhile: the new watch is not followed
            self.close()
            return []
        if self._failing:
            self._failing = False
            log.info("the registry answers again: %r listed again (%d keys)", self._prefix, len(listed))
        changes: list[Change] = []
        for key in [k for k in self._values if k not in listed and k not in self._held]:
            changes += self._vanished(key)
        for key, value in listed.items():
            self._held.pop(key, None)
            previous = self._values.get(key)
            self._values[key] = value
            if previous != value:
                changes.append(Change(key, value, previous))
        return changes

    def _lose_watch(self, exc: Exception) -> None:
        self._failed_at = time.monotonic()
        if self._watch is not None:
            try:
                self._watch.cancel()
            except Exception:  # a broken watch may fail to cancel too; it is dropped either way
                log.debug("cancelling the failed watch on %r", self._prefix, exc_info=True)
            self._watch = None
        if not self._failing:
            self._failing = True
            log.warning("the registry watch on %r failed (%s); listing it again when the registry answers",
                        self._prefix, exc)
        else:
            log.debug("the registry still fails (%s)", exc)
