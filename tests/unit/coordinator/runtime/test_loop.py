"""The coordinator's event loop against a real service host and an in-process registry.

The loop frames its requests and reads its replies with the one RPC layer, so what a host
answers (a body with tensors, an error code, a body of the wrong type) becomes the
:class:`Reply` event that says so; registry changes arrive as membership events.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from comm.codec import Message, pack, unpack
from comm.registry import KeepAlive, Lease, MemoryRegistry
from comm.registry.presence import PresenceCard
from comm.rpc import Call, Empty, RpcError, ServiceBase, ServiceHost
from comm.rpc.hot import PackedBody
from coordinator.runtime.loop import Event, EventLoop, Reply, WorkerJoined, WorkerLost
from services.host.worker import coordinator_key
from services.protocol import PhaseTiming, StepReply, WorkerCard, pack_times
from services.protocol.hot import StepRead, read_step_frame
from tests.unit.comm.registry.flaky import FlakyRegistry

WAIT = timedelta(seconds=10)
JOB = "loop-test"


class Scale(Message):
    factor: float


class Scaled(Message):
    factor: float


class LooseStep(Message):
    """A step reply as a broken (or foreign) worker might send it: the fields without their rules."""

    step: int
    stage: int
    losses: list[float]
    times: bytes = b""
    held_bytes: int | None = None
    phases: list[PhaseTiming] = []


class Worker(ServiceBase):
    def rpc_step(self, request: LooseStep, call: Call) -> LooseStep:
        return request

    def rpc_echo(self, request: StepReply, call: Call) -> StepReply:
        return request

    def rpc_scale(self, request: Scale, call: Call) -> Scaled:
        call.tensors_out = [(name, t * request.factor) for name, t in call.tensors.items()]
        return Scaled(factor=request.factor)

    def rpc_refuse(self, request: Empty, call: Call) -> Empty:
        raise RpcError("busy", "come back later")

    def rpc_later(self, request: Scale, call: Call) -> Scaled:
        """Answer after ``factor`` seconds (the host answers one request at a time), with when it did."""
        time.sleep(request.factor)
        return Scaled(factor=time.time())


@pytest.fixture
def setup() -> Iterator[tuple[MemoryRegistry, ServiceHost, EventLoop]]:
    registry = MemoryRegistry()
    host = ServiceHost("127.0.0.1")
    host.add("w", Worker())
    host.start()
    loop = EventLoop(registry, JOB).start()
    loop.connect("w0", host.address)
    yield registry, host, loop
    loop.close()
    host.shutdown()
    registry.close()


def _next(loop: EventLoop) -> Event:
    event = loop.next_event(WAIT)
    assert event is not None, f"no event within {WAIT.total_seconds():.0f}s"
    return event


def test_replies_become_events(setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    _, _, loop = setup
    x = torch.arange(6, dtype=torch.float64).view(2, 3)
    ok = loop.send("w0", "w", "scale", Scale(factor=2.0), Scaled, tensors=[("x", x)])
    refused = loop.send("w0", "w", "refuse", Empty(), Empty)
    wrong = loop.send("w0", "w", "scale", {"factor": 3.0}, Empty)  # a dumped body; the wrong reply type
    replies = {}
    for _ in range(3):
        event = _next(loop)
        assert isinstance(event, Reply)
        replies[event.id] = event
    assert replies[ok].ok and replies[ok].body == Scaled(factor=2.0)
    assert torch.equal(replies[ok].tensors["x"], x * 2)
    assert (replies[refused].ok, replies[refused].code, replies[refused].message) == (
        False, "busy", "come back later")
    assert not replies[wrong].ok and replies[wrong].code == "bad_reply"
    assert "factor: Extra inputs are not permitted" in replies[wrong].message


def test_step_replies_are_decoded_in_c_and_refused_as_the_model_refuses(
        setup: tuple[MemoryRegistry, ServiceHost, EventLoop], monkeypatch: pytest.MonkeyPatch) -> None:
    """A plain step reply takes the C decoder (services/protocol/hot.py) and comes as read (a StepRead whose
    message is the reply), a broken one is refused with the model's own reason, and the loop keeps serving."""
    _, _, loop = setup
    accepted: list[StepRead] = []

    def spy(frame: bytes) -> tuple[int, StepRead] | None:
        read = read_step_frame(frame)
        if read is not None:
            accepted.append(read[1])
        return read

    monkeypatch.setattr("coordinator.runtime.loop.read_step_frame", spy)
    whole = StepReply(step=3, stage=0, losses=[0.5], times=pack_times([1.0, 2.0], [1.5, 2.5]),
                      phases=[PhaseTiming(name="optimizer", start=0.5, end=0.75)], held_bytes=8)
    good = loop.send("w0", "w", "echo", whole, StepReply)
    partial = loop.send("w0", "w", "step", LooseStep(step=4, stage=0, losses=[0.5]),
                        StepReply)
    negative = loop.send("w0", "w", "step", LooseStep(step=5, stage=0, losses=[],
                                                      times=pack_times([1.0], [2.0]), held_bytes=-1),
                         StepReply)
    uneven = loop.send("w0", "w", "step", LooseStep(step=6, stage=0, losses=[], times=b"\0" * 24),
                       StepReply)
    replies = {}
    for _ in range(4):
        event = _next(loop)
        assert isinstance(event, Reply)
        replies[event.id] = event
    assert replies[good].ok and isinstance(replies[good].body, StepRead)
    assert len(accepted) == 1 and accepted[0] is replies[good].body  # the only one the decoder took
    assert replies[good].body.message() == whole
    assert replies[good].body.message().model_fields_set == set(StepReply.model_fields)
    # fields missing (LooseStep dumps only its own): the model fills the defaults, as it always did
    assert replies[partial].ok
    assert replies[partial].body == StepReply(step=4, stage=0, losses=[0.5])
    assert not replies[negative].ok and replies[negative].code == "bad_reply"
    assert "held_bytes: Input should be greater than or equal to 0" in replies[negative].message
    assert "metric_sums" not in replies[negative].message  # a missing field with a default is no error
    assert not replies[uneven].ok and "times holds 24 bytes, not a whole number" in replies[uneven].message
    assert replies[good].ok and _next_scaled(loop).body == Scaled(factor=2.0)


