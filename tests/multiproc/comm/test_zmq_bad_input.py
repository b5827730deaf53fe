"""Garbage on a rank's data sockets is logged, counted and dropped; the rank keeps serving.

The ranks run as threads of this process (each with its own sockets), and the garbage comes
from a raw ZeroMQ socket connected to rank 1's data socket for rank 0, exactly where a
confused or hostile peer would send it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta

import msgpack
import pytest
import torch
import zmq

from comm.codec import PROTOCOL_VERSION
from comm.registry.memory import MemoryRegistry
from comm.zmq.communicator import ZmqCommunicator

TIMEOUT = timedelta(seconds=20)


def _run_ranks(fns: list[Callable[[], None]], timeout: float = 30.0) -> None:
    errors: list[BaseException] = []

    def wrap(fn: Callable[[], None]) -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(fn,), daemon=True) for fn in fns]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        assert not t.is_alive(), "a rank did not finish in time"
    if errors:
        raise errors[0]


@pytest.fixture()
def pair() -> Iterator[list[ZmqCommunicator]]:
    registry = MemoryRegistry()
    comms: list[ZmqCommunicator] = []

    def make(rank: int) -> Callable[[], None]:
        def run() -> None:
            comms.append(ZmqCommunicator.create(rank=rank, world_size=2, registry=registry,
                                                prefix="/t/bad", timeout=TIMEOUT))
        return run

    _run_ranks([make(0), make(1)])
    comms.sort(key=lambda c: c.rank)
    yield comms
    for c in comms:
        c.close()
    registry.close()


def _pack(*fields: object) -> bytes:
    data = msgpack.packb(list(fields), use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _good(**kw: object) -> list[object]:
    fields: dict[str, object] = dict(v=PROTOCOL_VERSION, group="w", src=0, kind=0, seq=0, tag=0, part=0,
                                     dtype="float32", shape=[4], offset=0, nbytes=16, slot=-1)
    fields.update(kw)
    return list(fields.values())


GARBAGE: dict[str, list[bytes]] = {
    "truncated (header only)": [_pack(*_good())],
    "three frames": [_pack(*_good()), b"\0" * 16, b"extra"],
    "header not msgpack": [b"\xc1\xc1\xc1 not msgpack", b"\0" * 16],
    "wrong protocol version": [_pack(*_good(v=PROTOCOL_VERSION + 41)), b"\0" * 16],
    "unknown dtype": [_pack(*_good(dtype="quaternion")), b"\0" * 16],
    "negative shape": [_pack(*_good(shape=[-4])), b"\0" * 16],
    "enormous shape (2^40 elements)": [_pack(*_good(shape=[1 << 40])), b"\0" * 16],
    "enormous shape (2^20 x 2^20)": [_pack(*_good(shape=[1 << 20, 1 << 20])), b"\0" * 16],
    "body shorter than header": [_pack(*_good()), b"\0" * 15],
    "body longer than header": [_pack(*_good()), b"\0" * 17],
    "bytes past the tensor": [_pack(*_good(offset=8)), b"\0" * 16],
    "claims another source": [_pack(*_good(src=1)), b"\0" * 16],
    # a header naming a shared-memory slot (same-host peers, comm/zmq/shm.py)
    "slot that does not exist": [_pack(*_good(slot=99))],
    "slot not marked full": [_pack(*_good(slot=0))],
    "body larger than a slot": [_pack(*_good(shape=[2 << 20], nbytes=(4 << 20) + 4, slot=1))],
    "slot with a body frame": [_pack(*_good(slot=2)), b"\0" * 16],
}


def _data_address(comm: ZmqCommunicator, peer: int) -> str:
    """The address of ``comm``'s data socket that receives from ``peer``."""
    channel = comm._transport.channels[peer]
    assert channel.pull is not None
    endpoint = channel.pull.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def test_garbage_is_dropped_and_the_rank_keeps_serving(
    pair: list[ZmqCommunicator], caplog: pytest.LogCaptureFixture
) -> None:
    c0, c1 = pair
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(_data_address(c1, 0))
    try:
        for frames in GARBAGE.values():
            attacker.send_multipart(frames)
        # a valid operation after the garbage: rank 1 reads the channel from rank 0, meets every bad
        # message first, drops each, and still completes the all_reduce and a point-to-point receive
        with caplog.at_level(logging.ERROR, logger="comm.zmq.transport"):
            results: dict[int, torch.Tensor] = {}

            def rank(c: ZmqCommunicator) -> Callable[[], None]:
                def run() -> None:
                    x = torch.arange(1000, dtype=torch.float64) * (c.rank + 1)
                    c.all_reduce(x)
                    results[c.rank] = x
                    if c.rank == 0:
                        c.send(torch.full((4,), 7.0), dst=1)
                    else:
                        got = torch.zeros(4)
                        c.recv(got, src=0)
                        assert torch.equal(got, torch.full((4,), 7.0))
                return run

            _run_ranks([rank(c0), rank(c1)])
            expected = torch.arange(1000, dtype=torch.float64) * 3
            assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
            # the PULL socket fair-queues the attacker and the real peer, so the valid operation may
            # finish before every bad message was read: keep serving valid ones until all were met
            for _ in range(200):
                if c1.bad_messages >= len(GARBAGE):
                    break
                _run_ranks([rank(c0), rank(c1)])
                assert torch.equal(results[0], expected) and torch.equal(results[1], expected)
        assert c1.bad_messages == len(GARBAGE)
        dropped = [r for r in caplog.records if "dropped a bad data message" in r.getMessage()]
        assert len(dropped) == len(GARBAGE)
        reasons = " | ".join(r.getMessage() for r in dropped)
        for needle in ("frames", "not msgpack", "protocol version", "unknown dtype", "outside",
                       "over the", "header says", "run past", "claims src", "does not exist",
                       "not marked full", "-byte slot"):
            assert needle in reasons, f"no drop logged for {needle!r}: {reasons}"
    finally:
        attacker.close()


def test_shape_mismatch_is_a_clear_error(pair: list[ZmqCommunicator]) -> None:
    c0, c1 = pair
    seen: list[str] = []

    def sender() -> None:
        c0.send(torch.zeros(5), dst=1)

    def receiver() -> None:
        try:
            c1.recv(torch.zeros(4), src=0, timeout=timedelta(seconds=5))
        except Exception as exc:
            seen.append(str(exc))

    _run_ranks([sender, receiver])
    assert seen and "float32[5]" in seen[0] and "float32[4]" in seen[0], seen
