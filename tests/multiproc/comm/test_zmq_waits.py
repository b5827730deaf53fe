"""A ZeroMQ receiver blocked on a peer sleeps until something happens: the message, its deadline, the peer
found gone, the communicator closed ([Note: a receiver woken, not polling] in ``comm/zmq/transport.py``).

The checks run in rank processes (``tests/multiproc/comm/wait_checks.py``). Two of them make the
receiver's unwoken sleep a minute long, so only the wake-up can end its wait before the deadline.
"""

from __future__ import annotations

import signal
import time
from datetime import timedelta

import pytest

from tests.harness.procs import RankGroup

pytestmark = pytest.mark.timeout(90)

W = "tests.multiproc.comm.wait_checks"
LIVENESS_TTL = timedelta(seconds=1)
DEADLINE_S = 30.0


def test_a_blocked_receiver_does_not_wake_to_look_every_few_milliseconds() -> None:
    with RankGroup(2, "zmq") as group:
        _, waited = group.run(f"{W}:late_send", delay_s=2.0, timeout_s=DEADLINE_S,
                              timeout=timedelta(seconds=60))
    assert waited["value"] == 1.0 and waited["waited"] >= 1.5, waited
    # a look a second at most, plus the message's own wake-up (it polled in 100 ms slices: ~20)
    assert waited["polls"] <= 2 + waited["waited"], waited


def test_a_peer_found_gone_wakes_its_blocked_receiver() -> None:
    with RankGroup(2, "zmq", liveness_ttl=LIVENESS_TTL) as group:
        pending = group.submit(f"{W}:wait_for_the_dead", ranks=[1], peer=0, timeout_s=DEADLINE_S)
        time.sleep(0.5)
        group.kill(0, signal.SIGKILL)
        [outcome] = group.collect(pending, ranks=[1], timeout=timedelta(seconds=60))
    assert outcome["error"] == "PeerLostError" and outcome["peer"] == 0, outcome
    assert outcome["waited"] < DEADLINE_S / 2, outcome  # woken when the lease lapsed, not at the deadline


def test_closing_the_communicator_wakes_its_blocked_receiver() -> None:
    with RankGroup(2, "zmq") as group:
        [outcome] = group.run(f"{W}:closed_while_waiting", ranks=[1], peer=0, close_after_s=0.5,
                              timeout_s=DEADLINE_S, timeout=timedelta(seconds=60))
    assert outcome["error"] is not None and "closed" in outcome["message"], outcome
    # woken by the close (which first closes the rendezvous: a registry write or two), not at the deadline
    assert outcome["waited"] < DEADLINE_S / 2, outcome
