"""KeepAlive through registry outages: it never gives up, renews a lease the outage cost, and says
how long the registry has been silent (and never mistakes a frozen holder for an outage)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest

from comm.registry import KeepAlive, Lease, MemoryRegistry, Registry
from tests.unit.comm.registry.flaky import FlakyRegistry, wait_until

TTL = timedelta(milliseconds=600)
KEY = "/cellmesh/t/workers/w"


def renewer(registry: Registry, value: bytes = b"card") -> Callable[[], Lease]:
    """What a holder does when its lease is gone: a new lease, the same key and value put with it."""

    def renew() -> Lease:
        lease = registry.lease(TTL)
        registry.put(KEY, value, lease=lease)
        return lease

    return renew


@pytest.fixture
def flaky() -> Iterator[FlakyRegistry]:
    registry = FlakyRegistry()
    yield registry
    registry.close()


def test_an_outage_longer_than_the_lease_ends_with_the_card_published_again(flaky: FlakyRegistry) -> None:
    lease = flaky.lease(TTL)
    flaky.put(KEY, b"card", lease=lease)
    keeper = KeepAlive(lease, renew=renewer(flaky))
    try:
        flaky.down.set()
        went_down = time.monotonic()
        wait_until(lambda: flaky.inner.get(KEY) is None, 3, "the lease lapsing in the store")
        time.sleep(0.3)
        silent = keeper.unreachable_for()
        # counted from the last answer: at most one interval before the outage began
        assert TTL.total_seconds() < silent <= time.monotonic() - went_down + keeper.interval + 0.05, silent
        assert keeper.in_doubt() and keeper.renewals == 0 and not keeper.lost.is_set()

        flaky.down.clear()
        back = wait_until(lambda: flaky.inner.get(KEY) is not None, 3, "the card coming back")
        assert back < 1.0, back  # the next retry (<= 0.5 s) finds the lease gone and renews at once
        kv = flaky.inner.get(KEY)
        assert kv is not None and kv.value == b"card"
        assert keeper.renewals == 1 and keeper.lease.id != lease.id and not keeper.lost.is_set()
        assert keeper.unreachable_for() == 0.0
        assert keeper.in_doubt() and not keeper.in_doubt(within=timedelta(0))  # the outage was just now

        time.sleep(3 * TTL.total_seconds())  # and it is kept again
        assert flaky.inner.get(KEY) is not None and keeper.renewals == 1
    finally:
        keeper.stop(revoke=True)
    assert flaky.inner.get(KEY) is None  # the renewed lease is the one revoked


def test_an_outage_shorter_than_the_lease_costs_nothing(flaky: FlakyRegistry) -> None:
    lease = flaky.lease(timedelta(seconds=3))
    flaky.put(KEY, b"card", lease=lease)
    keeper = KeepAlive(lease, renew=renewer(flaky))
    try:
        flaky.down.set()
        time.sleep(1.5)
        assert keeper.unreachable_for() > 0.5 and keeper.in_doubt()
        flaky.down.clear()
        wait_until(lambda: keeper.unreachable_for() == 0.0, 2, "the registry answering again")
        assert keeper.renewals == 0 and keeper.lease.id == lease.id and flaky.inner.get(KEY) is not None
    finally:
        keeper.stop(revoke=True)


def test_without_renew_a_lease_the_outage_cost_is_lost(flaky: FlakyRegistry) -> None:
    lease = flaky.lease(TTL)
    flaky.put(KEY, b"card", lease=lease)
    keeper = KeepAlive(lease)
    try:
        flaky.down.set()
        time.sleep(1.0)
        assert not keeper.lost.is_set()  # silence alone is no verdict: the registry may come back
        flaky.down.clear()
        assert keeper.lost.wait(2)
        assert flaky.inner.get(KEY) is None
    finally:
        keeper.stop()


def test_a_frozen_holder_renews_without_reading_as_an_outage() -> None:
    """A holder that did not run for longer than its lease (frozen, swapped out) finds the lease gone
    at once when it resumes: the registry answered, so it was never unreachable."""
    with MemoryRegistry() as registry:
        lease = registry.lease(TTL)
        registry.put(KEY, b"card", lease=lease)
        keeper = KeepAlive(lease, renew=renewer(registry), interval=timedelta(seconds=1))  # 1 s > TTL
        try:
            silences = []
            deadline = time.monotonic() + 1.5
            while time.monotonic() < deadline:
                silences.append(keeper.unreachable_for())
                time.sleep(0.01)
            assert max(silences) == 0.0
            assert keeper.renewals == 1 and registry.get(KEY) is not None
            assert keeper.in_doubt()  # the lease was lost: its keys vanished and came back
        finally:
            keeper.stop(revoke=True)


class _SlowLease(Lease):
    """A lease whose registry takes ``delay`` to answer each refresh."""

    def __init__(self, delay: float) -> None:
        super().__init__(7, timedelta(seconds=30))
        self.delay = delay

    def refresh(self) -> None:
        time.sleep(self.delay)

    def revoke(self) -> None:
        pass


def _hold_gil(seconds: float) -> None:
    """Hold the GIL for at least about ``seconds`` in one C call (``sum`` over a range never lets it go),
    its length from the quickest of a few short sums (one slowed by a busy machine would make it short)."""
    quickest = math.inf
    for _ in range(5):
        started = time.perf_counter()
        sum(range(200_000))
        quickest = min(quickest, time.perf_counter() - started)
    sum(range(int(200_000 / max(quickest, 1e-6) * seconds)))


def _delays(caplog: pytest.LogCaptureFixture, kind: str) -> list[float]:
    """The delays named by the keepalive's lines of ``kind`` ("late": the thread ran late; "took": slow)."""
    lines = [r.getMessage() for r in caplog.records]
    if kind == "late":
        return [float(line.split(" ran ")[1].split("s late")[0]) for line in lines if " ran " in line]
    return [float(line.split(" took ")[1].split("s ")[0]) for line in lines if "a refresh took" in line]


