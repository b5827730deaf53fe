"""A process's presence in the registry: a leased key saying "I am here", and following another's.

The coordinator publishes ``/cellmesh/{job}/coordinator`` with a :class:`Presence` from its
event loop's start to its close (``coordinator/runtime/loop.py``); the workers of a job on etcd
follow it with a :class:`PresenceMonitor` to know when their coordinator is gone
(``services/host/worker.py``).

* :class:`Presence` puts a :class:`PresenceCard` under a lease kept by a
  :class:`~comm.registry.keepalive.KeepAlive` that publishes the card again if an outage cost
  the lease. Closing marks the card ``closed`` (only while it is still this holder's), then
  revokes the lease, so a follower tells "finished" (closed, then deleted) from "died" (deleted).
* :class:`PresenceMonitor` follows the key from a thread through a
  :class:`~comm.registry.follow.Follower`. The holder is *waiting* (no card yet, or the last
  one closed: a worker started before its coordinator waits for it), *present*, or *gone*: its
  card vanished without closing, at once while the registry answers, or not back within the
  outage grace when the registry was in doubt (see [Note: registry outages] in
  ``comm/registry/keepalive.py``). Gone is final.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections.abc import Callable
from datetime import timedelta

from pydantic import Field

from comm.codec import Message, pack, unpack
from comm.errors import ProtocolError
from comm.registry.base import Lease, Registry
from comm.registry.follow import FOLLOW_POLL, Change, Follower
from comm.registry.keepalive import OUTAGE_GRACE, KeepAlive

__all__ = ["DEFAULT_CLOSE_TIMEOUT", "Presence", "PresenceCard", "PresenceMonitor"]

log = logging.getLogger(__name__)

DEFAULT_CLOSE_TIMEOUT = timedelta(seconds=3)
"""Bounds :meth:`Presence.close`'s goodbye (an unreachable registry lets the lease lapse instead)."""


class PresenceCard(Message):
    """What a present process publishes: who it is, its lease's TTL, and whether it closed."""

    pid: int
    host: str
    token: str  # this holder's, so a successor's card under the same key is never closed by it
    ttl_ms: int = Field(gt=0)
    closed: bool = False


class Presence:
    """``key`` holds this process's :class:`PresenceCard` while it is present (see the module docstring).

    Args:
        registry: where the key lives.
        key: the presence key.
        ttl: the lease's TTL: a holder that dies vanishes this long after (etcd rounds it up to 2 s).
    """

    def __init__(self, registry: Registry, key: str, ttl: timedelta) -> None:
        self.registry = registry
        self.key = key
        self.ttl = ttl
        self._card: PresenceCard | None = None
        self._keepalive: KeepAlive | None = None

    def start(self) -> Presence:
        """Grant the lease and put the card.

        Raises:
            RegistryError: the registry did not answer or refused.
        """
        lease = self.registry.lease(self.ttl)
        self._card = PresenceCard(pid=os.getpid(), host=socket.gethostname(), token=uuid.uuid4().hex,
                                  ttl_ms=max(1, round(lease.ttl.total_seconds() * 1000)))
        self.registry.put(self.key, pack(self._card), lease=lease)
        self._keepalive = KeepAlive(lease, renew=self._renew, what=f"the presence {self.key}")
        return self

    def in_doubt(self) -> bool:
        """Whether the registry is, or just was, unreachable from here (see :meth:`KeepAlive.in_doubt`)."""
        return self._keepalive is not None and self._keepalive.in_doubt()

    def _renew(self) -> Lease:
        assert self._card is not None
        lease = self.registry.lease(self.ttl)
        self.registry.put(self.key, pack(self._card), lease=lease)
        return lease

    def close(self, timeout: timedelta = DEFAULT_CLOSE_TIMEOUT) -> None:
        """Mark the card closed and revoke the lease; bounded by ``timeout``, never raises. Idempotent."""
        keepalive, card, self._keepalive = self._keepalive, self._card, None
        if keepalive is None or card is None:
            return
        keepalive.stop()

        def goodbye() -> None:
            closed = card.model_copy(update={"closed": True})
            try:
                self.registry.compare_and_set(self.key, pack(card), pack(closed), lease=keepalive.lease)
            except Exception:  # the revocation below removes the card all the same
                log.debug("could not mark %s closed", self.key, exc_info=True)
            try:
                keepalive.lease.revoke()
            except Exception:
                log.debug("could not revoke the lease of %s; it lapses by itself", self.key, exc_info=True)

        thread = threading.Thread(target=goodbye, name="presence-goodbye", daemon=True)
        thread.start()
        thread.join(timeout.total_seconds())
        if thread.is_alive():
            log.info("the registry did not answer within %.1fs; %s lapses with its lease",
                     timeout.total_seconds(), self.key)


class PresenceMonitor:
    """Follows another process's :class:`Presence` at ``key`` from a daemon thread.

    Args:
        registry: where the key lives.
        key: the presence key.
        in_doubt: whether the registry is, or just was, unreachable from this process
            (:meth:`comm.registry.keepalive.KeepAlive.in_doubt` of a lease it keeps).
        what: names the holder in :attr:`reason` ("the coordinator").

    Attributes:
        gone: set once the holder is gone; :attr:`reason` says how.
    """

    def __init__(self, registry: Registry, key: str, *, in_doubt: Callable[[], bool],
                 what: str = "the coordinator", poll: timedelta = FOLLOW_POLL) -> None:
        self.key = key
        self.what = what
        self.gone = threading.Event()
        self.reason = ""
        self._follower = Follower(registry, key, in_doubt=in_doubt, exact=True)
        self._poll = poll
        self._card: PresenceCard | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="presence-monitor", daemon=True)

    @property
    def present(self) -> PresenceCard | None:
        """The holder's card while it is present (None: waiting or gone)."""
        card = self._card
        return None if card is None or card.closed else card

    def start(self) -> PresenceMonitor:
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following: the follower's long poll ends at once ([Note: a follower's long poll] in
        ``comm/registry/follow.py``). Idempotent."""
        self._stop.set()
        self._follower.close()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)

    def _run(self) -> None:
        try:
            while not self._stop.is_set() and not self.gone.is_set():
                for change in self._follower.poll(self._poll):
                    self._on(change)
        finally:
            self._follower.close()

    def _on(self, change: Change) -> None:
        if change.value is not None:
            try:
                card = unpack(change.value, PresenceCard, what=f"the presence card at {self.key}")
            except ProtocolError as exc:
                log.warning("ignoring %s: %s", self.key, exc)
                return
            if self.present is None and not card.closed:
                log.info("%s is present (pid %d on %s)", self.what, card.pid, card.host)
            self._card = card
            return
        previous, self._card = self._card, None
        if previous is None or previous.closed:
            return  # it finished: wait for the next one
        how = (f"it vanished when the registry came back and was not published again within "
               f"{OUTAGE_GRACE.total_seconds():.0f}s" if change.after_outage
               else "its lease lapsed while the registry answers")
        self.reason = (f"{self.what} (pid {previous.pid} on {previous.host}) is gone: its presence "
                       f"{self.key} vanished ({how})")
        self.gone.set()
