"""The one RPC layer in one process: framing, the host (deferred answers, error codes, the
authorization hook), the client, and the mailbox that wakes a polling thread."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator
from datetime import timedelta

import msgpack
import pytest
import torch
import zmq

from comm import refusals
from comm.codec import Message, unpack_raw
from comm.errors import ProtocolError
from comm.rpc import (
    Call,
    Empty,
    ErrorBody,
    Mailbox,
    Peer,
    ReplyEnvelope,
    RequestEnvelope,
    RpcClient,
    RpcError,
    ServiceBase,
    ServiceHost,
    TensorSpec,
    decode_tensors,
    error_frames,
    open_reply,
    reply_frames,
    request_frames,
)
from comm.rpc import host as host_module
from comm.sockets import CHUNK_BYTES

TIMEOUT = timedelta(seconds=10)


class Echo(Message):
    text: str


class Wait(Message):
    ms: int
    answer: str  # "body" or "error": what the host answers when the wait is over


class Oops(ValueError):
    """An exception the service answers with a code of its own."""


class Toy(ServiceBase):
    error_codes = ((Oops, "oops"),)

    def __init__(self) -> None:
        self.peers: list[Peer] = []
        self.kept: list[weakref.ref[Call]] = []  # the calls of rpc_far, weakly
        self.threads: list[threading.Thread] = []

    def rpc_echo(self, request: Echo, call: Call) -> Echo:
        self.peers.append(call.peer)
        call.tensors_out = [(name, t * 2) for name, t in call.tensors.items()]
        return Echo(text=request.text)

    def rpc_wait(self, request: Wait, call: Call) -> None:
        def on_timeout() -> Echo | tuple[str, str]:
            return Echo(text="late") if request.answer == "body" else ("timeout", f"waited {request.ms} ms")

        call.defer(timedelta(milliseconds=request.ms), on_timeout)

    def rpc_later(self, request: Echo, call: Call) -> None:
        """Answers from another thread, as a worker pool does."""
        call.defer(TIMEOUT, lambda: ("timeout", "never answered"))
        threading.Thread(target=lambda: call.reply(Echo(text=request.text + "!"))).start()

    def rpc_far(self, request: Echo, call: Call) -> None:
        """Answers from another thread soon, its deadline an hour away."""
        call.defer(timedelta(hours=1), lambda: ("timeout", "never answered"))
        self.kept.append(weakref.ref(call))
        thread = threading.Thread(target=lambda: call.reply(Echo(text=str(len(request.text)))))
        self.threads.append(thread)
        thread.start()

    def rpc_oops(self, request: Empty, call: Call) -> Empty:
        raise Oops("the service says no")

    def rpc_bug(self, request: Empty, call: Call) -> Empty:
        raise KeyError("a bug")

    def rpc_secret(self, request: Empty, call: Call) -> Empty:
        return Empty()


def refuse_secrets(service: str, method: str, peer: Peer) -> str | None:
    return "secrets are for admins" if method == "secret" else None


@pytest.fixture
def toy() -> Iterator[tuple[ServiceHost, Toy, RpcClient]]:
    host = ServiceHost("127.0.0.1", authorize=refuse_secrets)
    service = Toy()
    host.add("toy", service)
    host.start()
    client = RpcClient(host.address, timeout=TIMEOUT)
    yield host, service, client
    client.close()
    host.shutdown()


# -- framing ----------------------------------------------------------------------------


def _frames(parts: list[object]) -> list[zmq.Frame]:
    return [zmq.Frame(bytes(p) if not isinstance(p, bytes) else p) for p in parts]


def test_request_frames_are_the_envelope_and_the_tensors() -> None:
    big = torch.arange(CHUNK_BYTES // 4 + 5, dtype=torch.float32)  # two frames
    small = torch.tensor([[1, 2], [3, 4]], dtype=torch.int64)
    frames = request_frames(7, "toy", "echo", Echo(text="hi"), [("big", big), ("small", small)])
    envelope = RequestEnvelope.model_validate(unpack_raw(frames[0]))
    assert envelope == RequestEnvelope(id=7, service="toy", method="echo", body={"text": "hi"}, tensors=[
        TensorSpec(name="big", dtype="float32", shape=[big.numel()], frames=2),
        TensorSpec(name="small", dtype="int64", shape=[2, 2], frames=1),
    ])
    tensors = decode_tensors(envelope.tensors, _frames(frames[1:]))
    assert torch.equal(tensors["big"], big) and torch.equal(tensors["small"], small)
    # a body already dumped travels the same
    dumped = request_frames(7, "toy", "echo", {"text": "hi"})
    assert dumped == request_frames(7, "toy", "echo", Echo(text="hi"))


def test_reply_frames_and_open_reply() -> None:
    frames = reply_frames(3, Echo(text="ok"), [("t", torch.ones(3))])
    reply = ReplyEnvelope.model_validate(unpack_raw(frames[0]))
    body, tensors = open_reply(reply, _frames(frames[1:]), Echo, "toy", "echo")
    assert body == Echo(text="ok") and torch.equal(tensors["t"], torch.ones(3))
    with pytest.raises(ProtocolError, match=r"reply of toy.echo: Wait: ms: Field required"):
        open_reply(reply, _frames(frames[1:]), Wait, "toy", "echo")
    error = ReplyEnvelope.model_validate(unpack_raw(error_frames(3, "busy", "try later")[0]))
    assert error == ReplyEnvelope(id=3, ok=False, error=ErrorBody(code="busy", message="try later"))
    with pytest.raises(RpcError, match=r"toy.echo: \[busy\] try later") as info:
        open_reply(error, [], Echo, "toy", "echo")
    assert (info.value.code, info.value.message) == ("busy", "try later")


def test_decode_tensors_checks_frames_against_specs() -> None:
    spec = TensorSpec(name="t", dtype="float32", shape=[4], frames=1)
    with pytest.raises(ProtocolError, match="specs announce 1 frames, the message has 0"):
        decode_tensors([spec], [])
    with pytest.raises(ProtocolError, match=r"tensor 't': float32\[4\] needs 16 bytes"):
        decode_tensors([spec], _frames([b"\0" * 15]))


# -- the host and its client ------------------------------------------------------------


def test_a_call_round_trips_body_and_tensors(toy: tuple[ServiceHost, Toy, RpcClient]) -> None:
    _, service, client = toy
    body, tensors = client.call("toy", "echo", Echo(text="hello"), Echo,
                                tensors=[("x", torch.arange(4.0))])
    assert body == Echo(text="hello")
    assert torch.equal(tensors["x"], torch.arange(4.0) * 2)
    assert len(service.peers) == 1 and service.peers[0].identity and service.peers[0].user is None


def test_deferred_calls_answer_from_another_thread_or_at_their_deadline(
    toy: tuple[ServiceHost, Toy, RpcClient]
) -> None:
    _, _, client = toy
    assert client.call("toy", "later", Echo(text="done"), Echo)[0] == Echo(text="done!")
    start = time.monotonic()
    assert client.call("toy", "wait", Wait(ms=200, answer="body"), Echo)[0] == Echo(text="late")
    assert 0.15 <= time.monotonic() - start < 3
    with pytest.raises(RpcError, match=r"toy.wait: \[timeout\] waited 100 ms"):
        client.call("toy", "wait", Wait(ms=100, answer="error"), Echo)


def test_an_answered_call_is_not_kept_until_its_deadline(toy: tuple[ServiceHost, Toy, RpcClient]) -> None:
    """[Note: an answered call leaves only its deadline]: 40 calls of 100 KB deferred for an hour and
    answered at once are freed with their answers (the heap keeps their deadlines, and drops them later)."""
    host, service, client = toy
    for _ in range(40):
        assert client.call("toy", "far", Echo(text="x" * 100_000), Echo)[0] == Echo(text="100000")
    for thread in service.threads:
        thread.join(timeout=10)
    assert len(service.kept) == 40
    # the client may hear the last answer while the host thread is still returning from sending it
    deadline = time.monotonic() + 5
    while True:
        gc.collect()
        alive = [i for i, ref in enumerate(service.kept) if ref() is not None]
        if not alive or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert alive == []
    assert len(host._deferred) == 40 and all(d.call is None and d.on_timeout is None for d in host._deferred)


def test_errors_are_answered_with_their_codes(
    toy: tuple[ServiceHost, Toy, RpcClient], caplog: pytest.LogCaptureFixture
) -> None:
    host, _, client = toy
    with pytest.raises(RpcError, match=r"\[oops\] the service says no"):
        client.call("toy", "oops", Empty(), Empty)
    assert not [r for r in caplog.records if r.exc_info], "an expected error was logged as a bug"
    with pytest.raises(RpcError, match=r"\[internal\] toy.bug failed on the server") as failed:
        client.call("toy", "bug", Empty(), Empty)
    assert "a bug" not in str(failed.value) and "KeyError" not in str(failed.value)  # internals stay home
    assert any(r.exc_info and "a bug" in str(r.exc_info[1]) for r in caplog.records)  # ...in the log
    with pytest.raises(RpcError, match=r"\[unknown_method\] toy has no method 'nope'"):
        client.call("toy", "nope", Empty(), Empty)
    with pytest.raises(RpcError, match=r"\[bad_request\] Echo: text: Field required; ms: Extra inputs"):
        client.call("toy", "echo", Wait(ms=1, answer="x"), Echo)  # the wrong body
    assert host.bad_requests == 1
    assert client.call("toy", "echo", Echo(text="still here"), Echo)[0] == Echo(text="still here")


def test_the_authorizer_refuses_before_dispatch(toy: tuple[ServiceHost, Toy, RpcClient]) -> None:
    host, _, client = toy
    with pytest.raises(RpcError, match=r"\[forbidden\] toy.secret: secrets are for admins") as info:
        client.call("toy", "secret", Empty(), Empty)
    assert info.value.code == "forbidden" and host.refused == 1
    with pytest.raises(RpcError, match="forbidden"):  # refused before the lookup: it reveals nothing
        client.call("elsewhere", "secret", Empty(), Empty)
    assert client.call("toy", "echo", Echo(text="fine"), Echo)[0] == Echo(text="fine")


def test_a_broken_authorizer_refuses() -> None:
    def broken(service: str, method: str, peer: Peer) -> str | None:
        raise RuntimeError("no policy loaded")

    host = ServiceHost("127.0.0.1", authorize=broken)
    host.add("toy", Toy())
    host.start()
    try:
        with RpcClient(host.address, timeout=TIMEOUT) as client, pytest.raises(
            RpcError, match=r"\[forbidden\].*no policy loaded"
        ):
            client.call("toy", "echo", Echo(text="x"), Echo)
    finally:
        host.shutdown()


def test_garbage_gets_an_error_reply_and_the_host_keeps_serving(
    toy: tuple[ServiceHost, Toy, RpcClient]
) -> None:
    host, _, client = toy
    reply = ReplyEnvelope.model_validate(unpack_raw(client.send_raw([b"\xc1 garbage"])[0]))
    assert (reply.ok, reply.id, reply.error and reply.error.code) == (False, 0, "bad_request")
    envelope = msgpack.packb({"v": 1, "id": 5, "service": "toy", "method": "echo", "body": {"text": "x"},
                              "tensors": [], "extra": 1})
    reply = ReplyEnvelope.model_validate(unpack_raw(client.send_raw([envelope])[0]))
    assert reply.id == 5 and reply.error is not None and "extra" in reply.error.message
    assert client.call("toy", "echo", Echo(text="after"), Echo)[0] == Echo(text="after")
    assert host.bad_requests == 2


def test_closing_a_client_ends_a_call_in_flight(toy: tuple[ServiceHost, Toy, RpcClient]) -> None:
    _, _, client = toy
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            client.call("toy", "wait", Wait(ms=5000, answer="body"), Echo)
        except BaseException as exc:
            errors.append(exc)

    caller = threading.Thread(target=wait)
    caller.start()
    time.sleep(0.2)
    start = time.monotonic()
    client.close()
    caller.join(5)
    assert time.monotonic() - start < 1
    assert len(errors) == 1 and isinstance(errors[0], RpcError) and errors[0].code == "closed", errors
    with pytest.raises(RpcError, match="closed"):
        client.call("toy", "echo", Echo(text="x"), Echo)


def test_a_long_wait_is_one_poll_not_a_wake_up_per_slice(toy: tuple[ServiceHost, Toy, RpcClient],
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A call waits for its reply in one poll (close() wakes it through the client's pipe): an idle
    worker's registry watches long-poll 5 s at a time, and woke 10 times a second in 100 ms slices."""
    _, _, client = toy
    poller = client._pollers[zmq.POLLIN]
    polls: list[int | None] = []
    poll = poller.poll

    def counting(timeout: int | None = None) -> list[tuple[object, int]]:
        polls.append(timeout)
        return poll(timeout)

    monkeypatch.setattr(poller, "poll", counting)
    assert client.call("toy", "wait", Wait(ms=600, answer="body"), Echo)[0] == Echo(text="late")
    assert len(polls) <= 2, polls  # one, and one more only for a reply that was not this call's


