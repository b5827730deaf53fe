"""The workers' columns, and a placement read from them, against the worker-by-worker definitions."""

from __future__ import annotations

import random

import pytest

from coordinator.planning.planner import _Placed, _Shared, shared_cores
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Worker


def _random_resources(rng: random.Random) -> Resources:
    workers = []
    for h in range(rng.randint(1, 6)):
        given = rng.choice([None, rng.randint(1, 8)])
        for k in range(rng.randint(1, 5)):
            cuda = rng.random() < 0.1
            workers.append(Worker(name=f"h{h}-{k}", device="cuda" if cuda else "cpu", gpus=int(cuda),
                                  cpus=rng.randint(1, 3), memory_bytes=rng.randint(1, 9) * 10**9,
                                  speed=rng.choice([1.0, 0.5, 2.0, 1.3]),
                                  host=f"h{h}" if rng.random() < 0.9 else None, host_cpus=given))
    rng.shuffle(workers)
    return Resources(workers=tuple(workers))


def _wants(resources: Resources, ranks: list[list[Worker]]
           ) -> tuple[tuple[float, ...], list[list[tuple[int, float, int]]]]:
    """Per rank and CPU host, by definition: the threads its workers there run and how many they are; hosts
    numbered as their first CPU worker comes."""
    number: dict[str, int] = {}
    cores: list[float] = []
    wants: list[list[tuple[int, float, int]]] = []
    for ws in ranks:
        mine: dict[int, tuple[float, int]] = {}
        for w in ws:
            if w.device != "cpu" or w.host is None:
                continue
            if w.host not in number:
                number[w.host] = len(cores)
                cores.append(float(resources.host_cores(w.name)))
            k, n = mine.get(number[w.host], (0.0, 0))
            mine[number[w.host]] = (k + w.cpus, n + 1)
        wants.append([(h, k, n) for h, (k, n) in mine.items()])
    return tuple(cores), wants


def _starved(resources: Resources, ranks: list[list[Worker]]) -> list[float]:
    """Per rank, by definition: the most, over its workers' hosts with their cores given, of the share of the
    sync threads with no core to spare (the placed CPU workers' threads against the host's cores)."""
    placed = {w.name: w for ws in ranks for w in ws}.values()
    threads: dict[str, int] = {}
    count: dict[str, int] = {}
    for w in placed:
        if w.device == "cpu" and w.host is not None and w.host_cpus is not None:
            threads[w.host] = threads.get(w.host, 0) + w.cpus
            count[w.host] = count.get(w.host, 0) + 1
    one_of = {w.host: w.name for w in resources.workers if w.host is not None}  # a worker of each host
    share = {h: 1.0 - min(1.0, max(0, resources.host_cores(one_of[h]) - threads[h]) / count[h])
             for h in threads}
    if not resources.host_cores_given:
        return [0.0] * len(ranks)
    return [max([share.get(w.host, 0.0) if w.host is not None else 0.0 for w in ws], default=0.0)
            for ws in ranks]


@pytest.mark.parametrize("seed", range(40))
def test_a_placement_reads_its_workers_as_worker_by_worker(seed: int) -> None:
    rng = random.Random(seed)
    resources = _random_resources(rng)
    profile = Profile.synthetic([1e-3] * 4)
    names = [w.name for w in resources.workers]
    ranks = rng.randint(1, min(4, len(names)))
    replicas = rng.randint(1, len(names) // ranks)
    chunks = rng.choice([1, 1, 2, 3])
    chosen = rng.sample(names, replicas * ranks)
    placement = tuple(tuple(chosen[r * ranks:(r + 1) * ranks]) * chunks for r in range(replicas))
    placed = _Placed(_Shared(profile, resources), placement, ranks * chunks)

    by_name = {w.name: w for w in resources.workers}
    rows = [[by_name[row[k]] for row in placement] for k in range(ranks)]  # per rank, its replicas' workers
    per_stage = [rows[s % ranks] for s in range(ranks * chunks)]
    assert [[w.name for w in ws] for ws in placed.workers] == [[w.name for w in ws] for ws in per_stage]
    assert placed.speed == [min(w.speed for w in ws) for ws in per_stage]
    assert placed.memory == [min(w.memory_bytes for w in ws) for ws in per_stage]
    every = list({w.name: w for ws in rows for w in ws}.values())
    assert placed.on_cuda == all(w.device == "cuda" for w in every)
    hosts = [w.host for w in every if w.host is not None]
    assert placed.shared_host == (all(w.device == "cpu" for w in every) and len(hosts) > len(set(hosts)))
    if not placed.on_cuda:
        on_host = [[w for w in ws if w.device == "cpu" and w.host is not None] for ws in per_stage]
        assert placed.twins == [len(ws) > len({w.host for w in ws}) for ws in on_host]
    assert placed.starved == [_starved(resources, rows)[s % ranks] for s in range(ranks * chunks)]

    sharing = shared_cores(resources, rows)
    cores, wants = _wants(resources, rows)
    assert sharing.cores == cores
    assert [list(w) for w in sharing.wants] == wants
    if placed.shared_host:
        got = placed.sharing(ranks)
        assert got is not None and (got.cores, got.wants) == (sharing.cores, sharing.wants)
    else:
        assert placed.sharing(ranks) is None


def test_the_table_numbers_hosts_as_their_first_worker_comes() -> None:
    resources = Resources(workers=(
        Worker(name="a", memory_bytes=1, host="y"), Worker(name="b", memory_bytes=2, host="x", cpus=2),
        Worker(name="c", memory_bytes=3), Worker(name="d", memory_bytes=4, host="y", host_cpus=8)))
    table = resources.worker_table
    assert table.host.tolist() == [0, 1, -3, 0]
    assert table.host_cores.tolist() == [8, 2]
    assert table.indices(["d", "a"]).tolist() == [3, 0]
    with pytest.raises(KeyError):
        table.indices(["nobody"])
