"""The coordinator's event loop against a real service host and an in-process registry.

The loop frames its requests and reads its replies with the one RPC layer, so what a host
answers (a body with tensors, an error code, a body of the wrong type) becomes the
:class:`Reply` event that says so; registry changes arrive as membership events.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch

from comm.codec import Message, pack
from comm.registry import MemoryRegistry
from comm.rpc import Call, Empty, RpcError, ServiceBase, ServiceHost
from coordinator.runtime.loop import Event, EventLoop, Reply, WorkerJoined, WorkerLost
from services.protocol import WorkerCard

WAIT = timedelta(seconds=10)
JOB = "loop-test"


class Scale(Message):
    factor: float


class Scaled(Message):
    factor: float


class Worker(ServiceBase):
    def rpc_scale(self, request: Scale, call: Call) -> Scaled:
        call.tensors_out = [(name, t * request.factor) for name, t in call.tensors.items()]
        return Scaled(factor=request.factor)

    def rpc_refuse(self, request: Empty, call: Call) -> Empty:
        raise RpcError("busy", "come back later")


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
