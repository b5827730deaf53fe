"""The process's refusals: counted by kind and reason from any thread, warned about once per peer a window."""

from __future__ import annotations

import threading
import time

import zmq

from comm.refusals import Refusals, peer_address


def test_counts_are_by_kind_and_reason_never_by_peer() -> None:
    refusals = Refusals()
    for peer in ("10.0.0.1", "10.0.0.2", "10.0.0.3"):
        refusals.refuse("frame", "data/size", peer)
    refusals.refuse("frame", "rpc/bad_request", "10.0.0.1")
    refusals.count("connection", "a key that is not the job's")
    assert refusals.counts() == {("frame", "data/size"): 3, ("frame", "rpc/bad_request"): 1,
                                 ("connection", "a key that is not the job's"): 1}
    assert refusals.total("frame") == 4 and refusals.total("connection") == 1


def test_one_warning_per_peer_and_reason_per_window_with_the_count_held_back() -> None:
    refusals = Refusals(window=0.3)
    assert refusals.refuse("frame", "data/size", "a") == 0  # the first: warn now
    assert refusals.refuse("frame", "data/size", "b") == 0  # another peer: its own warning
    assert refusals.refuse("frame", "data/dtype", "a") == 0  # another reason: its own warning
    assert [refusals.refuse("frame", "data/size", "a") for _ in range(5)] == [None] * 5  # within the window
    time.sleep(0.35)
    assert refusals.refuse("frame", "data/size", "a") == 5  # the window passed: warn, saying 5 were held back
    assert refusals.counts()[("frame", "data/size")] == 8


def test_counting_from_many_threads_loses_nothing() -> None:
    refusals = Refusals()

    def hammer() -> None:
        for _ in range(2000):
            refusals.refuse("frame", "rpc/bad_request", "127.0.0.1")

    threads = [threading.Thread(target=hammer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert refusals.counts() == {("frame", "rpc/bad_request"): 8000}


def test_the_peer_address_of_a_frame() -> None:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.connect(f"tcp://127.0.0.1:{port}")
        push.send(b"x")
        assert pull.poll(5000)
        assert peer_address(pull.recv(copy=False)) == "127.0.0.1"
        assert peer_address(zmq.Frame(b"made here")) == ""  # never received: no connection
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()
