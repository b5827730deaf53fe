"""Rendezvous and liveness: how the ranks of a communicator find each other and notice who is gone.

Each rank puts ``{prefix}/members/{rank}`` (a msgpack map: its addresses and pid),
attached to a lease it keeps alive from a daemon thread. The key is both the rank's
address card and its pulse: when the process dies or freezes, the lease lapses, the
key vanishes, and every other rank's watch sees the DELETE. A rank that closes its
communicator cleanly first rewrites its card with ``"closed": True``, so peers can
tell "left" from "lost".

The prefix must be fresh for every new communicator (a job generation, a group
name): a rendezvous never reads keys of an older one.

The data plane never needs the registry once the ranks met, so a registry outage must not
end it: the lease is kept through the outage and the card published again if the outage
cost it, and a peer's card that vanishes then is a loss only if it is not back within the
outage grace ([Note: registry outages] in ``comm/registry/keepalive.py``).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import Any

import msgpack

from comm.errors import PeerLostError, RegistryError
from comm.registry.base import Lease, Registry
from comm.registry.follow import FOLLOW_POLL, Change, Follower
from comm.registry.keepalive import KeepAlive

__all__ = ["DEFAULT_LIVENESS_TTL", "Rendezvous"]

log = logging.getLogger(__name__)

DEFAULT_LIVENESS_TTL = timedelta(seconds=10)


class Rendezvous:
    """Publishes this rank's card, gathers everyone's, and tracks which ranks were lost.

    Args:
        registry: where the cards live.
        prefix: this communicator's fresh key prefix.
        rank, world_size: this rank and the group size.
        liveness_ttl: lease time of the card; a peer that stops renewing is declared lost
            after at most this long (etcd rounds it up to 2 s).
    """

    def __init__(
        self,
        registry: Registry,
        prefix: str,
        rank: int,
        world_size: int,
        *,
        liveness_ttl: timedelta = DEFAULT_LIVENESS_TTL,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside 0..{world_size - 1} (world_size={world_size})")
        self.registry = registry
        self.prefix = prefix.rstrip("/")
        self.rank = rank
        self.world_size = world_size
        self._card: dict[str, Any] = {}
        self._ttl = liveness_ttl
        self._publishing = threading.Lock()  # publish() and the keepalive's renewal put the same card
        self._keepalive = KeepAlive(registry.lease(liveness_ttl), renew=self._renew,
                                    what=f"rank {rank}'s card under {self.prefix}")
        self._lost: dict[int, str] = {}  # rank -> "lost" | "closed"
        self._closed_cards: set[int] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None
        self._follower: Follower | None = None
        self._loss_listeners: list[Callable[[], None]] = []

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/members/{rank}"

    def publish(self, card: dict[str, Any]) -> None:
        """Put this rank's card (addresses etc.) under its liveness lease."""
        with self._publishing:
            self._card = dict(card, pid=os.getpid(), rank=self.rank)
            self.registry.put(self._key(self.rank), _pack(self._card), lease=self._keepalive.lease)

    def _renew(self) -> Lease:
        """A new lease, and the card put again with it (the registry lost the old one in an outage)."""
        with self._publishing:
            lease = self.registry.lease(self._ttl)
            if self._card:
                self.registry.put(self._key(self.rank), _pack(self._card), lease=lease)
            return lease

    def gather(self, timeout: timedelta) -> list[dict[str, Any]]:
        """Wait until every rank published its card; return the cards in rank order.

        Raises:
            RegistryTimeoutError: naming the ranks that did not publish within ``timeout``.
        """
        members = f"{self.prefix}/members/"
        start_revision = self.registry.revision()
        try:
            items = self.registry.wait_for(
                members,
                lambda kvs: len(kvs) >= self.world_size,
                timeout=timeout,
                what=f"{self.world_size} ranks to join (this is rank {self.rank})",
            )
        except RegistryError as exc:
            present = {int(kv.key.rsplit("/", 1)[1]) for kv in self.registry.list(members)}
            missing = sorted(set(range(self.world_size)) - present)
            raise type(exc)(f"{exc}; missing ranks: {missing}") from None
        cards: dict[int, dict[str, Any]] = {}
        for kv in items:
            card = _unpack(kv.value)
            cards[int(card["rank"])] = card
        known = {kv.key: kv.value for kv in items}
        self._start_watch(known, min(start_revision, max(kv.revision for kv in items)))
        return [cards[r] for r in range(self.world_size)]

    # -- liveness -------------------------------------------------------------------

    def _start_watch(self, known: dict[str, bytes], start_revision: int) -> None:
        self._watcher = threading.Thread(
            target=self._watch, args=(known, start_revision), name=f"liveness-{self.rank}", daemon=True
        )
        self._watcher.start()

    def _watch(self, known: dict[str, bytes], start_revision: int) -> None:
        members = f"{self.prefix}/members/"
        follower = self._follower = Follower(self.registry, members, in_doubt=self._keepalive.in_doubt)
        try:
            follower.begin(known, start_revision)
        except Exception as exc:  # the registry went away just now: the follower lists again when it answers
            log.debug("[rank %d] liveness watch on %s could not start yet: %s", self.rank, members, exc)
        try:
            while not self._stop.is_set():  # close() closes the follower: a long poll ends at once
                for change in follower.poll(FOLLOW_POLL):
                    self._on_change(change)
        finally:
            follower.close()

    def _on_change(self, change: Change) -> None:
        try:
            rank = int(change.key.rsplit("/", 1)[1])
            card = None if change.value is None else _unpack(change.value)
        except (ValueError, RegistryError):
            return
        with self._lock:
            if card is not None:
                if card.get("closed"):
                    self._closed_cards.add(rank)
                return
            if rank == self.rank or rank in self._lost:
                return
            how = "closed" if rank in self._closed_cards else "lost"
            self._lost[rank] = how
            listeners = list(self._loss_listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:  # a listener's bug must not stop the watch
                log.exception("[rank %d] a loss listener failed", self.rank)
        if how == "lost":
            after = " (it vanished in a registry outage and did not come back)" if change.after_outage else ""
            log.warning("[rank %d] peer rank %d lost its liveness lease%s", self.rank, rank, after)

    def on_loss(self, listener: Callable[[], None]) -> None:
        """Call ``listener`` (on the watch thread; it must not block) each time a rank is found gone, after
        :meth:`lost` shows it: a thread blocked on a peer wakes to look (``comm/zmq/transport.py``)."""
        with self._lock:
            self._loss_listeners.append(listener)

    def lost(self) -> dict[int, str]:
        """Ranks that are gone: ``{rank: "lost" | "closed"}``."""
        with self._lock:
            return dict(self._lost)

    def check(self, ranks: Iterable[int], op: str) -> None:
        """Raise :class:`PeerLostError` if any of ``ranks`` is gone."""
        gone = self.lost()
        if not gone:
            return
        for r in ranks:
            if r in gone:
                raise PeerLostError(self.describe_loss(r, op), op=op.split("(", 1)[0], peer=r)

    def describe_loss(self, rank: int, op: str) -> str:
        how = self.lost().get(rank, "lost")
        reason = (
            "closed its communicator"
            if how == "closed"
            else "is gone (its liveness lease lapsed: the process died or is frozen)"
        )
        return f"{op} on rank {self.rank}: peer rank {rank} {reason}"

    def wait_for_loss(self, ranks: Iterable[int], within: timedelta) -> int | None:
        """After a backend error, wait up to ``within`` for one of ``ranks`` to be declared lost."""
        wanted = set(ranks)
        deadline = time.monotonic() + within.total_seconds()
        while True:
            gone = [r for r in self.lost() if r in wanted]
            if gone:
                return min(gone)
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.02)

    @property
    def liveness_ttl(self) -> timedelta:
        return self._keepalive.lease.ttl

    def close(self) -> None:
        """Mark this rank's card closed, stop renewing and revoke the lease. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        try:
            with self._publishing:
                if self._card:
                    self._card["closed"] = True
                    self.registry.put(self._key(self.rank), _pack(self._card), lease=self._keepalive.lease)
        except Exception:  # the registry may be gone at shutdown; the lease lapses anyway
            log.debug("[rank %d] could not mark card closed", self.rank, exc_info=True)
        self._keepalive.stop(revoke=True)
        if self._follower is not None:
            self._follower.close()  # ends the watcher's long poll ([Note: a follower's long poll])
        if self._watcher is not None:
            self._watcher.join(timeout=2)


def _pack(card: dict[str, Any]) -> bytes:
    data = msgpack.packb(card, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _unpack(data: bytes) -> dict[str, Any]:
    card = msgpack.unpackb(data, raw=False)
    if not isinstance(card, dict):
        raise RegistryError(f"rendezvous card is not a map: {card!r}")
    return card
