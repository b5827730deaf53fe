"""What this process sent through each backend and refused from its peers: its traffic counters.

Two kinds of cumulative counts make a process's traffic (:class:`TrafficCounts`, what its
``/metrics`` shows and what a worker reports to the coordinator with each step):

* bytes sent, per backend (:data:`BACKENDS`), counted by :data:`SENT` as the backends issue
  them (see [Note: what "bytes sent" counts]);
* frames and connections refused, per reason, counted by :data:`comm.refusals.REFUSALS`.

[Note: what "bytes sent" counts]
The tensor bytes this process handed to a backend, payload only (headers, handshakes and
RPC traffic are not counted):

* ``zmq``: the bodies :class:`comm.zmq.transport.Transport` sent, through its sockets and
  its shared-memory inboxes alike (one count: the path is the transport's choice, the
  bytes are the algorithm's). So a collective counts what its algorithm sends from this
  rank: an all-reduce of S bytes over n ranks sends 2(n-1)/n * S on the ring and, on
  recursive doubling (tensors up to ``comm.zmq.collectives.DOUBLING_MAX_BYTES``), log2(p) * S
  (p the largest power of two <= n), one S more on a rank that sends a folded partner the
  result, and just S on the folded rank itself (``comm/zmq/doubling.py``);
* ``gloo`` and ``nccl``: the algorithm is the library's, so a call counts the size of what
  this rank contributes as issued: S for an all-reduce, a send or the root's broadcast,
  the input of an all-gather or a reduce-scatter; nothing for a receive, a non-root
  broadcast or a barrier.

[Note: counting without a lock]
A chunk's send must not pay for its count, so each thread adds to a tally of its own (a
plain int add, no lock, no allocation but the int's); a read sums the tallies under a lock
and folds those of threads that ended into the totals, so the tallies stay as many as the
threads alive. A read sees each tally as of some recent add: counts are cumulative and
only grow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Annotated, Literal, Protocol, TypeVar

from pydantic import Field, NonNegativeInt, StringConstraints

from comm import refusals
from comm.codec import Message

__all__ = ["BACKENDS", "GLOO", "MAX_REASONS", "MAX_REASON_CHARS", "NCCL", "SENT", "ZMQ", "Backend",
           "SentBytes", "TrafficCounts", "TrafficReport", "latest_by", "snapshot", "total"]

Backend = Literal["zmq", "gloo", "nccl"]
BACKENDS: tuple[Backend, ...] = ("zmq", "gloo", "nccl")
ZMQ, GLOO, NCCL = range(len(BACKENDS))
"""Indices of :data:`BACKENDS`, what :meth:`SentBytes.add` takes (an index is cheaper than a name)."""

MAX_REASONS = 32  # reasons of each kind one report carries (there are about 20 in the code)
MAX_REASON_CHARS = 80

Reason = Annotated[str, StringConstraints(min_length=1, max_length=MAX_REASON_CHARS)]


class SentBytes:
    """Bytes sent per backend by every thread of the process (see [Note: counting without a lock])."""

    def __init__(self) -> None:
        self._local = threading.local()
        self._lock = threading.Lock()  # guards the two fields below, never taken by add
        self._tallies: list[tuple[threading.Thread, list[int]]] = []
        self._ended = [0] * len(BACKENDS)  # the tallies of threads that ended

    def add(self, backend: int, nbytes: int) -> None:
        """Count ``nbytes`` sent through ``backend`` (an index: :data:`ZMQ`, :data:`GLOO`, :data:`NCCL`)."""
        try:
            tally: list[int] = self._local.tally
        except AttributeError:
            tally = self._register()
        tally[backend] += nbytes

    def _register(self) -> list[int]:
        """The calling thread's tally, made on its first send."""
        tally = [0] * len(BACKENDS)
        with self._lock:
            self._tallies.append((threading.current_thread(), tally))
        self._local.tally = tally
        return tally

    def totals(self) -> dict[Backend, int]:
        """Bytes sent so far per backend, the backends that sent nothing left out."""
        with self._lock:
            alive = []
            for thread, tally in self._tallies:
                if thread.is_alive():
                    alive.append((thread, tally))
                else:  # it can add no more: fold it
                    self._ended = [a + b for a, b in zip(self._ended, tally, strict=True)]
            self._tallies = alive
            sums = list(self._ended)
            for _, tally in alive:
                sums = [a + b for a, b in zip(sums, tally, strict=True)]
        return {name: n for name, n in zip(BACKENDS, sums, strict=True) if n}


SENT = SentBytes()
"""This process's bytes sent (what ``/metrics`` and the workers' step replies report)."""


