"""Blocked receives of the ZeroMQ backend, run inside rank processes (``RankGroup`` commands): how often a
receiver wakes while it waits, and what ends its wait ([Note: a receiver woken, not polling] in
``comm/zmq/transport.py``)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Any

import torch
import zmq

from comm.base import Communicator
from comm.zmq import transport


def _counting_polls() -> tuple[list[float], Any]:
    """Count every ``zmq.Poller.poll`` of this process from now on; returns the counts and the real poll."""
    calls: list[float] = []
    real = zmq.Poller.poll

    def counted(self: zmq.Poller, timeout: float | None = None) -> Any:
        calls.append(time.monotonic())
        return real(self, timeout)

    zmq.Poller.poll = counted  # type: ignore[method-assign]
    return calls, real


def late_send(comm: Communicator, *, delay_s: float, timeout_s: float) -> dict[str, Any]:
    """Rank 0 sends rank 1 a tensor after ``delay_s``; rank 1 waits for it, counting its polls meanwhile."""
    t = torch.zeros(1024)
    limit = timedelta(seconds=timeout_s)
    if comm.rank == 0:
        comm.send(t, 1, tag=4, timeout=limit)
        time.sleep(delay_s)
        comm.send(t + 1, 1, tag=5, timeout=limit)
        return {}
    comm.recv(t, 0, tag=4, timeout=limit)  # opens the channel: the wait below is on a bound channel
    calls, real = _counting_polls()
    started = time.monotonic()
    try:
        comm.recv(t, 0, tag=5, timeout=limit)
    finally:
        zmq.Poller.poll = real  # type: ignore[method-assign]
    return {"waited": time.monotonic() - started, "polls": len(calls), "value": float(t[0])}


def wait_for_the_dead(comm: Communicator, *, peer: int, timeout_s: float) -> dict[str, Any]:
    """Wait for a message from ``peer`` (which the test kills) with the unwoken sleep made a minute long:
    only a wake-up from the rendezvous can end the wait before the deadline."""
    transport._LONGEST_SLEEP_MS = 60_000
    t = torch.zeros(16)
    started = time.monotonic()
    try:
        comm.recv(t, peer, tag=6, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        return {"error": type(exc).__name__, "peer": getattr(exc, "peer", None), "message": str(exc),
                "waited": time.monotonic() - started}
    return {"error": None, "waited": time.monotonic() - started}


def closed_while_waiting(comm: Communicator, *, peer: int, close_after_s: float, timeout_s: float
                         ) -> dict[str, Any]:
    """Close the communicator from another thread while this one waits for ``peer`` (who sends nothing),
    the unwoken sleep a minute long: the close must end the wait."""
    transport._LONGEST_SLEEP_MS = 60_000
    closer = threading.Timer(close_after_s, comm.close)
    closer.start()
    t = torch.zeros(16)
    started = time.monotonic()
    try:
        comm.recv(t, peer, tag=7, timeout=timedelta(seconds=timeout_s))
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc), "waited": time.monotonic() - started}
    finally:
        closer.join()
    return {"error": None, "waited": time.monotonic() - started}
