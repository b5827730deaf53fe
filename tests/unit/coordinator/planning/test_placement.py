"""Placement: the list's order on one host; on several, pipelines or replica groups inside hosts by the
cost model's terms; the planner's predicted step gains from it."""

from __future__ import annotations

import itertools
import random

import pytest

from coordinator.planning import planner
from coordinator.planning.config import PlanConfig
from coordinator.planning.placement import (
    Placement,
    Traffic,
    _blocks,
    _first_fit,
    _hops,
    _links_by_hosts,
    grids,
    layout_cost,
    neighbour_link,
    place,
    place_with_links,
    step_traffic,
)
from coordinator.planning.profile import Profile
from coordinator.planning.resource_file import ClusterFile, HostGroup
from coordinator.planning.resources import Link, LinkSpeed, Resources, Worker

MiB = 2**20
INTRA = LinkSpeed(bandwidth_bps=100e9, latency_s=2e-6)
INTER = LinkSpeed(bandwidth_bps=1e9, latency_s=5e-5)


def cluster(hosts: int, per_host: int, *, device: str = "cpu") -> Resources:
    group = HostGroup(name="n", count=hosts, workers=per_host, device=device, gpus=int(device == "cuda"),
                      memory=80 * 2**30)
    return ClusterFile(hosts=(group,), intra_host=INTRA, inter_host=INTER).resources()


def todays(res: Resources, d: int, p: int, ranks: int) -> Placement:
    return tuple(tuple(res.workers[r * ranks + s % ranks].name for s in range(p)) for r in range(d))


def shapes(n: int) -> list[tuple[int, int, int]]:
    """Every (replicas, stages, ranks) that fits ``n`` workers, interleaved ones (2 chunks) too."""
    return [(d, ranks * v, ranks) for d in range(1, n + 1) for ranks in range(1, n // d + 1) for v in (1, 2)]


def test_one_host_is_the_list_order() -> None:
    for res in (Resources.local(8, memory_bytes=MiB), cluster(1, 8)):
        for d, p, ranks in shapes(8):
            assert place(res, d, p, ranks, traffic=lambda: Traffic(1e6, 4, 1e6)) == todays(res, d, p, ranks)


def test_links_that_ignore_hosts_keep_the_list_order() -> None:
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1, host=f"h{i % 2}") for i in range(8)))
    for d, p, ranks in shapes(8):
        assert place(res, d, p, ranks) == todays(res, d, p, ranks)


def hosts_of(res: Resources, names: tuple[str, ...]) -> set[tuple[str, str]]:
    return {res.host_of(n) for n in names}


def test_activations_keep_pipelines_in_a_host_and_gradients_keep_replica_groups() -> None:
    res = cluster(2, 4)
    activations, gradients = Traffic(64 * MiB, 8, 1024), Traffic(1024, 8, 512 * MiB)
    piped = place(res, 2, 4, 4, traffic=lambda: activations)
    assert all(len(hosts_of(res, row)) == 1 for row in piped) and piped == todays(res, 2, 4, 4)
    grouped = place(res, 2, 4, 4, traffic=lambda: gradients)
    assert all(len(hosts_of(res, (grouped[0][s], grouped[1][s]))) == 1 for s in range(4))
    assert sorted(n for row in grouped for n in row) == sorted(w.name for w in res.workers)
    for traffic, chosen, other in ((activations, piped, grouped), (gradients, grouped, piped)):
        assert layout_cost(res, chosen, traffic) < layout_cost(res, other, traffic)
    assert neighbour_link(res, piped) == (INTRA.bandwidth_bps, INTRA.latency_s)
    assert neighbour_link(res, grouped) == (INTER.bandwidth_bps, INTER.latency_s)


