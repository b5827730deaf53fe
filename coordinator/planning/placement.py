"""Placement: which worker holds each stage of each replica of a plan shape.

:func:`place` answers for the planner (``_evaluate`` in ``coordinator/planning/planner.py``) with
``placement[r][s]``, the worker of replica ``r``'s stage ``s``; stage ``s`` runs on the replica's
rank ``s % ranks`` (``ranks = stages / chunks``, see [Note: chunks] in
``coordinator/planning/schedules.py``), so a worker of an interleaved schedule holds several stages.

[Note: placing replicas and stages on hosts]
Where the links do not depend on hosts (a resource list without ``intra_host`` or
``host_links``: this machine's local workers, a cluster's pods each a host of its own), or all
the workers are on one host, the placement is the list's order: replica ``r``'s rank ``k`` is
worker ``r * ranks + k``. Otherwise two terms of the step's cost model change with it:

- the transfers between neighbouring stages: per microbatch, one cut's activations forward and
  their gradients back (``_transfer`` of the planner), ``m`` times a step on every rank's critical
  path (``m * chunks`` crossings per rank in an interleaved schedule);
- each stage's gradient sync among its ``d`` replicas: once a step, a ring all-reduce of the
  stage's gradients, ``2 (d - 1) / d`` of their bytes over the group's slowest link plus
  ``2 (d - 1)`` latencies (``_sync`` and ``sharding.sharded_sync`` of the planner).

A host can hold a replica's whole pipeline (the first term inside the host, the second across
hosts) or a stage's whole replica group (the other way round), and when neither fits, blocks as
close to those as first fit gives. :func:`place` builds both layouts, prices each with the two
terms on the links the resource list gives (:func:`layout_cost`, from :class:`Traffic`: the
shape's microbatches, the profile's mean cut bytes and a stage's gradient bytes) and keeps the
cheaper; a tie keeps the pipelines inside hosts (the list's order when a host holds whole
replicas). Activations dominate for small models run with many or large microbatches, gradients
for parameter-heavy stages with few microbatches. A layout's links are taken as the planner takes
them, a group's slowest (lowest bandwidth, highest latency); the two layouts are built once per
(replicas, ranks) of a resource list (:func:`grids`: the planner bounds a shape by them before it places
it) and their links once per chunks, in O(workers + hosts), so the planner's many microbatch counts of a
shape price them in O(distinct links) each.

[Note: a layout's speeds] The planner runs each stage at its slowest replica's worker's speed (a
stage's replicas synchronise their gradients every step), and cuts the chain in proportion to the
stages' speeds. On workers of two speeds a layout whose every stage group holds a slow worker runs the
whole pipeline at the slow speed: on 128 hosts of 8 CPU workers, half of them half as fast, the
pipelines-inside-hosts layout of 64 replicas x 16 stages put a slow worker in all 16 groups, where the
replica groups inside hosts keep 8 stages fast. So where the layouts' speeds differ (each rank at its
slowest replica's, added up), each is priced with its compute too, one microbatch through every stage
(:attr:`Traffic.compute_s`) times the microbatches over that sum: the compute of a cut balanced by the
stages' speeds; and where the links ignore hosts, a list of mixed speeds is placed by stage groups, the
fastest workers first, when that adds up to more speed than the list's order. On two generations the
chosen plans were 1.44x (CPU hosts) and 1.23x (GPU hosts) quicker than before (docs/benchmarks.md,
"Planning"); on alike workers nothing changes.

The planner charges a shape's pipeline transfers at :func:`neighbour_link`, the slowest link between
neighbouring stages of any replica (each stage boundary, and an interleaved rank's last stage to the
next chunk's first), and each stage's sync at the slowest link among its replicas: a pipeline inside a
host is priced at the intra-host link, a replica group inside a host likewise.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Speed

__all__ = ["PlacedLinks", "Placement", "Traffic", "grids", "layout_cost", "neighbour_link", "place",
           "place_with_links", "step_traffic"]

Placement = tuple[tuple[str, ...], ...]  # placement[r][s]: the worker of replica r's stage s
Grid = list[list[str]]  # grid[r][k]: the worker of replica r's rank k


@dataclass(frozen=True)
class Traffic:
    """What a plan shape moves per step (see [Note: placing replicas and stages on hosts]).

    Attributes:
        boundary_bytes: Across one stage boundary per microbatch: the activations forward and their
            gradients back.
        microbatches: Microbatches per step.
        gradient_bytes: One stage's gradients, synchronised among its replicas once per step.
        compute_s: One microbatch's forward and backward through every stage, on a worker of speed 1
            ([Note: a layout's speeds]).
    """

    boundary_bytes: float
    microbatches: int
    gradient_bytes: float
    compute_s: float = 0.0


# id(profile) -> (profile, mean cut bytes, gradient bytes, a microbatch's compute)
_CUT_TOTALS: dict[int, tuple[Profile, float, float, float]] = {}


def step_traffic(profile: Profile, stages: int, microbatches: int, microbatch_size: int) -> Traffic:
    """A shape's :class:`Traffic`: the mean of the profile's cuttable cuts (a stage boundary is one of
    them) at ``microbatch_size``, the model's gradient bytes over ``stages``, and every node's forward and
    backward at ``microbatch_size`` (scaled from the profiled size)."""
    cached = _CUT_TOTALS.get(id(profile))
    if cached is None or cached[0] is not profile:
        inner = [c for c in profile.cuts[1:-1] if c.cuttable]
        mean = (sum(t.nbytes * (1 + t.requires_grad) for c in inner for t in c.tensors) / len(inner)
                if inner else 0.0)
        if len(_CUT_TOTALS) > 16:  # a few profiles at a time: the planner asks of one
            _CUT_TOTALS.clear()
        cached = _CUT_TOTALS[id(profile)] = (profile, mean, float(sum(nd.grad_bytes for nd in profile.nodes)),
                                             float(sum(nd.forward_s + nd.backward_s for nd in profile.nodes)))
    _, mean, grads, compute = cached
    scale = microbatch_size / profile.microbatch_size
    return Traffic(mean * scale, microbatches, grads / stages, compute * scale)


def _transfer(nbytes: float, link: Speed) -> float:
    bandwidth, latency = link
    return 0.0 if nbytes <= 0 else 2 * latency + nbytes / bandwidth  # forward and backward


def _all_reduce(nbytes: float, replicas: int, link: Speed) -> float:
    bandwidth, latency = link
    if replicas < 2 or nbytes <= 0:
        return 0.0
    return 2 * (replicas - 1) / replicas * nbytes / bandwidth + 2 * (replicas - 1) * latency


def _hops(ranks: int, chunks: int) -> list[tuple[int, int]]:
    """The rank pairs a replica's stage boundaries cross (interleaved: also the last rank to rank 0)."""
    hops = [(k, k + 1) for k in range(ranks - 1)]
    return [*hops, (ranks - 1, 0)] if chunks > 1 and ranks > 1 else hops


@dataclass(frozen=True)
class PlacedLinks:
    """The links a placement's step crosses, as :func:`place_with_links` found them placing it.

    Attributes:
        neighbour: :func:`neighbour_link` of the placement.
        ranks: Per rank of a replica, the slowest link among its replicas' workers (stage ``s``'s group:
            ``ranks[s % len(ranks)]``).
    """

    neighbour: Speed
    ranks: tuple[Speed, ...]


@dataclass(frozen=True)
class _Layout:
    """A grid and the links its two cost terms cross (see :func:`layout_cost`)."""

    grid: Grid
    pipe_link: Speed | None  # the slowest link a stage boundary crosses; None: no boundary
    group_links: tuple[Speed, ...]  # each stage group's slowest link, once each
    rank_links: tuple[Speed, ...]  # per rank, its stage group's slowest link
    speed: float  # the ranks' speeds added up, each its slowest replica's worker's

    @classmethod
    def of(cls, resources: Resources, grid: Grid, chunks: int) -> _Layout:
        hops = _hops(len(grid[0]), chunks)
        by_hosts = _links_by_hosts(resources, grid, hops)
        if by_hosts is not None:
            pipe, ranks = by_hosts
        else:
            pipe = (resources.slowest_of_pairs((row[a], row[b]) for row in grid for a, b in hops) if hops
                    else None)
            ranks = tuple(resources.slowest_link([row[k] for row in grid]) for k in range(len(grid[0])))
        return cls(grid, pipe, tuple(sorted(set(ranks))), ranks, _rank_speeds(resources, grid))

    def links(self, resources: Resources) -> PlacedLinks:
        """:class:`PlacedLinks` of the placement this grid gives (its boundaries are the hops: a pipeline
        of one rank has none, as :func:`neighbour_link` skips a worker paired with itself)."""
        return PlacedLinks(self.pipe_link if self.pipe_link is not None else resources.slowest_of_pairs(()),
                           self.rank_links)

    def cost(self, traffic: Traffic, chunks: int) -> float:
        pipe = _transfer(traffic.boundary_bytes, self.pipe_link) if self.pipe_link is not None else 0.0
        replicas, nbytes = len(self.grid), traffic.gradient_bytes * chunks
        sync = max(_all_reduce(nbytes, replicas, link) for link in self.group_links)
        return traffic.microbatches * chunks * pipe + sync


def _rank_speeds(resources: Resources, grid: Sequence[Sequence[str]]) -> float:
    """The ranks' speeds of ``grid[r][k]`` added up, each rank at its slowest replica's worker's speed (what
    the planner runs a stage at): [Note: a layout's speeds]."""
    table = resources.worker_table
    speeds = table.speed[table.indices([name for row in grid for name in row])].reshape(len(grid), -1)
    return float(speeds.min(axis=0).sum())


def _chosen(layouts: Sequence[_Layout], traffic: Traffic, chunks: int) -> _Layout:
    """The layout of least cost ([Note: placing replicas and stages on hosts]), its compute over its ranks'
    speeds added where the layouts' speeds differ ([Note: a layout's speeds]); a tie keeps the first."""
    if len({layout.speed for layout in layouts}) == 1:
        return min(layouts, key=lambda layout: layout.cost(traffic, chunks))
    work = traffic.microbatches * traffic.compute_s
    return min(layouts, key=lambda layout: layout.cost(traffic, chunks) + work / layout.speed)


def _links_by_hosts(resources: Resources, grid: Grid, hops: Sequence[tuple[int, int]]
                    ) -> tuple[Speed | None, tuple[Speed, ...]] | None:
    """:meth:`_Layout.of`'s links from the workers' host numbers alone, where the links follow the hosts
    (``Resources.links_follow_hosts``) and the grid names each worker of the list once, in rows of one
    length: the hops' slowest link (None without hops) and each rank's; None otherwise (the pairs are then
    looked up). The same answers as ``slowest_of_pairs`` and ``slowest_link``, in a few numpy passes over a
    grid of 1,024 workers."""
    if not resources.links_follow_hosts:
        return None
    names = [name for row in grid for name in row]
    table = resources.worker_table
    unique = set(names)
    if len(unique) != len(names) or len({len(row) for row in grid}) != 1 or not unique <= table.index.keys():
        return None  # a worker twice, rows of several lengths or a name not in the list: the pairs' way
    workers = table.indices(names).reshape(len(grid), -1)
    host = table.host[workers]  # a worker without a host: a negative number of its own
    pipe = None
    if hops:
        a, b = (np.array(ends, dtype=np.int64) for ends in zip(*hops, strict=True))
        inside = (host[:, a] == host[:, b]) & (host[:, a] >= 0)
        pipe = resources.slowest_by_kind(bool(inside.any()), bool((~inside).any()))
    replicas = len(grid)
    if replicas < 2:
        return pipe, (resources.default_link,) * host.shape[1]
    ordered = np.sort(host, axis=0)
    hosts = 1 + (ordered[1:] != ordered[:-1]).sum(axis=0)  # per rank, the hosts its replicas are on
    return pipe, tuple(resources.slowest_by_kind(n < replicas, n > 1) for n in hosts.tolist())


def layout_cost(resources: Resources, grid: Sequence[Sequence[str]], traffic: Traffic,
                chunks: int = 1) -> float:
    """The two placement-dependent terms of a step for ``grid[r][k]`` (see [Note: placing replicas and
    stages on hosts]): a boundary's transfers over the slowest link a boundary crosses (its lowest
    bandwidth and highest latency, as the planner takes links) times the crossings per rank, plus the
    slowest stage group's all-reduce."""
    return _Layout.of(resources, [list(row) for row in grid], chunks).cost(traffic, chunks)


# per resource list (by id, the list kept so the id stays its own): (replicas, ranks) -> grids, and
# (replicas, ranks, chunks) -> layouts
_LAYOUTS: dict[int, tuple[Resources, dict[tuple[int, int], tuple[Grid, ...]],
                          dict[tuple[int, int, int], tuple[_Layout, ...]]]] = {}


def _cached(resources: Resources) -> tuple[dict[tuple[int, int], tuple[Grid, ...]],
                                           dict[tuple[int, int, int], tuple[_Layout, ...]]]:
    cached = _LAYOUTS.get(id(resources))
    if cached is None or cached[0] is not resources:
        if len(_LAYOUTS) > 8:
            _LAYOUTS.clear()
        cached = _LAYOUTS[id(resources)] = (resources, {}, {})
    return cached[1], cached[2]


def grids(resources: Resources, replicas: int, ranks: int) -> tuple[Grid, ...]:
    """The grids (``grid[r][k]``: the worker of replica ``r``'s rank ``k``) :func:`place_with_links` picks
    from for ``replicas`` x ``ranks``, whatever the stages and the traffic: the one it takes where the
    hosts leave no choice, else the pipelines-inside-hosts layout and, when it differs, the
    replica-groups-inside-hosts one. Built once per shape of a resource list (the planner asks again for
    every stage and microbatch count)."""
    known, _ = _cached(resources)
    key = (replicas, ranks)
    if key not in known:
        groups = resources.host_groups
        if not resources.host_dependent_links or len(groups) == 1:
            names = [w.name for w in resources.workers]
            grid: Grid = [names[r * ranks:(r + 1) * ranks] for r in range(replicas)]
            speeds = resources.worker_table.speed
            if replicas > 1 and ranks > 1 and speeds.min() < speeds.max():  # [Note: a layout's speeds]
                grouped = _fastest_groups(resources, replicas, ranks)
                if _rank_speeds(resources, grouped) > _rank_speeds(resources, grid):
                    grid = grouped
            known[key] = (grid,)
        else:
            flat = resources.names_by_host
            pipelines = _blocks(groups, replicas, ranks, flat)
            by_stage = _blocks(groups, ranks, replicas, flat)
            replica_groups = [[by_stage[k][r] for k in range(ranks)] for r in range(replicas)]
            known[key] = (pipelines,) if pipelines == replica_groups else (pipelines, replica_groups)
    return known[key]


def _layouts(resources: Resources, replicas: int, ranks: int, chunks: int) -> tuple[_Layout, ...]:
    """:func:`grids` with their links, for hosts that leave a choice."""
    _, layouts = _cached(resources)
    key = (replicas, ranks, chunks)
    if key not in layouts:
        layouts[key] = tuple(_Layout.of(resources, g, chunks) for g in grids(resources, replicas, ranks))
    return layouts[key]


def _blocks(groups: Sequence[Sequence[str]], count: int, size: int, flat: Sequence[str] | None = None
            ) -> Grid:
    """``count`` blocks of ``size`` workers: each inside the first host with room for it, else the free
    workers in order (:func:`_first_fit`). Hosts of one size that a block's size divides, or that divide
    it, fill in list order: the blocks are then the workers in host order (``flat``, if given), cut in
    turn."""
    sizes = {len(names) for names in groups}
    if len(sizes) == 1 and ((host := sizes.pop()) % size == 0 or size % host == 0):
        if flat is None:
            flat = [name for names in groups for name in names]
        return [list(flat[k * size:(k + 1) * size]) for k in range(count)]
    return _first_fit(groups, count, size)


def _first_fit(groups: Sequence[Sequence[str]], count: int, size: int) -> Grid:
    """:func:`_blocks` for any hosts. O(hosts + workers): a host's room only shrinks, so the scan for room
    resumes where the last one stopped."""
    used = [0] * len(groups)  # workers taken from each host, from its front
    blocks: Grid = []
    fits = 0  # hosts before it have no room for a block
    free = 0  # hosts before it have no free worker
    for _ in range(count):
        while fits < len(groups) and len(groups[fits]) - used[fits] < size:
            fits += 1
        if fits < len(groups):
            blocks.append(list(groups[fits][used[fits]:used[fits] + size]))
            used[fits] += size
            continue
        block: list[str] = []
        while free < len(groups) and used[free] == len(groups[free]):
            free += 1
        for h in range(free, len(groups)):
            names = groups[h]
            take = min(size - len(block), len(names) - used[h])
            block += names[used[h]:used[h] + take]
            used[h] += take
            if len(block) == size:
                break
        blocks.append(block)
    return blocks


def neighbour_link(resources: Resources, placement: Placement) -> Speed:
    """The lowest bandwidth and highest latency between the workers of neighbouring stages of any replica
    (the links a pipeline's transfers cross); the defaults for single-stage replicas."""
    pairs = set().union(*map(itertools.pairwise, placement))  # each once: a row repeats its ranks
    return resources.slowest_of_pairs((a, b) for a, b in pairs if a != b)


def place(resources: Resources, replicas: int, stages: int, ranks: int, *,
          traffic: Callable[[], Traffic] | None = None) -> Placement:
    """Where each replica's stages run: :func:`place_with_links` 's placement."""
    return place_with_links(resources, replicas, stages, ranks, traffic=traffic)[0]


def place_with_links(resources: Resources, replicas: int, stages: int, ranks: int, *,
                     traffic: Callable[[], Traffic] | None = None) -> tuple[Placement, PlacedLinks | None]:
    """Where each replica's stages run (see [Note: placing replicas and stages on hosts]).

    Args:
        resources: The workers.
        replicas: Data-parallel replicas ``d``.
        stages: Stages per replica ``p`` (a multiple of ``ranks``).
        ranks: Workers per replica; stage ``s`` runs on rank ``s % ranks``.
        traffic: The shape's :class:`Traffic`, asked only when the hosts leave a choice; None prices
            a boundary's bytes and a stage's gradients alike, once per step.

    Returns:
        ``placement[r][s]``: the worker of replica ``r``'s stage ``s``; and where the hosts gave a choice,
        the links the chosen layout crosses (the planner asks them of every placement; None: the
        list's order, whose links are not looked up here).

    Raises:
        ValueError: Fewer than ``replicas * ranks`` workers, or ``stages`` not a multiple of ``ranks``.
    """
    if replicas < 1 or ranks < 1 or stages % ranks:
        raise ValueError(f"place: {stages} stages on {ranks} ranks per replica x {replicas} replicas: the "
                         "stages must be a multiple of the ranks, each at least 1")
    if replicas * ranks > resources.num_workers:
        raise ValueError(f"place: {replicas} replicas x {ranks} workers need {replicas * ranks} workers, the "
                         f"resource list has {resources.num_workers}")
    links = None
    if not resources.host_dependent_links or len(resources.host_groups) == 1:
        grid = grids(resources, replicas, ranks)[0]
    else:
        chunks = stages // ranks
        layouts = _layouts(resources, replicas, ranks, chunks)
        chosen = layouts[0]
        if len(layouts) > 1:
            chosen = _chosen(layouts, traffic() if traffic is not None else Traffic(1.0, 1, 1.0), chunks)
        grid, links = chosen.grid, chosen.links(resources)
    return tuple(tuple(row) * (stages // ranks) for row in grid), links  # stage s on rank s % ranks


def _fastest_groups(resources: Resources, replicas: int, ranks: int) -> Grid:
    """``grid[r][k]``: rank ``k``'s replicas on the ``k``-th block of ``replicas`` workers, the workers taken
    fastest first (in list order among alike): the grid whose ranks' slowest speeds add up to the most."""
    order = sorted(resources.workers, key=lambda w: -w.speed)  # stable: list order among alike
    return [[order[k * replicas + r].name for k in range(ranks)] for r in range(replicas)]
