"""A process's traffic counters: bytes sent from any thread without a lock, refusals, bounded reports."""

from __future__ import annotations

import threading

import pytest
from pydantic import ValidationError

from comm.codec import pack, unpack
from comm.refusals import Refusals
from comm.traffic import (
    GLOO,
    MAX_REASON_CHARS,
    MAX_REASONS,
    NCCL,
    ZMQ,
    SentBytes,
    TrafficCounts,
    latest_by,
    snapshot,
    total,
)


def test_every_threads_sends_are_counted_while_a_reader_reads() -> None:
    sent = SentBytes()
    threads, adds, chunk = 8, 5000, 4096
    start = threading.Barrier(threads + 1)
    seen: list[int] = []

    def sender() -> None:
        start.wait()
        for _ in range(adds):
            sent.add(ZMQ, chunk)

    workers = [threading.Thread(target=sender) for _ in range(threads)]
    for w in workers:
        w.start()
    start.wait()
    while any(w.is_alive() for w in workers):
        seen.append(sent.totals().get("zmq", 0))
    for w in workers:
        w.join()
    assert sent.totals() == {"zmq": threads * adds * chunk}  # nothing lost, though no add takes a lock
    assert seen == sorted(seen)  # a reader sees the counts only grow


def test_the_tallies_of_threads_that_ended_are_folded_not_kept() -> None:
    sent = SentBytes()
    for i in range(50):
        t = threading.Thread(target=sent.add, args=(GLOO if i % 2 else NCCL, 10))
        t.start()
        t.join()
    sent.add(ZMQ, 1)  # this thread's tally stays: it is alive
    assert sent.totals() == {"zmq": 1, "gloo": 250, "nccl": 250}
    assert len(sent._tallies) == 1  # the 50 ended threads' tallies were folded into the totals
    assert sent.totals() == {"zmq": 1, "gloo": 250, "nccl": 250}  # and stay counted


def test_a_snapshot_holds_bytes_and_refusals_by_reason_and_travels() -> None:
    sent, refusals = SentBytes(), Refusals()
    sent.add(ZMQ, 3480)
    for _ in range(3):
        refusals.refuse("frame", "data/size", "10.0.0.1")
    refusals.count("connection", "a key that is not the job's")
    counts = snapshot(sent, refusals)
    assert counts == TrafficCounts(bytes_sent={"zmq": 3480}, refused_frames={"data/size": 3},
                                   refused_connections={"a key that is not the job's": 1})
    assert unpack(pack(counts), TrafficCounts) == counts
    assert len(pack(snapshot(sent, Refusals()))) < 80  # a healthy worker's report: a few dozen bytes


def test_a_snapshot_stays_within_the_bounds_whatever_was_refused() -> None:
    refusals = Refusals()
    for i in range(MAX_REASONS + 8):  # more reasons than a report carries: the largest counts are kept
        for _ in range(i + 1):
            refusals.count("frame", f"reason-{i}")
    refusals.count("connection", "x" * (MAX_REASON_CHARS + 20))
    counts = snapshot(SentBytes(), refusals)
    assert len(counts.refused_frames) == MAX_REASONS
    assert min(counts.refused_frames.values()) == 9  # reasons 0..7 (counts 1..8) were left out
    assert counts.refused_connections == {"x" * MAX_REASON_CHARS: 1}
    TrafficCounts.model_validate(counts.model_dump())  # valid as the coordinator will check it


@pytest.mark.parametrize("body", [
    {"bytes_sent": {"tcp": 1}},  # not a backend
    {"bytes_sent": {"zmq": -1}},
    {"refused_frames": {f"r{i}": 1 for i in range(MAX_REASONS + 1)}},
    {"refused_frames": {"x" * (MAX_REASON_CHARS + 1): 1}},
    {"refused_connections": {"": 1}},
    {"bytes_sent": {"zmq": 1.5}},
])
def test_a_report_out_of_bounds_is_refused(body: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        TrafficCounts.model_validate(body)


def test_the_latest_report_of_a_process_and_the_sum_of_processes() -> None:
    early = TrafficCounts(bytes_sent={"zmq": 100}, refused_frames={"data/size": 1})
    late = TrafficCounts(bytes_sent={"zmq": 300, "gloo": 5},
                         refused_frames={"data/size": 1, "rpc/forbidden": 2})
    other = TrafficCounts(bytes_sent={"zmq": 7}, refused_connections={"no job keys loaded yet": 4})
    # two stages of worker a report its one process: in either order, the later counts win
    assert latest_by([("a", late), ("b", other), ("a", early), ("c", None)]) == {"a": late, "b": other}
    summed = total([late, other])
    assert summed.bytes_sent == {"zmq": 307, "gloo": 5}
    assert summed.refused_frames == {"data/size": 1, "rpc/forbidden": 2}
    assert summed.refused_connections == {"no job keys loaded yet": 4}
    assert total([]) == TrafficCounts()