def test_interleaved_stages_share_their_rank_s_worker() -> None:
    gradients = Traffic(1024, 4, 256 * MiB)
    placed = place(cluster(2, 4), 4, 4, 2, traffic=lambda: gradients)  # 2 chunks per worker
    assert all(row[s] == row[s % 2] for row in placed for s in range(4))
    assert all(len(hosts_of(cluster(2, 4), tuple(row[k] for row in placed))) == 1 for k in range(2))
    # hosts of 2 hold no group of 4 replicas: its sync crosses hosts either way, so the pipelines stay inside
    placed = place(cluster(4, 2), 4, 4, 2, traffic=lambda: gradients)
    assert all(len(hosts_of(cluster(4, 2), row)) == 1 for row in placed)


def test_every_placement_uses_distinct_workers_on_random_clusters() -> None:
    rng = random.Random(7)
    for _ in range(200):
        groups = tuple(HostGroup(name=f"h{i}", workers=rng.randint(1, 5), memory=1)
                       for i in range(rng.randint(1, 4)))
        res = ClusterFile(hosts=groups, intra_host=INTRA, inter_host=INTER).resources()
        d, p, ranks = rng.choice(shapes(res.num_workers))
        traffic = Traffic(rng.choice([0, 1e3, 1e8]), rng.randint(1, 8), rng.choice([0, 1e3, 1e8]))
        placed = place(res, d, p, ranks, traffic=lambda t=traffic: t)
        grid = [row[:ranks] for row in placed]
        assert len({n for row in grid for n in row}) == d * ranks
        assert all(row[s] == row[s % ranks] for row in placed for s in range(p))



def test_a_placement_is_one_of_the_grids_of_its_replicas_and_ranks() -> None:
    """``grids`` (what the planner bounds a shape by before placing it) holds the grid ``place`` picks, for
    any stage count and traffic: on random clusters with links inside hosts, on lists whose links ignore the
    hosts (two speeds among them half the time) and on one host."""
    rng = random.Random(13)
    for _ in range(300):
        sizes = [rng.randint(1, 5) for _ in range(rng.randint(1, 4))]
        slow = rng.random() < 0.5
        inside = INTRA if rng.random() < 0.7 else None
        res = Resources(workers=tuple(
            Worker(name=f"h{h}-{i}", memory_bytes=1, host=f"h{h}", speed=0.5 if slow and (h + i) % 3 else 1.0)
            for h, size in enumerate(sizes) for i in range(size)), intra_host=inside)
        d, p, ranks = rng.choice(shapes(res.num_workers))
        traffic = Traffic(rng.choice([0, 1e3, 1e8]), rng.randint(1, 8), rng.choice([0, 1e3, 1e8]), 1e-3)
        placed = place(res, d, p, ranks, traffic=lambda t=traffic: t)
        options = grids(res, d, ranks)
        assert 1 <= len(options) <= 2
        assert [list(row[:ranks]) for row in placed] in options, (sizes, d, p, ranks)


def test_the_links_a_placement_reports_are_those_of_its_workers() -> None:
    """What the planner takes from the placement instead of looking it up: the neighbour link and every
    stage group's slowest link, on random clusters of hosts of any sizes (with per-host-pair links too)."""
    rng = random.Random(11)
    for _ in range(200):
        groups = tuple(HostGroup(name=f"h{i}", workers=rng.randint(1, 5), memory=1)
                       for i in range(rng.randint(2, 5)))
        res = ClusterFile(hosts=groups, intra_host=INTRA, inter_host=INTER).resources()
        if rng.random() < 0.3:  # a slower pair of hosts
            slow = {"a": "h0-0", "b": "h1-0", "bandwidth_bps": 1e8, "latency_s": 1e-4}
            res = Resources(workers=res.workers, intra_host=res.intra_host, bandwidth_bps=res.bandwidth_bps,
                            latency_s=res.latency_s, host_links=({**slow, "a": "h0", "b": "h1"},))
        d, p, ranks = rng.choice(shapes(res.num_workers))
        traffic = Traffic(rng.choice([0, 1e3, 1e8]), rng.randint(1, 8), rng.choice([0, 1e3, 1e8]))
        placed, links = place_with_links(res, d, p, ranks, traffic=lambda t=traffic: t)
        assert placed == place(res, d, p, ranks, traffic=lambda t=traffic: t)
        assert links is not None
        assert links.neighbour == neighbour_link(res, placed)
        for s in range(p):
            assert links.ranks[s % ranks] == res.slowest_link([row[s] for row in placed])


