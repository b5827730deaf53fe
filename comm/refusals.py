"""What this process refused from its peers: counted by kind and reason, warned about once a minute.

A peer can repeat a fault at will (garbage on a data socket, malformed or forbidden
requests, handshakes with keys that are not the job's), so every place that refuses one
reports it here instead of logging it:

* :func:`refuse` counts it in the process's :data:`REFUSALS` and says whether to warn now:
  once per peer, kind and reason per :data:`WARN_WINDOW`, with how many were held back
  since the last warning (:class:`comm.logs.LogThrottle`); the ZAP handler, which
  throttles its own warnings per context, only counts (:meth:`Refusals.count`);
* the counts (by kind and reason, never by peer or message: those are unbounded) are what
  a process's ``/metrics`` shows (``services/host/health.py``).

Kinds: ``frame`` (a message dropped or answered with an error before any handler saw it:
a bad data message, a malformed request, a forbidden one) and ``connection`` (a handshake
the ZAP handler refused, ``comm/auth.py``). Reasons are short fixed words (``size``,
``version``, ``bad_request``, ``forbidden``...), so the keys stay few whatever peers send.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Literal

import zmq

from comm.logs import LogThrottle

__all__ = ["REFUSALS", "WARN_WINDOW", "Kind", "Refusals", "peer_address", "refuse"]

Kind = Literal["frame", "connection"]
WARN_WINDOW = 60.0
"""Seconds between two warnings for the same peer, kind and reason."""


class Refusals:
    """Thread-safe counts of refusals by ``(kind, reason)``, and the throttle of their warnings."""

    def __init__(self, window: float = WARN_WINDOW) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[tuple[Kind, str]] = Counter()
        self._throttle = LogThrottle(window)

    def refuse(self, kind: Kind, reason: str, peer: object) -> int | None:
        """Count one refusal; None to stay quiet, else warn now (the int: how many were held back).

        ``peer`` identifies the sender as far as the caller knows it (an address, a rank):
        it keys the warnings, never the counts. Keep it bounded (not a per-connection id).
        """
        with self._lock:
            self._counts[(kind, reason)] += 1
            return self._throttle.admit((peer, kind, reason))

    def count(self, kind: Kind, reason: str) -> None:
        """Count one refusal whose warning the caller throttles itself (the ZAP handler does)."""
        with self._lock:
            self._counts[(kind, reason)] += 1

    def counts(self) -> dict[tuple[Kind, str], int]:
        """A copy of the counts so far, by ``(kind, reason)``."""
        with self._lock:
            return dict(self._counts)

    def total(self, kind: Kind) -> int:
        with self._lock:
            return sum(n for (k, _), n in self._counts.items() if k == kind)


REFUSALS = Refusals()
"""This process's refusals (what ``/metrics`` reports)."""


def refuse(kind: Kind, reason: str, peer: object) -> int | None:
    """:meth:`Refusals.refuse` on :data:`REFUSALS`."""
    return REFUSALS.refuse(kind, reason, peer)


def peer_address(frame: zmq.Frame) -> str:
    """The address of the connection ``frame`` came on, to key warnings by ("" when there is none).

    Unlike a ROUTER identity it stays the same when the sender reconnects, and there are
    few of them (one per sending host), so warnings keyed by it stay bounded.
    """
    try:
        return str(frame.get("Peer-Address"))
    except zmq.ZMQError:
        return ""