def test_a_refresh_held_back_by_the_gil_or_a_slow_registry_is_logged_with_its_delay(
        caplog: pytest.LogCaptureFixture) -> None:
    """A healthy holder whose lease could lapse says why in its log, with the delay: the refresh ran
    late (a long GIL hold in the process, a starved CPU) or took long (the registry, or the same
    hold falling while the refresh was on its way). On a loaded machine the thread may also run a
    little late by itself: only a line naming at least the hold's delay counts."""
    caplog.set_level("WARNING", logger="comm.registry.keepalive")
    keeper = KeepAlive(_SlowLease(0.0), interval=timedelta(milliseconds=200), what="the test's card")
    try:
        time.sleep(0.3)
        _hold_gil(1.5)  # the line must name at least 0.5 s: a margin for a hold that ran quicker than timed
        wait_until(lambda: max(_delays(caplog, "late") + _delays(caplog, "took"), default=0.0) > 0.5, 5,
                   "the held-back refresh's line")
    finally:
        keeper.stop()
    line = next(r.getMessage() for r in caplog.records if "GIL" in r.getMessage())
    assert "the test's card" in line, line
    assert max(_delays(caplog, "late") + _delays(caplog, "took")) < 10.0

    caplog.clear()
    keeper = KeepAlive(_SlowLease(0.6), interval=timedelta(milliseconds=200), what="the test's card")
    try:
        wait_until(lambda: bool(_delays(caplog, "took")), 5, "the slow answer's line")
    finally:
        keeper.stop()
    line = next(r.getMessage() for r in caplog.records if "a refresh took" in r.getMessage())
    assert "registry answered slowly" in line and "the test's card" in line, line
    assert 0.6 <= _delays(caplog, "took")[0] < 10.0, line
