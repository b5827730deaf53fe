"""The resource list: validation, links, and this machine as local workers."""

from __future__ import annotations

import os
import random

import pytest
from pydantic import ValidationError

from coordinator.planning.resources import (
    LOCAL_BANDWIDTH_BPS,
    LOCAL_LATENCY_S,
    HostLink,
    Link,
    LinkSpeed,
    Resources,
    Worker,
)


def test_local_describes_this_machine() -> None:
    res = Resources.local(workers=2)
    assert [w.name for w in res.workers] == ["local-0", "local-1"]
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert sum(w.memory_bytes for w in res.workers) <= total
    assert all(w.device == "cpu" and w.cpus >= 1 for w in res.workers)
    assert Resources.local(3, memory_bytes=2**20).workers[2].memory_bytes == 2**20
    with pytest.raises(ValueError, match="workers must be >= 1"):
        Resources.local(0)


def test_links_and_defaults() -> None:
    res = Resources(workers=(Worker(name="a", memory_bytes=1), Worker(name="b", memory_bytes=1),
                             Worker(name="c", memory_bytes=1)),
                    bandwidth_bps=10e9, latency_s=1e-5,
                    links=(Link(a="a", b="c", bandwidth_bps=1e9, latency_s=1e-3),))
    assert res.link("c", "a") == (1e9, 1e-3)
    assert res.link("a", "b") == (10e9, 1e-5)
    assert res.slowest_link(["a", "b", "c"]) == (1e9, 1e-3)
    assert res.worker("b").name == "b"
    with pytest.raises(KeyError):
        res.worker("z")
    assert Resources.model_validate_json(res.model_dump_json()) == res


def test_bad_resource_lists_are_refused() -> None:
    with pytest.raises(ValidationError, match="duplicate worker names"):
        Resources(workers=(Worker(name="a", memory_bytes=1), Worker(name="a", memory_bytes=1)))
    with pytest.raises(ValidationError, match="unknown workers"):
        Resources(workers=(Worker(name="a", memory_bytes=1),),
                  links=(Link(a="a", b="x", bandwidth_bps=1, latency_s=0),))
    with pytest.raises(ValidationError, match="gpus"):
        Worker(name="g", device="cuda", memory_bytes=1)
    with pytest.raises(ValidationError, match="extra"):
        Worker.model_validate({"name": "a", "memory_bytes": 1, "colour": "red"})
    with pytest.raises(ValidationError):
        Resources(workers=())


def _pairwise(res: Resources, names: list[str]) -> tuple[float, float]:
    """The reference: every pair's link, as slowest_link visited them before it grouped by host."""
    pairs = [res.link(x, y) for i, x in enumerate(names) for y in names[i + 1:]]
    if not pairs:
        return res.bandwidth_bps, res.latency_s
    return min(bw for bw, _ in pairs), max(lat for _, lat in pairs)


def _random_cluster(rng: random.Random) -> Resources:
    hosts = [f"h{i}" for i in range(rng.randint(1, 4))]
    workers = tuple(Worker(name=f"w{i}", memory_bytes=1, host=rng.choice([*hosts, None]))
                    for i in range(rng.randint(2, 9)))
    names = [w.name for w in workers]
    used = sorted({w.host for w in workers if w.host is not None})
    speed = lambda: {"bandwidth_bps": rng.choice([1e9, 2e9, 5e9, 1e10]),  # noqa: E731
                     "latency_s": rng.choice([1e-6, 1e-5, 1e-4, 1e-3])}
    links = tuple(Link(a=rng.choice(names), b=rng.choice(names), **speed()) for _ in range(rng.randint(0, 6)))
    host_links = tuple(HostLink(a=rng.choice(used), b=rng.choice(used), **speed())
                       for _ in range(rng.randint(0, 3) if used else 0))
    intra = LinkSpeed(**speed()) if rng.random() < 0.7 else None
    return Resources(workers=workers, links=links, host_links=host_links, intra_host=intra, **speed())


def test_slowest_link_matches_every_pair_on_random_clusters() -> None:
    rng = random.Random(18)
    for _ in range(400):
        res = _random_cluster(rng)
        names = [w.name for w in res.workers]
        for _ in range(5):  # subsets, in any order, a name now and then twice
            group = rng.sample(names, rng.randint(0, len(names)))
            if group and rng.random() < 0.2:
                group.append(rng.choice(group))
            assert res.slowest_link(group) == _pairwise(res, group), (res, group)
            pairs = [(rng.choice(names), rng.choice(names)) for _ in range(rng.randint(0, 6))]
            links = [res.link(a, b) for a, b in pairs] or [(res.bandwidth_bps, res.latency_s)]
            assert res.slowest_of_pairs(pairs) == (min(bw for bw, _ in links), max(lat for _, lat in links))



def test_links_by_host_alone_match_every_pair_on_random_clusters() -> None:
    """A list whose links depend on the hosts alone (no per-worker or per-host-pair link) answers from the
    hosts' numbers: the same as every pair's link, workers without a host and a pair of one worker with
    itself included, and a name not in the list taken as link() takes it."""
    rng = random.Random(27)
    for _ in range(400):
        res = _random_cluster(rng)
        res = Resources(workers=res.workers, intra_host=res.intra_host, bandwidth_bps=res.bandwidth_bps,
                        latency_s=res.latency_s)
        names = [w.name for w in res.workers]
        for _ in range(5):
            group = rng.sample(names, rng.randint(0, len(names)))
            if group and rng.random() < 0.2:
                group.append(rng.choice(group))
            assert res.slowest_link(group) == _pairwise(res, group), (res, group)
            pairs = [(rng.choice([*names, "stranger"]), rng.choice(names)) for _ in range(rng.randint(0, 6))]
            links = [res.link(a, b) for a, b in pairs] or [(res.bandwidth_bps, res.latency_s)]
            assert res.slowest_of_pairs(iter(pairs)) == (min(bw for bw, _ in links),
                                                         max(lat for _, lat in links)), (res, pairs)