def test_a_client_times_out_naming_the_call() -> None:
    host = ServiceHost("127.0.0.1")
    host.add("toy", Toy())
    host.start()
    try:
        with RpcClient(host.address) as client, pytest.raises(
            TimeoutError, match=r"toy.wait at tcp://127.0.0.1:\d+: no reply within 0.2s"
        ):
            client.call("toy", "wait", Wait(ms=5000, answer="body"), Echo, timeout=timedelta(seconds=0.2))
    finally:
        host.shutdown()


def test_shutdown_is_prompt_and_idempotent() -> None:
    host = ServiceHost("127.0.0.1").start()
    time.sleep(0.05)
    start = time.monotonic()
    host.shutdown()
    assert time.monotonic() - start < 0.5  # the mailbox wakes the thread; no poll timeout waited out
    host.shutdown()


# -- the mailbox ------------------------------------------------------------------------


def test_a_mailbox_wakes_the_poller_and_keeps_order() -> None:
    mailbox: Mailbox[int] = Mailbox("test")
    poller = zmq.Poller()
    poller.register(mailbox.socket, zmq.POLLIN)
    try:
        assert not poller.poll(0) and mailbox.take() == [] and not mailbox
        threading.Thread(target=lambda: [mailbox.put(i) for i in range(5)]).start()
        assert poller.poll(5000), "a put did not wake the poller"
        mailbox.clear_wakeups()
        deadline = time.monotonic() + 5
        got: list[int] = []
        while len(got) < 5 and time.monotonic() < deadline:
            got += mailbox.take()
        assert got == [0, 1, 2, 3, 4]
    finally:
        mailbox.close()
    mailbox.put(9)  # after close: dropped, no error
    mailbox.close()