def test_a_packed_request_reaches_every_service_and_a_step_reply_where_none_is_expected_is_refused(
        setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    """A body packed once (PackedBody) goes to two services as two requests the host validates as any
    other; a reply the C decoder reads as a step reply, to a request that expects another type, is left
    to that type's model, which refuses it."""
    _, _, loop = setup
    whole = StepReply(step=3, stage=0, losses=[0.5], times=pack_times([1.0], [1.5]))
    packed = PackedBody(whole.model_dump(mode="python"))
    first = loop.send("w0", "w", "echo", packed, StepReply)
    second = loop.send("w0", "w", "echo", packed, StepReply)
    foreign = loop.send("w0", "w", "echo", packed, Scaled)
    bad = loop.send("w0", "w", "scale", PackedBody({"factor": "x"}), Scaled)
    replies = {}
    for _ in range(4):
        event = _next(loop)
        assert isinstance(event, Reply)
        replies[event.id] = event
    assert replies[first].ok and replies[first].body.message() == whole == replies[second].body.message()
    assert not replies[foreign].ok and replies[foreign].code == "bad_reply"
    assert "Scaled" in replies[foreign].message
    assert not replies[bad].ok and replies[bad].code == "bad_request" and "factor" in replies[bad].message
    assert _next_scaled(loop).body == Scaled(factor=2.0)


def _next_scaled(loop: EventLoop) -> Reply:
    loop.send("w0", "w", "scale", Scale(factor=2.0), Scaled)
    event = _next(loop)
    assert isinstance(event, Reply) and event.ok
    return event


def test_a_forgotten_request_is_not_an_event(setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    _, _, loop = setup
    loop.forget(loop.send("w0", "w", "scale", Scale(factor=1.0), Scaled))
    kept = loop.send("w0", "w", "scale", Scale(factor=5.0), Scaled)
    event = _next(loop)
    assert isinstance(event, Reply) and event.id == kept
    assert loop.next_event(timedelta(milliseconds=200)) is None


def test_membership_changes_become_events(setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    registry, host, loop = setup
    card = WorkerCard(name="w1", address=host.address, pid=1, cpus=1, memory_bytes=0, gpus=0)
    key = f"/cellmesh/{JOB}/workers/w1"
    registry.put(key, pack(card))
    joined = _next(loop)
    assert isinstance(joined, WorkerJoined) and joined.card == card and loop.members == {"w1": card}
    registry.delete(key)
    lost = _next(loop)
    assert isinstance(lost, WorkerLost) and lost.name == "w1" and loop.members == {}


def test_the_loop_keeps_the_coordinators_presence_while_it_runs() -> None:
    with MemoryRegistry() as registry:
        loop = EventLoop(registry, JOB).start()
        kv = registry.get(coordinator_key(JOB))
        assert kv is not None
        card = unpack(kv.value, PresenceCard)
        assert card.pid == os.getpid() and card.ttl_ms == 2000 and not card.closed
        loop.close()
        assert registry.get(coordinator_key(JOB)) is None  # withdrawn (marked closed, then revoked)


def test_a_card_whose_lease_lapses_is_lost_as_soon_as_it_lapses() -> None:
    """How fast the embedded registry turns a dead worker into WorkerLost: the lease's TTL after its
    last refresh, plus the reaper's and the watch's delay (measured: ~10 ms)."""
    with MemoryRegistry() as registry, EventLoop(registry, JOB) as loop:
        ttl = 0.5
        card = WorkerCard(name="w1", address="tcp://127.0.0.1:1", pid=1, cpus=1, memory_bytes=0, gpus=0)
        granted = time.monotonic()  # the lease runs from its grant, a moment before the put returns
        registry.put(f"/cellmesh/{JOB}/workers/w1", pack(card), lease=registry.lease(timedelta(seconds=ttl)))
        assert isinstance(_next(loop), WorkerJoined)
        lost = _next(loop)
        late = time.monotonic() - granted - ttl
        assert isinstance(lost, WorkerLost) and lost.name == "w1"
        assert 0 <= late <= ttl, late  # not a lease later (measured ~10 ms; loose for a loaded machine)


def test_a_card_published_again_after_an_outage_is_no_event() -> None:
    """The registry is unreachable for longer than the worker's lease: its card lapses in the store
    and is published again with a new lease when the registry answers. The loop sees no change."""
    flaky = FlakyRegistry()
    ttl = timedelta(milliseconds=600)
    key = f"/cellmesh/{JOB}/workers/w1"
    card = WorkerCard(name="w1", address="tcp://127.0.0.1:1", pid=1, cpus=1, memory_bytes=0, gpus=0)

    def renew() -> Lease:
        lease = flaky.lease(ttl)
        flaky.put(key, pack(card), lease=lease)
        return lease

    lease = flaky.lease(ttl)
    flaky.put(key, pack(card), lease=lease)
    keeper = KeepAlive(lease, renew=renew)
    loop = EventLoop(flaky, JOB, presence_ttl=ttl).start()
    try:
        assert loop.members == {"w1": card}
        flaky.down.set()
        deadline = time.monotonic() + 3
        while flaky.inner.get(key) is not None:  # the card lapses in the store
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(0.3)
        flaky.down.clear()
        event = loop.next_event(timedelta(seconds=3))
        assert event is None, event
        assert keeper.renewals == 1 and loop.members == {"w1": card}
        while loop.presence.in_doubt():  # once the outage is OUTAGE_GRACE behind,
            assert time.monotonic() < deadline + 10
            time.sleep(0.05)
        flaky.delete(key)
        lost = loop.next_event(timedelta(seconds=0.5))  # a deletion is a loss again, at once
        assert isinstance(lost, WorkerLost) and lost.name == "w1"
    finally:
        loop.close()
        keeper.stop()
        flaky.close()


def test_replies_gather_while_many_are_outstanding(
        setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    """[Note: fewer wake-ups]: replies 10 ms apart, read after 100 ms holds while at least 4 (the default) are
    outstanding, take a few wake-ups for 24, not one each; each of the last 3 (fewer outstanding) is read as
    it comes (long holds, so that "as it comes" has a bound a loaded machine keeps)."""
    _, _, loop = setup
    assert loop.coalesce_min == 4, "a step of 5 workers or more lets its replies gather"
    loop.coalesce, loop.coalesce_share = timedelta(milliseconds=100), 1e6
    ids = [loop.send("w0", "w", "later", Scale(factor=0.01), Scaled) for _ in range(24)]
    before = loop.wakeups
    replies = [_next(loop) for _ in ids]
    assert all(isinstance(r, Reply) and r.ok for r in replies)
    assert sorted(r.id for r in replies if isinstance(r, Reply)) == ids
    assert loop.wakeups - before <= 14, f"{loop.wakeups - before} wake-ups for 24 replies 10 ms apart"
    last = replies[-1]
    assert isinstance(last, Reply) and isinstance(last.body, Scaled)
    assert last.received - last.body.factor < 0.08, "the last reply waited for a hold (100 ms)"


def test_a_hold_gives_way_to_registry_events_and_the_deadline(
        setup: tuple[MemoryRegistry, ServiceHost, EventLoop]) -> None:
    """A hold (here 30 s) ends at once for a registry event, and never outlasts the caller's bound."""
    registry, host, loop = setup
    loop.coalesce, loop.coalesce_share, loop.coalesce_min = timedelta(seconds=30), 1e6, 2
    card = WorkerCard(name="w1", address=host.address, pid=1, cpus=1, memory_bytes=0, gpus=0)
    for what in ("deadline", "registry"):
        ids = [loop.send("w0", "w", "later", Scale(factor=0.05), Scaled) for _ in range(3)]
        first = _next(loop)  # alone: the others come 50 and 100 ms later, so a hold follows
        assert isinstance(first, Reply) and first.id == ids[0]
        started = time.monotonic()
        rest: list[Event | None] = []
        if what == "registry":
            timer = threading.Timer(0.2, registry.put, (f"/cellmesh/{JOB}/workers/w1", pack(card)))
            timer.start()
            assert isinstance(_next(loop), WorkerJoined)
            timer.join()
        else:  # the hold ends at the bound; a reply that came meanwhile may then be read
            rest.append(loop.next_event(timedelta(milliseconds=100)))
        assert time.monotonic() - started < 2, f"{what}: the hold went on"
        loop.coalesce = timedelta(0)
        rest += [_next(loop) for _ in range(2 - sum(isinstance(r, Reply) for r in rest))]
        assert [r.id for r in rest if isinstance(r, Reply)] == ids[1:]
        loop.coalesce = timedelta(seconds=30)
