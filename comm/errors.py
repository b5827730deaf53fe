"""Errors raised by the communication front end and discovery."""

from __future__ import annotations

__all__ = [
    "CommError",
    "CommTimeoutError",
    "LeaseExpiredError",
    "PeerLostError",
    "ProtocolError",
    "RegistryError",
    "RegistryTimeoutError",
]


class CommError(RuntimeError):
    """A communication operation failed (the message names the operation and the peer)."""


class CommTimeoutError(CommError, TimeoutError):
    """A blocking communication call did not finish within its timeout.

    Attributes:
        op: the operation that timed out (``"all_reduce"``, ``"recv"``, ...).
        peer: the global rank this process was waiting for, when there is one.
        waited: seconds waited before giving up.
    """

    def __init__(self, message: str, *, op: str, peer: int | None, waited: float) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer
        self.waited = waited


class PeerLostError(CommError):
    """A peer of the operation is gone (its process died, or stopped renewing its liveness lease).

    Attributes:
        op: the operation that was running.
        peer: the global rank that was lost.
    """

    def __init__(self, message: str, *, op: str, peer: int) -> None:
        super().__init__(message)
        self.op = op
        self.peer = peer


class ProtocolError(CommError, ValueError):
    """A message on a cellmesh socket is malformed (bad header, wrong version, bad sizes)."""


class RegistryError(RuntimeError):
    """A discovery registry operation failed."""


class RegistryTimeoutError(RegistryError, TimeoutError):
    """A registry call or a wait on the registry did not finish within its timeout."""


class LeaseExpiredError(RegistryError):
    """The registry answered that a lease no longer exists: it expired (its holder did not refresh it
    in time, or the registry was unreachable past its TTL) or was revoked; grant a new one."""
