"""Follower: the real changes under a prefix, with an outage's deletions held until they are clearly real."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from comm.registry import Change, Follower
from tests.unit.comm.registry.flaky import FlakyRegistry

PREFIX = "/cellmesh/t/workers/"
GRACE = timedelta(milliseconds=400)
POLL = timedelta(milliseconds=20)


class Doubt:
    """The caller's view of the registry, set by the test."""

    def __init__(self) -> None:
        self.flag = threading.Event()

    def __call__(self) -> bool:
        return self.flag.is_set()


def summary(changes: list[Change]) -> list[tuple[str, bytes | None, bytes | None, bool]]:
    return [(c.key.removeprefix(PREFIX), c.value, c.previous, c.after_outage) for c in changes]


def collect(follower: Follower, seconds: float) -> list[Change]:
    changes: list[Change] = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        changes += follower.poll(POLL)
    return changes


@pytest.fixture
def flaky() -> Iterator[FlakyRegistry]:
    registry = FlakyRegistry()
    yield registry
    registry.close()


@pytest.fixture
def doubt() -> Doubt:
    return Doubt()


@pytest.fixture
def follower(flaky: FlakyRegistry, doubt: Doubt) -> Iterator[Follower]:
    flaky.put(PREFIX + "a", b"1")
    follower = Follower(flaky, PREFIX, in_doubt=doubt, grace=GRACE)
    assert follower.begin_now() == {PREFIX + "a": b"1"}
    yield follower
    follower.close()


def test_changes_are_reported_and_a_value_put_again_is_not(flaky: FlakyRegistry, follower: Follower) -> None:
    flaky.put(PREFIX + "b", b"1")
    flaky.put(PREFIX + "a", b"1")  # the same value again: a holder publishing again
    flaky.put(PREFIX + "a", b"2")
    flaky.put("/cellmesh/t/other", b"x")  # not under the prefix
    assert flaky.delete(PREFIX + "b")
    assert summary(collect(follower, 0.3)) == [("b", b"1", None, False), ("a", b"2", b"1", False),
                                               ("b", None, b"1", False)]


def test_a_deletion_in_doubt_is_held_and_dropped_when_the_key_comes_back(
        flaky: FlakyRegistry, doubt: Doubt, follower: Follower) -> None:
    doubt.flag.set()
    assert flaky.delete(PREFIX + "a")
    assert collect(follower, 0.1) == []
    assert follower.values == {PREFIX + "a": b"1"}  # still known while held
    flaky.put(PREFIX + "a", b"1")  # published again with the value it had
    assert collect(follower, 2 * GRACE.total_seconds()) == []


def test_a_deletion_in_doubt_that_does_not_come_back_is_reported_after_the_grace(
        flaky: FlakyRegistry, doubt: Doubt, follower: Follower) -> None:
    doubt.flag.set()
    assert flaky.delete(PREFIX + "a")
    start = time.monotonic()
    changes: list[Change] = []
    while not changes and time.monotonic() - start < 3:
        changes = follower.poll(POLL)
    late = time.monotonic() - start
    assert summary(changes) == [("a", None, b"1", True)]
    assert GRACE.total_seconds() <= late <= GRACE.total_seconds() + 0.2, late


def test_a_failed_watch_lists_again_and_reports_the_difference(
        flaky: FlakyRegistry, follower: Follower) -> None:
    flaky.put(PREFIX + "b", b"1")
    assert summary(collect(follower, 0.1)) == [("b", b"1", None, False)]
    flaky.down.set()
    assert collect(follower, 0.2) == []  # no answer: nothing to report, nothing raised
    flaky.inner.delete(PREFIX + "a")  # meanwhile, in the store
    flaky.inner.put(PREFIX + "b", b"2")
    flaky.inner.put(PREFIX + "c", b"1")
    flaky.down.clear()
    changes = collect(follower, 0.2)
    assert summary(changes) == [("b", b"2", b"1", False), ("c", b"1", None, False)]
    # "a" vanished while the follower could not see: held as an outage's deletion, then reported
    assert summary(collect(follower, GRACE.total_seconds() + 0.3)) == [("a", None, b"1", True)]


def test_a_key_back_after_a_failed_watch_is_no_change(flaky: FlakyRegistry, follower: Follower) -> None:
    flaky.down.set()
    assert collect(follower, 0.2) == []
    flaky.inner.delete(PREFIX + "a")
    flaky.inner.put(PREFIX + "a", b"1")
    flaky.down.clear()
    assert collect(follower, GRACE.total_seconds() + 0.3) == []
