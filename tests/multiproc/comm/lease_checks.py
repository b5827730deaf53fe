"""Lease holders run inside rank processes (``tests.harness.procs.RankGroup`` commands)."""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from comm import auth
from comm.base import Communicator
from comm.registry.keepalive import KeepAlive
from comm.registry.remote import RemoteRegistry


def hold_lease(comm: Communicator, *, url: str, key: str, ttl_s: float, hold_s: float,
               keys_dir: str | None = None) -> dict[str, Any]:
    """Put ``key`` under a lease of ``ttl_s`` and keep it alive for ``hold_s``; then stop refreshing
    (no revoke: the lease lapses on its own). Returns whether the registry ever said it was gone.
    ``keys_dir``: the job's keys, spoken with as a worker (the registry authenticates each connection)."""
    if keys_dir is not None:  # the sockets made from now on (the registry's): the rank's own were made before
        auth.install(auth.load_credentials(Path(keys_dir), "worker"))
    try:
        return _hold(url, key, ttl_s, hold_s)
    finally:
        auth.install(None)


def _hold(url: str, key: str, ttl_s: float, hold_s: float) -> dict[str, Any]:
    registry = RemoteRegistry(url, request_timeout=timedelta(seconds=10))
    try:
        lease = registry.lease(timedelta(seconds=ttl_s))
        registry.put(key, b"held", lease=lease)
        keeper = KeepAlive(lease, what=key)
        try:
            time.sleep(hold_s)
        finally:
            keeper.stop()
        return {"lost": keeper.lost.is_set(), "renewals": keeper.renewals, "lease": lease.id}
    finally:
        registry.close()
