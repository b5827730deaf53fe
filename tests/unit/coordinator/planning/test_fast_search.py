"""The fast search (bounds, then the simulator on the finalists) chooses as the exhaustive search does.

The exhaustive search (``choose_plan(..., exhaustive=True)``) plays every shape and memory option in
the simulator; the fast one ranks the shapes by a lower bound and plays only those that could win
([Note: the fast search] in ``coordinator/planning/planner.py``). Over a grid of profiles (even,
uneven, heavy), worker counts, hosts, memory budgets and fixed fields, both must return the same
plan (shape, schedule, microbatches, cut, predicted step: the whole ``Plan``) or the same refusal.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Iterator

import numpy as np
import pytest

from coordinator.planning import planner
from coordinator.planning.closed_form import (
    KINDS,
    cut_free_bound,
    paced_fill_bound,
    pipeline_bound,
    rank_bounds,
    stage_bounds,
)
from coordinator.planning.config import PlanConfig
from coordinator.planning.cutting import get_cutter
from coordinator.planning.memory import AUTOMATIC, REPLICATED
from coordinator.planning.planner import _rank, candidate_plans, choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.request import PlanningError, Shape
from coordinator.planning.resources import HostLink, LinkSpeed, Resources, Worker
from coordinator.planning.schedules import (
    Step,
    build_schedule,
    peak_in_flight,
    schedule_problem,
    schedule_steps,
    stage_holds,
)
from coordinator.planning.simulator import Sharing, StageCosts, _filled_by, play
from services.compute.weight_grads import defers

MiB = 2**20
KiB = 2**10


def profile(kind: str) -> Profile:
    if kind == "even":
        return Profile.synthetic([1e-3] * 6, param_bytes=[2 * MiB] * 6, activation_bytes=[MiB] * 6,
                                 cut_bytes=[64 * KiB] * 5, microbatch_size=2)
    if kind == "uneven":  # a heavy middle, a light tail, one big crossing
        return Profile.synthetic([1e-3, 4e-3, 6e-3, 1e-3, 5e-4, 2e-3, 3e-4],
                                 param_bytes=[MiB, 6 * MiB, 8 * MiB, MiB, 512 * KiB, 3 * MiB, 256 * KiB],
                                 activation_bytes=[MiB, 2 * MiB, 3 * MiB, MiB, MiB, 2 * MiB, 512 * KiB],
                                 cut_bytes=[64 * KiB, 2 * MiB, 128 * KiB, 64 * KiB, 32 * KiB, 16 * KiB],
                                 microbatch_size=2)
    if kind == "long":  # more nodes than workers, uneven: many stage counts to search
        times = [1e-3, 3e-3, 2e-3, 5e-4, 4e-3, 1e-3, 2e-3, 6e-3, 1e-3, 5e-4, 3e-3, 2e-3, 1e-3, 2e-3]
        return Profile.synthetic(times, param_bytes=[int(t * 4e9) for t in times],
                                 activation_bytes=[int(t * 5e8) for t in times],
                                 cut_bytes=[(i % 4 + 1) * 32 * KiB for i in range(len(times) - 1)],
                                 microbatch_size=2)
    if kind == "split":  # the uneven chain with its backwards timed as halves (I and W, part fixed)
        base = profile("uneven")
        nodes = tuple(nd.model_copy(update={"input_backward_s": 0.45 * nd.backward_s,
                                            "input_backward_fixed_s": 0.1 * nd.backward_s,
                                            "weight_s": 0.4 * nd.backward_s * (i % 3 > 0),
                                            "weight_fixed_s": 0.2 * nd.backward_s * (i % 3 > 0)})
                      for i, nd in enumerate(base.nodes))
        return base.model_copy(update={"nodes": nodes})
    # heavy: parameters dominate (the sync decides between replicas and stages)
    return Profile.synthetic([2e-3] * 8, param_bytes=[24 * MiB] * 8, activation_bytes=[256 * KiB] * 8,
                             cut_bytes=[32 * KiB] * 7, microbatch_size=2)


def workers(count: int, memory: int, hosts: str) -> Resources:
    """``hosts``: ``one`` (all on one host), ``own`` (a host each), ``pairs`` (two a host, the last slow),
    ``cores`` (all on one host of 2 cores, as ``Resources.local`` on this machine: they take turns)."""
    def host(i: int) -> str:
        return "h" if hosts in ("one", "cores") else f"h{i}" if hosts == "own" else f"h{i // 2}"
    return Resources(workers=tuple(
        Worker(name=f"w{i}", memory_bytes=memory, host=host(i), host_cpus=2 if hosts == "cores" else None,
               speed=0.5 if hosts == "pairs" and i == count - 1 else 1.0) for i in range(count)))


FIXED = [{}, {"schedule": "1f1b"}, {"data_parallel": 2}, {"num_stages": 2}, {"mode": "parameter_server"},
         {"num_microbatches": 4}, {"strategy": "pipeline"}, {"schedule": "interleaved-1f1b"},
         {"schedule": "zb-h1"}]
BIG = 1 << 40
CASES = [  # profile, workers, hosts, memory per worker, FIXED index
    ("even", 1, "one", BIG, 0), ("even", 2, "one", BIG, 0), ("even", 3, "own", BIG, 0),
    ("even", 4, "one", BIG, 0), ("even", 4, "own", BIG, 1), ("even", 8, "pairs", BIG, 0),
    ("even", 16, "own", BIG, 0), ("even", 6, "one", BIG, 2), ("even", 4, "one", 14 * MiB, 0),
    ("uneven", 2, "one", BIG, 0), ("uneven", 4, "own", BIG, 0), ("uneven", 4, "one", BIG, 1),
    ("uneven", 8, "own", BIG, 0), ("uneven", 8, "pairs", BIG, 3), ("uneven", 5, "one", BIG, 4),
    ("uneven", 4, "own", BIG, 5), ("uneven", 4, "one", 40 * MiB, 0), ("uneven", 8, "one", 30 * MiB, 6),
    ("uneven", 16, "pairs", BIG, 0), ("uneven", 2, "one", 20 * MiB, 0),
    ("heavy", 2, "own", BIG, 0), ("heavy", 4, "one", BIG, 0), ("heavy", 8, "own", BIG, 0),
    ("heavy", 4, "own", 200 * MiB, 0), ("heavy", 8, "pairs", 150 * MiB, 0), ("heavy", 4, "one", 300 * MiB, 2),
    ("heavy", 16, "own", BIG, 5), ("heavy", 2, "one", 100 * MiB, 0),
    # free stage counts over a longer chain: hosts, memory that forces stages, each pipelined schedule
    ("long", 12, "pairs", BIG, 0), ("long", 8, "own", 140 * MiB, 0), ("long", 6, "one", BIG, 7),
    ("long", 8, "pairs", BIG, 8), ("long", 16, "own", 220 * MiB, 6), ("long", 10, "one", BIG, 0),
    # more workers than the host's cores: every shape's work over the cores ties, the bound must cut
    ("even", 6, "cores", BIG, 0), ("uneven", 8, "cores", BIG, 0), ("uneven", 4, "cores", 40 * MiB, 7),
    ("heavy", 6, "cores", BIG, 4), ("long", 12, "cores", BIG, 0), ("long", 8, "cores", BIG, 8),
    # backwards priced as each schedule runs them
    ("split", 4, "own", BIG, 0), ("split", 6, "cores", BIG, 0), ("split", 4, "one", BIG, 8),
    ("split", 8, "pairs", BIG, 7), ("split", 4, "own", 40 * MiB, 1), ("split", 6, "one", BIG, 2)]


def both_searches(prof: Profile, res: Resources, request: PlanConfig) -> tuple[object, object]:
    """The fast and the exhaustive search's answers for 16 samples: a plan, or the planning error's gist."""
    outcomes: list[object] = []
    for exhaustive in (False, True):
        try:
            outcomes.append(choose_plan(prof, res, request, global_batch=16, exhaustive=exhaustive))
        except PlanningError as exc:
            outcomes.append(str(exc).split(" (")[0])
    return outcomes[0], outcomes[1]


@pytest.mark.parametrize(("kind", "count", "hosts", "budget", "fixed"), CASES)
def test_the_fast_search_chooses_the_exhaustive_plan(kind: str, count: int, hosts: str, budget: int,
                                                     fixed: int) -> None:
    prof, res = profile(kind), workers(count, budget, hosts)
    request = PlanConfig(max_microbatches=4, **FIXED[fixed])
    fast, exhaustive = both_searches(prof, res, request)
    assert fast == exhaustive


@pytest.mark.parametrize("case", [CASES[i] for i in (6, 13, 18, 22, 28, 33)])
def test_the_runners_up_are_the_best_of_every_candidate(case: tuple[str, int, str, int, int]) -> None:
    """``candidate_plans(limit=N)`` (branch and bound, the N-th best as the bar) against every candidate."""
    kind, count, hosts, budget, fixed = case
    prof, res = profile(kind), workers(count, budget, hosts)
    request = PlanConfig(max_microbatches=4, **FIXED[fixed])
    every = candidate_plans(prof, res, request, global_batch=16)
    plain = sorted(((_rank(c), i) for i, c in enumerate(every) if c.fits and c.option == REPLICATED))
    assert len(plain) >= 6
    for limit in (1, 5):
        best = candidate_plans(prof, res, request, global_batch=16, limit=limit)
        assert best == [every[i] for _, i in plain[:limit]]


def test_the_grid_is_not_vacuous() -> None:
    """Its plans pipeline, replicate and do both, over several schedules; some refuse."""
    shapes, schedules = set(), set()
    for kind, count, hosts, budget, fixed in CASES:
        try:
            plan = choose_plan(profile(kind), workers(count, budget, hosts),
                               PlanConfig(max_microbatches=4, **FIXED[fixed]), global_batch=16)
        except PlanningError:
            continue
        shapes.add((plan.data_parallel > 1, plan.num_stages > 1))
        schedules.add(plan.schedule_name)
    assert shapes >= {(True, False), (False, True), (True, True)}
    assert len(schedules) >= 2


def random_schedule(rng: random.Random) -> tuple[str, int, int, int]:
    """A schedule, stages, microbatches and chunks per worker drawn at random (some are invalid)."""
    name = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
    p, m = rng.randint(1, 9), rng.randint(1, 10)
    return name, p, m, rng.choice([2, 3]) if name == "interleaved-1f1b" else 1


def valid_schedules(rng: random.Random, tries: int) -> Iterator[tuple[str, int, int, int]]:
    """The valid ones of ``tries`` :func:`random_schedule` draws."""
    for _ in range(tries):
        name, p, m, v = random_schedule(rng)
        if not schedule_problem(name, p, m, v):
            yield name, p, m, v


def random_costs(rng: random.Random, p: int, even: bool, transfer: float) -> StageCosts:
    """Stage costs drawn at random (``even``: forward 1, backward 2 and ``transfer`` on every stage and
    cut), some stages starting late."""
    return StageCosts(tuple(1.0 if even else rng.uniform(0.1, 2) for _ in range(p)),
                      tuple(2.0 if even else rng.uniform(0.1, 4) for _ in range(p)),
                      tuple(transfer if even else rng.uniform(0, 0.3) for _ in range(p - 1)),
                      tuple(transfer if even else rng.uniform(0, 0.3) for _ in range(p - 1)),
                      start_s=tuple(rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(p)))


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_never_exceeds_the_played_step(seed: int) -> None:
    rng = random.Random(seed)
    for name, p, m, v in valid_schedules(rng, 150):
        even = rng.random() < 0.3
        costs = random_costs(rng, p, even, 0.1)
        order = schedule_steps(name, p, m, v)[0]
        ranks = len(order)
        step = play(name, order, [tuple(range(r, p, ranks)) for r in range(ranks)], costs).step_time_s
        bound = pipeline_bound(name, m, ranks, costs.forward_s, costs.backward_s, costs.activation_transfer_s,
                               costs.gradient_transfer_s, costs.start_s, costs.weight_s)
        assert bound <= step * (1 + 1e-12)
        if even and name in ("gpipe", "1f1b") and not any(costs.start_s):  # equal stages: close to the step
            assert bound >= 0.9 * step


@pytest.mark.parametrize("seed", range(4))
def test_the_crowded_host_bound_never_exceeds_the_shared_play(seed: int) -> None:
    """``Sharing.crowded_time`` ([Note: a crowded host's slowdown]) from ``rank_bounds`` at the ranks' own
    pace, against the shared-core play, on random schedules, costs, hosts and placements: ranks of 1-3
    workers on hosts of 1-8 cores, homes shared or not, slowdowns up to 2. Where every rank's home holds
    4 or more equal ranks that are kept busy, it must also lift the bound at their own pace."""
    rng = random.Random(700 + seed)
    lifted = packed = 0
    for case in range(120):
        name, p, m, v = random_schedule(rng)
        if schedule_problem(name, p, m, v):
            continue
        dense = case % 4 == 0  # every rank on one host, equal stages, many microbatches: kept busy
        if dense:
            m = max(m, 2 * p)
        even = dense or rng.random() < 0.3
        costs = random_costs(rng, p, even, 0.01)
        order = schedule_steps(name, p, m, v)[0]
        ranks = len(order)
        hosts = 1 if dense else rng.randint(1, 4)
        wants = []
        for _ in range(ranks):
            mine: dict[int, tuple[float, int]] = {}
            for _ in range(1 if dense else rng.choice([1, 1, 2, 3])):
                h = rng.randrange(hosts)
                k, n = mine.get(h, (0.0, 0))
                mine[h] = (k + (1.0 if dense else rng.choice([1.0, 2.0])), n + 1)
            wants.append(tuple((h, k, n) for h, (k, n) in mine.items()))
        fs, bs = (1.05, 1.15) if dense else (rng.uniform(1, 2), rng.uniform(1, 2))
        sharing = Sharing(tuple(float(ranks if dense else rng.choice([1, 2, 4, 8])) for _ in range(hosts)),
                          tuple(wants), fs, bs)
        held = [tuple(range(r, p, ranks)) for r in range(ranks)]
        step = play(name, order, held, costs, sharing).step_time_s
        ends, occupied = rank_bounds(name, m, ranks, costs.forward_s, costs.backward_s,
                                     costs.activation_transfer_s, costs.gradient_transfer_s, costs.start_s,
                                     costs.weight_s)
        forward = [m * sum(costs.forward_s[s] for s in ss) for ss in held]
        backward = [m * sum(costs.backward_s[s] for s in ss) for ss in held]
        crowded = sharing.crowded_time(ends, occupied, forward, backward)
        assert crowded <= step * (1 + 1e-9), (name, p, m, v, sharing)
        if dense and ranks >= 4:
            packed += 1
            lifted += crowded > max(ends) * 1.03
    assert lifted >= 0.8 * packed > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_bounds_of_busy_hosts_never_exceed_the_shared_play(seed: int) -> None:
    """A host's cores from its ranks' first microbatch on (``Sharing.least_time`` with ``ready``: [Note: a
    host's fill]) and each rank's actions at its pace over the cores it wants at home
    (``Sharing.least_stretch``, then ``rank_bounds``), against the shared-core play: random schedules,
    costs and ranks of 1-3 workers wanting up to twice their home's cores. Where a home's ranks come late
    in a long pipeline, its fill must lift the cores' bound; where ranks want more than their home has,
    their pace must lift the pipeline's."""
    rng = random.Random(1300 + seed)
    filled = stretched = 0
    for name, p, m, v in valid_schedules(rng, 100):
        costs = random_costs(rng, p, rng.random() < 0.3, 0.01)
        order = schedule_steps(name, p, m, v)[0]
        ranks = len(order)
        hosts = rng.randint(1, ranks)
        cores = tuple(float(rng.choice([1, 2, 4])) for _ in range(hosts))
        wants = []
        for r in range(ranks):
            home = min(hosts - 1, r * hosts // ranks)  # consecutive ranks share a host: late hosts fill late
            k = cores[home] * rng.choice([0.5, 1.0, 2.0])
            wants.append(((home, k, rng.randint(1, 3)),))
        sharing = Sharing(cores, tuple(wants), rng.uniform(1, 1.3), rng.uniform(1, 1.3),
                          rng.choice([1.0, 1.2]))
        if not sharing.crowded:  # the planner's sharings are (two workers on a host): else the plain play
            continue
        held = [tuple(range(r, p, ranks)) for r in range(ranks)]
        step = play(name, order, held, costs, sharing).step_time_s
        homes = sharing.homes()  # a host's turns slow its ranks throughout, as the planner's bounds take them
        stretch = [x * (1.0 if h is None else sharing.turns(h))
                   for x, h in zip(sharing.least_stretch(), homes, strict=True)]
        forward = [t * stretch[s % ranks] for s, t in enumerate(costs.forward_s)]
        backward = [t * stretch[s % ranks] for s, t in enumerate(costs.backward_s)]
        weights = [t * stretch[s % ranks] for s, t in enumerate(costs.weight_s)]
        ends, _ = rank_bounds(name, m, ranks, forward, backward, costs.activation_transfer_s,
                              costs.gradient_transfer_s, costs.start_s, weights)
        assert max(ends) <= step * (1 + 1e-9), (name, p, m, v, sharing)
        starts = [sum(costs.start_s[s] for s in ss) for ss in held]
        ready = [starts[0]]
        for r in range(1, ranks):
            ready.append(max(starts[r], ready[-1] + forward[r - 1] + costs.activation_transfer_s[r - 1]))
        work = ([m * sum(costs.forward_s[s] for s in ss) for ss in held],
                [m * sum(costs.backward_s[s] for s in ss) for ss in held], starts)
        late = sharing.least_time(*work, ready)
        assert late <= step * (1 + 1e-9), (name, p, m, v, sharing)
        filled += late > sharing.least_time(*work) * 1.01
        plain = rank_bounds(name, m, ranks, costs.forward_s, costs.backward_s, costs.activation_transfer_s,
                            costs.gradient_transfer_s, costs.start_s, costs.weight_s)[0]
        stretched += max(ends) > max(plain) * 1.01
    assert filled > 0 and stretched > 0, (filled, stretched)


@pytest.mark.parametrize("seed", range(4))
def test_the_bound_over_every_cut_never_exceeds_the_played_step(seed: int) -> None:
    """``cut_free_bound`` from a chain's totals against the simulator on random cuts of random chains."""
    rng = random.Random(100 + seed)
    overhead = 3e-4
    for name, p, m, v in valid_schedules(rng, 120):
        n = p + rng.randint(0, 12)
        even = rng.random() < 0.3
        f = [0.1 if even else rng.uniform(0.01, 1) for _ in range(n)]
        b = [0.2 if even else rng.uniform(0.01, 2) for _ in range(n)]
        act = [0.01 if even else rng.uniform(0, 0.1) for _ in range(n - 1)]
        grad = [0.01 if even else rng.uniform(0, 0.1) for _ in range(n - 1)]
        bounds = [0, *sorted(rng.sample(range(1, n), p - 1)), n]
        spans = list(itertools.pairwise(bounds))
        start = [rng.choice([0.0, rng.uniform(0, 0.5)]) for _ in range(p)]
        costs = StageCosts(tuple(sum(f[a:z]) + overhead for a, z in spans),
                           tuple(sum(b[a:z]) + overhead for a, z in spans),
                           tuple(act[c - 1] for c in bounds[1:-1]), tuple(grad[c - 1] for c in bounds[1:-1]),
                           start_s=tuple(start))
        order = schedule_steps(name, p, m, v)[0]
        ranks = len(order)
        step = play(name, order, [tuple(range(r, p, ranks)) for r in range(ranks)], costs).step_time_s
        cut = sorted(a + g for a, g in zip(act, grad, strict=True))
        def one(x: float) -> np.ndarray:
            return np.array([x])
        loose = cut_free_bound(np.array([KINDS[name]]), np.array([m]), np.array([p]), np.array([ranks]),
                               one(sum(f) + sum(b) + 2 * p * overhead), one(2 * sum(cut[:p - 1])),
                               one(sum(start)),
                               one(max(map(sum, zip(f, b, strict=True))) + 2 * overhead),
                               one(min(map(sum, zip(f, b, strict=True))) + 2 * overhead),
                               one(cut[0] if p > 1 else 0.0),
                               one(min(0.5, *(x / (x + y) for x, y in zip(f, b, strict=True)))),
                               one(sum(f) + sum(b) / 2 + p * overhead),  # an unmeasured W: half a B
                               one(min(x + y / 2 for x, y in zip(f, b, strict=True)) + overhead))[0]
        assert loose <= step * (1 + 1e-12), (name, p, m, v)


def random_chain(rng: random.Random) -> Profile:
    """A chain of 3-9 nodes of random times, bytes and crossings; half the time its backwards timed as
    halves (I and W, part of W fixed), each schedule pricing them its way."""
    n = rng.randint(3, 9)
    times = [rng.uniform(2e-4, 3e-3) for _ in range(n)]
    prof = Profile.synthetic(times, backward_s=[t * rng.uniform(1, 3) for t in times],
                             param_bytes=[rng.randint(1, 8) * MiB for _ in range(n)],
                             activation_bytes=[MiB] * n, microbatch_size=2,
                             cut_bytes=[rng.randint(1, 64) * KiB for _ in range(n - 1)])
    if rng.random() < 0.5:
        prof = prof.model_copy(update={"nodes": tuple(nd.model_copy(update={
            "input_backward_s": nd.backward_s * rng.uniform(0.3, 0.6), "weight_s": nd.backward_s * h,
            "weight_fixed_s": nd.backward_s * h * rng.uniform(0, 1)})
            for nd in prof.nodes for h in [rng.uniform(0.2, 0.7)])})
    return prof


def placed_bounds(prof: Profile, res: Resources, request: PlanConfig) -> Iterator[
        tuple[planner.Candidate, Shape, planner._Shared, planner._Setup, float, float, float]]:
    """Every replicated candidate played for 16 samples (:func:`replicated`), with its shape, the search's
    shared parts, its setup, its bound over every cut and that bound's part that is not the pipeline's
    (``_cut_free_parts``), and its bound with the placement (at least the former)."""
    cands, shapes = replicated(prof, res, request)
    shared = planner._Shared(prof, res)
    loose, rest = planner._cut_free_parts(shared, shapes, 16)
    for cand, shape, bound, other in zip(cands, shapes, loose.tolist(), rest.tolist(), strict=True):
        setup = planner._setup(shared, shape, 16, request, AUTOMATIC)
        placed = max(bound, planner._placed_bound(shared, setup, other))
        yield cand, shape, shared, setup, bound, other, placed


def replicated(prof: Profile, res: Resources, request: PlanConfig
               ) -> tuple[list[planner.Candidate], list[Shape]]:
    """Every replicated candidate played for 16 samples, and its shape."""
    cands = [c for c in candidate_plans(prof, res, request, global_batch=16)
             if c.option == REPLICATED and c.plan is not None]
    return cands, [(c.data_parallel, c.num_stages, c.mode, c.schedule_name, c.num_microbatches, c.chunks)
                   for c in cands]


@pytest.mark.parametrize("seed", range(3))
def test_the_bounds_on_one_host_never_exceed_the_played_step(seed: int) -> None:
    """Both bounds of the fast search (over every cut, with the host's cores; with the shape's cut) against
    every replicated candidate played, on random chains over one host of fewer cores than workers (or
    more), workers of 1 or 2 threads; and the host's cores bound is what holds the loose bound up."""
    rng = random.Random(300 + seed)
    tight = crowded = 0
    for _ in range(4):
        prof = random_chain(rng)
        count, cores, cpus = rng.randint(2, 8), rng.choice([1, 2, 3, 8]), rng.choice([1, 1, 2])
        res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=BIG, host="h", cpus=cpus,
                                             host_cpus=cores) for i in range(count)))
        request = PlanConfig(max_microbatches=4)
        cands, shapes = replicated(prof, res, request)
        shared = planner._Shared(prof, res)
        loose = planner._cut_free_bounds(shared, shapes, 16)
        cutter = get_cutter(request.cutter)
        for cand, shape, bound in zip(cands, shapes, loose.tolist(), strict=True):
            step = cand.step_time_s
            assert bound <= step * (1 + 1e-9), (shape, cores, cpus)
            setup = planner._setup(shared, shape, 16, request, AUTOMATIC)
            cut = planner._replicated_bound(prof, shared, setup, cutter, None, bound)
            assert bound <= cut <= step * (1 + 1e-9), (shape, cores, cpus)
            if shape[3] != "zb-h1":
                rest = float(planner._cut_free_parts(shared, [shape], 16)[1][0])
                quick = planner._replicated_bound(prof, shared, setup, cutter, None, bound, rest)
                assert bound <= quick <= step * (1 + 1e-9), (shape, cores, cpus)
            d, p, *_, v = shape
            if d * p // v > cores:  # more workers than cores: the cores bind, and the bound follows the step
                crowded += 1
                tight += bound >= 0.6 * step
    assert tight >= 0.75 * crowded > 0


@pytest.mark.parametrize("seed", range(4))
def test_the_chains_of_a_cut_bound_it_first(seed: int) -> None:
    """[Note: a cut's chains, bounded first]: on random chains over random workers (speeds, hosts of CPU
    workers with their cores given or not, GPU workers), the cut the bounds take is the one the candidate
    plays, and the bound from its chains lies between the bound over every cut and the bounds with the cut
    (quick and full), above the bound with the placement on some."""
    rng = random.Random(1400 + seed)
    checked = lifted = 0
    for _ in range(4):
        prof = random_chain(rng)
        gpu = rng.random() < 0.3
        per_host, cores = rng.randint(1, 4), rng.choice([None, 2, 8])
        res = Resources(workers=tuple(
            Worker(name=f"w{i}", memory_bytes=BIG, device="cuda" if gpu else "cpu", gpus=int(gpu),
                   host=f"h{i // per_host}", host_cpus=None if gpu else cores,
                   speed=rng.choice([0.5, 1.0, 2.0])) for i in range(rng.randint(2, 8))))
        request = PlanConfig(max_microbatches=4)
        cutter = get_cutter(request.cutter)
        for cand, shape, shared, setup, bound, other, placed in placed_bounds(prof, res, request):
            edges = planner._bound_cut(shared, setup, cutter, None)
            assert cand.plan is not None and edges == cand.plan.bounds, shape
            chained = max(bound, planner._chain_bound(shared, setup, edges, other))
            full = planner._replicated_bound(prof, shared, setup, cutter, None, bound)
            given = planner._replicated_bound(prof, shared, setup, cutter, None, bound, cut_bounds=edges)
            assert given == full, shape
            assert bound <= chained <= full * (1 + 1e-9) and full <= cand.step_time_s * (1 + 1e-9), shape
            if shape[3] != "zb-h1":
                quick = planner._replicated_bound(prof, shared, setup, cutter, None, bound, other, edges)
                assert chained <= quick * (1 + 1e-9), shape
            checked += 1
            lifted += chained > placed * 1.001
    assert checked > 0 and lifted > 0, (checked, lifted)


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_with_the_placement_never_exceeds_the_played_step(seed: int, monkeypatch: pytest.MonkeyPatch
                                                                     ) -> None:
    """The bound with the placement, before the cut ([Note: a crowded host, before the cut]), against every
    replicated candidate played, on random chains over random hosts of CPU workers (2-4 hosts of 1-4
    workers, their cores given or not, one worker slow or none): between the bound over every cut and the
    step, above the former on some busy hosts, and above itself without the pipelines' fill ([Note: a
    pipeline's fill, before the cut]) on some."""
    rng = random.Random(700 + seed)
    lifted = checked = filled = quicker = 0
    with_fill = planner._with_fill
    for _ in range(4):
        prof = random_chain(rng)
        sizes = [rng.randint(1, 4) for _ in range(rng.randint(2, 4))]
        cores = rng.choice([None, 2, 8])
        slow = rng.randrange(sum(sizes) + 1)  # this worker runs at half speed (none past the end)
        res = Resources(workers=tuple(
            Worker(name=f"h{h}-{i}", memory_bytes=BIG, host=f"h{h}", host_cpus=cores,
                   speed=0.5 if sum(sizes[:h]) + i == slow else 1.0)
            for h, size in enumerate(sizes) for i in range(size)))
        request = PlanConfig(max_microbatches=4)
        for cand, shape, shared, setup, bound, other, placed in placed_bounds(prof, res, request):
            assert bound <= placed <= cand.step_time_s * (1 + 1e-9), (shape, sizes, cores, slow)
            if shape[3] != "zb-h1":  # the quick bound with the cut ([Note: the cut, bounded quickly])
                cutter = get_cutter(request.cutter)
                quick = planner._replicated_bound(prof, shared, setup, cutter, None, bound, other)
                assert bound <= quick <= cand.step_time_s * (1 + 1e-9), (shape, sizes, cores, slow)
                quicker += quick > placed * 1.001
            checked += 1
            lifted += placed > bound * 1.001
            monkeypatch.setattr(planner, "_with_fill", lambda work, ranks, *_: work / ranks)
            filled += placed > max(bound, planner._placed_bound(shared, setup, other)) * 1.001
            monkeypatch.setattr(planner, "_with_fill", with_fill)
    assert lifted > 0 and checked > 0, (lifted, checked)  # 3-16% of the candidates on 40 seeds
    assert filled > 0, filled  # 12% of them on 40 seeds (gpipe, 1f1b and zb-h1 on busy hosts)
    assert quicker > 0, quicker  # the cut's fill: over the bound with the placement on some


@pytest.mark.parametrize(("p", "m"), [(2, 1), (4, 8), (16, 64), (8, 2), (61, 64)])
def test_the_fill_before_the_cut_by_hand(p: int, m: int) -> None:
    """``_with_fill`` of an even pipeline of ``p`` stages of one second a microbatch, ``m`` microbatches: its
    root solves the quadratic, and it lies between the work alone, ``m C / p``, and the even GPipe step
    ``(m + p - 1) C / p``, with a fifth of the bubble between them or more (0.24-0.45 of it here)."""
    chain = float(p)  # C: one microbatch through every stage
    work = m * chain
    got = planner._with_fill(work, p, chain, chain, m)
    k = chain * m / got
    assert p * got == pytest.approx(work + chain * (k - 1) / 2, rel=1e-12)
    even = (m + p - 1) * chain / p
    assert work / p <= got <= even * (1 + 1e-12)
    assert got - work / p >= 0.2 * (even - work / p), (got, even)
    assert planner._with_fill(work, p, 0.0, chain, m) == work / p  # nothing held: the work alone


@pytest.mark.parametrize(("p", "m", "share"), [(2, 1, 1.0), (4, 8, 1.0), (16, 64, 1.0), (61, 64, 1.0),
                                               (8, 4, 0.3), (128, 64, 0.25)])
def test_the_paced_fill_on_alike_paces_is_the_even_fill(p: int, m: int, share: float) -> None:
    """On alike paces every stage holds work at the optimum, so ``paced_fill_bound`` is the closed form
    ``share C / (1 - (1 - share / m)^p)`` (over pace 2 here), and each stage's overhead counts as the
    overhead of one microbatch through every stage does there."""
    chain = 3.0
    got = paced_fill_bound([2.0] * p, chain, share, m)
    assert got == pytest.approx(share * chain / 2.0 / (1 - (1 - share / m) ** p), rel=1e-12)
    with_overhead = paced_fill_bound([2.0] * p, chain, share, m, 0.01)
    even = share * (chain / 2.0 + 0.01 * p) / (1 - (1 - share / m) ** p)
    assert with_overhead == pytest.approx(even, rel=1e-12)


@pytest.mark.parametrize("seed", range(6))
def test_the_paced_fill_never_exceeds_the_best_cut(seed: int) -> None:
    """``paced_fill_bound`` against every cut of small random chains into ``p`` non-empty stages at random
    paces: the least over the cuts of ``max_s share * sum_{j<s} u_j + m u_s`` is at least the bound (which
    allows empty stages and any split of a node)."""
    rng = random.Random(1300 + seed)
    for _ in range(20):
        n, p = rng.randint(2, 9), rng.randint(2, 5)
        p = min(p, n)
        nodes = [rng.uniform(0.1, 3.0) for _ in range(n)]
        paces = [rng.choice([0.5, 1.0, 2.0, 3.0]) for _ in range(p)]
        m, share = rng.choice([1, 2, 4, 8, 32]), rng.choice([1.0, 0.5, 0.2])
        overhead = rng.choice([0.0, 0.05])
        bound = paced_fill_bound(paces, sum(nodes), share, m, overhead)
        best = float("inf")
        for inner in itertools.combinations(range(1, n), p - 1):
            edges = (0, *inner, n)
            u = [sum(nodes[a:b]) / v + overhead
                 for (a, b), v in zip(itertools.pairwise(edges), paces, strict=True)]
            best = min(best, max(share * sum(u[:s]) + m * u[s] for s in range(p)))
        assert bound <= best * (1 + 1e-12), (nodes, paces, m, share, overhead)
        assert bound > 0


def test_the_host_bound_by_hand() -> None:
    """``_host_bound``: the work of every worker, slowed, over the cores, against arithmetic done here."""
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB, host="h", host_cpus=2)
                                  for i in range(4)))
    fs, bs = planner.SHARED_HOST_FORWARD_SLOWDOWN, planner.SHARED_HOST_BACKWARD_SLOWDOWN
    weighted = fs * 1.0 + bs * 2.0  # a replica's chain of 1 s forward, 2 s backward per microbatch
    d, m, ranks = np.array([1, 2, 1, 1]), np.array([4, 2, 4, 1]), np.array([4, 2, 1, 2])
    got = planner._host_bound(res, d, m, ranks, np.full(4, weighted), np.full(4, 0.1), np.full(4, 0.05),
                              np.full(4, 0.5))
    turns = planner.SHARED_HOST_TURNS_SLOWDOWN  # more workers than cores take turns: compute weighs more
    per_replica = [m_ * (t * (weighted + 0.1 * (fs + bs)) + 0.05) + 0.5
                   for m_, t in ((4, turns), (2, turns), (4, 1.0), (1, 1.0))]
    assert got[0] == pytest.approx(per_replica[0] / 2)  # 4 workers on 2 cores
    assert got[1] == pytest.approx(2 * per_replica[1] / 2)  # 2 replicas of 2 ranks: all 4 workers
    assert got[2] == 0.0  # one worker: nothing shared
    # 2 workers, 1 thread each: 2 cores, or one worker alone at its slowed weight (1.6 x 1 core < 2)
    assert got[3] == pytest.approx(per_replica[3] / max(2, bs))
    # 1 core: one alone does up to 1.6 cores' weighted work, and the 2 workers take turns
    one = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB, host="h", host_cpus=1)
                                  for i in range(2)))
    on_one = m[3] * (turns * (weighted + 0.1 * (fs + bs)) + 0.05) + 0.5
    assert planner._host_bound(one, d[3:], m[3:], ranks[3:], np.full(1, weighted), np.full(1, 0.1),
                               np.full(1, 0.05), np.full(1, 0.5))[0] == pytest.approx(on_one / bs)
    # several hosts, or a GPU: no bound from here
    apart = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=MiB, host=f"h{i}") for i in range(2)))
    assert planner._host_bound(apart, d, m, ranks, np.full(4, 1.0), np.zeros(4), np.zeros(4),
                               np.zeros(4)).tolist() == [0.0] * 4


