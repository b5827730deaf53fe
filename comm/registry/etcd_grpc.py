"""The ``etcd3`` package, imported once, and what the etcd registry and its watches share of gRPC.

[Note: etcd3 0.12 workarounds]
The package's high-level calls are awkward in three ways, so the etcd backend uses the
client only for its gRPC channel and stubs (``client.kvstub``, ``client.leasestub``)
and its protobuf messages (``etcd3.etcdrpc``):

1. its methods pass only a deadline, so a call made while the channel is reconnecting
   (just after an etcd restart) fails at once with UNAVAILABLE; ``comm/registry/etcd.py``
   calls the stubs with ``wait_for_ready=True``, which waits for the channel, bounded by
   the same deadline;
2. its ``Watcher`` re-opens the stream in a tight loop while etcd is down, drops the
   callbacks of every watch on an error and never resumes them, and cancels by
   queueing a request onto a stream that may be gone; ``comm/registry/etcd_watch.py``
   drives the bidirectional ``Watch`` RPC itself, one stream per watch, and cancels it
   with the gRPC call's own ``cancel()``;
3. gRPC errors other than four codes escape untranslated; the registry translates every
   ``grpc.RpcError`` into :class:`RegistryError` / :class:`RegistryTimeoutError`.
"""

from __future__ import annotations

import warnings

import grpc

with warnings.catch_warnings():
    # etcd3 0.12's generated protobuf modules use descriptor calls that protobuf 3.20
    # deprecates; the warning is about etcd3's code, not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    import etcd3 as etcd3
    import etcd3.etcdrpc as etcdrpc

__all__ = ["GRPC_OPTIONS", "etcd3", "etcdrpc", "prefix_end", "status_name"]

# Reconnect quickly after an etcd restart (gRPC's own default backoff starts at 1 s and
# grows to 2 min); ping a silent connection every 10 s (etcd's default minimum is 5 s).
GRPC_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
]


def prefix_end(prefix: bytes) -> bytes:
    """The end of etcd's range for ``prefix``: the prefix with its last byte incremented.

    An empty prefix (every key) is the range ``[b"\\0", b"\\0")`` in etcd's convention.
    """
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        return b"\0"
    return stripped[:-1] + bytes([stripped[-1] + 1])


def status_name(exc: grpc.RpcError) -> tuple[grpc.StatusCode | None, str]:
    """The status code of a failed call (None when the error carries none) and its name for messages."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return code, code.name if code is not None else type(exc).__name__