def test_which_link_joins_two_workers() -> None:
    hosts = {"a0": "a", "a1": "a", "b0": "b", "c0": "c", "solo": None}
    res = Resources(workers=tuple(Worker(name=n, memory_bytes=1, host=h) for n, h in hosts.items()),
                    bandwidth_bps=1e9, latency_s=1e-4,
                    intra_host=LinkSpeed(bandwidth_bps=1e11, latency_s=1e-6),
                    host_links=(HostLink(a="a", b="b", bandwidth_bps=5e9, latency_s=2e-5),  # the first wins
                                HostLink(a="b", b="a", bandwidth_bps=1, latency_s=1)),
                    links=(Link(a="a1", b="a0", bandwidth_bps=2e9, latency_s=3e-5),))
    assert res.link("a0", "a1") == (2e9, 3e-5)  # the pair's own link
    assert res.link("a0", "b0") == (5e9, 2e-5)  # the host pair's
    assert res.link("a0", "c0") == res.link("solo", "a0") == (1e9, 1e-4)  # the defaults between hosts
    assert res.slowest_link(["a0", "a1"]) == (2e9, 3e-5)  # the only intra-host pair is overridden
    assert res.slowest_link(["a0", "a1", "b0"]) == (2e9, 3e-5)
    assert res.slowest_link(["a1", "b0", "c0"]) == (1e9, 1e-4)
    assert [len(g) for g in res.host_groups] == [2, 1, 1, 1] and res.host_of("solo") == ("alone", "solo")
    with pytest.raises(ValidationError, match="unknown hosts"):
        Resources(workers=res.workers, host_links=(HostLink(a="a", b="z", bandwidth_bps=1, latency_s=0),))


def test_slowest_link_of_a_thousand_workers_visits_no_pair(monkeypatch: pytest.MonkeyPatch) -> None:
    inter, intra = (1.25e9, 1e-4), (3e11, 5e-6)
    res = Resources(workers=tuple(Worker(name=f"n{i // 8}-{i % 8}", memory_bytes=1, host=f"n{i // 8}")
                                  for i in range(1024)),
                    bandwidth_bps=inter[0], latency_s=inter[1],
                    intra_host=LinkSpeed(bandwidth_bps=intra[0], latency_s=intra[1]),
                    links=(Link(a="n5-0", b="n5-1", bandwidth_bps=1e8, latency_s=1e-3),))
    visited: list[tuple[str, str]] = []
    original = Resources.link
    monkeypatch.setattr(Resources, "link", lambda self, a, b: visited.append((a, b)) or original(self, a, b))
    names = [w.name for w in res.workers]
    assert res.slowest_link(names) == (1e8, 1e-3)
    assert res.slowest_link([n for n in names if not n.startswith("n5-")]) == inter
    assert res.slowest_link([f"n7-{i}" for i in range(8)]) == intra
    assert res.slowest_link(["n5-0", "n5-1", "n5-2"]) == (1e8, 1e-3)
    assert res.slowest_link(["n5-0", "n5-1"]) == (1e8, 1e-3)
    assert visited == []


def test_local_has_the_flat_links_of_before() -> None:
    res = Resources.local(3, memory_bytes=2**20)
    assert res.intra_host is None and res.host_links == () and not res.host_dependent_links
    assert res.slowest_link([w.name for w in res.workers]) == (LOCAL_BANDWIDTH_BPS, LOCAL_LATENCY_S)


def test_crowded_hosts_are_those_whose_cpu_workers_want_more_threads_than_cores() -> None:
    """Per host, the CPU workers' threads against its cores (the most ``host_cpus`` given, else the threads
    together: never crowded); GPU workers and workers of no host are not counted."""
    res = Resources(workers=(
        Worker(name="a0", memory_bytes=1, host="a", cpus=4, host_cpus=6),
        Worker(name="a1", memory_bytes=1, host="a", cpus=4),  # a's cores: 6, the most given
        Worker(name="b0", memory_bytes=1, host="b", cpus=2, host_cpus=4),
        Worker(name="b1", memory_bytes=1, host="b", cpus=2),  # 4 threads of 4 cores: not crowded
        Worker(name="c0", memory_bytes=1, host="c", cpus=8),
        Worker(name="c1", memory_bytes=1, host="c", cpus=8),  # no cores given: the threads together
        Worker(name="g0", memory_bytes=1, host="g", device="cuda", gpus=1, cpus=8, host_cpus=2),
        Worker(name="alone", memory_bytes=1, cpus=64)))
    assert res.crowded_hosts() == [("a", 2, 8, 6)]
    assert Resources.local(2 * (os.cpu_count() or 1)).crowded_hosts()[0][1:] == (
        2 * (os.cpu_count() or 1), 2 * (os.cpu_count() or 1), os.cpu_count() or 1)