@pytest.mark.parametrize("seed", range(3))
def test_the_bounds_over_mixed_speeds_never_exceed_the_played_step(seed: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The bounds over every cut and with the placement ([Note: the speed a shape's ranks can have]) against
    every replicated candidate played, on random chains over workers of two to four speeds (GPU workers,
    CPU workers of shared hosts); above the bound that prices every stage on the fastest worker on some,
    and the bound with the placement above itself without the fill at the stages' paces on some."""
    rng = random.Random(900 + seed)
    lifted = checked = filled = 0
    for _ in range(4):
        prof = random_chain(rng)
        gpu = rng.random() < 0.5
        speeds = rng.sample([0.5, 1.0, 2.0, 3.0], rng.randint(2, 4))
        count, per_host = rng.randint(2, 8), rng.randint(1, 4)
        res = Resources(workers=tuple(
            Worker(name=f"w{i}", memory_bytes=BIG, device="cuda" if gpu else "cpu", gpus=int(gpu),
                   host=f"h{i // per_host}", speed=rng.choice(speeds)) for i in range(count)))
        request = PlanConfig(max_microbatches=4)
        cands, shapes = replicated(prof, res, request)
        shared = planner._Shared(prof, res)
        loose, rest = planner._cut_free_parts(shared, shapes, 16)
        with monkeypatch.context() as patched:  # the same bounds without the speeds' one
            patched.setattr(planner, "_paced", lambda unit, *_: np.zeros(np.shape(unit)))
            unpaced = planner._cut_free_parts(shared, shapes, 16)[0].tolist()
        for cand, shape, bound, other, before in zip(cands, shapes, loose.tolist(), rest.tolist(), unpaced,
                                                     strict=True):
            setup = planner._setup(shared, shape, 16, request, AUTOMATIC)
            placed = max(bound, planner._placed_bound(shared, setup, other))
            assert bound <= placed <= cand.step_time_s * (1 + 1e-9), (shape, [w.speed for w in res.workers])
            checked += 1
            lifted += bound > before * 1.001
            with monkeypatch.context() as patched:  # without the fill at the stages' paces
                patched.setattr(planner, "paced_fill_bound", lambda *_: 0.0)
                filled += placed > max(bound, planner._placed_bound(shared, setup, other)) * 1.001
    assert checked > 0 and lifted > 0, (checked, lifted)
    assert filled > 0, filled  # [Note: a pipeline's fill at its stages' paces] lifts some


def thousand_nodes() -> Profile:
    """The cluster-size chain of bench/planning.py: 1,000 nodes of 1 ms, 4 MB of parameters, 1 MB saved,
    256 KiB crossing each cut."""
    return Profile.synthetic([1e-3] * 1000, param_bytes=[4 * 10**6] * 1000, activation_bytes=[10**6] * 1000,
                             cut_bytes=[256 * KiB] * 999)


def count_calls(monkeypatch: pytest.MonkeyPatch, name: str) -> list[int]:
    """``planner.<name>`` counted as it runs (a count, not a time): the list's one entry, its calls so far."""
    calls = [0]
    real = getattr(planner, name)

    def counted(*args: object, **kwargs: object) -> object:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(planner, name, counted)
    return calls


def test_two_generations_of_gpus_cut_few_shapes(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,024 GPU workers, half of them half as fast: the bounds that know the speeds the shapes can have
    leave few shapes to cut (1,622 were cut when every stage was priced on the fastest worker; a count,
    not a time: the time is bench/planning.py's)."""
    prof = thousand_nodes()
    res = Resources(workers=tuple(
        Worker(name=f"h{i // 8}-{i % 8}", device="cuda", gpus=1, cpus=8, host=f"h{i // 8}",
               memory_bytes=(80 if i < 512 else 40) * 2**30, speed=20.0 if i < 512 else 10.0)
        for i in range(1024)), bandwidth_bps=12.5e9, latency_s=20e-6,
        intra_host=LinkSpeed(bandwidth_bps=100e9, latency_s=5e-6))
    cuts = count_calls(monkeypatch, "_replicated_bound")
    plan = choose_plan(prof, res, PlanConfig(), global_batch=4096)
    assert plan.num_workers <= 1024 and 0 < cuts[0] < 200, cuts


def test_a_thousand_nodes_on_1024_workers_is_planned() -> None:
    """The cluster-size case finishes (its time is bench/planning.py's: no timed assertion here): 128 hosts
    of 8 one-core workers (1,024 workers on this machine's cores would all tie, and every shape be played)."""
    prof = thousand_nodes()
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=80 * 2**30, host=f"h{i // 8}")
                                  for i in range(1024)))
    plan = choose_plan(prof, res, PlanConfig(num_stages=128), global_batch=4096)
    assert plan.num_stages == 128 and plan.num_workers <= 1024
    assert plan.bounds[0] == 0 and plan.bounds[-1] == 1000


def test_a_flat_search_on_cpu_hosts_chooses_the_exact_plan(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a flat search]: on 1,000 nodes over 128 hosts of 8 CPU workers of 4 of their 32 cores (the
    finalists' bounds 0.1-1.6% under their steps, so the search goes flat), the search with its gap chooses
    the plan of the search that never stops early: the same plan, played fewer times."""
    prof = thousand_nodes()
    res = Resources(workers=tuple(
        Worker(name=f"h{i // 8}-{i % 8}", cpus=4, memory_bytes=64 * 2**30, host=f"h{i // 8}", host_cpus=32)
        for i in range(1024)), bandwidth_bps=12.5e9, latency_s=20e-6,
        intra_host=LinkSpeed(bandwidth_bps=100e9, latency_s=5e-6))
    plays = count_calls(monkeypatch, "_evaluate")
    flat = choose_plan(prof, res, PlanConfig(), global_batch=4096)
    flat_plays, plays[0] = plays[0], 0
    monkeypatch.setattr(planner, "_EXACT_PLAYS", 10**9)
    monkeypatch.setattr(planner, "_EXACT_CUTS", 10**9)
    exact = choose_plan(prof, res, PlanConfig(), global_batch=4096)
    assert flat == exact
    assert flat_plays < plays[0], (flat_plays, plays)


def test_stage_holds_is_what_the_built_schedules_hold() -> None:
    """The closed forms (and interleaved 1F1B's count) against the built, validated schedules' lists."""
    for name in ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"]:
        for p in range(1, 10):
            for m in range(1, 13):
                for v in [2, 3, 4] if name == "interleaved-1f1b" else [1]:
                    if schedule_problem(name, p, m, v):
                        continue
                    built = build_schedule(name, p, m, v)
                    assert stage_holds(name, p, m, v) == (
                        tuple(peak_in_flight(acts) for acts in built.actions),
                        tuple(defers(acts) for acts in built.actions))
                    order, lists = schedule_steps(name, p, m, v)
                    assert lists == tuple(tuple(Step(a.stage, a.kind, a.microbatch) for a in acts)
                                          for acts in built.actions)
                    steps = [[Step(a.stage, a.kind, a.microbatch) for a in built.rank_actions(r)]
                             for r in range(built.num_ranks)]
                    assert order == tuple(map(tuple, steps))
    for p, m, v in [(16, 32, 2), (16, 16, 4), (24, 24, 3), (32, 64, 4), (12, 8, 3)]:  # interleaved, longer
        built = build_schedule("interleaved-1f1b", p, m, v)
        peaks = tuple(peak_in_flight(acts) for acts in built.actions)
        deferring = tuple(defers(acts) for acts in built.actions)
        assert stage_holds("interleaved-1f1b", p, m, v) == (peaks, deferring)


def test_the_fast_search_agrees_on_random_small_jobs() -> None:
    """Random chains, worker counts, devices, speeds, hosts, links, memory and fixed fields (the memory
    options among them: with the replicated one out, the fast search falls back on the options' own
    evaluation, where recompute was once priced faster than the same plan without it)."""
    rng = random.Random(11)
    fixed: list[dict[str, object]] = [{}, {"schedule": "zb-h1"}, {"schedule": "interleaved-1f1b"},
                                      {"mode": "parameter_server"}, {"strategy": "pipeline"}, {"zero": 1},
                                      {"zero": 2}, {"recompute": True}]
    for _ in range(20):
        n = rng.randint(2, 10)
        prof = Profile.synthetic([rng.choice([5e-4, 1e-3, 4e-3]) for _ in range(n)],
                                 param_bytes=[rng.choice([MiB, 4 * MiB, 16 * MiB]) for _ in range(n)],
                                 activation_bytes=[rng.choice([256 * KiB, MiB, 4 * MiB]) for _ in range(n)],
                                 cut_bytes=[rng.choice([16 * KiB, 256 * KiB, 2 * MiB]) for _ in range(n - 1)],
                                 microbatch_size=2)
        device, memory = rng.choice(["cpu", "cuda"]), rng.choice([BIG, 60 * MiB, 250 * MiB])
        per_host, count = rng.randint(1, 3), rng.randint(1, 8)
        res = Resources(workers=tuple(
            Worker(name=f"w{i}", memory_bytes=memory, device=device, gpus=int(device == "cuda"),
                   host=f"h{i // per_host}", speed=rng.choice([1.0, 0.5, 2.0])) for i in range(count)),
            intra_host=rng.choice([None, LinkSpeed(bandwidth_bps=50e9, latency_s=5e-6)]))
        request = PlanConfig(max_microbatches=4, **rng.choice(fixed))  # type: ignore[arg-type]
        fast, exhaustive = both_searches(prof, res, request)
        assert fast == exhaustive


@pytest.mark.parametrize("seed", range(6))
def test_replicas_over_more_workers_than_a_host_holds_are_bounded_by_a_link_between_hosts(seed: int) -> None:
    """The cut-free bound prices a stage's replicas on more workers than one host holds at the fastest
    link between hosts (``Resources.fastest_link_between_hosts``), not inside one: hosts of 2-4 workers
    with a fast link inside and slow ones between (some pairs of hosts faster), gradients large enough
    that the sync decides. The fast search still picks what the exhaustive one does."""
    rng = random.Random(100 + seed)
    per_host, hosts = rng.randint(2, 4), rng.randint(2, 4)
    n = rng.randint(3, 8)
    prof = Profile.synthetic([rng.choice([5e-4, 1e-3]) for _ in range(n)],
                             param_bytes=[rng.choice([16 * MiB, 64 * MiB]) for _ in range(n)],
                             activation_bytes=[MiB] * n, cut_bytes=[256 * KiB] * (n - 1), microbatch_size=2)
    host_links = tuple(HostLink(a=f"h{a}", b=f"h{a + 1}", bandwidth_bps=rng.choice([2e9, 5e9]),
                                latency_s=1e-5) for a in range(hosts - 1) if rng.random() < 0.5)
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=BIG, device="cuda", gpus=1,
                                         host=f"h{i // per_host}") for i in range(per_host * hosts)),
                    bandwidth_bps=1e9, latency_s=2e-5, host_links=host_links,
                    intra_host=LinkSpeed(bandwidth_bps=100e9, latency_s=5e-6))
    assert res.most_on_a_host == per_host
    assert res.fastest_link_between_hosts[0] == max([1e9, *(hl.bandwidth_bps for hl in host_links)])
    assert res.fastest_link[0] == 100e9
    fast, exhaustive = both_searches(prof, res, PlanConfig(max_microbatches=4))
    assert fast == exhaustive


@pytest.mark.parametrize("zero", [1, 2])
def test_recompute_is_never_predicted_faster_than_the_same_plan_without(zero: int) -> None:
    """Found by a fuzzed search (3 nodes, 2 replicas, ``plan.zero`` fixed): ZeRO-1/2's first gathers run
    behind the first forward, and a recomputing backward's forwards again were counted as forward, so
    they hid more of the gathers than they added: recompute was predicted 16 us faster, the exhaustive
    search chose it, and the fast one (which leaves recompute out once a plan without it fits) did not."""
    prof = Profile.synthetic([2.0e-4, 2.0e-4, 1.5e-4], backward_s=[2.4e-4, 2.55e-4, 3.0e-4],
                             param_bytes=[241_059, 922_601, 8_596_906],
                             activation_bytes=[4_564_896, 165_316, 1_167_900], cut_bytes=[698_104, 737_544],
                             microbatch_size=2)
    res = Resources(workers=(Worker(name="w1", memory_bytes=2**40), Worker(name="w2", memory_bytes=2**40)),
                    bandwidth_bps=1e8, latency_s=1e-6)
    request = PlanConfig(zero=zero)
    fast, exhaustive = (choose_plan(prof, res, request, global_batch=2, exhaustive=e) for e in (False, True))
    assert fast == exhaustive
    by_option = {(c.schedule_name, c.option.recompute): c.plan.step_time_s
                 for c in candidate_plans(prof, res, request, global_batch=2, exhaustive=True)
                 if c.plan is not None and c.data_parallel == 2}
    for (schedule, recompute), step in by_option.items():
        if recompute:
            assert step >= by_option[schedule, False]


def test_a_host_fill_by_hand() -> None:
    """[Note: a host's fill]: ranks of one core each ready at 0, 1 and 2 on a host of 2 cores do 5 seconds
    of work by 3 (1 alone until the second is ready, then 2 a second); one rank wanting 4 cores of 2, slowed
    1.5x when crowded, does at most 3 a second alone."""
    assert planner_fill([(0.0, 1.0, 1.0), (1.0, 1.0, 1.0), (2.0, 1.0, 1.0)], 5.0, 2.0) == pytest.approx(3.0)
    assert planner_fill([(2.0, 1.0, 1.0), (0.0, 1.0, 1.0), (1.0, 1.0, 1.0)], 0.5, 2.0) == pytest.approx(0.5)
    assert planner_fill([(1.0, 4.0, 3.0)], 6.0, 2.0) == pytest.approx(3.0)
    sharing = Sharing((2.0,), (((0, 1.0, 1),), ((0, 1.0, 1),), ((0, 1.0, 1),)))
    work = ([1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [0.0] * 3)
    assert sharing.least_time(*work, [0.0, 1.0, 2.0]) == pytest.approx(3.0)
    assert sharing.least_time(*work) == pytest.approx(2.5)  # without the fill: its work over its cores


def planner_fill(arrivals: list[tuple[float, float, float]], work: float, cores: float) -> float:
    return _filled_by(arrivals, work, cores)


def memory_bound_case(rng: random.Random) -> tuple[Profile, Resources, PlanConfig]:
    """A random chain over 2-6 workers whose memory holds its parameters only when cut with care."""
    prof = random_chain(rng)
    count = rng.randint(2, 6)
    static = sum(4 * nd.param_bytes for nd in prof.nodes)  # parameters, gradients and Adam's state
    memory = int(static / count * rng.uniform(1.2, 3.0)) + 24 * MiB
    hosts = rng.choice(["own", "one", "cores"])
    res = Resources(workers=tuple(Worker(
        name=f"w{i}", memory_bytes=memory, host="h" if hosts != "own" else f"h{i}",
        host_cpus=2 if hosts == "cores" else None) for i in range(count)))
    return prof, res, PlanConfig(max_microbatches=4)


@pytest.mark.parametrize("seed", range(3))
def test_the_bounds_with_a_cut_within_memory_never_exceed_the_played_step(seed: int) -> None:
    """[Note: a cut within memory, bounded]: where the cut that ignores memory does not fit, both bounds
    with the cut take the cutter's cut within memory; against every fitting replicated candidate played, on
    random chains over workers of little memory. Some such bounds must rise over the bound over every
    cut (the one such shapes kept before)."""
    rng = random.Random(2100 + seed)
    within = lifted = 0
    for _ in range(12):
        prof, res, request = memory_bound_case(rng)
        cands, shapes = replicated(prof, res, request)
        shared = planner._Shared(prof, res)
        cutter = get_cutter(request.cutter)
        loose, rests = planner._cut_free_parts(shared, shapes, 16)
        for cand, shape, bound, rest in zip(cands, shapes, loose.tolist(), rests.tolist(), strict=True):
            if not cand.fits:
                continue
            setup = planner._setup(shared, shape, 16, request, AUTOMATIC)
            cut = planner._replicated_bound(prof, shared, setup, cutter, None, bound)
            assert cut <= cand.step_time_s * (1 + 1e-9), shape
            if shape[3] != "zb-h1":
                quick = planner._replicated_bound(prof, shared, setup, cutter, None, bound, rest)
                assert quick <= cand.step_time_s * (1 + 1e-9), shape
            if shared.memory_cuts:
                within += 1
                lifted += cut > bound * 1.001
            shared.memory_cuts.clear()
    assert within > 0 and lifted > 0, (within, lifted)


@pytest.mark.parametrize("seed", range(3))
def test_a_shape_left_before_placement_fits_no_cut(seed: int) -> None:
    """A shape the search leaves before placing it (``_may_fit_anywhere``) has no fitting replicated
    candidate in the exhaustive search; and on workers of little memory some are left."""
    rng = random.Random(2200 + seed)
    left = 0
    for _ in range(10):
        prof, res, request = memory_bound_case(rng)
        shared = planner._Shared(prof, res)
        for cand in candidate_plans(prof, res, request, global_batch=16, exhaustive=True):
            if cand.option != REPLICATED:
                continue
            shape = (cand.data_parallel, cand.num_stages, cand.mode, cand.schedule_name,
                     cand.num_microbatches, cand.chunks)
            if not planner._may_fit_anywhere(shared, shape, 16):
                left += 1
                assert not cand.fits, shape
    assert left > 0


def test_a_flat_search_is_within_its_gap(monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: a flat search]: with the gap from the first play on, every plan of the grid is within the gap
    of the exhaustive search's step (and the same plan where no other is that close)."""
    monkeypatch.setattr(planner, "_EXACT_PLAYS", 0)
    monkeypatch.setattr(planner, "_EXACT_CUTS", 0)
    gap = planner._SEARCH_GAP
    same = 0
    for kind, count, hosts, budget, fixed in CASES[::3]:
        prof, res = profile(kind), workers(count, budget, hosts)
        fast, exhaustive = both_searches(prof, res, PlanConfig(max_microbatches=4, **FIXED[fixed]))
        if isinstance(exhaustive, str):
            assert fast == exhaustive
            continue
        assert isinstance(fast, planner.Plan) and isinstance(exhaustive, planner.Plan)
        assert fast.step_time_s * (1 - gap) <= exhaustive.step_time_s * (1 + 1e-9), (kind, count, hosts)
        same += fast == exhaustive
        # ``cellmesh plan``'s runners-up start with the plan chosen, as in an exact search
        request = PlanConfig(max_microbatches=4, **FIXED[fixed])
        assert candidate_plans(prof, res, request, global_batch=16, limit=3)[0].plan == fast
    assert same > 0


def test_a_thousand_uneven_nodes_on_a_crowded_host_play_few(monkeypatch: pytest.MonkeyPatch) -> None:
    """1,000 uneven nodes over 1,024 workers of one host of 2 cores (``Resources.local(1024)`` here): every
    shape's step is the host's work over its cores to within 0.1%; the search played 3,466 shapes before the
    bounds took the cut within memory and a flat search its gap (a count, not a time)."""
    rng = random.Random(7)
    n = 1000
    prof = Profile.synthetic([rng.uniform(0.2e-3, 5e-3) for _ in range(n)],
                             param_bytes=[rng.randint(0, 16 * 10**6) for _ in range(n)],
                             activation_bytes=[rng.randint(10**5, 4 * 10**6) for _ in range(n)],
                             cut_bytes=[rng.randint(1024, 2**20) for _ in range(n - 1)])
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=80 * 2**30, host="h", host_cpus=2)
                                  for i in range(1024)))
    plays = count_calls(monkeypatch, "_evaluate")
    plan = choose_plan(prof, res, PlanConfig(), global_batch=4096)
    assert plan.num_workers <= 1024 and plays[0] <= planner._EXACT_PLAYS + 8, plays
    runners = candidate_plans(prof, res, PlanConfig(), global_batch=4096, limit=3)
    assert runners[0].plan == plan and len(runners) == 3  # the chosen plan first, as `cellmesh plan` shows


@pytest.mark.parametrize("m", [1, 2, 3, 4, 8])
def test_interleaving_few_microbatches_is_bounded_by_the_chain_through_every_chunk(m: int) -> None:
    """[Note: the bound]: 4 ranks holding 3 chunks each (12 stages of 1 s forward, 2 s backward), fewer
    microbatches than ranks: microbatch 0 goes down all 12 stages before the last one's backwards, which the
    ranks' chains alone (through the first chunk) do not see. Both stay under the played step."""
    p, ranks = 12, 4
    assert not schedule_problem("interleaved-1f1b", p, m, 3)
    costs = StageCosts((1.0,) * p, (2.0,) * p, (0.1,) * (p - 1), (0.1,) * (p - 1), start_s=(0.0,) * p)
    order = schedule_steps("interleaved-1f1b", p, m, 3)[0]
    held = [tuple(range(r, p, ranks)) for r in range(ranks)]
    step = play("interleaved-1f1b", order, held, costs).step_time_s
    args = ("interleaved-1f1b", m, ranks, costs.forward_s, costs.backward_s, costs.activation_transfer_s,
            costs.gradient_transfer_s, costs.start_s)
    chains = stage_bounds(*args)
    # the last stage's: 11 stages' receive, forward and send before it (stage 0 receives nothing), its own m
    # with the transfers of its one cut, 11 backwards after it likewise; by hand
    assert chains == pytest.approx(11 * 1.2 - 0.1 + m * 3.2 + 11 * 2.2 - 0.1, rel=1e-12)
    ranked = max(rank_bounds(*args)[0])
    assert chains <= step * (1 + 1e-12)
    if m < ranks:  # the chain through every chunk is the step here (m = 1: 40.4 s, the ranks' 20 s)
        assert chains > ranked and chains >= 0.99 * step
    assert stage_bounds("1f1b", m, ranks, *args[3:]) == 0.0  # a stage per rank: rank_bounds holds it


@pytest.mark.parametrize(("m", "chunks"), [(1, 2), (2, 2), (2, 4), (4, 2)])
def test_an_interleaved_chain_over_two_speeds_bounds_the_shape_before_its_cut(m: int, chunks: int) -> None:
    """[Note: an interleaved chain, before the cut]: 8 ranks, the last 4 half as fast, holding 2 or 4 chunks
    of a 48-node chain, fewer microbatches than ranks: the bound with the placement holds microbatch 0's
    chain through every stage (above the bound over every cut) and stays under the played step."""
    prof = Profile.synthetic([1e-3] * 48, param_bytes=[MiB] * 48, activation_bytes=[MiB] * 48,
                             cut_bytes=[16 * KiB] * 47)
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=BIG, device="cuda", gpus=1, host=f"h{i}",
                                         speed=2.0 if i < 4 else 1.0) for i in range(8)))
    shape = (1, 8 * chunks, "collective", "interleaved-1f1b", m, chunks)
    assert not schedule_problem("interleaved-1f1b", 8 * chunks, m, chunks)
    shared = planner._Shared(prof, res)
    loose, rest = (float(x[0]) for x in planner._cut_free_parts(shared, [shape], 8 * m))
    setup = planner._setup(shared, shape, 8 * m, PlanConfig(), AUTOMATIC)
    placed = planner._placed_bound(shared, setup, rest)
    played = planner._evaluate(prof, res, shape, 8 * m, get_cutter("minmax"), "minmax", None, PlanConfig(),
                               AUTOMATIC, shared=shared, only=REPLICATED)[0]
    assert played.plan is not None
    assert loose < placed <= played.step_time_s * (1 + 1e-9), (loose, placed, played.step_time_s)


