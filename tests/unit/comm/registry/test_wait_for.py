"""``Registry.wait_for``: the listing kept by the watch's events, and listed afresh only after quiet spells
that grow (a large group's ranks waiting on one registry listed it every half second each)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest

from comm.errors import RegistryTimeoutError
from comm.registry import MemoryRegistry
from comm.registry.base import QUIET_RELIST_MAX_S, QUIET_RELIST_S
from tests.harness.spies import record_calls

PREFIX = "/cellmesh/t/members/"


def test_a_quiet_wait_lists_again_after_spells_that_double(monkeypatch: pytest.MonkeyPatch) -> None:
    with MemoryRegistry() as registry:
        registry.put(PREFIX + "0", b"card")
        lists = record_calls(monkeypatch, registry, "list")
        wait = 3.2  # quiet spells of 0.5, 1 and 2 s: three listings after the first two
        with pytest.raises(RegistryTimeoutError, match="2 ranks"):
            registry.wait_for(PREFIX, lambda kvs: len(kvs) >= 2, timeout=timedelta(seconds=wait),
                              what="2 ranks")
        spells, total = 0, 0.0
        while total < wait:
            total += min(QUIET_RELIST_S * 2**spells, QUIET_RELIST_MAX_S)
            spells += 1
        assert len(lists) <= 2 + spells, lists  # a listing every half second would be 2 + 6
        assert len(lists) >= 3  # it does list again: a watch that lost events cannot hold it up


def test_the_events_complete_the_listing_without_listing_again() -> None:
    with MemoryRegistry() as registry:
        registry.put(PREFIX + "0", b"card")
        timer = threading.Timer(0.2, lambda: registry.put(PREFIX + "1", b"card"))
        timer.start()
        try:
            got = registry.wait_for(PREFIX, lambda kvs: len(kvs) >= 2, timeout=timedelta(seconds=10),
                                    what="2 ranks")
        finally:
            timer.join()
        assert [kv.key for kv in got] == [PREFIX + "0", PREFIX + "1"]
