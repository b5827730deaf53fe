"""The discovery contract: keys, leases, prefix watches and compare-and-set.

Every registry backend (the embedded one, its ZeroMQ-served client, etcd) implements
:class:`Registry`, and every backend passes the same contract suite in
``tests/multiproc/comm/test_registry_contract.py``.

Semantics (the same for every backend):

* Keys are ``str``, values are ``bytes``. Callers encode values themselves (msgpack).
* Every change bumps one store-wide, strictly increasing *revision* (as etcd's).
* A key put with a lease vanishes when the lease expires (its owner stopped calling
  :meth:`Lease.refresh`) or is revoked; a watcher sees a ``DELETE`` event for it.
  Holders keep leases with :class:`comm.registry.keepalive.KeepAlive`, also through registry
  outages (see [Note: registry outages] there).
* A watch on a prefix delivers every ``PUT``/``DELETE`` under that prefix in revision
  order, starting after ``start_revision`` when one is given (so a watcher that
  remembers the last revision it saw can resume without losing events).
"""

from __future__ import annotations

import abc
import builtins
import enum
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

from comm.errors import RegistryTimeoutError

__all__ = [
    "DEFAULT_REGISTRY_TIMEOUT",
    "QUIET_RELIST_MAX_S",
    "QUIET_RELIST_S",
    "EventType",
    "KeyValue",
    "Lease",
    "Registry",
    "Watch",
    "WatchEvent",
]

DEFAULT_REGISTRY_TIMEOUT = timedelta(seconds=30)
QUIET_RELIST_S = 0.5  # wait_for's first quiet spell before it lists again (a watch that lost events)
QUIET_RELIST_MAX_S = 5.0  # ...and its longest


class EventType(str, enum.Enum):
    PUT = "put"
    DELETE = "delete"


@dataclass(frozen=True, slots=True)
class KeyValue:
    key: str
    value: bytes
    revision: int  # the revision of the last change to this key


@dataclass(frozen=True, slots=True)
class WatchEvent:
    type: EventType
    key: str
    value: bytes  # empty for DELETE
    revision: int


def _apply(state: dict[str, KeyValue], event: WatchEvent) -> None:
    """Apply one watch event to a listing by key (an event older than what the listing holds is skipped)."""
    held = state.get(event.key)
    if held is not None and held.revision > event.revision:
        return
    if event.type == EventType.PUT:
        state[event.key] = KeyValue(event.key, event.value, event.revision)
    else:
        state.pop(event.key, None)


class Lease(abc.ABC):
    """A time-to-live grant; keys put with it vanish when it expires or is revoked.

    Backends subclass it with ``refresh`` and ``revoke``; the id and TTL live here.
    """

    def __init__(self, lease_id: int, ttl: timedelta) -> None:
        self._id = lease_id
        self._ttl = ttl

    @property
    def id(self) -> int:
        return self._id

    @property
    def ttl(self) -> timedelta:
        return self._ttl

    @abc.abstractmethod
    def refresh(self) -> None:
        """Renew the lease for another ``ttl``.

        Raises:
            LeaseExpiredError: the registry answered that the lease is gone (expired or revoked).
            RegistryError: the registry did not answer (RegistryTimeoutError) or failed otherwise.
        """

    @abc.abstractmethod
    def revoke(self) -> None:
        """End the lease now; its keys are deleted. Revoking twice is a no-op."""


class Watch(abc.ABC):
    """A stream of events under one prefix. Not thread-safe: one consumer per watch."""

    @abc.abstractmethod
    def get(self, timeout: timedelta) -> WatchEvent | None:
        """The next event, or None if none arrived within ``timeout``."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Stop watching and release the watch's resources. Idempotent."""

    def __iter__(self) -> Iterator[WatchEvent]:
        """Iterate events forever (until cancel); use :meth:`get` where a bound is needed."""
        while True:
            event = self.get(timedelta(seconds=1))
            if event is not None:
                yield event

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


class Registry(abc.ABC):
    """Discovery: a small consistent key-value store with leases, watches and CAS.

    Every method is blocking and bounded by the backend's request timeout.
    Registries are thread-safe.
    """

    @abc.abstractmethod
    def put(self, key: str, value: bytes, *, lease: Lease | None = None) -> int:
        """Set ``key`` to ``value`` (attached to ``lease`` if given); returns the new revision."""

    @abc.abstractmethod
    def get(self, key: str) -> KeyValue | None:
        """The key's value and revision, or None if it does not exist."""

    @abc.abstractmethod
    def delete(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""

    @abc.abstractmethod
    def list(self, prefix: str) -> builtins.list[KeyValue]:
        """Every key under ``prefix``, sorted by key."""

    @abc.abstractmethod
    def compare_and_set(
        self, key: str, expected: bytes | None, value: bytes, *, lease: Lease | None = None
    ) -> bool:
        """Set ``key`` to ``value`` only if its current value is ``expected``.

        ``expected=None`` means "only if the key does not exist" (create). Returns
        whether the write happened.
        """

    @abc.abstractmethod
    def lease(self, ttl: timedelta) -> Lease:
        """Grant a lease of ``ttl`` (backends may round up: etcd's minimum is 2 s)."""

    @abc.abstractmethod
    def watch(self, prefix: str, *, start_revision: int | None = None) -> Watch:
        """Watch every change under ``prefix``.

        With ``start_revision``, events from that revision on (inclusive) are replayed
        first; without it, only changes after the call are delivered.
        """

    @abc.abstractmethod
    def revision(self) -> int:
        """The store's current revision."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release connections and threads. Idempotent."""

    # -- helpers shared by every backend ------------------------------------------

    def wait_for(
        self,
        prefix: str,
        predicate: Callable[[builtins.list[KeyValue]], bool],
        *,
        timeout: timedelta,
        what: str,
    ) -> builtins.list[KeyValue]:
        """Block until ``predicate(self.list(prefix))`` holds; return that listing.

        The prefix is listed once; after that the watch's events keep the listing up to date, so a
        group of ``g`` members forming reads ``g`` entries and ``g`` events, not ``g`` listings of up to
        ``g`` entries each. Events are applied in batches (all that are queued), so the listing never
        shows a replayed change the first listing had already seen undone; a listing is taken afresh
        whenever the watch stays quiet for a while: half a second at first, twice as long each quiet
        spell after, up to :data:`QUIET_RELIST_MAX_S` (the ranks of a large group waiting on one
        registry each listed every half second: a thousand listings a second at 512 ranks).

        Raises:
            RegistryTimeoutError: naming ``what`` and the last listing seen, after ``timeout``.
        """
        deadline = time.monotonic() + timeout.total_seconds()
        start = self.revision()
        items = self.list(prefix)
        if predicate(items):
            return items
        with self.watch(prefix, start_revision=start + 1) as watch:
            state = {kv.key: kv for kv in self.list(prefix)}
            quiet = QUIET_RELIST_S
            while True:
                items = [state[key] for key in sorted(state)]
                if predicate(items):
                    return items
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RegistryTimeoutError(
                        f"timed out after {timeout.total_seconds():.1f}s waiting for {what} "
                        f"under {prefix!r}; present: {[kv.key for kv in items]}"
                    )
                event = watch.get(timedelta(seconds=min(left, quiet)))
                if event is None:  # quiet: take a fresh listing (a watch that lost events cannot lose us)
                    state = {kv.key: kv for kv in self.list(prefix)}
                    quiet = min(2 * quiet, QUIET_RELIST_MAX_S)
                    continue
                while event is not None:
                    _apply(state, event)
                    event = watch.get(timedelta(0))

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
