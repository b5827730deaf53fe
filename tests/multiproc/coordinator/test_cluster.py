"""Workers started elsewhere (coordinator/runtime/cluster.py) and the entry points' refusals."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest

from comm.codec import pack
from comm.registry import RegistryServer
from coordinator.runtime.cluster import ClusterWorkers
from services.host.worker import worker_key
from services.protocol import WorkerCard
from tests.harness import commands

pytestmark = pytest.mark.timeout(60)

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def served() -> Iterator[RegistryServer]:
    with RegistryServer(host="127.0.0.1") as server:
        yield server


def _card(name: str, rank: int | None = None, world: int | None = None, gpus: int = 0) -> WorkerCard:
    return WorkerCard(
        name=name,
        address=f"tcp://127.0.0.1:{1000 + (rank or 0)}",
        pid=1,
        cpus=4,
        memory_bytes=2**30,
        gpus=gpus,
        rank=rank,
        world_size=world,
    )


def _publish(server: RegistryServer, job: str, *cards: WorkerCard) -> None:
    for card in cards:
        server.registry.put(worker_key(job, card.name), pack(card))


def test_workers_are_ordered_by_rank_and_described_as_resources(served: RegistryServer) -> None:
    _publish(served, "j", _card("b", 0, 3), _card("a", 2, 3), _card("c", 1, 3, gpus=1))
    with ClusterWorkers(str(served.address), "j", 3, timeout=timedelta(seconds=5)) as pool:
        assert pool.names == ["b", "c", "a"]
        assert pool.address("a") == "tcp://127.0.0.1:1002"
        resources = pool.resources()
    assert [w.name for w in resources.workers] == ["b", "c", "a"]
    assert [(w.device, w.gpus, w.cpus) for w in resources.workers] == [
        ("cpu", 0, 4),
        ("cuda", 1, 4),
        ("cpu", 0, 4),
    ]
    assert resources.workers[0].memory_bytes == int(2**30 * 0.8)


def test_a_timeout_names_who_came(served: RegistryServer) -> None:
    _publish(served, "j", _card("only", 0))
    served.registry.put("/cellmesh/j/workers/garbage", b"\x00not a card")  # skipped, not fatal
    pool = ClusterWorkers(str(served.address), "j", 2, timeout=timedelta(seconds=1))
    with pytest.raises(TimeoutError, match=r"1 of 2 workers registered .*\(only\); check .*--job j"):
        pool.start()
    pool.close()


@pytest.mark.parametrize(
    ("cards", "message"),
    [
        ((_card("a", 0, 3), _card("b", 1, 3)), "says WORLD_SIZE=3, the job expects 2"),
        ((_card("a", 1, 2), _card("b", 1, 2)), r"claim the same rank \[1\]"),
    ],
)
def test_inconsistent_cards_are_refused(
    served: RegistryServer, cards: tuple[WorkerCard, ...], message: str
) -> None:
    _publish(served, "j", *cards)
    pool = ClusterWorkers(str(served.address), "j", 2, timeout=timedelta(seconds=5))
    with pytest.raises(ValueError, match=message):
        pool.start()
    pool.close()


def _cellmesh(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return commands.run([sys.executable, "-m", "coordinator.commands.cli", *args], cwd=ROOT, timeout=50,
                        env={**os.environ, **(env or {})})


def test_the_coordinator_names_the_missing_workers_and_exits_2(
    served: RegistryServer, tmp_path: Path
) -> None:
    spec = tmp_path / "lonely.yaml"
    spec.write_text("name: lonely\nmodel: {factory: charlm:model}\ndata: {factory: charlm:data}\n"
                    "loss: {factory: charlm:loss}\nruntime: {workers: 2}\n")
    done = _cellmesh(
        "coordinator",
        str(spec),
        "--registry",
        str(served.address),
        "--wait-timeout",
        "1",
        "--output",
        str(tmp_path / "out.pt"),
        "--run-dir",
        str(tmp_path / "run"),
        "--insecure",  # the served registry of this test has no keys
        env={"PYTHONPATH": str(ROOT / "examples")},
    )
    assert done.returncode == 2, done.stderr
    assert "0 of 2 workers registered under /cellmesh/lonely/workers/" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "out.pt").exists()
    record = json.loads((tmp_path / "run" / "run.json").read_text())  # the failure is recorded
    assert record["phase"] == "failed" and "0 of 2 workers registered" in record["error"]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PET_NPROC_PER_NODE": "4"}, "one process per pod"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "RANK=2 is not below WORLD_SIZE=2"),
        ({}, "no registry"),
    ],
)
def test_the_worker_refuses_a_bad_launch_environment(env: dict[str, str], message: str) -> None:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "CELLMESH_REGISTRY"))}
    done = commands.run([sys.executable, "-m", "coordinator.commands.cli", "worker"], cwd=ROOT, timeout=50,
                        env={**clean, **env})
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.parametrize("command", [["worker", "--registry", "tcp://127.0.0.1:9"],
                                     ["coordinator", "job.yaml", "--registry", "tcp://127.0.0.1:9"]])
def test_an_entry_point_without_the_jobs_keys_refuses_to_start(command: list[str], tmp_path: Path) -> None:
    """Nothing is served unauthenticated by omission: no keys and no --insecure is an error, exit 2."""
    clean = {k: v for k, v in os.environ.items() if k != "CELLMESH_KEYS_DIR"}
    done = commands.run([sys.executable, "-m", "coordinator.commands.cli", *command], cwd=tmp_path,
                        timeout=50, env=clean)
    assert done.returncode == 2, done.stderr
    assert "no job keys" in done.stderr and "--insecure" in done.stderr
    assert "Traceback" not in done.stderr
