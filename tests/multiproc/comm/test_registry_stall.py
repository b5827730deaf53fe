"""A served registry whose process stalls keeps the leases its holders refreshed in time.

The rank process holds a lease of 2 s through the test process's registry server; the test process
then holds the GIL for 3.5 s (a C call through ``ctypes.PyDLL``, which does not release it), so the
holder's refreshes wait unread in the server's socket past the lease's deadline. The lease must
survive: see [Note: leases of a stalled server] in ``comm/registry/memory.py``. Once the holder stops
refreshing, the lease still lapses on time.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta

import pytest

from comm.registry.base import EventType
from tests.harness.procs import RankGroup

pytestmark = pytest.mark.timeout(60)

TTL_S = 2.0
STALL_S = 3.5
KEY = "/stall/holder"


def _hold_the_gil(seconds: float) -> None:
    """Block every thread of this process for ``seconds``: libc's usleep called with the GIL held."""
    ctypes.PyDLL(None).usleep(int(seconds * 1e6))


def _wait_for_key(group: RankGroup, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while group.registry.get(KEY) is None:
        assert time.monotonic() < deadline, f"the rank did not put {KEY} within {timeout}s"
        time.sleep(0.02)


def test_a_stalled_server_lets_no_lease_refreshed_in_time_lapse() -> None:
    with RankGroup(world_size=1, backend="zmq") as group:
        start = group.registry.revision() + 1
        pending = group.submit("tests.multiproc.comm.lease_checks:hold_lease", url=group.registry_address,
                               key=KEY, ttl_s=TTL_S, hold_s=STALL_S + 2.0)
        _wait_for_key(group, timeout=20)
        time.sleep(TTL_S / 2)  # a refresh or two answered before the stall
        stalled_at = time.monotonic()
        _hold_the_gil(STALL_S)
        assert time.monotonic() - stalled_at >= STALL_S  # every thread here was held, the server's too
        [held] = group.collect(pending, timeout=timedelta(seconds=30))
        stopped = time.monotonic()  # the holder refreshes no more: its lease lapses within TTL_S
        assert held == {"lost": False, "renewals": 0, "lease": held["lease"]}, held
        events, _ = group.registry.events_since(KEY, start, timeout=timedelta(0))
        assert [e.type for e in events] == [EventType.PUT], events  # never deleted during the stall
        with group.registry.watch(KEY, start_revision=group.registry.revision() + 1) as watch:
            event = watch.get(timedelta(seconds=TTL_S + 5))
        assert event is not None and event.type == EventType.DELETE, event
        assert time.monotonic() - stopped < TTL_S + 0.5, "a lapsed lease waited for the idle server"
