"""A plan request resolved against the model, the workers and the global batch: what is fixed, what searched.

The job config's plan section (:class:`~coordinator.planning.config.PlanConfig`) fixes some
counts (replicas, stages, microbatches) and leaves the rest to the planner. Before any
shape is costed, this module decides which counts are possible and enumerates the shapes
``(d, p, mode, schedule, m)`` to evaluate (``coordinator/planning/planner.py``).

[Note: the global batch decides the shapes] A step's ``B`` samples split into ``d`` equal
replica shares and each share into ``m`` equal microbatches, so only ``d`` dividing ``B``
and ``m`` dividing ``B / d`` exist. A count the user fixed that does not divide is refused
naming the numbers (:class:`PlanningError`), as is ``strategy: data_parallel`` when no
count of 2 or more replicas divides ``B``. When the planner chose, the batch may have ruled
out the shapes that use every worker (33 samples on 2 workers: one replica);
:func:`batch_note` says so in one line, the plan it chose and the batch that would use them.

[Note: no split backward on one stage] A schedule that splits the backward (zb-h1) exists to fill a
pipeline's bubbles with weight gradients; one stage has none. The search leaves it out for one stage
unless the request names it: measured (``bench/train.py``'s MLP, 2026-11-29), one stage ran 7% slower
under it on one worker (44.5-45.7 ms a step against gpipe's 41.4-42.7) and 20% slower in data
parallelism over 2 (61.8-63.2 against 49.7-54.0: the weight gradients, and so the all-reduce's buckets,
come only after the whole input backward), while the cost model priced it 10% faster, so every
one-stage plan the planner chose ran zb-h1.

[Note: interleaved shapes] A schedule of ``CHUNKED`` (``interleaved-1f1b``) puts ``v`` (``chunks``)
stages on each worker: ``p = v R`` stages on ``R`` workers per replica, so ``p`` may exceed the
workers. Unless the request fixes them, ``v`` runs over ``2..MAX_SEARCHED_CHUNKS`` and ``R`` from 2
(one worker holding every stage only adds transfers to one stage: only when the request asks for
several stages per worker and a replica has one worker or ``num_stages`` says so); the microbatch
counts are those the schedule allows (``schedule_problem``: Megatron's ``R | m``, or ``m < R``, or
``m`` splitting into ``m // R`` groups). A request that fixes the schedule or ``chunks`` and
leaves no shape is refused with the schedule's own reason and fix.

Everything here needs only the model's node count, so :func:`check_batch` runs it before the
model is profiled (``coordinator/runtime/preflight.py``), with the cells' count as an upper
bound on the stages (the traced graph may forbid some cuts; the planner then checks again).

A model with BatchNorm layers is trained exactly only by plans whose every BatchNorm forward
sees the global batch ([Note: BatchNorm sees the global batch] in
``services/compute/batchnorm.py``): :func:`batch_norm_request` narrows a request to them (one
microbatch per replica, replicas in collective mode) or refuses what it fixes against that,
and :func:`check_batch_norm_plan` refuses a complete plan given as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import get_args

from coordinator.planning.config import Mode, PlanConfig
from coordinator.planning.schedules import CHUNKED, SCHEDULES, SPLIT, chunked_fits, schedule_problem

__all__ = [
    "MAX_SEARCHED_CHUNKS",
    "FixedCounts",
    "PlanningError",
    "Shape",
    "batch_norm_request",
    "batch_note",
    "check_batch",
    "check_batch_norm_plan",
    "divisors",
    "near_multiples",
    "plan_shapes",
    "resolve",
]

# (data_parallel, num_stages, mode, schedule, num_microbatches, chunks)
Shape = tuple[int, int, Mode, str, int, int]
MAX_SEARCHED_CHUNKS = 4  # the most stages per worker the planner tries when the request does not fix it


class PlanningError(ValueError):
    """No plan satisfies the request; the message says why and what would fit."""


def divisors(x: int, cap: int) -> list[int]:
    """The divisors of ``x`` up to ``cap``, ascending."""
    return [k for k in range(1, min(x, cap) + 1) if x % k == 0]


def near_multiples(x: int, k: int) -> str:
    """The multiples of ``k`` nearest ``x``: ``(33, 2)`` -> ``"32 or 34"``, ``(3, 4)`` -> ``"4"``."""
    below = x // k * k
    return f"{below} or {below + k}" if below >= k else str(k)


@dataclass(frozen=True)
class FixedCounts:
    """A plan section resolved against the model and the workers: what is fixed, what is searched."""

    data_parallel: int | None
    num_stages: int | None
    max_stages: int  # stages the model's cuttable positions allow
    num_workers: int
    chunks: int | None = None  # stages per worker (see [Note: interleaved shapes])
    chunked: bool = False  # whether a schedule with several stages per worker may be chosen
    asked: bool = False  # the request asks for them (the schedule or chunks): one worker may hold every stage

    def chunk_counts(self) -> list[int]:
        """The stages per worker to search: the fixed count, or 1 and (chunked) 2..MAX_SEARCHED_CHUNKS."""
        if self.chunks is not None:
            return [self.chunks]
        return [1, *range(2, MAX_SEARCHED_CHUNKS + 1)] if self.chunked else [1]

    def least_workers(self, num_stages: int) -> int:
        """The fewest workers per replica ``num_stages`` stages take (several per worker only when asked)."""
        fits = [num_stages // v for v in self.chunk_counts()
                if num_stages % v == 0 and (self.asked or v == 1)]
        return min(fits, default=num_stages)


def resolve(request: PlanConfig, num_nodes: int, max_stages: int, num_workers: int) -> FixedCounts:
    """The fixed replicas and stages the request implies (strategy, balance), checked against the model.

    Args:
        request: The plan section.
        num_nodes: The model's nodes (its cells).
        max_stages: The most stages its cuttable positions allow (at most ``num_nodes``).
        num_workers: The workers of the resources.

    Raises:
        PlanningError: The fixed stages or replicas do not fit the model or the workers.
    """
    d = 1 if request.strategy == "pipeline" else request.data_parallel
    p = 1 if request.strategy == "data_parallel" else request.num_stages
    if request.balance is not None:
        if sum(request.balance) != num_nodes:
            raise PlanningError(f"balance {list(request.balance)} must be positive node counts summing to "
                                f"the {num_nodes} nodes")
        p = len(request.balance)
    chunked = request.schedule is None or request.schedule in CHUNKED
    if request.chunks is not None and request.chunks > 1 and not chunked:
        raise PlanningError(f"chunks={request.chunks} puts several stages on each worker, which schedule "
                            f"{request.schedule!r} does not do: use schedule interleaved-1f1b, or chunks=1")
    if request.chunks is not None and request.chunks > 1 and d is not None and p == 1:
        raise PlanningError(f"chunks={request.chunks} needs a pipeline of at least {request.chunks} stages; "
                            f"strategy={request.strategy!r} fixes one")
    asked = request.schedule in CHUNKED or (request.chunks or 1) > 1
    fixed = FixedCounts(d, p, max_stages, num_workers, request.chunks, chunked, asked)
    _check_counts(fixed, num_nodes)
    return fixed


def _check_counts(fixed: FixedCounts, num_nodes: int) -> None:
    """Refuse fixed stage and replica counts the model's cuts or the workers cannot hold.

    Raises:
        PlanningError: Naming the count, the limit and what would fit.
    """
    d, p, most, workers = fixed.data_parallel, fixed.num_stages, fixed.max_stages, fixed.num_workers
    if p is not None and not 1 <= p <= most:
        why = f"the model has {num_nodes} nodes"
        if most < num_nodes:
            why += f" and {most - 1} cuttable positions"
        raise PlanningError(f"num_stages={p} is impossible: {why}; use 1..{most} stages")
    if p is not None and fixed.chunks is not None and p % fixed.chunks:
        raise PlanningError(f"num_stages={p} does not split into chunks={fixed.chunks} stages per worker: "
                            f"use a multiple of {fixed.chunks} stages")
    need = fixed.least_workers(p) if p is not None else 1
    chunked = f" ({need} with {p // need} stages per worker)" if p is not None and need < p else ""
    if p is not None and need > workers:
        raise PlanningError(f"num_stages={p} needs {need} workers{chunked}, the resources have {workers}; "
                            f"use at most {min(workers, most)} stages, or interleaved-1f1b with several per "
                            "worker")
    if d is not None and not 1 <= d <= workers:
        raise PlanningError(f"data_parallel={d} needs 1..{workers} workers; the resources have {workers}")
    if d is not None and p is not None and d * need > workers:
        raise PlanningError(f"data_parallel={d} x num_stages={p} needs {d * need} workers{chunked}, the "
                            f"resources have {workers}; with data_parallel={d} at most {workers // d} "
                            f"{'workers per replica' if chunked else 'stages'} fit")


def _degrees(request: PlanConfig, fixed: FixedCounts, global_batch: int) -> list[int]:
    """The data-parallel degrees to search (see [Note: the global batch decides the shapes]).

    Raises:
        PlanningError: The global batch does not split into the fixed replicas, or (``strategy:
            data_parallel``) into any count of 2 or more.
    """
    if global_batch < 1:
        raise PlanningError(f"global_batch must be >= 1, got {global_batch}")
    d, workers = fixed.data_parallel, fixed.num_workers
    if d is not None:
        if global_batch % d:
            fits = divisors(global_batch, workers)
            raise PlanningError(f"global_batch={global_batch} does not split evenly into data_parallel={d} "
                                f"replicas; degrees that divide it: {fits}, or use a global batch that is "
                                f"a multiple of {d} ({near_multiples(global_batch, d)})")
        return [d]
    degrees = divisors(global_batch, workers)
    if request.strategy == "data_parallel" and workers > 1:
        degrees = degrees[1:]  # replicas, not one worker: the cost model may favour one on small models
        if not degrees:
            raise PlanningError(f"strategy='data_parallel' on {workers} workers needs a global batch that "
                                f"splits evenly into 2 or more replicas; global_batch={global_batch} splits "
                                f"into none of 2..{workers}: use a multiple of {workers} "
                                f"({near_multiples(global_batch, workers)}), or strategy 'auto'")
    return degrees


def plan_shapes(request: PlanConfig, fixed: FixedCounts, global_batch: int) -> list[Shape]:
    """Every shape the request allows, in enumeration order (degrees, stages, modes, schedules, counts).

    Raises:
        PlanningError: No shape exists (the batch does not split into the fixed replicas, or the
            fixed microbatch count divides no replica's share).
    """
    degrees = _degrees(request, fixed, global_batch)
    shapes = [shape for d in degrees for shape in _shapes_of_degree(request, fixed, global_batch, d)]
    if not shapes and (request.schedule in CHUNKED or (request.chunks or 1) > 1):
        raise PlanningError(_chunked_problem(request, fixed, global_batch, degrees))
    if not shapes:
        d_text = (f"data_parallel={fixed.data_parallel}" if fixed.data_parallel is not None
                  else "any data-parallel degree")
        raise PlanningError(f"num_microbatches={request.num_microbatches} does not divide "
                            f"global_batch={global_batch} with {d_text}; per replica it must divide "
                            "global_batch / data_parallel, e.g. "
                            f"{divisors(global_batch // degrees[0], request.max_microbatches)}")
    return shapes


def _counts(request: PlanConfig, global_batch: int, d: int) -> list[int]:
    """The microbatch counts of ``d`` replicas: the fixed one, or the divisors of a replica's share."""
    per_replica = global_batch // d
    counts = [request.num_microbatches] if request.num_microbatches is not None else divisors(
        per_replica, request.max_microbatches)
    return [c for c in counts if per_replica % c == 0]


def _shapes_of_degree(request: PlanConfig, fixed: FixedCounts, global_batch: int, d: int) -> list[Shape]:
    """The shapes of ``d`` replicas: stage counts, then modes, schedules, microbatch and chunk counts."""
    counts = _counts(request, global_batch, d)
    ranks = fixed.num_workers // d  # the most workers a replica may take
    most = min(fixed.max_stages, ranks)
    stage_counts = range(1, most + 1) if fixed.num_stages is None else [fixed.num_stages]
    if request.strategy == "pipeline" and fixed.num_stages is None and most > 1:
        stage_counts = range(2, most + 1)  # stages, not one worker
    modes: tuple[Mode, ...] = get_args(Mode) if d > 1 else ("collective",)
    if request.mode is not None:
        modes = (request.mode,)
    schedules = list(SCHEDULES) if request.schedule is None else [request.schedule]
    # per schedule, the stage counts it takes and, per stage count, its (microbatches, chunks) in order
    runs: dict[str, dict[int, list[tuple[int, int]]]] = {}
    for schedule in schedules:
        if schedule not in CHUNKED:
            if fixed.chunks in (None, 1):
                plain = [(m, 1) for m in counts]  # the same runs for every stage count
                runs[schedule] = {p: plain for p in stage_counts if d * p <= fixed.num_workers
                                  and (p > 1 or schedule not in SPLIT or request.schedule is not None)}
            continue
        by_stages: dict[int, list[tuple[int, int]]] = {}
        for v in fixed.chunk_counts():
            if v < 2:
                continue
            alone = ranks == 1 or fixed.num_stages is not None  # see [Note: interleaved shapes]
            first = 1 if fixed.asked and alone else 2
            all_stages = ([fixed.num_stages] if fixed.num_stages is not None
                          else [v * r for r in range(first, ranks + 1) if v * r <= fixed.max_stages])
            for p in all_stages:
                if p % v == 0 and d * (p // v) <= fixed.num_workers and p // v >= first:
                    by_stages.setdefault(p, []).extend(
                        (m, v) for m in counts if chunked_fits(schedule, p // v, m))
        # a stage count's runs by microbatch count (its first position in ``counts``), then chunks
        count_at = {x: i for i, x in reversed(list(enumerate(counts)))}  # the first of equal counts
        runs[schedule] = {p: sorted(pairs, key=lambda mv: (count_at[mv[0]], mv[1]))
                          for p, pairs in by_stages.items() if pairs}
    # stages, modes, schedules, counts (the planner keeps the first of equally good plans), then chunks:
    # made in that order
    every_p = sorted({p for by in runs.values() for p in by})
    return [(d, p, mode, schedule, m, v) for p in every_p for mode in modes for schedule in schedules
            for m, v in runs.get(schedule, {}).get(p, ())]


def _chunked_problem(request: PlanConfig, fixed: FixedCounts, global_batch: int, degrees: list[int]) -> str:
    """Why a request for several stages per worker has no shape (the schedule's reason where it has one)."""
    name = request.schedule or next(iter(CHUNKED))
    for d in degrees:
        for m in _counts(request, global_batch, d):
            for v in [c for c in fixed.chunk_counts() if c > 1]:
                p = fixed.num_stages if fixed.num_stages is not None else v * max(1, fixed.num_workers // d)
                problem = schedule_problem(name, p, m, v)
                if problem is not None:
                    return problem
    return (f"{name} has no plan here: it needs chunks x R stages the model can cut "
            f"({fixed.max_stages} at most) on R >= 2 workers per replica (of {fixed.num_workers}; R = 1 only "
            "when num_stages fixes it or a replica has one worker), with microbatch counts that divide "
            f"global_batch={global_batch} per replica")


def check_batch(request: PlanConfig, num_nodes: int, num_workers: int, global_batch: int) -> None:
    """Refuse, before profiling, what the planner would refuse about the counts and the global batch.

    The model's ``num_nodes`` bound the stages (its cuts are not known yet), so what passes
    here may still be refused by the planner; nothing refused here would pass there.

    Raises:
        PlanningError: A fixed count does not fit the model or the workers, or the batch does
            not split into the fixed replicas or microbatches (naming the numbers).
    """
    plan_shapes(request, resolve(request, num_nodes, num_nodes, num_workers), global_batch)


def batch_note(data_parallel: int, num_stages: int, request: PlanConfig, num_workers: int,
               global_batch: int) -> str | None:
    """Why a chosen plan of ``data_parallel x num_stages`` leaves workers idle, when the batch is why.

    None when it uses every worker, when the user fixed the replicas (then a batch that does
    not divide is an error), or when some replica count that would use more workers divides
    the batch (the planner could have taken it and chose fewer workers for speed: the batch
    is not why, e.g. 16 samples on 4 workers run on 1 although 3 replicas are ruled out).
    """
    used = data_parallel * num_stages
    if used >= num_workers or request.data_parallel is not None or request.strategy == "pipeline":
        return None
    more = range(data_parallel + 1, num_workers // num_stages + 1)
    ruled_out = [d for d in more if global_batch % d]
    if not ruled_out or len(ruled_out) < len(more):
        return None
    d = ruled_out[-1]
    return (f"global_batch={global_batch} does not split evenly into {d} replicas, so the plan uses "
            f"{used} of the {num_workers} workers ({data_parallel} replica(s) x {num_stages} stage(s)); a "
            f"global batch that is a multiple of {d} ({near_multiples(global_batch, d)}) lets the planner "
            f"use {d * num_stages}")


_BATCH_NORM_FIXES = ("BatchNorm takes one microbatch per replica (replicas share its statistics in "
                     "collective mode); or normalise per sample (GroupNorm, LayerNorm)")


def _batch_norm_problem(microbatches: int | None, replicas: int | None, mode: Mode | None) -> str | None:
    """What keeps a BatchNorm layer from seeing the global batch under these counts, or None."""
    if microbatches is not None and microbatches > 1:
        return (f"with num_microbatches={microbatches} each microbatch is normalised on its own and the "
                f"running statistics move {microbatches} times a step")
    if mode == "parameter_server" and replicas != 1:
        return "parameter-server mode has no data-parallel group to share the statistics of the replicas"
    return None


def batch_norm_request(request: PlanConfig, layers: Sequence[str]) -> PlanConfig:
    """``request`` narrowed to the plans exact for a model with BatchNorm ``layers`` (qualified names).

    One microbatch per replica, and collective mode between replicas (they all-reduce the
    statistics); unchanged when ``layers`` is empty.

    Raises:
        PlanningError: The request fixes more microbatches or parameter-server mode (naming the first
            layer, why and the fix).
    """
    if not layers:
        return request
    problem = _batch_norm_problem(request.num_microbatches, request.data_parallel, request.mode)
    if problem is not None:
        raise PlanningError(f"BatchNorm layer {layers[0]} normalises with the statistics of the batch it "
                            f"sees: {problem}, unlike one process training the global batch; "
                            f"{_BATCH_NORM_FIXES}")
    return request.model_copy(update={"num_microbatches": 1, "mode": request.mode or "collective"})


def check_batch_norm_plan(layers: Sequence[str], num_microbatches: int, data_parallel: int,
                          mode: Mode) -> None:
    """Refuse a complete plan whose BatchNorm ``layers`` would not see the global batch.

    Raises:
        PlanningError: Naming the first layer, why and the fix.
    """
    problem = _batch_norm_problem(num_microbatches, data_parallel, mode) if layers else None
    if problem is not None:
        raise PlanningError(f"the plan ({data_parallel} replica(s), {num_microbatches} microbatch(es), "
                            f"{mode}) does not train BatchNorm layer {layers[0]} as one process does: "
                            f"{problem}; {_BATCH_NORM_FIXES}")
