"""The worker process (registration, lease, drain, kill -9) and the barrier service it hosts."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest

from comm.codec import pack
from comm.registry import RegistryServer, RemoteRegistry
from comm.rpc import RpcClient, RpcError
from services.host.worker import worker_key
from services.protocol import Assignment, AssignmentReply, BarrierArrive, BarrierReleased, Empty, WorkerStatus
from tests.harness.workers import WorkerProcess, registry_server, start_worker

JOB = "t-worker"


@pytest.fixture(scope="module")
def server() -> Iterator[RegistryServer]:
    with registry_server() as s:
        yield s


@pytest.fixture(scope="module")
def barrier_worker(server: RegistryServer) -> Iterator[WorkerProcess]:
    w = start_worker(server.address, JOB, "barrier-host")
    with RpcClient(w.address) as c:
        reply, _ = c.call("worker", "assign", Assignment(service="barrier", kind="barrier"), AssignmentReply)
        assert reply.address == w.address
    yield w
    w.stop()


def test_card_reports_resources(barrier_worker: WorkerProcess) -> None:
    card = barrier_worker.card
    assert card.cpus >= 1 and card.memory_bytes > 0 and card.gpus >= 0
    with RpcClient(barrier_worker.address) as c:
        status, _ = c.call("worker", "status", Empty(), WorkerStatus)
    assert status.services == ["barrier"] and not status.draining


def _arrive(address: str, name: str, member: str, members: list[str], timeout_ms: int,
            out: dict[str, object]) -> None:
    with RpcClient(address, timeout=timedelta(seconds=30)) as c:
        try:
            reply, _ = c.call("barrier", "arrive",
                              BarrierArrive(name=name, member=member, members=members, timeout_ms=timeout_ms),
                              BarrierReleased)
            out[member] = reply.generation
        except RpcError as exc:
            out[member] = exc


def _arrival(address: str, name: str, member: str, members: list[str], out: dict[str, object]
             ) -> threading.Thread:
    t = threading.Thread(target=_arrive, args=(address, name, member, members, 20_000, out))
    t.start()
    return t


def test_barrier_generations(barrier_worker: WorkerProcess) -> None:
    members = ["a", "b", "c"]
    addr = barrier_worker.address
    gen0: dict[str, object] = {}
    waiting = [_arrival(addr, "g", m, members, gen0) for m in ("a", "b")]
    time.sleep(0.3)
    assert gen0 == {}, "generation 0 released before every member arrived"
    _arrive(addr, "g", "c", members, 20_000, gen0)
    for t in waiting:
        t.join(10)
    assert gen0 == {"a": 0, "b": 0, "c": 0}
    # the second use of the same name: a fast member waits for the others' second arrival
    gen1: dict[str, object] = {}
    fast = _arrival(addr, "g", "a", members, gen1)
    time.sleep(0.3)
    assert gen1 == {}, "a passed generation 1 alone"
    rest = [_arrival(addr, "g", m, members, gen1) for m in ("b", "c")]
    for t in [fast, *rest]:
        t.join(10)
    assert gen1 == {"a": 1, "b": 1, "c": 1}


def test_barrier_timeout_names_missing_member(barrier_worker: WorkerProcess) -> None:
    results: dict[str, object] = {}
    start = time.monotonic()
    _arrive(barrier_worker.address, "t", "x", ["x", "y", "z"], 500, results)
    waited = time.monotonic() - start
    err = results["x"]
    assert isinstance(err, RpcError) and err.code == "timeout"
    missing = err.message.split("did not arrive")[1]
    assert "'y'" in missing and "'z'" in missing and "'x'" not in missing
    assert 0.4 < waited < 5


def test_bad_input_then_valid(barrier_worker: WorkerProcess) -> None:
    import msgpack

    from comm.codec import PROTOCOL_VERSION

    def envelope(**kw: object) -> bytes:
        body: dict[str, object] = dict(v=PROTOCOL_VERSION, id=5, service="barrier", method="arrive",
                                       body=dict(name="n", member="m", members=["m"], timeout_ms=100),
                                       tensors=[])
        body.update(kw)
        data = msgpack.packb(body)
        assert isinstance(data, bytes)
        return data

    cases = {
        "not msgpack": ([b"\xc1\xc1 junk"], "bad_request"),
        "wrong version": ([envelope(v=PROTOCOL_VERSION + 1)], "bad_request"),
        "unknown method": ([envelope(method="teleport")], "unknown_method"),
        "unknown service": ([envelope(service="nope")], "unknown_service"),
        "field of wrong type": ([envelope(body=dict(name="n", member="m", members=["m"], timeout_ms="100"))],
                                "bad_request"),
        "extra field": ([envelope(body=dict(name="n", member="m", members=["m"], timeout_ms=1, x=1))],
                        "bad_request"),
        "tensor frames missing": ([envelope(tensors=[dict(name="t", dtype="float32", shape=[4], frames=1)])],
                                  "bad_request"),
    }
    import msgpack as mp

    with RpcClient(barrier_worker.address) as c:
        for what, (frames, code) in cases.items():
            reply = mp.unpackb(c.send_raw(frames)[0])
            assert reply["ok"] is False and reply["error"]["code"] == code, (what, reply)
        reply_ok, _ = c.call("barrier", "arrive",
                             BarrierArrive(name="solo", member="m", members=["m"], timeout_ms=1000),
                             BarrierReleased)
        assert reply_ok.generation == 0
    assert "timeout_ms" in str(cases)  # the type error names the field


def test_sigterm_drains_and_deregisters(server: RegistryServer) -> None:
    w = start_worker(server.address, JOB, "drained")
    registry = RemoteRegistry(server.address)
    try:
        w.signal(signal.SIGTERM)
        assert w.wait(15) == 0
        assert registry.get(worker_key(JOB, "drained")) is None
    finally:
        w.stop()
        registry.close()


def test_kill9_loses_lease_within_ttl(server: RegistryServer) -> None:
    w = start_worker(server.address, JOB, "killed", lease_ttl=1.0)
    registry = RemoteRegistry(server.address)
    try:
        assert registry.get(worker_key(JOB, "killed")) is not None
        w.signal(signal.SIGKILL)
        start = time.monotonic()
        while registry.get(worker_key(JOB, "killed")) is not None and time.monotonic() - start < 10:
            time.sleep(0.05)
        gone_after = time.monotonic() - start
        assert registry.get(worker_key(JOB, "killed")) is None
        assert gone_after < 1.0 + 1.0, f"card vanished {gone_after:.2f}s after kill -9 (lease 1 s)"
    finally:
        w.stop()
        registry.close()
    assert pack  # the card codec is the shared one


def test_worker_exits_when_its_registry_is_gone() -> None:
    with registry_server() as own:
        w = start_worker(own.address, JOB, "orphan", lease_ttl=1.0)
    # the registry (and the coordinator that served it) is gone: the worker must not linger
    try:
        code = w.wait(20)
    finally:
        w.stop()
    assert code == 0  # an orphaned worker did nothing wrong: it drains and exits 0