def test_hosts_of_one_size_cut_in_turn_as_first_fit_would() -> None:
    """Blocks on hosts of one size that divides the block or that the block divides: the workers in host
    order, cut in turn, the same as the first fit of any hosts gives."""
    for host, hosts in itertools.product((1, 2, 4, 8), (1, 3, 16)):
        groups = [[f"h{h}-{k}" for k in range(host)] for h in range(hosts)]
        for size in range(1, host * hosts + 1):
            if host % size and size % host:
                continue
            for count in range(1, host * hosts // size + 1):
                assert _blocks(groups, count, size) == _first_fit(groups, count, size), (host, size, count)


def test_place_refuses_a_shape_it_cannot_place() -> None:
    with pytest.raises(ValueError, match="need 9 workers, the resource list has 8"):
        place(cluster(2, 4), 3, 3, 3)
    with pytest.raises(ValueError, match="multiple of the ranks"):
        place(cluster(2, 4), 1, 3, 2)


def test_step_traffic_scales_the_cuts_with_the_microbatch() -> None:
    prof = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, cut_bytes=[1000, 2000, 3000],
                             microbatch_size=2)
    # the mean cut, forward and back, at twice the profiled size; half the gradients per stage; every
    # node's forward (1 ms) and backward (twice it) at twice the profiled size
    got = step_traffic(prof, 2, 8, 4)
    assert got == Traffic(2 * 2 * 2000, 8, 2 * MiB, got.compute_s)
    assert got.compute_s == pytest.approx(2 * 4 * 3e-3)


def test_the_planner_syncs_replica_groups_inside_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Parameter-heavy stages with small cuts on 2 hosts x 4 GPUs: each stage's replicas share a host, and the
    predicted step beats the list's order (pipelines inside hosts, replica groups across)."""
    prof = Profile.synthetic([1e-3] * 8, param_bytes=[64 * MiB] * 8, activation_bytes=[MiB] * 8,
                             cut_bytes=[16 * 1024] * 7, microbatch_size=4)
    res, request = cluster(2, 4, device="cuda"), PlanConfig(data_parallel=2, num_stages=4, schedule="1f1b")
    plan = planner.choose_plan(prof, res, request, global_batch=64)
    assert all(len(hosts_of(res, st.workers)) == 1 for st in plan.stages)
    monkeypatch.setattr(planner, "place_with_links",
                        lambda r, d, p, ranks, traffic=None: (todays(r, d, p, ranks), None))
    listed = planner.choose_plan(prof, res, request, global_batch=64)
    assert all(len(hosts_of(res, st.workers)) == 2 for st in listed.stages)
    assert plan.step_time_s < listed.step_time_s
    assert max(st.sync_s for st in plan.stages) < max(st.sync_s for st in listed.stages) / 10


