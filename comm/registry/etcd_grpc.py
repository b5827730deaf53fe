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
   ``grpc.RpcError`` into :class:`RegistryError` / :class:`RegistryTimeoutError`;
4. given a user and password, its client logs in at once (failing when etcd is not up yet)
   and never again, while etcd forgets its tokens when it restarts (and after an idle
   ``--auth-token-ttl``); :class:`EtcdLogin` logs in when first needed, waiting for the
   channel like every call, and again when etcd says the token is invalid.

[Note: etcd TLS and users]
The channel is TLS when the options name a CA (``comm/registry/etcd_options.py``), with the
client certificate if given; that is all etcd needs for ``--client-cert-auth``. A user's
token travels as the ``token`` metadata of every call and watch stream.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterator
from typing import Any

import grpc

with warnings.catch_warnings():
    # etcd3 0.12's generated protobuf modules use descriptor calls that protobuf 3.20
    # deprecates; the warning is about etcd3's code, not ours.
    warnings.simplefilter("ignore", DeprecationWarning)
    import etcd3 as etcd3
    import etcd3.etcdrpc as etcdrpc

from comm.errors import RegistryError, RegistryTimeoutError
from comm.registry.etcd_options import PASSWORD_ENV, PASSWORD_FILE_ENV, EtcdOptions

__all__ = ["GRPC_OPTIONS", "EtcdLogin", "TokenCheckedStream", "etcd3", "etcdrpc", "open_client", "prefix_end",
           "status_name"]

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


def open_client(host: str, port: int, options: EtcdOptions, timeout: float) -> Any:
    """etcd3's client for ``host:port`` (TLS as ``options`` say; it does not log in: :class:`EtcdLogin`).

    Raises:
        ValueError: A CA, certificate or key file cannot be read (naming the option).
    """
    for name in ("ca", "cert", "key"):
        path = getattr(options, name)
        if path is not None and not path.is_file():
            raise ValueError(f"etcd at {host}:{port}: {name}={path} is not a readable file")
    return etcd3.client(
        host=host, port=port, timeout=timeout, grpc_options=GRPC_OPTIONS,
        ca_cert=None if options.ca is None else str(options.ca),
        cert_key=None if options.key is None else str(options.key),
        cert_cert=None if options.cert is None else str(options.cert),
    )


class EtcdLogin:
    """The token of an etcd user, fetched when first needed and again when etcd no longer knows it.

    Without a user (plain, or TLS with a client certificate only) every call goes out without
    a token. See [Note: etcd3 0.12 workarounds] (4).
    """

    def __init__(self, channel: Any, endpoint: str, options: EtcdOptions, timeout: float) -> None:
        self._stub: Any = etcdrpc.AuthStub(channel)
        self._endpoint = endpoint
        self._user = options.user
        self._password = options.password
        self._timeout = timeout
        self._lock = threading.Lock()
        self._token: str | None = None

    @property
    def enabled(self) -> bool:
        return self._user is not None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The ``token`` metadata of the next call (logging in first if needed), or None without a user.

        Raises:
            RegistryError: etcd refused the user or password (naming where they come from).
            RegistryTimeoutError: etcd did not answer the login within the timeout.
        """
        if self._user is None:
            return None
        with self._lock:
            if self._token is None:
                self._token = self._login()
            return (("token", self._token),)

    def forget(self, metadata: tuple[tuple[str, str], ...] | None) -> bool:
        """Drop the token ``metadata`` carried (etcd said it is invalid); True if a new login may help."""
        if self._user is None or metadata is None:
            return False
        with self._lock:
            if self._token == metadata[0][1]:
                self._token = None
        return True

    def _login(self) -> str:
        request = etcdrpc.AuthenticateRequest(name=self._user, password=self._password)
        try:
            response = self._stub.Authenticate(request, timeout=self._timeout, wait_for_ready=True)
        except grpc.RpcError as exc:
            code, name = status_name(exc)
            details = exc.details() if callable(getattr(exc, "details", None)) else str(exc)
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise RegistryTimeoutError(f"etcd at {self._endpoint}: the login as {self._user!r} did not "
                                           f"complete within {self._timeout:.1f}s ({details})") from None
            raise RegistryError(f"etcd at {self._endpoint}: the login as {self._user!r} failed: {name}: "
                                f"{details}; check the user and the password in {PASSWORD_FILE_ENV} or "
                                f"{PASSWORD_ENV}") from None
        return str(response.token)


class TokenCheckedStream:
    """A watch stream that tells its :class:`EtcdLogin` when etcd refused the token it carried.

    etcd refuses a watch whose token it no longer knows by cancelling it ("permission
    denied", not a gRPC error), and a dead stream by UNAUTHENTICATED. The watch reconnects
    either way (``comm/registry/etcd_watch.py``); with the token forgotten, the next attempt
    logs in again instead of retrying a dead token until it gives up.
    """

    def __init__(self, call: Any, login: EtcdLogin, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._call = call
        self._login = login
        self._metadata = metadata

    def __iter__(self) -> Iterator[Any]:
        try:
            for response in self._call:
                if response.canceled:
                    self._login.forget(self._metadata)
                yield response
        except grpc.RpcError as exc:
            if status_name(exc)[0] == grpc.StatusCode.UNAUTHENTICATED:
                self._login.forget(self._metadata)
            raise

    def cancel(self) -> bool:
        return bool(self._call.cancel())
