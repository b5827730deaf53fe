"""Presence and PresenceMonitor: a follower waits for the holder, tells "closed" from "died", and does
not take an outage that cost the holder its lease for a death."""

from __future__ import annotations

import os
import time
from datetime import timedelta

from comm.codec import pack, unpack
from comm.registry import KeepAlive, MemoryRegistry, Presence, PresenceMonitor
from comm.registry.presence import PresenceCard
from tests.unit.comm.registry.flaky import FlakyRegistry, wait_until

KEY = "/cellmesh/t/coordinator"
TTL = timedelta(milliseconds=600)


def never() -> bool:
    return False


def test_a_monitor_waits_for_the_holder_and_a_closed_holder_is_not_gone() -> None:
    with MemoryRegistry() as registry:
        monitor = PresenceMonitor(registry, KEY, in_doubt=never).start()
        presence = Presence(registry, KEY, TTL)
        try:
            time.sleep(0.3)
            assert monitor.present is None and not monitor.gone.is_set()  # waiting, not gone
            presence.start()
            wait_until(lambda: monitor.present is not None, 2, "the holder showing")
            card = monitor.present
            assert card is not None and card.pid == os.getpid() and card.ttl_ms == 600 and not card.closed
            presence.close()
            assert registry.get(KEY) is None  # marked closed, then revoked
            wait_until(lambda: monitor.present is None, 2, "the holder leaving")
            time.sleep(2 * TTL.total_seconds())
            assert not monitor.gone.is_set()  # it finished: the monitor waits for the next one
            successor = Presence(registry, KEY, TTL).start()
            wait_until(lambda: monitor.present is not None, 2, "the next holder showing")
            successor.close()
        finally:
            monitor.close()


def test_a_holder_that_dies_is_gone_when_its_lease_lapses() -> None:
    with MemoryRegistry() as registry:
        monitor = PresenceMonitor(registry, KEY, in_doubt=never).start()
        try:
            granted = time.monotonic()  # the lease runs from its grant, a moment before the put returns
            lease = registry.lease(TTL)  # a holder that publishes, then dies (nobody refreshes)
            card = PresenceCard(pid=4242, host="elsewhere", token="t", ttl_ms=600)
            registry.put(KEY, pack(card), lease=lease)
            assert monitor.gone.wait(3)
            late = time.monotonic() - granted - TTL.total_seconds()
            assert 0 <= late <= 0.4, late  # the lapse is immediate; the monitor polls every 0.25 s
            assert "pid 4242 on elsewhere" in monitor.reason and "lease lapsed" in monitor.reason
        finally:
            monitor.close()


def test_an_outage_that_costs_the_holder_its_lease_is_not_a_death() -> None:
    """Holder and follower share one registry that goes down for longer than the lease: the
    presence lapses in the store, comes back when the holder publishes again, and the
    follower (in doubt, as its own lease's keepalive says) never declares it gone."""
    flaky = FlakyRegistry()
    presence = Presence(flaky, KEY, TTL).start()
    own = flaky.lease(TTL)  # the follower's own lease (a worker's card), whose keepalive judges the registry
    keeper = KeepAlive(own)
    monitor = PresenceMonitor(flaky, KEY, in_doubt=keeper.in_doubt).start()
    try:
        wait_until(lambda: monitor.present is not None, 2, "the holder showing")
        published = flaky.inner.get(KEY)
        assert published is not None
        token = unpack(published.value, PresenceCard).token
        flaky.down.set()
        wait_until(lambda: flaky.inner.get(KEY) is None, 3, "the presence lapsing in the store")
        time.sleep(0.3)
        flaky.down.clear()
        wait_until(lambda: flaky.inner.get(KEY) is not None, 3, "the holder publishing again")
        time.sleep(1.0)
        assert not monitor.gone.is_set(), monitor.reason
        card = monitor.present
        assert card is not None and card.token == token
    finally:
        monitor.close()
        keeper.stop()
        presence.close()
        flaky.close()
