"""The coordinator's event loop under load: every reply arrives, once, in bounded time.

48 service hosts (threads of this process, speaking the job's CURVE as real workers do) answer
bursts of requests: some at once, some a few milliseconds later from another thread (so replies
arrive while the loop is still sending the burst), some with a tensor. Each reply the loop reads
makes it send more, to any worker, so sends and reads interleave; between rounds the loop sits
idle for a moment or not at all, and every few rounds a worker is replaced by a host at a new
address (the old one shut down). A loop that loses a reply (a wake-up it slept through, a reply
read and dropped, a request of the old connection answered as the new one's) fails here: every
request must be answered exactly once, with its own body and tensor, and no reply may wait
longer than ``PATIENCE`` while others flow.

The other tests here pin the rest of the loop's contract: a wait ends at its timeout, a reply that
comes back on a replaced worker's old connection is no event, and a request to a host that refused
the coordinator's key fails at once (``unreachable``) instead of blocking the coordinator.
"""

from __future__ import annotations

import heapq
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta

import pytest
import torch
import zmq

from comm import auth
from comm.codec import Message
from comm.registry import MemoryRegistry
from comm.rpc import Call, ServiceBase, ServiceHost
from comm.sockets import bind_port, free_port
from coordinator.runtime.loop import EventLoop, Reply

pytestmark = pytest.mark.timeout(120)

WORKERS = 48
ROUNDS = 24
PATIENCE = timedelta(seconds=5)  # far above a reply's latency here (milliseconds), far below a hang
JOB = "loop-stress"


class Ask(Message):
    n: int
    delay_ms: float
    size: int = 0


class Told(Message):
    n: int