@pytest.mark.parametrize("seed", range(3))
def test_the_homes_cores_before_the_cut_never_exceed_the_played_step(seed: int,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """[Note: the homes' cores, before the cut]: 2-3 hosts of 2-4 workers wanting up to four times their
    host's cores (a worker's threads 1-4, the host's cores 2-4), random chains, every replicated candidate
    played: the bound with the placement stays under the step, and the homes' cores lift it on some."""
    rng = random.Random(1900 + seed)
    lifted = checked = 0
    for _ in range(3):
        prof = random_chain(rng)
        sizes = [rng.randint(2, 4) for _ in range(rng.randint(2, 3))]
        threads, cores = rng.choice([1, 2, 4]), rng.choice([2, 4])
        res = Resources(workers=tuple(
            Worker(name=f"h{h}-{i}", memory_bytes=BIG, host=f"h{h}", cpus=threads, host_cpus=cores)
            for h, size in enumerate(sizes) for i in range(size)))
        for cand, shape, shared, setup, bound, other, placed in placed_bounds(prof, res, PlanConfig(
                max_microbatches=4)):
            assert placed <= cand.step_time_s * (1 + 1e-9), (shape, sizes, threads, cores)
            with monkeypatch.context() as patched:
                patched.setattr(Sharing, "spread_time", lambda *_: 0.0)
                without = max(bound, planner._placed_bound(shared, setup, other))
            checked += 1
            lifted += placed > without * 1.001
    assert checked > 0 and lifted > 0, (checked, lifted)


@pytest.mark.parametrize(("name", "p", "m"), [("gpipe", 2, 4), ("1f1b", 4, 8), ("zb-h1", 3, 6)])
def test_a_rank_that_crowds_its_home_by_itself_is_bounded_slowed(name: str, p: int, m: int) -> None:
    """[Note: a rank never alone]: every rank has two workers of 2 threads on one host of 4 cores, so
    whenever one is busy the host holds two busy workers and its forwards and backwards are slowed, alone
    or not. The hosts' cores bound then divides by the cores (one rank alone does no more), and it sits at
    the shared play where the stages are even; with one worker a rank, alone it runs unslowed, and the
    bound divides by that rate."""
    fs, bs = 1.05, 1.15
    costs = StageCosts((1.0,) * p, (2.0,) * p, (0.0,) * (p - 1), (0.0,) * (p - 1), start_s=(0.0,) * p)
    order = schedule_steps(name, p, m, 1)[0]
    held = [(s,) for s in range(p)]
    work = ([m * 1.0] * p, [m * 2.0] * p, [0.0] * p)
    for workers, slowed in ((2, True), (1, False)):
        sharing = Sharing((4.0,), tuple(((0, 4.0, workers),) for _ in range(p)), fs, bs)
        step = play(name, order, held, costs, sharing).step_time_s
        bound = sharing.least_time(*work)
        assert bound <= step * (1 + 1e-12)
        weighted = 4.0 * p * m * (fs * 1.0 + bs * 2.0)
        assert bound == pytest.approx(weighted / (4.0 if slowed else 4.0 * bs))
        if slowed:  # the ranks take the cores in turn, each slowed: the bound is the play
            assert bound == pytest.approx(step)


def crowded_hosts(rng: random.Random) -> Resources:
    """2-3 hosts of 2-4 CPU workers of 1-4 threads on 2-8 cores, now and then a worker of no host; the
    links inside a host faster half the time (the placement then has two layouts to choose from)."""
    sizes = [rng.randint(2, 4) for _ in range(rng.randint(2, 3))]
    cores = rng.choice([2, 4, 8])
    workers = [Worker(name=f"h{h}-{i}", memory_bytes=BIG, host=f"h{h}", cpus=rng.randint(1, 4),
                      host_cpus=cores) for h, size in enumerate(sizes) for i in range(size)]
    if rng.random() < 0.3:
        workers.append(Worker(name="alone", memory_bytes=BIG, cpus=rng.randint(1, 4)))
    inside = LinkSpeed(bandwidth_bps=100e9, latency_s=1e-6) if rng.random() < 0.5 else None
    return Resources(workers=tuple(workers), intra_host=inside)


@pytest.mark.parametrize("seed", range(3))
def test_the_homes_cores_before_the_placement_never_exceed_the_bound_with_it(seed: int) -> None:
    """[Note: the homes' cores, before the placement]: on random chains over crowded hosts, every replicated
    candidate's bound from the homes' cores of the grids it may be placed on stays under its bound with its
    placement (so under its step), and lifts the bound over every cut on some."""
    rng = random.Random(2300 + seed)
    lifted = checked = 0
    for _ in range(3):
        prof, res = random_chain(rng), crowded_hosts(rng)
        for cand, shape, shared, _, bound, other, placed in placed_bounds(prof, res, PlanConfig(
                max_microbatches=4)):
            homes = planner._homes_bound(shared, shape, 16, other)
            assert homes <= placed * (1 + 1e-9) and placed <= cand.step_time_s * (1 + 1e-9), (shape, res)
            checked += 1
            lifted += homes > bound * 1.001
    assert checked > 0 and lifted > 0, (checked, lifted)


@pytest.mark.parametrize("seed", range(4))
def test_the_spread_of_a_grid_is_its_sharings(seed: int) -> None:
    """``_spread_of`` gives what ``Sharing.spread_time`` reads of the sharing the placement builds, on random
    subsets of random workers in random order (hosts of mixed threads and cores, some workers of no host),
    and None exactly where that sharing is none or a rank has no home."""
    rng = random.Random(2400 + seed)
    some = 0
    for _ in range(100):
        hosts = rng.randint(1, 5)
        workers = []
        for i in range(rng.randint(2, 20)):
            h = rng.randrange(hosts + 1)  # ``hosts``: no host
            workers.append(Worker(name=f"w{i}", memory_bytes=BIG, cpus=rng.choice([1, 2, 3, 8]),
                                  host=None if h == hosts else f"h{h}",
                                  host_cpus=None if h == hosts else [4, 6, 16][h % 3]))
        res = Resources(workers=tuple(workers))
        d = rng.randint(1, len(workers))
        ranks = rng.randint(1, len(workers) // d)
        rows = np.array(rng.sample(range(len(workers)), d * ranks)).reshape(d, ranks).T
        table = res.worker_table
        hosted = table.host[rows][table.host[rows] >= 0]
        sharing = planner._rows_sharing(res, rows) if len(hosted) > len(np.unique(hosted)) else None
        want = sharing._spread if sharing is not None else None
        got = planner._spread_of(res, rows)
        assert (got is None) == (want is None), (rows, want, got)
        if got is not None and want is not None:
            assert got[0] == want[0] and got[1] == pytest.approx(want[1], rel=1e-12), (rows, want, got)
            some += 1
    assert some > 10, some


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_of_every_option_never_exceeds_a_fitting_step(seed: int) -> None:
    """[Note: a search where nothing replicated fits]: the bound over every cut without updates or sync
    stays under the step of every candidate evaluated, whatever its memory option (ZeRO, recompute,
    offload), on random chains over random hosts of CPU workers with their cores, or GPUs."""
    rng = random.Random(2500 + seed)
    checked = set()
    for _ in range(3):
        prof = random_chain(rng)
        res = crowded_hosts(rng) if rng.random() < 0.5 else Resources(workers=tuple(
            Worker(name=f"g{i}", device="cuda", gpus=1, memory_bytes=BIG, host=f"h{i // 2}",
                   speed=rng.choice([1.0, 2.0])) for i in range(rng.randint(2, 6))))
        cands = candidate_plans(prof, res, PlanConfig(max_microbatches=4), global_batch=16, exhaustive=True)
        shapes = [(c.data_parallel, c.num_stages, c.mode, c.schedule_name, c.num_microbatches, c.chunks)
                  for c in cands]
        bounds = planner._cut_free_parts(planner._Shared(prof, res), shapes, 16, replicated=False)[0]
        for cand, bound in zip(cands, bounds.tolist(), strict=True):
            if cand.plan is not None:
                assert bound <= cand.plan.step_time_s * (1 + 1e-9), (cand.option, cand.plan.summary())
                checked.add(cand.option)
    assert len(checked) >= 4, checked  # the replicated option, ZeRO, recompute and offload among them


def test_a_search_where_nothing_replicated_fits_chooses_the_exhaustive_plan(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Random chains on workers of little memory, where often no replicated plan fits: the bounded search
    over every option ([Note: a search where nothing replicated fits]) chooses the exhaustive search's
    plan, and on some evaluates fewer shapes than there are; the runners-up where fewer replicated plans
    fit than asked for are the fastest of every candidate."""
    rng = random.Random(2600)
    searched: list[planner.Plan] = []
    every_option = planner._fastest_of_every_option

    def kept(*args: object, **kwargs: object) -> planner.Plan | None:
        plan = every_option(*args, **kwargs)  # type: ignore[arg-type]
        if plan is not None:
            searched.append(plan)
        return plan

    monkeypatch.setattr(planner, "_fastest_of_every_option", kept)
    evaluated = [0]
    evaluate = planner._evaluate

    def counted(*args: object, **kwargs: object) -> list[planner.Candidate]:
        evaluated[0] += kwargs.get("only") is None
        return evaluate(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(planner, "_evaluate", counted)
    fewer = bounded = 0
    for _ in range(8):
        n = rng.randint(4, 10)
        prof = Profile.synthetic([rng.uniform(2e-4, 3e-3) for _ in range(n)],
                                 param_bytes=[rng.randint(4, 24) * MiB for _ in range(n)],
                                 activation_bytes=[rng.randint(1, 4) * MiB for _ in range(n)],
                                 cut_bytes=[rng.randint(16, 512) * KiB for _ in range(n - 1)],
                                 microbatch_size=2, optimizer=rng.choice(["sgd", "adamw"]))
        count = rng.randint(2, 8)
        res = Resources(workers=tuple(Worker(name=f"g{i}", device="cuda", gpus=1, memory_bytes=rng.choice(
            [60, 90, 120]) * MiB, host=f"h{i // 2}") for i in range(count)))
        request = PlanConfig(max_microbatches=4)
        before, evaluated[0] = len(searched), 0
        try:
            fast: object = choose_plan(prof, res, request, global_batch=16)
        except PlanningError as exc:
            fast = str(exc).split(" (")[0]
        if len(searched) > before:  # the bounded search answered: fewer shapes than every one?
            fewer += evaluated[0] < len(planner._shapes(prof, res, request, 16)[1])
        assert fast == both_searches(prof, res, request)[1]
        every = candidate_plans(prof, res, request, global_batch=16)
        ranked = sorted(range(len(every)), key=lambda i: (not every[i].fits, _rank(every[i])
                                                           if every[i].plan is not None else (math.inf,), i))
        plain = [i for i in ranked if every[i].fits and every[i].option == REPLICATED]
        for limit in (1, 3):  # the runners-up: the replicated ones where enough fit, else the same bound's
            want = plain if len(plain) >= limit else ranked
            assert candidate_plans(prof, res, request, global_batch=16, limit=limit) == [
                every[i] for i in want[:limit]]
            bounded += len(plain) < limit and every[ranked[limit - 1]].fits
    assert len(searched) >= 3 and fewer >= 1 and bounded >= 3, (len(searched), fewer, bounded)
