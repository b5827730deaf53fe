"""Point to point between same-host zmq ranks: through shared memory, complete on return, exact.

The ranks run as threads of this process (each with its own sockets and shared-memory inboxes,
as two processes on one host would have).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch

from comm.errors import CommError
from comm.zmq import shm
from comm.zmq.communicator import ZmqCommunicator
from tests.harness.threads import run_ranks, zmq_pair

pytestmark = pytest.mark.skipif(not shm.available(), reason="shared memory needs x86-64 and /dev/shm")

TIMEOUT = timedelta(seconds=20)


@pytest.fixture()
def pair() -> Iterator[list[ZmqCommunicator]]:
    with zmq_pair("/t/p2p", TIMEOUT) as comms:
        yield comms


def test_a_send_is_complete_on_return_and_the_tensor_free_to_change(pair: list[ZmqCommunicator]) -> None:
    c0, c1 = pair
    x = torch.arange(8 * 1024, dtype=torch.float32).view(8, 1024)  # 32 KiB, a pipeline's activations
    work = c0.isend(x, dst=1, tag=3)
    assert work.is_completed()  # in shared memory already: no socket, no tracker
    x.zero_()  # the next microbatch overwrites it at once
    got = torch.empty(8, 1024)
    c1.irecv(got, src=0, tag=3).wait(TIMEOUT)
    assert torch.equal(got, torch.arange(8 * 1024, dtype=torch.float32).view(8, 1024))
    assert c1.bad_messages == 0


def test_more_sends_in_flight_than_slots_and_records_arrive_exact_and_in_order(
    pair: list[ZmqCommunicator],
) -> None:
    """Past the small slots (and the ring) sends fall back to the socket; nothing is lost or reordered."""
    c0, c1 = pair
    count = shm.RING + 40
    sizes = [(i * 37) % 3000 for i in range(count)]  # 0 B to ~12 KiB of float32, 0 among them
    sent = [torch.randn(n, generator=torch.Generator().manual_seed(i)) for i, n in enumerate(sizes)]
    works = [c0.isend(t, dst=1, tag=i % 3) for i, t in enumerate(sent)]  # nobody receives yet
    assert all(w.is_completed() for w in works[:shm.SMALL_SLOTS])
    # the receiver takes tag 2 first, then 0, then 1: the others are stashed meanwhile
    for tag in (2, 0, 1):
        for i in range(tag, count, 3):
            got = torch.empty(sizes[i])
            c1.irecv(got, src=0, tag=tag).wait(TIMEOUT)
            assert torch.equal(got, sent[i]), i
    for w in works:
        w.wait(TIMEOUT)
    assert c1.bad_messages == 0


def test_a_pipeline_exchange_both_ways_is_exact(pair: list[ZmqCommunicator]) -> None:
    """Two stages, 8 microbatches: activations forward, gradients back, receives posted early."""
    microbatches = 8

    def stage(c: ZmqCommunicator) -> Callable[[], None]:
        def run() -> None:
            peer = 1 - c.rank
            posted = [(m, torch.empty(8, 1024, dtype=torch.float64)) for m in range(microbatches)]
            works = [(m, buf, c.irecv(buf, src=peer, tag=m)) for m, buf in posted]
            for m in range(microbatches):
                c.isend(torch.full((8, 1024), float(100 * c.rank + m), dtype=torch.float64), dst=peer, tag=m)
            for m, buf, work in works:
                work.wait(TIMEOUT)
                assert torch.equal(buf, torch.full((8, 1024), float(100 * peer + m), dtype=torch.float64))
        return run

    c0, c1 = pair
    run_ranks([stage(c0), stage(c1)])


def test_a_ping_pong_wakes_each_sleeping_receiver_at_once(pair: list[ZmqCommunicator]) -> None:
    """Each receive waits for a message its peer sends only once its own arrived, so a receiver sleeps on its
    doorbell every time: a wake-up the sender failed to ring would cost the poll's 100 ms slice. 300 round
    trips (~40 us each on a quiet machine) must not take 300 slices."""
    rounds = 300

    def side(c: ZmqCommunicator) -> Callable[[], None]:
        def run() -> None:
            peer, buf = 1 - c.rank, torch.empty(64)
            for i in range(rounds):
                if c.rank == 0:
                    c.isend(torch.full((64,), float(i)), dst=peer, tag=1)
                c.irecv(buf, src=peer, tag=1).wait(TIMEOUT)
                assert float(buf[0]) == i
                if c.rank == 1:
                    c.isend(buf, dst=peer, tag=1)
        return run

    c0, c1 = pair
    start = time.monotonic()
    run_ranks([side(c0), side(c1)])
    assert time.monotonic() - start < rounds * 0.1 / 4, "receivers slept through their doorbells"


def test_closing_a_rank_under_its_waiting_and_sending_threads_fails_them_by_name(
        pair: list[ZmqCommunicator]) -> None:
    """A step abandoned from another thread closes the communicator while the step's threads still wait
    in it ([Note: closing under the channel's locks] in comm/zmq/transport.py): each fails within a poll
    slice with an error naming the close, and nothing touches a closed socket or an unmapped inbox."""
    c0 = pair[0]
    errors: list[BaseException] = []

    def receive() -> None:
        try:
            c0.irecv(torch.empty(4096), src=1, tag=7).wait(TIMEOUT)  # rank 1 never sends it
        except Exception as exc:
            errors.append(exc)

    def send() -> None:
        try:
            for _ in range(10_000):  # rank 1 never receives: the slots, the ring, then the socket fill
                c0.isend(torch.ones(4096), dst=1, tag=8).wait(TIMEOUT)
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=receive), threading.Thread(target=send)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    start = time.monotonic()
    c0.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads) and time.monotonic() - start < 5
    assert len(errors) == 2, errors
    for e in errors:
        assert isinstance(e, CommError) and "this rank's communicator was closed" in str(e), errors
