"""Garbage on a rank's data sockets is dropped, counted by reason, warned about once; the rank keeps serving.

The ranks run as threads of this process (each with its own sockets), and the garbage comes
from a raw ZeroMQ socket connected to rank 1's data socket for rank 0, exactly where a
confused or hostile peer would send it.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import timedelta

import msgpack
import pytest
import torch
import zmq

from comm import refusals
from comm.codec import PROTOCOL_VERSION
from comm.errors import CommError
from comm.refusals import Refusals
from comm.zmq import shm
from comm.zmq.communicator import ZmqCommunicator
from comm.zmq.door import ChannelRequest, ask
from tests.harness.threads import run_ranks, zmq_pair

TIMEOUT = timedelta(seconds=20)


@pytest.fixture()
def pair() -> Iterator[list[ZmqCommunicator]]:
    with zmq_pair("/t/bad", TIMEOUT) as comms:
        yield comms


def _pack(*fields: object) -> bytes:
    data = msgpack.packb(list(fields), use_bin_type=True)
    assert isinstance(data, bytes)
    return data


def _good(**kw: object) -> list[object]:
    fields: dict[str, object] = dict(v=PROTOCOL_VERSION, group="w", src=0, kind=0, seq=0, tag=0, part=0,
                                     dtype="float32", shape=[4], offset=0, nbytes=16, slot=-1)
    fields.update(kw)
    return list(fields.values())


# name: (frames, the reason it is counted under, what its warning says)
GARBAGE: dict[str, tuple[list[bytes], str, str]] = {
    "truncated (header only)": ([_pack(*_good())], "frames", "frames"),
    "three frames": ([_pack(*_good()), b"\0" * 16, b"extra"], "frames", "frames"),
    "header not msgpack": ([b"\xc1\xc1\xc1 not msgpack", b"\0" * 16], "encoding", "not msgpack"),
    "wrong protocol version": ([_pack(*_good(v=PROTOCOL_VERSION + 41)), b"\0" * 16], "version",
                               "protocol version"),
    "unknown dtype": ([_pack(*_good(dtype="quaternion")), b"\0" * 16], "dtype", "unknown dtype"),
    "negative shape": ([_pack(*_good(shape=[-4])), b"\0" * 16], "range", "outside"),
    "enormous shape (2^40 elements)": ([_pack(*_good(shape=[1 << 40])), b"\0" * 16], "size", "over the"),
    "enormous shape (2^20 x 2^20)": ([_pack(*_good(shape=[1 << 20, 1 << 20])), b"\0" * 16], "size",
                                     "over the"),
    "body shorter than header": ([_pack(*_good()), b"\0" * 15], "length", "header says"),
    "body longer than header": ([_pack(*_good()), b"\0" * 17], "length", "header says"),
    "bytes past the tensor": ([_pack(*_good(offset=8)), b"\0" * 16], "range", "run past"),
    "claims another source": ([_pack(*_good(src=1)), b"\0" * 16], "source", "claims src"),
    # a header naming a shared-memory slot (same-host peers, comm/zmq/shm.py)
    "slot that does not exist": ([_pack(*_good(slot=99))], "slot", "does not exist"),
    "slot not marked full": ([_pack(*_good(slot=0))], "slot", "not marked full"),
    "body larger than a slot": ([_pack(*_good(shape=[2 << 20], nbytes=(4 << 20) + 4, slot=1))], "slot",
                                "-byte slot"),
    "slot with a body frame": ([_pack(*_good(slot=2)), b"\0" * 16], "frames", "frames"),
}


def _data_address(comm: ZmqCommunicator, peer: int) -> str:
    """The address of ``comm``'s data socket that receives from ``peer`` (bound now if it was not: a
    channel is bound when its peer first asks the door for it, comm/zmq/door.py)."""
    transport = comm._transport
    channel = transport._inbound(transport._channel(peer))
    assert channel.pull is not None
    endpoint = channel.pull.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(endpoint, bytes)
    return endpoint.decode()


def _all_reduce_and_p2p(c0: ZmqCommunicator, c1: ZmqCommunicator) -> None:
    """A valid all_reduce and a point-to-point transfer between the two ranks, checked."""
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

    run_ranks([rank(c0), rank(c1)])
    expected = torch.arange(1000, dtype=torch.float64) * 3
    assert torch.equal(results[0], expected) and torch.equal(results[1], expected)


def _serve_until_read(c0: ZmqCommunicator, c1: ZmqCommunicator, bad: int) -> None:
    """Run valid operations until rank 1 has read ``bad`` bad messages.

    The PULL socket fair-queues the attacker and the real peer, so a valid operation may
    finish before every bad message was read: keep serving valid ones until all were met.
    """
    _all_reduce_and_p2p(c0, c1)
    for _ in range(200):
        if c1.bad_messages >= bad:
            return
        _all_reduce_and_p2p(c0, c1)


def test_garbage_is_dropped_and_the_rank_keeps_serving(
    pair: list[ZmqCommunicator], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    c0, c1 = pair
    counted = Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)  # this test's counts and warnings alone
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(_data_address(c1, 0))
    expected = Counter(f"data/{reason}" for _, reason, _ in GARBAGE.values())
    try:
        with caplog.at_level(logging.WARNING, logger="comm.zmq.transport"):
            for frames, _, _ in GARBAGE.values():
                attacker.send_multipart(frames)
            # a valid operation after the garbage: rank 1 reads the channel from rank 0, meets every bad
            # message first, drops each, and still completes the all_reduce and a point-to-point receive
            _serve_until_read(c0, c1, len(GARBAGE))
            assert c1.bad_messages == len(GARBAGE)
            assert {r: n for (k, r), n in counted.counts().items() if k == "frame"} == expected
            # the same garbage again: counted again, and not one more warning within the minute
            for frames, _, _ in GARBAGE.values():
                attacker.send_multipart(frames)
            _serve_until_read(c0, c1, 2 * len(GARBAGE))
        assert c1.bad_messages == 2 * len(GARBAGE)
        assert {r: n for (k, r), n in counted.counts().items() if k == "frame"} == {
            r: 2 * n for r, n in expected.items()}
        dropped = [r.getMessage() for r in caplog.records if "dropped a bad data message" in r.getMessage()]
        assert all(r.levelno == logging.WARNING for r in caplog.records if r.name == "comm.zmq.transport")
        # one warning per reason (one sender here), naming what the first message of that reason broke
        first: dict[str, str] = {}
        for _, reason, needle in GARBAGE.values():
            first.setdefault(reason, needle)
        assert len(dropped) == len(first), dropped
        for reason, needle in first.items():
            said = [m for m in dropped if f"({reason})" in m]
            assert len(said) == 1 and needle in said[0], (reason, dropped)
    finally:
        attacker.close()


def test_an_address_zeromq_cannot_take_fails_the_first_send_by_name(pair: list[ZmqCommunicator]) -> None:
    """A channel connects at its first message ([Note: connecting at the first message] in
    comm/zmq/transport.py): a card's address that ZeroMQ refuses fails that send, naming the peer and the
    address, and leaves no socket behind; the other direction keeps working."""
    c0, c1 = pair
    channel = c0._transport._channel(1)
    channel.address = "tcp://no such host:port"  # as if the door had said so
    with pytest.raises(CommError, match=r"cannot connect to rank 1 at 'tcp://no such host:port'"):
        c0.send(torch.zeros(4), dst=1, timeout=timedelta(seconds=2))
    assert channel.push is None
    got = torch.empty(3)
    run_ranks([lambda: c1.send(torch.arange(3.0), dst=0), lambda: c0.recv(got, src=1, timeout=TIMEOUT)])
    assert torch.equal(got, torch.arange(3.0))


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

    run_ranks([sender, receiver])
    assert seen and "float32[5]" in seen[0] and "float32[4]" in seen[0], seen


# records a confused same-host peer could put in the shared-memory ring (comm/zmq/shm.py): the header
# alone, checked exactly like one from the socket
RING_GARBAGE: dict[str, tuple[bytes, str]] = {
    "not msgpack": (b"\xc1\xc1\xc1 not msgpack", "encoding"),
    "a body frame's header (no slot)": (_pack(*_good()), "frames"),
    "claims another source": (_pack(*_good(src=1, slot=shm.LARGE_SLOTS)), "source"),
    "slot that does not exist": (_pack(*_good(slot=shm.SLOTS)), "slot"),
    "slot not marked full": (_pack(*_good(slot=shm.LARGE_SLOTS + 3)), "slot"),
    "body larger than a small slot": (
        _pack(*_good(shape=[1 << 20], nbytes=shm.SMALL_BYTES + 4, slot=shm.SLOTS - 1)), "slot"),
}


@pytest.mark.skipif(not shm.available(), reason="the shared-memory ring needs x86-64 and /dev/shm")
def test_garbage_in_the_shared_memory_ring_is_dropped_and_the_rank_keeps_serving(
    pair: list[ZmqCommunicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    c0, c1 = pair
    counted = Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)
    # a channel connects (and maps the peer's inbox) at its first message: this one's is the garbage
    channel = c0._transport._opened(c0._transport._channel(1))
    assert channel.outbox is not None
    with channel.send_lock:
        for record, _ in RING_GARBAGE.values():
            assert channel.outbox.post(record)
        channel.outbox._lengths[0] = 1 << 20  # the first record's length no longer fits a record
    _serve_until_read(c0, c1, len(RING_GARBAGE))
    assert c1.bad_messages == len(RING_GARBAGE)
    # the first record's length was broken after it was written: it counts as a record too long
    reasons = [reason for _, reason in RING_GARBAGE.values()]
    expected = Counter(["data/size", *(f"data/{r}" for r in reasons[1:])])
    assert {r: n for (k, r), n in counted.counts().items() if k == "frame"} == expected


@pytest.mark.skipif(not shm.available(), reason="the shared-memory ring needs x86-64 and /dev/shm")
def test_garbage_on_the_socket_is_read_while_the_ring_feeds_every_receive(
    pair: list[ZmqCommunicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A receiver that never waits (each message is in the ring when it asks) still reads its socket:
    the garbage queued there is dropped and counted within as many receives as there are bad frames."""
    c0, c1 = pair
    counted = Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)
    ctx = zmq.Context.instance()
    attacker = ctx.socket(zmq.PUSH)
    attacker.setsockopt(zmq.LINGER, 0)
    attacker.connect(_data_address(c1, 0))
    bad = [[b"\xc1 not msgpack %d" % k, b"\0" * 16] for k in range(3)]
    try:
        for frames in bad:
            attacker.send_multipart(frames)
        pull = c1._transport._channel(0).pull
        assert pull is not None and pull.poll(int(TIMEOUT.total_seconds() * 1000), zmq.POLLIN)
        for k in range(len(bad) + 2):  # every message is in the ring before its receive starts
            c0.send(torch.full((4,), float(k)), dst=1)
        for k in range(len(bad) + 2):
            got = torch.zeros(4)
            c1.recv(got, src=0)
            assert torch.equal(got, torch.full((4,), float(k)))
        assert c1.bad_messages == len(bad)
        assert {r: n for (kind, r), n in counted.counts().items() if kind == "frame"} == {"data/encoding": 3}
    finally:
        attacker.close()