def test_a_pipeline_inside_a_host_is_priced_at_the_intra_host_link(monkeypatch: pytest.MonkeyPatch) -> None:
    """2 hosts x 2 CPU workers, large activations: each replica's pipeline runs inside a host and its
    transfers cost the intra-host link (by hand below), not the slowest link of the plan's workers."""
    cut = 8 * MiB
    prof = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, activation_bytes=[MiB] * 4,
                             cut_bytes=[cut] * 3, microbatch_size=4)
    res = cluster(2, 2)
    request = PlanConfig(data_parallel=2, num_stages=2, schedule="gpipe", num_microbatches=2)
    plan = planner.choose_plan(prof, res, request, global_batch=16)
    assert all(len(hosts_of(res, row)) == 1 for row in plan.placement)
    # each endpoint pays its activations forward and their gradients back, at 4 samples (the profiled size)
    hand = 2 * (planner.TRANSFER_OVERHEAD_S + INTRA.latency_s + cut / INTRA.bandwidth_bps)
    assert plan.stages[0].transfer_s == pytest.approx(hand, rel=1e-12)
    assert plan.stages[1].transfer_s == pytest.approx(hand, rel=1e-12)
    # priced as before (the slowest link among all four workers: between hosts), the same placement is slower
    monkeypatch.setattr(planner, "neighbour_link",
                        lambda r, placement: r.slowest_link([n for row in placement for n in row]))
    monkeypatch.setattr(planner, "place_with_links",  # the links looked up (by the line above), not reported
                        lambda r, d, p, ranks, traffic=None: (place(r, d, p, ranks, traffic=traffic), None))
    before = planner.choose_plan(prof, res, request, global_batch=16)
    assert before.placement == plan.placement
    slow = 2 * (planner.TRANSFER_OVERHEAD_S + INTER.latency_s + cut / INTER.bandwidth_bps)
    assert before.stages[0].transfer_s == pytest.approx(slow, rel=1e-12)
    # the replica groups cross hosts in both (the hiding backward as each placement's play stretched it)
    assert before.sync_time_s == pytest.approx(plan.sync_time_s, rel=1e-9)
    # microbatch 0's activations and microbatch 1's gradients cross on the step's one dependency chain
    assert before.pipeline_time_s - plan.pipeline_time_s > slow - hand


@pytest.mark.parametrize("seed", range(60))
def test_a_layout_s_links_from_host_numbers_are_the_pairs_slowest(seed: int) -> None:
    """Where the links follow the hosts, a grid's hop and rank links read from the workers' host numbers
    are what looking the pairs up gives (workers with and without hosts, one replica or many)."""
    rng = random.Random(seed)
    workers = [Worker(name=f"h{h}-{k}", memory_bytes=10**9, host=f"h{h}" if rng.random() < 0.85 else None)
               for h in range(rng.randint(1, 5)) for k in range(rng.randint(1, 5))]
    rng.shuffle(workers)
    resources = Resources(workers=tuple(workers), bandwidth_bps=rng.choice([1e9, 5e9]), latency_s=1e-4,
                          intra_host=LinkSpeed(bandwidth_bps=rng.choice([1e9, 1e10]),
                                               latency_s=rng.choice([1e-6, 1e-3])) if seed % 5 else None)
    names = [w.name for w in workers]
    ranks = rng.randint(1, min(4, len(names)))
    replicas = rng.randint(1, len(names) // ranks)
    chosen = rng.sample(names, replicas * ranks)
    grid = [chosen[r * ranks:(r + 1) * ranks] for r in range(replicas)]
    hops = _hops(ranks, rng.choice([1, 2]))
    pipe = resources.slowest_of_pairs((row[a], row[b]) for row in grid for a, b in hops) if hops else None
    per_rank = tuple(resources.slowest_link([row[k] for row in grid]) for k in range(ranks))
    assert _links_by_hosts(resources, grid, hops) == (pipe, per_rank)
    named = Resources(workers=resources.workers, links=(Link(a=names[0], b=names[-1], bandwidth_bps=1.0,
                                                             latency_s=1.0),))
    assert _links_by_hosts(named, grid, hops) is None  # a per-pair link: the pairs are looked up
    assert _links_by_hosts(resources, [*grid[:-1], [*grid[-1][:-1], "not-a-worker"]], hops) is None
    assert _links_by_hosts(resources, [*grid, grid[0]], hops) is None  # a worker twice


def two_generations(fast_hosts: int, slow_hosts: int, per_host: int, speed: float = 2.0) -> Resources:
    """Hosts of GPU workers, the first ``fast_hosts`` at ``speed``, the rest at 1."""
    groups = (HostGroup(name="new", count=fast_hosts, workers=per_host, device="cuda", gpus=1,
                        memory=80 * 2**30, speed=speed),
              HostGroup(name="old", count=slow_hosts, workers=per_host, device="cuda", gpus=1,
                        memory=80 * 2**30))
    return ClusterFile(hosts=groups, intra_host=INTRA, inter_host=INTER).resources()


def rank_speeds(res: Resources, placed: Placement, ranks: int) -> list[float]:
    return [min(res.worker(row[k]).speed for row in placed) for k in range(ranks)]


def test_a_stage_group_of_one_generation_beats_a_pipeline_over_both() -> None:
    """[Note: a layout's speeds]: 4 replicas x 4 stages on 2 fast and 2 slow hosts of 4. Pipelines inside
    hosts put a slow worker in every stage's group (each stage at half speed); stage groups inside hosts
    keep two stages fast. Where the compute outweighs the links, the stage groups are chosen; with no
    compute, the links alone decide as before (the pipelines, for activations)."""
    res = two_generations(2, 2, 4)
    activations = Traffic(64 * MiB, 8, 1024)
    assert rank_speeds(res, place(res, 4, 4, 4, traffic=lambda: activations), 4) == [1.0] * 4
    busy = Traffic(64 * MiB, 8, 1024, compute_s=1.0)  # a second of compute a microbatch: over the links' ms
    placed = place(res, 4, 4, 4, traffic=lambda: busy)
    assert rank_speeds(res, placed, 4) == [2.0, 2.0, 1.0, 1.0]
    assert all(len(hosts_of(res, tuple(row[k] for row in placed))) == 1 for k in range(4))
    assert sorted(n for row in placed for n in row) == sorted(w.name for w in res.workers)


def test_a_list_without_host_links_groups_each_stage_on_alike_workers() -> None:
    """[Note: a layout's speeds]: links that ignore hosts leave the list's order, unless its workers' speeds
    differ: then each stage's replicas go on the fastest alike workers left (list order among alike), which
    adds up the most speed over the stages; the list's order where that gains nothing."""
    speeds = [1.0, 1.0, 1.0, 1.0, 0.5, 0.5, 0.5, 0.5]
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB, speed=s)
                                  for i, s in enumerate(speeds)))
    placed = place(res, 2, 4, 4)
    assert rank_speeds(res, todays(res, 2, 4, 4), 4) == [0.5] * 4
    assert placed == (("w0", "w2", "w4", "w6"), ("w1", "w3", "w5", "w7"))
    assert rank_speeds(res, placed, 4) == [1.0, 1.0, 0.5, 0.5]
    # one replica, or one stage: nothing to group; alike speeds: the list's order
    assert place(res, 1, 4, 4) == todays(res, 1, 4, 4) and place(res, 4, 1, 1) == todays(res, 4, 1, 1)
    alike = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB) for i in range(8)))
    assert place(alike, 2, 4, 4) == todays(alike, 2, 4, 4)
    # speeds that alternate: grouping the fast ones gains nothing over the list's order, which stays
    mixed = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB, speed=(1.0, 0.5)[i % 2])
                                    for i in range(8)))
    assert place(mixed, 2, 4, 4) == todays(mixed, 2, 4, 4)


