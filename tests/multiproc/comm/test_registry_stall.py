"""A served registry whose process stalls keeps the leases its holders refreshed in time.

The rank process holds a lease of 2 s through the test process's registry server; the test process
then holds the GIL for 3.5 s (a C call through ``ctypes.PyDLL``, which does not release it), so the
holder's refreshes wait unread in the server's socket past the lease's deadline. The lease must
survive: see [Note: leases of a stalled server] in ``comm/registry/memory.py``. Once the holder stops
refreshing, the lease still lapses on time.

The guard sees only refreshes that were sent: a holder whose refresh waited behind its own call in
flight (one client, calls serialized) would send it after the stall, past the deadline. So a remote
registry refreshes on a client of its own.
"""

from __future__ import annotations

import ctypes
import time
from datetime import timedelta
from pathlib import Path

import pytest

from comm import auth
from comm.auth import Credentials, JobKeys
from comm.registry import KeepAlive, MemoryRegistry
from comm.registry.base import EventType, KeyValue
from comm.registry.remote import RemoteRegistry
from comm.registry.server import RegistryServer
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


class _SlowGets(MemoryRegistry):
    """A registry whose ``get`` of :data:`SLOW_KEY` takes :data:`SLOW_S`: the serving host's thread is
    held meanwhile, as a stalled coordinator's would be, and every request behind it waits unread."""

    def get(self, key: str) -> KeyValue | None:
        if key == SLOW_KEY:
            time.sleep(SLOW_S)
        return super().get(key)


SLOW_KEY, SLOW_S, SHORT_TTL = "/stall/slow", 1.5, timedelta(milliseconds=600)


def test_a_refresh_never_waits_behind_another_call_of_its_holder() -> None:
    """The holder's other thread has a call in flight past the lease's deadline; the refresh is sent
    meanwhile (a client of its own), so the server reads it in time and the lease is kept."""
    with RegistryServer(_SlowGets(), host="127.0.0.1") as server:
        client = RemoteRegistry(server.address, request_timeout=timedelta(seconds=10))
        try:
            lease = client.lease(SHORT_TTL)
            client.put(KEY, b"card", lease=lease)
            start = server.registry.revision() + 1
            keeper = KeepAlive(lease)
            try:
                time.sleep(SHORT_TTL.total_seconds() / 2)
                began = time.monotonic()
                assert client.get(SLOW_KEY) is None
                assert time.monotonic() - began >= SLOW_S  # > 2 TTLs with the server's thread held
                time.sleep(SHORT_TTL.total_seconds())  # and a refresh after it
                assert not keeper.lost.is_set()
                kv = server.registry.get(KEY)
                assert kv is not None and kv.value == b"card"
                events, _ = server.registry.events_since(KEY, start, timeout=timedelta(0))
                assert events == [], events  # never deleted
            finally:
                keeper.stop(revoke=True)
        finally:
            client.close()


def test_a_lease_granted_with_keys_survives_a_stall_right_after_its_grant(tmp_path: Path) -> None:
    """With the job's keys, each new connection waits for the serving process's ZAP handler, a thread that
    stalls with it. A lease whose refreshes opened a connection of their own after the grant sent none
    through a stall that began before the first refresh (it waited in the handshake, where the server's
    guard cannot see it), so the lease lapsed although its holder refreshed in time; a remote registry
    grants a lease on the connection its refreshes then use."""
    keys = JobKeys.generate()
    keys.for_workers().save(tmp_path / "keys")
    with RankGroup(world_size=1, backend="zmq") as group:
        auth.install(Credentials(keys, "coordinator"))
        try:
            with RegistryServer() as server:
                pending = group.submit("tests.multiproc.comm.lease_checks:hold_lease", url=server.address,
                                       key=KEY, ttl_s=TTL_S, hold_s=STALL_S + 2.0,
                                       keys_dir=str(tmp_path / "keys"))
                deadline = time.monotonic() + 20
                while server.registry.get(KEY) is None:  # granted and put: the first refresh is due in TTL/3
                    assert time.monotonic() < deadline, f"the rank did not put {KEY} within 20s"
                    time.sleep(0.01)
                _hold_the_gil(STALL_S)  # the ZAP handler with every other thread here
                [held] = group.collect(pending, timeout=timedelta(seconds=30))
                assert held == {"lost": False, "renewals": 0, "lease": held["lease"]}, held
        finally:
            auth.install(None)