def _door_request(**kw: object) -> bytes:
    data = msgpack.packb({"v": PROTOCOL_VERSION, "src": 0, "host_key": "h", **kw}, use_bin_type=True)
    assert isinstance(data, bytes)
    return data


# name: (frames a peer sends the door, the reason it is counted under, what the error reply says)
DOOR_GARBAGE: dict[str, tuple[list[bytes], str, str]] = {
    "not msgpack": ([b"\xc1\xc1 not msgpack"], "request", "not msgpack"),
    "a list, not a map": ([_pack(0, "h")], "request", "expected a msgpack map"),
    "wrong protocol version": ([_door_request(v=PROTOCOL_VERSION + 1)], "request", "protocol version"),
    "unknown field": ([_door_request(evil=1)], "request", "evil"),
    "src as a string": ([_door_request(src="0")], "request", "src"),
    "src outside the group": ([_door_request(src=7)], "request", "not another rank"),
    "src is the door's own rank": ([_door_request(src=1)], "request", "not another rank"),
    "negative src": ([_door_request(src=-1)], "request", "src"),
    "two frames": ([_door_request(), b"more"], "frames", "one frame"),
}


def test_garbage_at_the_door_is_answered_with_an_error_and_the_door_keeps_serving(
    pair: list[ZmqCommunicator], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The door (comm/zmq/door.py) is the one address a rank's card gives: each bad request gets an error
    reply naming what is wrong and is counted by reason; the door still opens channels afterwards."""
    c0, c1 = pair
    counted = Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)
    door = c1._transport._door
    assert door is not None
    asker = zmq.Context.instance().socket(zmq.DEALER)
    asker.setsockopt(zmq.LINGER, 0)
    asker.connect(door.tcp)
    try:
        for name, (frames, _, needle) in DOOR_GARBAGE.items():
            asker.send_multipart(frames)
            assert asker.poll(int(TIMEOUT.total_seconds() * 1000), zmq.POLLIN), name
            reply = msgpack.unpackb(asker.recv())
            assert needle in reply["error"] and not reply["tcp"], (name, reply)
        oversized = b"\x00" * 8192  # over the door's message size: the connection is dropped, no reply
        asker.send(oversized)
        assert not asker.poll(300, zmq.POLLIN)
    finally:
        asker.close()
    expected = Counter(f"door/{reason}" for _, reason, _ in DOOR_GARBAGE.values())
    assert {r: n for (k, r), n in counted.counts().items() if k == "frame"} == expected
    assert door.served == 0  # nothing was opened for garbage
    _all_reduce_and_p2p(c0, c1)  # rank 0 asks the door now: a channel, and the ranks still talk
    assert door.served == 1 and set(c1._transport.channels) == {0}


def test_a_door_that_fails_to_open_a_channel_says_so_and_keeps_serving(
        pair: list[ZmqCommunicator], caplog: pytest.LogCaptureFixture) -> None:
    """An unexpected error while the door opens a channel (a bug, not the peer's fault) reaches the sender as
    a CommError naming it, is logged with its traceback, and the door opens the channel when asked again."""
    c0, c1 = pair
    door = c1._transport._door
    assert door is not None
    opened = door._open
    calls = 0

    def broken(request: object) -> object:
        nonlocal calls
        calls += 1
        raise RuntimeError("boom")

    door._open = broken  # type: ignore[assignment]
    with caplog.at_level(logging.ERROR, logger="comm.zmq.door"), \
            pytest.raises(CommError, match=r"failed to open the channel: RuntimeError: boom"):
        c0.send(torch.zeros(4), dst=1, timeout=timedelta(seconds=5))
    assert calls == 1 and any(r.exc_info for r in caplog.records if r.name == "comm.zmq.door")
    door._open = opened  # type: ignore[method-assign]
    # the failed send spent its sequence number (a failed operation leaves the pair out of step, as any
    # failed send does): the door itself is asked again, as a peer would
    got = ask(door.tcp, ChannelRequest(src=0, host_key="elsewhere"), deadline_at=time.monotonic() + 20,
              slice_ms=100, check=lambda: None, what="asking again")
    assert got.tcp and not got.error and door.served == 1