def test_faults_are_counted_by_reason_and_warned_about_once_per_address(
    toy: tuple[ServiceHost, Toy, RpcClient], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A peer that reconnects for every bad request (a new ROUTER identity each time) is one peer."""
    host, _, _ = toy
    counted = refusals.Refusals()
    monkeypatch.setattr(refusals, "REFUSALS", counted)
    with caplog.at_level("WARNING", logger="comm.rpc.host"):
        for _ in range(5):
            with RpcClient(host.address, timeout=TIMEOUT) as fresh:
                reply = ReplyEnvelope.model_validate(unpack_raw(fresh.send_raw([b"\xc1 garbage"])[0]))
                assert reply.error is not None and reply.error.code == "bad_request"
                with pytest.raises(RpcError, match="unknown_method"):
                    fresh.call("toy", "nope", Empty(), Empty)
    assert counted.counts() == {("frame", "rpc/bad_request"): 5, ("frame", "rpc/unknown_method"): 5}
    warned = [r.getMessage() for r in caplog.records if r.name == "comm.rpc.host"]
    assert len(warned) == 1 and "127.0.0.1" in warned[0], warned


def test_a_request_that_breaks_the_reading_is_answered_internal_and_the_host_lives_on(
    toy: tuple[ServiceHost, Toy, RpcClient], caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in reading one request (here: tensor decoding raising what it should not) stops nothing."""
    _, _, client = toy
    monkeypatch.setattr(refusals, "REFUSALS", refusals.Refusals())

    def broken(*args: object) -> dict[str, torch.Tensor]:
        raise RuntimeError("Stride calculation overflowed")

    monkeypatch.setattr(host_module, "decode_tensors", broken)
    with pytest.raises(RpcError, match=r"\[internal\] the server failed to read the request") as failed:
        client.call("toy", "echo", Echo(text="x"), Echo)
    assert "Stride" not in str(failed.value)  # internals stay home...
    assert any(r.exc_info and "Stride" in str(r.exc_info[1]) for r in caplog.records)  # ...in the log
    monkeypatch.undo()
    assert client.call("toy", "echo", Echo(text="after"), Echo)[0] == Echo(text="after")
