"""The session's view of a failed runtime's checkpoint parts: who writes each, and which writers are lost."""

from __future__ import annotations

from types import SimpleNamespace

from comm.codec import pack
from comm.registry.memory import MemoryRegistry
from coordinator.runtime.session import Session
from services.protocol import WorkerCard

PREFIX = "/cellmesh/j/workers/"


def _card(name: str, incarnation: str) -> WorkerCard:
    return WorkerCard(name=name, address="tcp://127.0.0.1:1", pid=1, cpus=1, memory_bytes=0, gpus=0,
                      incarnation=incarnation)


def test_the_lost_writers_are_read_from_the_registry_not_from_the_events_not_read_yet() -> None:
    """A salvage waits on the coordinator's thread, which is not reading the event loop's events: a worker
    whose card vanished meanwhile must still count as lost, or the wait would last the whole step timeout."""
    registry = MemoryRegistry()
    registry.put(PREFIX + "local-0", pack(_card("local-0", "a")))
    registry.put(PREFIX + "local-2", pack(_card("local-2", "c2")))  # restarted in place: another incarnation
    placed = {"local-0": "a", "local-1": "b", "local-2": "c", "local-3": "d"}
    session = Session.__new__(Session)
    session.job = SimpleNamespace(name="j")  # type: ignore[assignment]
    session.runtime = SimpleNamespace(placed_incarnation=placed.get)  # type: ignore[assignment]
    session.loop = SimpleNamespace(registry=registry, prefix=PREFIX,  # type: ignore[assignment]
                                   members={n: _card(n, i) for n, i in placed.items()})  # as last read
    writers = {"r0-s0": "local-0", "r1-s0": "local-1", "r2-s0": "local-2", "ps-s0-3": "local-3"}
    assert session._lost_writers(writers, "") == {"local-1", "local-2", "local-3"}
    assert session._lost_writers(writers, "local-0") == {"local-0", "local-1", "local-2", "local-3"}
    registry.close()
