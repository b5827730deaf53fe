"""A world larger than the inbox budget: only the chosen peers get shared memory, the others the socket,
and every collective and transfer stays exact (ranks as threads of this process, as on one host)."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import pytest
import torch

from comm.registry.memory import MemoryRegistry
from comm.zmq import shm
from comm.zmq.communicator import ZmqCommunicator
from tests.harness.threads import run_ranks

pytestmark = [pytest.mark.skipif(not shm.available(), reason="shared memory needs x86-64 and /dev/shm"),
              pytest.mark.timeout(120)]

WORLD = 12
BUDGET = 2
TIMEOUT = timedelta(seconds=30)


def test_past_the_budget_peers_talk_through_the_socket_and_stay_exact(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(shm.PEERS_ENV, str(BUDGET))
    registry = MemoryRegistry()
    comms: dict[int, ZmqCommunicator] = {}

    def make(rank: int) -> Callable[[], None]:
        def run() -> None:
            comms[rank] = ZmqCommunicator.create(rank=rank, world_size=WORLD, registry=registry,
                                                 prefix="/t/budget", timeout=TIMEOUT)
        return run

    try:
        run_ranks([make(r) for r in range(WORLD)], timeout=60)

        def step(rank: int) -> Callable[[], None]:
            def run() -> None:
                comm = comms[rank]
                x = torch.arange(300_000, dtype=torch.float64) * (rank + 1)  # 2.4 MB: the large slots
                comm.all_reduce(x, timeout=TIMEOUT)
                assert torch.equal(x, torch.arange(300_000, dtype=torch.float64) * (WORLD * (WORLD + 1) // 2))
                far = (rank + WORLD // 2) % WORLD  # no inbox either way: through the socket
                near = (rank + 1) % WORLD  # an inbox: through shared memory
                for peer, tag in ((far, 1), (near, 2)):
                    comm.isend(torch.full((1000,), float(rank)), dst=peer, tag=tag).wait(TIMEOUT)
                for peer, tag in ((far, 1), ((rank - 1) % WORLD, 2)):
                    got = torch.empty(1000)
                    comm.irecv(got, src=peer, tag=tag).wait(TIMEOUT)
                    assert torch.equal(got, torch.full((1000,), float(peer)))
                assert comm.bad_messages == 0
            return run

        run_ranks([step(r) for r in range(WORLD)], timeout=90)
        for rank, comm in comms.items():
            # channels are bound as peers send (the ring's previous rank, the far one): of those, the ones
            # the budget chose ({rank - 1, rank + 1}) have an inbox
            bound = {p for p, ch in comm._transport.channels.items() if ch.pull is not None}
            inboxes = {p for p, ch in comm._transport.channels.items() if ch.inbox is not None}
            assert bound == {(rank - 1) % WORLD, (rank + WORLD // 2) % WORLD}, (rank, bound)
            assert inboxes == {(rank - 1) % WORLD}, (rank, inboxes)
    finally:
        for comm in comms.values():
            comm.close()
        registry.close()