class TrafficCounts(Message):
    """One process's cumulative traffic: bytes sent per backend, frames and connections refused per reason.

    Small and bounded, so a worker can send it with every step reply: only counts above
    zero are listed, at most :data:`MAX_REASONS` reasons of each kind.
    """

    bytes_sent: dict[Backend, NonNegativeInt] = Field(default_factory=dict)
    refused_frames: dict[Reason, NonNegativeInt] = Field(default_factory=dict, max_length=MAX_REASONS)
    refused_connections: dict[Reason, NonNegativeInt] = Field(default_factory=dict, max_length=MAX_REASONS)

    def latest(self, other: TrafficReport) -> TrafficCounts:
        """The later of two reports of one process: each count's larger value (counts only grow).

        For the coordinator's view, never sent: the union of two reports' reasons is not bounded
        by :data:`MAX_REASONS`.
        """
        return TrafficCounts.model_construct(
            bytes_sent=_merge([self.bytes_sent, other.bytes_sent], max),
            refused_frames=_merge([self.refused_frames, other.refused_frames], max),
            refused_connections=_merge([self.refused_connections, other.refused_connections], max))


_K = TypeVar("_K", bound=str)


def _merge(maps: Iterable[Mapping[_K, int]], pick: Callable[[int, int], int]) -> dict[_K, int]:
    """Every key of ``maps`` with its counts combined by ``pick``."""
    out: dict[_K, int] = {}
    for counts in maps:
        for key, n in counts.items():
            out[key] = pick(out[key], n) if key in out else n
    return out


class TrafficReport(Protocol):
    """Counters as a reader gets them: a :class:`TrafficCounts`, or the same maps decoded another way (the
    coordinator's step replies, read in C: ``services/protocol/hot.py``)."""

    @property
    def bytes_sent(self) -> Mapping[Backend, int]: ...

    @property
    def refused_frames(self) -> Mapping[str, int]: ...

    @property
    def refused_connections(self) -> Mapping[str, int]: ...


def latest_by(reports: Iterable[tuple[str, TrafficReport | None]]) -> dict[str, TrafficCounts]:
    """Each process's latest counters from ``(process, report)`` pairs (None: no report), in the order
    they were made, of one moment or of several (a window's steps).

    Counts only grow: a worker hosting several stages reports its one process's counters with each
    stage's step reply, and a window's steps report in turn, so each count's larger value is the later
    one. A process's reports are merged once, whatever their number.
    """
    seen: dict[str, list[TrafficReport]] = {}
    for process, report in reports:
        if report is not None:
            if (mine := seen.get(process)) is None:
                seen[process] = [report]
            else:
                mine.append(report)
    out: dict[str, TrafficCounts] = {}
    for process, mine in seen.items():
        if len(mine) == 1 and isinstance(mine[0], TrafficCounts):
            out[process] = mine[0]
        else:
            out[process] = TrafficCounts.model_construct(
                bytes_sent=_merge([r.bytes_sent for r in mine], max),
                refused_frames=_merge([r.refused_frames for r in mine], max),
                refused_connections=_merge([r.refused_connections for r in mine], max))
    return out


def _add(a: int, b: int) -> int:
    return a + b


def total(counts: Iterable[TrafficCounts]) -> TrafficCounts:
    """The traffic of several processes together: each count summed (for display, never sent)."""
    counts = list(counts)
    return TrafficCounts.model_construct(
        bytes_sent=_merge([c.bytes_sent for c in counts], _add),
        refused_frames=_merge([c.refused_frames for c in counts], _add),
        refused_connections=_merge([c.refused_connections for c in counts], _add))


def _largest(counts: dict[str, int]) -> dict[str, int]:
    """The :data:`MAX_REASONS` largest of ``counts`` (a report stays bounded whatever peers did)."""
    return dict(sorted(counts.items(), key=lambda item: -item[1])[:MAX_REASONS])


def snapshot(sent: SentBytes | None = None, refused: refusals.Refusals | None = None) -> TrafficCounts:
    """This process's traffic so far: ``sent`` (:data:`SENT`) and ``refused`` (``comm.refusals.REFUSALS``).

    Costs a few microseconds (two locks, a dict per kind): cheap enough for every step reply.
    """
    by_kind: dict[str, dict[str, int]] = {"frame": {}, "connection": {}}
    for (kind, reason), n in (refusals.REFUSALS if refused is None else refused).counts().items():
        key = reason[:MAX_REASON_CHARS] or "?"
        by_kind[kind][key] = by_kind[kind].get(key, 0) + n
    return TrafficCounts(bytes_sent=(SENT if sent is None else sent).totals(),
                         refused_frames=_largest(by_kind["frame"]),
                         refused_connections=_largest(by_kind["connection"]))