def test_the_planner_runs_two_generations_faster_with_their_stages_grouped() -> None:
    """On 2 fast and 2 slow hosts of 4 GPUs, a fixed shape of 4 replicas x 4 stages of a model whose
    activations outweigh its gradients (the links alone keep pipelines inside hosts): the plan's predicted
    step against the same plan on the slow hosts' speed everywhere, which is what a pipeline over both
    generations ran at (every stage had a slow replica: 1.0 of it). Grouped, two stages run twice as fast
    and the cut gives them more of the chain: at most 0.8 of it (0.79 here; the compute alone, 4 speed
    units of 6, would give 0.67)."""
    prof = Profile.synthetic([1e-2] * 16, param_bytes=[1024] * 16, activation_bytes=[MiB] * 16,
                             cut_bytes=[4 * MiB] * 15, microbatch_size=4)
    request = PlanConfig(data_parallel=4, num_stages=4, schedule="gpipe", num_microbatches=4)
    mixed = planner.choose_plan(prof, two_generations(2, 2, 4), request, global_batch=64)
    slow = planner.choose_plan(prof, two_generations(2, 2, 4, speed=1.0), request, global_batch=64)
    assert mixed.step_time_s <= 0.8 * slow.step_time_s, (mixed.step_time_s, slow.step_time_s)
