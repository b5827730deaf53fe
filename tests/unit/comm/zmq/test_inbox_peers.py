"""Which same-host peers get a shared-memory inbox ([Note: which peers get an inbox] in comm/zmq/shm.py)."""

from __future__ import annotations

import pytest

from comm.zmq import shm


@pytest.mark.parametrize("world", [2, 3, 5, 9])
def test_a_world_of_up_to_nine_ranks_gives_every_peer_an_inbox(world: int) -> None:
    for rank in range(world):
        others = [p for p in range(world) if p != rank]
        assert sorted(shm.inbox_peers(rank, world, shm.DEFAULT_PEERS)) == others


def test_ring_neighbours_come_first_then_powers_of_two_then_the_nearest() -> None:
    # rank 5 of 32: the ring's neighbours 6 and 4, then distances 2, 4, 8, 16, then 3, 5, ...
    assert shm.inbox_peers(5, 32, 12) == [6, 4, 7, 3, 9, 1, 13, 29, 21, 8, 2, 10]
    # the wrap: rank 0's neighbours include the last rank (an interleaved schedule's loop back)
    assert shm.inbox_peers(0, 64, 2) == [1, 63]


@pytest.mark.parametrize("world", [2, 7, 64, 1000])
def test_the_budget_bounds_the_inboxes_whatever_the_world(world: int) -> None:
    for rank in (0, world // 2, world - 1):
        peers = shm.inbox_peers(rank, world, 8)
        assert len(peers) == min(8, world - 1) and len(set(peers)) == len(peers) and rank not in peers
        assert all(0 <= p < world for p in peers)
    assert shm.inbox_peers(0, world, 0) == []


def test_the_budget_comes_from_the_environment_and_a_bad_one_is_named(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(shm.PEERS_ENV, raising=False)
    assert shm.inbox_budget() == shm.DEFAULT_PEERS
    monkeypatch.setenv(shm.PEERS_ENV, "3")
    assert shm.inbox_budget() == 3
    for bad in ("-1", "many", "2.5"):
        monkeypatch.setenv(shm.PEERS_ENV, bad)
        with pytest.raises(ValueError, match=shm.PEERS_ENV):
            shm.inbox_budget()