class Later:
    """Runs callbacks after a delay on one thread (a deferred reply answered from elsewhere)."""

    def __init__(self) -> None:
        self._due: list[tuple[float, int, Callable[[], None]]] = []
        self._order = 0
        self._wake = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="loop-stress-later")
        self._thread.start()

    def call(self, delay_s: float, fn: Callable[[], None]) -> None:
        with self._wake:
            self._order += 1
            heapq.heappush(self._due, (time.monotonic() + delay_s, self._order, fn))
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stop and (not self._due or self._due[0][0] > time.monotonic()):
                    self._wake.wait(self._due[0][0] - time.monotonic() if self._due else None)
                if self._stop:
                    return
                _, _, fn = heapq.heappop(self._due)
            fn()

    def stop(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join(5)


class Answering(ServiceBase):
    def __init__(self, later: Later) -> None:
        self.later = later

    def rpc_ask(self, request: Ask, call: Call) -> Told | None:
        tensors = [("t", torch.full((request.size,), float(request.n)))] if request.size else []
        if request.delay_ms <= 0:
            call.tensors_out = tensors
            return Told(n=request.n)
        call.defer(timedelta(seconds=60), ("late", "no answer within 60 s"))
        self.later.call(request.delay_ms / 1000, lambda: call.reply(Told(n=request.n), tensors))
        return None


@pytest.fixture
def curve() -> Iterator[auth.JobKeys]:
    previous = auth.installed()
    keys = auth.JobKeys.generate()
    auth.install(auth.Credentials(keys, "coordinator"))
    yield keys
    auth.install(previous)


def _host(later: Later) -> ServiceHost:
    host = ServiceHost("127.0.0.1")
    host.add("s", Answering(later))
    return host.start()


def test_every_reply_arrives_through_bursts_interleaved_sends_and_replacements(curve: auth.JobKeys) -> None:
    rng = random.Random(18)
    later = Later()
    hosts = [_host(later) for _ in range(WORKERS)]
    registry = MemoryRegistry()
    loop = EventLoop(registry, JOB).start()
    asked: dict[int, tuple[str, Ask, float]] = {}  # request id -> worker, request, sent at
    answered = slowest = 0.0
    counter = iter(range(1 << 30))

    def ask(worker: int) -> None:
        request = Ask(n=next(counter), delay_ms=rng.choice([0, 0, 0, 0.2, 1, 5]),
                      size=rng.choice([0, 0, 0, 0, 0, 0, 0, 1 << 16]))
        name = f"w{worker}"
        asked[loop.send(name, "s", "ask", request, Told)] = (name, request, time.monotonic())

    try:
        for i, host in enumerate(hosts):
            loop.connect(f"w{i}", host.address)
        for round_ in range(ROUNDS):
            if round_ % 6 == 5:  # a replacement: the old host gone, a new one at another address
                i = rng.randrange(WORKERS)
                hosts[i].shutdown()
                hosts[i] = _host(later)
                loop.connect(f"w{i}", hosts[i].address)
            for worker in rng.sample(range(WORKERS), WORKERS):  # the burst
                for _ in range(rng.randint(1, 3)):
                    ask(worker)
            follow_ups = WORKERS
            while asked:
                event = loop.next_event(PATIENCE)
                assert event is not None, (
                    f"round {round_}: {len(asked)} requests unanswered after {PATIENCE.total_seconds()} s "
                    f"of silence, e.g. {sorted(asked.items())[:3]}")
                assert isinstance(event, Reply), event
                assert event.id in asked, f"a reply to request {event.id}, unknown or answered before"
                name, request, sent = asked.pop(event.id)
                assert (event.ok, event.worker, event.body) == (True, name, Told(n=request.n)), event
                if request.size:
                    assert torch.equal(event.tensors["t"], torch.full((request.size,), float(request.n)))
                else:
                    assert event.tensors == {}
                slowest = max(slowest, time.monotonic() - sent)
                answered += 1
                for _ in range(rng.choice([0, 1, 1, 2]) if follow_ups > 0 else 0):  # sends between reads
                    follow_ups -= 1
                    ask(rng.randrange(WORKERS))
            time.sleep(rng.choice([0.0, 0.0, 0.02]))
        assert loop.next_event(timedelta(milliseconds=50)) is None  # nothing answered twice
        assert answered > ROUNDS * WORKERS * 2
        assert slowest < PATIENCE.total_seconds(), slowest
    finally:
        loop.close()
        for host in hosts:
            host.shutdown()
        registry.close()
        later.stop()


@pytest.fixture
def loop() -> Iterator[EventLoop]:
    registry = MemoryRegistry()
    loop = EventLoop(registry, JOB).start()
    yield loop
    loop.close()
    registry.close()


def test_a_wait_with_nothing_to_read_ends_at_its_timeout(curve: auth.JobKeys, loop: EventLoop) -> None:
    loop.connect("w0", f"tcp://127.0.0.1:{free_port()}")  # nobody there: the request waits in the queue
    loop.send("w0", "s", "ask", Ask(n=1, delay_ms=0), Told)
    for timeout in (0.0, 0.05, 0.3):
        started = time.monotonic()
        assert loop.next_event(timedelta(seconds=timeout)) is None
        waited = time.monotonic() - started
        assert timeout <= waited < timeout + 0.25, (timeout, waited)


def test_a_reply_on_a_replaced_workers_old_connection_is_no_event(curve: auth.JobKeys,
                                                                   loop: EventLoop) -> None:
    later = Later()
    old, new = _host(later), _host(later)
    try:
        loop.connect("w0", old.address)
        stale = loop.send("w0", "s", "ask", Ask(n=1, delay_ms=300), Told)
        loop.connect("w0", new.address)  # replaced before the old host answers
        fresh = loop.send("w0", "s", "ask", Ask(n=2, delay_ms=0), Told)
        event = loop.next_event(PATIENCE)
        assert isinstance(event, Reply) and (event.id, event.body) == (fresh, Told(n=2)), event
        assert loop.next_event(timedelta(seconds=0.8)) is None, f"request {stale}'s answer came through"
    finally:
        old.shutdown()
        new.shutdown()
        later.stop()


def test_a_request_to_a_host_that_refused_the_coordinator_fails_at_once(curve: auth.JobKeys,
                                                                         loop: EventLoop) -> None:
    """The host holds the job's server key, but its ZAP handler admits another job's clients: the CURVE
    handshake fails for good. A DEALER would block the coordinator on its next send; the loop answers
    that send with a failed reply naming the worker and its address."""
    other = auth.JobKeys.generate()
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    auth.secure_server(sock, auth.Credentials(
        auth.JobKeys(server=curve.server, coordinator=other.coordinator, worker=other.worker), "worker"))
    address = bind_port(sock, "127.0.0.1")
    try:
        loop.connect("w0", address)
        deadline = time.monotonic() + PATIENCE.total_seconds()
        refused = None
        while refused is None:
            assert time.monotonic() < deadline, "every send was queued: the refusal never showed"
            loop.send("w0", "s", "ask", Ask(n=1, delay_ms=0), Told)
            refused = loop.next_event(timedelta(milliseconds=50))
        assert isinstance(refused, Reply) and not refused.ok and refused.code == "unreachable", refused
        assert "worker w0" in refused.message and address in refused.message, refused.message
    finally:
        sock.close(0)
        context.term()
