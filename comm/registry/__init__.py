"""Discovery: the Registry contract and its backends (embedded, served embedded, etcd).

* :class:`MemoryRegistry` — in-process, thread-safe; what the coordinator serves.
* :class:`RegistryServer` / :class:`RemoteRegistry` — the embedded registry served over
  ZeroMQ to the other local processes, and its client.
* :class:`EtcdRegistry` — etcd through the ``etcd3`` package (what a cluster uses).

Holding and following keys through outages: :class:`KeepAlive` (``keepalive.py``, with
[Note: registry outages]), :class:`Follower` (``follow.py``), and a process's presence,
:class:`Presence` / :class:`PresenceMonitor` (``presence.py``).

:func:`connect_registry` picks the backend from a URL, so a worker needs only the
address it was given::

    connect_registry("memory://")               # a new in-process MemoryRegistry
    connect_registry("tcp://127.0.0.1:5555")    # a RegistryServer's address
    connect_registry("etcd://10.0.0.7:2379")    # an etcd cluster member
    connect_registry("etcd://etcd:2379?ca=/certs/ca.pem&cert=/certs/c.pem&key=/certs/c.key")  # over TLS

An etcd URL's options (TLS files, a user whose password comes from the environment) are
``comm/registry/etcd_options.py``'s.
"""

from __future__ import annotations

from datetime import timedelta
from urllib.parse import urlsplit

from comm.registry.base import (
    DEFAULT_REGISTRY_TIMEOUT,
    EventType,
    KeyValue,
    Lease,
    Registry,
    Watch,
    WatchEvent,
)
from comm.registry.etcd_options import etcd_options
from comm.registry.follow import Change, Follower
from comm.registry.keepalive import OUTAGE_GRACE, KeepAlive
from comm.registry.memory import MemoryRegistry
from comm.registry.presence import Presence, PresenceMonitor
from comm.registry.remote import DEFAULT_REQUEST_TIMEOUT, RemoteRegistry
from comm.registry.server import RegistryServer

__all__ = [
    "DEFAULT_REGISTRY_TIMEOUT",
    "DEFAULT_REQUEST_TIMEOUT",
    "OUTAGE_GRACE",
    "SCHEMES",
    "Change",
    "EventType",
    "Follower",
    "KeepAlive",
    "KeyValue",
    "Lease",
    "MemoryRegistry",
    "Presence",
    "PresenceMonitor",
    "Registry",
    "RegistryServer",
    "RemoteRegistry",
    "Watch",
    "WatchEvent",
    "connect_registry",
    "follows_presence",
]

SCHEMES = ("memory", "tcp", "etcd")
_ETCD_DEFAULT_PORT = 2379


def connect_registry(url: str, *, request_timeout: timedelta = DEFAULT_REQUEST_TIMEOUT) -> Registry:
    """The registry named by ``url``.

    Args:
        url: ``memory://`` (a new, empty in-process registry), ``tcp://host:port`` (a
            :class:`RegistryServer`) or ``etcd://host[:port][?ca=...&cert=...&key=...&user=...]``
            (port 2379 by default; options: :mod:`comm.registry.etcd_options`).

    Keyword Args:
        request_timeout: the bound on each request of the remote backends (default 10 s).

    Connecting does not block: the remote backends connect lazily, so an unreachable
    server shows as :class:`comm.errors.RegistryTimeoutError` on the first call.

    Raises:
        ValueError: for another scheme, a ``tcp://`` URL without host and port, or an etcd URL
            whose options are wrong or whose user has no password set (naming the fix).
    """
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "memory":
        return MemoryRegistry()
    if scheme == "tcp":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname or port is None:
            raise ValueError(f"registry URL {url!r}: a tcp:// URL needs a host and a port (tcp://host:port)")
        return RemoteRegistry(f"tcp://{parts.hostname}:{port}", request_timeout=request_timeout)
    if scheme == "etcd":
        try:
            port = parts.port
        except ValueError:
            port = None
        if not parts.hostname:
            raise ValueError(f"registry URL {url!r}: an etcd:// URL needs a host (etcd://host:port)")
        options = etcd_options(url, parts)
        try:
            from comm.registry.etcd import EtcdRegistry
        except ImportError as exc:
            raise ImportError(f"registry URL {url!r}: the etcd backend needs the etcd3 package ({exc}); "
                              "install it with `pip install 'cellmesh[etcd]'`") from exc
        return EtcdRegistry(parts.hostname, port or _ETCD_DEFAULT_PORT, request_timeout=request_timeout,
                            options=options)
    accepted = ", ".join(f"{s}://" for s in SCHEMES)
    raise ValueError(f"registry URL {url!r}: unknown scheme {parts.scheme!r}; accepted: {accepted}")


def follows_presence(url: str) -> bool:
    """Whether a worker of the registry at ``url`` learns that its coordinator is gone from the
    coordinator's presence key (etcd: the registry outlives the coordinator) rather than from
    the registry itself going silent (``tcp://``: the coordinator serves it, they die together)."""
    return urlsplit(url).scheme.lower() == "etcd"
