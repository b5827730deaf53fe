"""Cutting a chain of nodes into pipeline stages: the exact min-max cutter, the even split, the plug-in seam.

A cutter receives a :class:`CutProblem` (per-node compute, per-cut transfer, optional
memory limits) and returns stage boundaries ``(0, b1, ..., n)``: stage ``s`` runs nodes
``[bounds[s], bounds[s+1])``. Two ship, chosen by name:

- ``"minmax"`` (:func:`cut_min_max`, the default): minimises the slowest stage's time,
  exactly, by dynamic programming over the chain, honouring memory limits and uncuttable
  positions (long chains run the programme compiled: ``compiled_cut.py``);
- ``"even"`` (:func:`cut_even`): equal node counts, the baseline other tools offer.

A user's cutter is any callable with the :class:`Cutter` signature, passed in directly or
registered under a name with :func:`register_cutter`.

[Note: transfer cost] Moving a tensor set of ``B`` bytes across a cut costs
``latency + B / bandwidth`` (nothing when ``B`` is 0) and *both* endpoints pay it: the
sender while it sends, the receiver while it receives (on CPU both ends copy the bytes;
on loopback TCP both ends spend the time). Per microbatch, the cut between two stages
moves activations forward and the gradients of the crossing tensors that need them
backward, so a stage's time is::

    stage_time(a, b) = sum(compute[a:b]) * pace[s] + cut[a] + cut[b]     cut[0] = cut[n] = 0
    cut[c] = transfer(activation bytes at c) + transfer(gradient bytes at c)

Every tensor alive across ``c`` is counted, skip connections included (a skip that spans
stages is relayed through each). The simulator plays the same model.

[Note: a stage's pace] ``pace[s]`` is what stage ``s``'s compute takes in multiples of ``compute``
(1 for every stage where its workers are alike). The planner prices ``compute`` at the slowest placed
worker's speed and gives a stage whose workers are faster a pace below 1 (``CutProblem.pace``), so a
pipeline across two generations of hosts gives the faster ones more nodes. Cut as if every stage ran at
the slowest's speed, the faster stages idled: 16 equal nodes over a worker and one twice as fast were cut
8 and 8, a 2-stage pipeline of 800 ms a step, and the search kept to the fast worker alone (774 ms); cut
by speed, 11 and 5, the pipeline takes 562 ms and the search chooses it. Transfers do not scale with the
pace: both ends pay the link's time.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np

from coordinator.planning import compiled_cut

__all__ = [
    "CUTTERS",
    "CutError",
    "CutProblem",
    "Cutter",
    "cut_even",
    "cut_min_max",
    "get_cutter",
    "may_fit",
    "register_cutter",
]

Bounds: TypeAlias = tuple[int, ...]

# Memory sums are compared with a rounding slack: the cutter sums prefix differences, a check
# sums a stage's nodes directly, and the two may differ in the last bits for the same stage.
MEMORY_SLACK = 1e-9


def with_slack(limit: float) -> float:
    """``limit`` plus a rounding slack (relative, and absolute for limits near 0)."""
    return limit + MEMORY_SLACK * max(1.0, abs(limit))


class CutError(ValueError):
    """No cut satisfies the problem (too many stages, memory limits, uncuttable positions)."""


@dataclass(frozen=True)
class CutProblem:
    """A chain to cut, its costs per microbatch, and the constraints.

    Args:
        compute_s: Forward + backward time of each of the ``n`` nodes.
        cut_s: Transfer time charged to each stage adjacent to cut ``c`` (between node
            ``c-1`` and ``c``), length ``n + 1``; entries 0 and ``n`` are ignored.
        num_stages: How many contiguous, non-empty stages to make (1..n).
        cuttable: Length ``n + 1``; False forbids a boundary at that cut (for example a
            non-tensor value crosses it). Default: all allowed.
        static_bytes: Memory each node needs regardless of microbatches (parameters,
            gradients, optimizer state), length ``n``; None ignores memory.
        activation_bytes: Memory one microbatch's activations hold on each node, length ``n``.
        in_flight: Per stage, how many microbatches' activations it holds at its peak.
        deferred_bytes: Memory one microbatch holds on each node from its backward to the
            step's deferred weight gradients (length ``n``; None: nothing deferred).
        defers: Per stage, whether it defers its weight gradients
            (``services.compute.weight_grads.defers``); such a stage holds, per microbatch in
            flight, the larger of the two on each node.
        memory_limit: Per stage, the bytes it may use; None means unlimited.
        hold_bytes: What a stage that holds its backwards' weight gradients to compute them together
            (1F1B: ``services/compute/executor.py``) holds on each node at its peak, beyond its
            activations (length ``n``; None: nothing).
        holds: Per stage, whether it holds them (with ``hold_bytes``).
        transient_bytes: Memory a node needs only while it runs (ZeRO-3's gathered parameters, a
            recomputed cell's activations: ``coordinator/planning/memory.py``), length ``n``; a stage
            adds its largest node's. None: nothing.
        pace: Per stage, what its compute takes in multiples of ``compute_s`` (its workers' speed
            against the speed ``compute_s`` is priced at: [Note: a stage's pace]); None: 1 for all.

    Raises:
        ValueError: On inconsistent lengths, negative costs or ``num_stages`` outside 1..n.
    """

    compute_s: tuple[float, ...]
    cut_s: tuple[float, ...]
    num_stages: int
    cuttable: tuple[bool, ...] | None = None
    static_bytes: tuple[float, ...] | None = None
    activation_bytes: tuple[float, ...] | None = None
    in_flight: tuple[int, ...] | None = None
    memory_limit: tuple[float, ...] | None = None
    deferred_bytes: tuple[float, ...] | None = None
    defers: tuple[bool, ...] | None = None
    transient_bytes: tuple[float, ...] | None = None
    hold_bytes: tuple[float, ...] | None = None
    holds: tuple[bool, ...] | None = None
    pace: tuple[float, ...] | None = None
    _prefix: np.ndarray = field(init=False, repr=False, compare=False)
    _deferring: tuple[float, ...] | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        n = len(self.compute_s)
        if n < 1 or len(self.cut_s) != n + 1:
            raise ValueError(f"need n >= 1 node costs and n + 1 cut costs, got {n} and {len(self.cut_s)}")
        if not 1 <= self.num_stages <= n:
            raise ValueError(f"num_stages={self.num_stages} must be between 1 and the {n} nodes")
        if min(self.compute_s) < 0 or min(self.cut_s) < 0:
            raise ValueError("compute and transfer times must be >= 0")
        if self.cuttable is not None and len(self.cuttable) != n + 1:
            raise ValueError("cuttable needs n + 1 entries")
        if self.memory_limit is not None:
            if self.static_bytes is None or self.activation_bytes is None or self.in_flight is None:
                raise ValueError("memory_limit needs static_bytes, activation_bytes and in_flight")
            if len(self.static_bytes) != n or len(self.activation_bytes) != n:
                raise ValueError("static_bytes and activation_bytes need n entries")
            if len(self.memory_limit) != self.num_stages or len(self.in_flight) != self.num_stages:
                raise ValueError("memory_limit and in_flight need one entry per stage")
        if (self.deferred_bytes is None) != (self.defers is None) or (
                self.deferred_bytes is not None and self.defers is not None
                and (len(self.deferred_bytes) != n or len(self.defers) != self.num_stages)):
            raise ValueError("deferred_bytes (n entries) and defers (one per stage) come together")
        if self.transient_bytes is not None and len(self.transient_bytes) != n:
            raise ValueError("transient_bytes needs n entries")
        if (self.hold_bytes is None) != (self.holds is None) or (
                self.hold_bytes is not None and self.holds is not None
                and (len(self.hold_bytes) != n or len(self.holds) != self.num_stages)):
            raise ValueError("hold_bytes (n entries) and holds (one per stage) come together")
        if self.pace is not None and (len(self.pace) != self.num_stages or not all(x > 0 for x in self.pace)):
            raise ValueError(f"pace needs one positive entry per stage ({self.num_stages}), got {self.pace}")
        object.__setattr__(self, "_prefix", np.concatenate([[0.0], np.cumsum(self.compute_s)]))
        # the costs are >= 0 (above), so both sums are finite exactly when every cost is
        if not (math.isfinite(float(self._prefix[n])) and math.isfinite(sum(self.cut_s))):
            raise ValueError("compute and transfer times must be finite (a node's or a cut's time is inf or "
                             "NaN: check the profile's timings)")

    @property
    def num_nodes(self) -> int:
        return len(self.compute_s)

    def stage_time(self, start: int, stop: int, stage: int = 0) -> float:
        """Time of stage ``stage`` running nodes ``[start, stop)`` (see [Note: transfer cost])."""
        n = self.num_nodes
        inner = self.cut_s[start] if start > 0 else 0.0
        outer = self.cut_s[stop] if stop < n else 0.0
        compute = float(self._prefix[stop] - self._prefix[start])
        if self.pace is not None:
            compute *= self.pace[stage]
        return compute + inner + outer

    def held_bytes(self, stage: int) -> tuple[float, ...] | None:
        """What one microbatch in flight holds on each node if stage ``stage`` runs it: its activations,
        or for a stage that defers its weight gradients the larger of those and its deferred bytes."""
        if self.activation_bytes is None:
            return None
        if self.defers is None or self.deferred_bytes is None or not self.defers[stage]:
            return self.activation_bytes
        if self._deferring is None:  # made when first asked: most problems are only cut for compute
            object.__setattr__(self, "_deferring", tuple(np.maximum(
                np.asarray(self.activation_bytes, dtype=np.float64),
                np.asarray(self.deferred_bytes, dtype=np.float64)).tolist()))
        return self._deferring

    def stage_memory(self, stage: int, start: int, stop: int) -> float:
        """Peak bytes of stage ``stage`` running nodes ``[start, stop)`` (0 without memory data)."""
        held = self.held_bytes(stage)
        if self.static_bytes is None or held is None or self.in_flight is None:
            return 0.0
        transient = max(self.transient_bytes[start:stop]) if self.transient_bytes is not None else 0.0
        return (sum(self.static_bytes[start:stop]) + sum(held[start:stop]) * self.in_flight[stage] + transient
                + self.stage_hold(stage, start, stop))

    def stage_hold(self, stage: int, start: int, stop: int) -> float:
        """What stage ``stage`` over nodes ``[start, stop)`` holds for its held weight gradients
        (``hold_bytes``)."""
        if self.hold_bytes is None or self.holds is None or not self.holds[stage]:
            return 0.0
        return float(sum(self.hold_bytes[start:stop]))

    def check(self, bounds: Sequence[int]) -> Bounds:
        """Validates boundaries against the problem and returns them as a tuple.

        Raises:
            CutError: If the bounds are malformed, cut at a forbidden position or exceed a
                memory limit; the message names the stage.
        """
        b = tuple(int(x) for x in bounds)
        n, k = self.num_nodes, self.num_stages
        if len(b) != k + 1 or b[0] != 0 or b[-1] != n or any(x >= y for x, y in itertools.pairwise(b)):
            raise CutError(f"bounds {b} are not 0 = b0 < b1 < ... < b{k} = {n}")
        for c in b[1:-1]:
            if self.cuttable is not None and not self.cuttable[c]:
                raise CutError(f"bounds {b} cut at position {c}, which cannot be cut")
        if self.memory_limit is not None:
            for s in range(k):
                need = self.stage_memory(s, b[s], b[s + 1])
                if need > with_slack(self.memory_limit[s]):
                    raise CutError(f"stage {s} (nodes {b[s]}..{b[s + 1] - 1}) needs {need:.4g} bytes, "
                                   f"its limit is {self.memory_limit[s]:.4g}")
        return b

    def max_stage_time(self, bounds: Sequence[int]) -> float:
        """The slowest stage's time under ``bounds``."""
        return max(self.stage_time(a, b, s) for s, (a, b) in enumerate(itertools.pairwise(bounds)))


class Cutter(Protocol):
    """The cutter signature: a problem in, boundaries ``(0, b1, ..., n)`` out.

    A cutter may ignore memory limits (the planner re-checks them) but must return
    ``num_stages + 1`` strictly increasing boundaries from 0 to ``n``, or raise
    :class:`CutError` saying why none exist.
    """

    def __call__(self, problem: CutProblem, /) -> Bounds: ...


# The bottleneck bounds the band tries, in multiples of the least a stage can take (the average
# stage with the cheapest cuts' transfers, or the heaviest node), before the last try takes every start
# (the dense dynamic programme). A try too narrow costs a pass; one too wide, a wider band each pass.
_BAND_TRIES = (1.15, 1.5, 6.0, math.inf)
# A cut with memory limits starts its tries from the relaxed optimum ([Note: a cut bound by memory]), at
# any length: its passes (a dozen limits; one where memory does not bind) cost less than a try that fails.


def cut_min_max(problem: CutProblem) -> Bounds:
    """The exact min-max cut: no other boundaries give a faster slowest stage.

    Dynamic programming over (stages, end node)::

        best[s][j] = min over i of max(best[s-1][i], stage_time(i, j))
        (stage s runs nodes [i, j); infeasible (i, j) for stage s cost infinity)

    Ties go to the earliest cut. [Note: the band] The minimum of ``best[k][n]`` is at most any bound
    ``U`` some cut reaches, and a stage of that cut has ``sum(compute[i:j]) <= U`` (transfers add to
    it), so only the starts ``i`` within that much compute of ``j`` take part: the band. Every value of
    the programme that is ``<= U``, and every minimiser that leads to one, is the same as over all
    starts (a value that needs a start outside the band exceeds ``U``), so the band gives the very
    boundaries of the full programme whenever its ``best[k][n] <= U``. ``U`` starts at
    :data:`_BAND_TRIES` times the least possible bottleneck (under memory limits, the relaxed one of
    [Note: a cut bound by memory]) and widens until that holds (the last try is every start); a try that
    found a cut over its ``U`` makes that cut's slowest stage the next ``U``, which holds. Work: ``k``
    numpy passes over ``n x w`` (``w``: the nodes of the widest band, about ``1.5 n / k`` for even
    nodes), so ``n^2``-ish in all instead of ``k n^2``: a 1,000-node chain into 128 stages in a few
    milliseconds, 4,000 in well under a second. A chain of at least ``compiled_cut.COMPILED_FROM`` nodes x
    stages runs the same programme compiled instead ([Note: the compiled programme] in compiled_cut.py):
    the same boundaries, 5-9x quicker on the cuts a cluster's search makes.

    Raises:
        CutError: If no boundaries satisfy the cuttable positions and memory limits.
    """
    n, k = problem.num_nodes, problem.num_stages
    prefix = problem._prefix
    # the stages' speeds together, in stages of pace 1; the quickest and slowest pace ([Note: a stage's pace])
    share, quickest, slowest = float(k), 1.0, 1.0
    if problem.pace is not None:
        share, quickest, slowest = sum(1 / x for x in problem.pace), min(problem.pace), max(problem.pace)
    least = max(float(prefix[n]) / share, max(problem.compute_s) * quickest)
    if 1 < k <= n:  # every inner boundary charges its cut to both stages beside it: the k - 1 cheapest
        inner = np.asarray(problem.cut_s[1:n], dtype=np.float64)
        if problem.cuttable is not None:
            inner = inner[np.asarray(problem.cuttable[1:n], dtype=bool)]
        if len(inner) >= k - 1:
            cheapest = 2 * float(np.partition(inner, k - 2)[:k - 1].sum())
            least = max(least, (float(prefix[n]) + cheapest / slowest) / share)
    if may_fit(problem):
        if compiled_cut.wanted(problem):  # the same boundaries, an order quicker ([Note: the compiled
            bounds = compiled_cut.cut(problem, least)  # programme] in compiled_cut.py)
        else:
            started = time.process_time()
            bounds = _band_cut(problem, least)
            compiled_cut.band_spent(time.process_time() - started, problem)
        if bounds is not None:
            return bounds
    raise CutError(f"no way to cut {n} nodes into {k} stages within the cuttable positions "
                   "and memory limits")


def _band_cut(problem: CutProblem, least: float) -> Bounds | None:
    """The band's tries ([Note: the band]) from ``least``; None where no cut fits."""
    if not fits_memory(problem):
        return None
    found = math.inf  # the slowest stage of a cut a failed try found: the optimum is at most that
    if problem.memory_limit is not None and problem.num_stages > 1:  # where memory puts the optimum, at least
        least = _least_relaxed(problem, least)
    for factor in _BAND_TRIES:
        bounds, found = _banded(problem, min(factor * least if least > 0 else math.inf, found))
        if bounds is not None:
            return bounds
    return None


def _least_relaxed(problem: CutProblem, least: float, within: float = 0.02) -> float:
    """A lower bound on the min-max cut's slowest stage, at least ``least``: the least limit on each stage's
    compute (at its pace) under which some cut keeps every stage within it and within its memory, the cuts
    costing nothing and a stage holding its static bytes and activations alone.

    [Note: a cut bound by memory] Where memory decides the cut, the optimum sits far above the compute's
    share (4x on 1,000 uneven nodes over 14 stages of 1F1B, whose first stages hold 14 microbatches), and
    the band's tries from the share, each wider than the last, failed until the widest: 100-200 ms a
    problem where the band near the optimum takes a few. Relaxed so, both constraints only bound a stage's
    start from below for each end, so whether a limit has a cut is :func:`fits_memory`'s pass with one
    more bound: ``k`` passes of a few numpy calls, a dozen limits to bracket the relaxed optimum within
    ``within``. It only sets where the tries start; the band stays exact whatever it says."""
    n, k = problem.num_nodes, problem.num_stages
    prefix = problem._prefix
    pace = problem.pace or (1.0,) * k
    ends = np.arange(n + 1)
    allowed = _ends(problem)
    # per stage, the earliest start its memory allows for each end (0 without a limit)
    earliest = [np.zeros(n + 1, dtype=np.int64)] * k
    limits, in_flight = problem.memory_limit, problem.in_flight
    if limits is not None and problem.static_bytes is not None and in_flight is not None:
        static = np.asarray(problem.static_bytes, dtype=np.float64)
        arrays: dict[int, np.ndarray] = {}  # per held bytes (two tuples the problem keeps)
        found: dict[tuple[int, float, float], np.ndarray] = {}  # stages alike in memory share theirs
        for s in range(k):
            held = problem.held_bytes(s)
            if held is None:
                continue
            key = (id(held), in_flight[s], limits[s])
            if key not in found:
                if (values := arrays.get(id(held))) is None:
                    values = arrays[id(held)] = np.asarray(held, dtype=np.float64)
                used = np.concatenate([[0.0], np.cumsum(static + values * in_flight[s])])
                found[key] = np.searchsorted(used, used - with_slack(limits[s]), side="left")
            earliest[s] = found[key]

    def feasible(limit: float) -> bool:
        reach = ends == 0
        latest = np.empty(n + 1, dtype=np.int64)
        latest[0] = -1
        by_pace: dict[float, np.ndarray] = {}  # the earliest start the limit allows, per pace: few paces
        for s in range(k):
            latest[1:] = np.maximum.accumulate(np.where(reach, ends, -1))[:-1]
            if (reach_back := by_pace.get(pace[s])) is None:
                reach_back = by_pace[pace[s]] = np.searchsorted(prefix, prefix - limit / pace[s], side="left")
            # a start is at least 0, so a latest start of -1 (none reachable) is never at or past it
            reach = (latest >= np.maximum(reach_back, earliest[s])) & allowed
            if s < k - 1:
                reach[n] = False  # the later stages need nodes of their own
        return bool(reach[n])

    if not 0 < least < math.inf or feasible(least):
        return least
    low, high = least, 2 * least
    for _ in range(40):  # doubling: a limit with a cut (one always exists: the memory fits some cut)
        if feasible(high):
            break
        low, high = high, 2 * high
    else:
        return least
    for _ in range(12):  # halving the ratio: 2 ** (1 / 2 ** 12) is well within ``within``
        if high <= low * (1 + within):
            break
        middle = math.sqrt(low) * math.sqrt(high)  # the geometric mean, without the product's underflow
        if feasible(middle):
            high = middle
        else:
            low = middle
    return low


def _ends(problem: CutProblem) -> np.ndarray:
    """Where a stage may end: the cuttable positions, and the last node's end."""
    n = problem.num_nodes
    allowed = np.ones(n + 1, dtype=bool)
    if problem.cuttable is not None:
        allowed = np.asarray(problem.cuttable, dtype=bool).copy()
        allowed[n] = True
    return allowed


def may_fit(problem: CutProblem) -> bool:
    """False when no cut fits memory whatever it is: every node's static bytes and one microbatch of its
    activations per microbatch the emptiest stage holds exceed all the stages' limits together."""
    if problem.memory_limit is None or problem.static_bytes is None or problem.activation_bytes is None:
        return True
    assert problem.in_flight is not None
    least = sum(problem.static_bytes) + sum(problem.activation_bytes) * min(problem.in_flight)
    return floor_fits(least, sum(with_slack(limit) for limit in problem.memory_limit))


def floor_fits(least: float, room: float) -> bool:
    """Whether ``least`` bytes (what any cut holds over its stages: :func:`may_fit`) fit the stages'
    ``room`` together (their limits, each :func:`with_slack`), within the sums' rounding."""
    return least <= room * (1 + 1e-9)


def fits_memory(problem: CutProblem) -> bool:
    """Whether some cut meets every stage's memory limit and the cuttable positions, whatever its time.

    [Note: a cut that cannot fit] The min-max programme proves that none fits only after its widest try,
    every start of every end for every stage (73-114 ms a problem for 1,000 nodes into 16 stages, most of
    a cluster-sized plan's search: docs/benchmarks.md). Memory alone is decided in ``O(k n)``: a stage's
    bytes grow with its last node and shrink with its first, so among the starts the stages before it can
    reach, the latest one is the best start for any end. Stage by stage, each end is reachable when the
    latest reachable start before it fits; some cut fits when the last stage reaches ``n``. Exact (the
    tests hold it against the brute force). Transient bytes count as the programme counts them, their most
    over the stage's nodes (:func:`_range_max`), which also grows with the last node and shrinks with the
    first. Left to the programme, a problem that cannot fit took its four tries, the last over every
    start: on GPU workers of 2 GiB (1,000 nodes, 1,024 workers) 15 such cuts were 6 s of a 7 s search.
    """
    limits = problem.memory_limit
    if limits is None or problem.static_bytes is None or problem.activation_bytes is None \
            or problem.in_flight is None:
        return True
    n, k = problem.num_nodes, problem.num_stages
    transient = (np.asarray(problem.transient_bytes, dtype=np.float64)
                 if problem.transient_bytes is not None and any(problem.transient_bytes) else None)
    ends = np.arange(n + 1)
    allowed = _ends(problem)
    static = np.concatenate([[0.0], np.cumsum(np.asarray(problem.static_bytes, dtype=np.float64))])
    hold = (np.concatenate([[0.0], np.cumsum(np.asarray(problem.hold_bytes, dtype=np.float64))])
            if problem.hold_bytes is not None and problem.holds is not None else None)
    runs = None if transient is None else _run_maxima(transient)
    sums: dict[int, np.ndarray] = {}  # per held bytes (most stages share them): their prefix sums
    reach = ends == 0  # where the stages so far may end (stage 0 starts at 0)
    for s in range(k):
        held = problem.held_bytes(s)
        assert held is not None
        marked = np.where(reach, ends, -1)
        latest = np.concatenate([[-1], np.maximum.accumulate(marked)[:-1]])  # the latest reachable start < j
        start = np.maximum(latest, 0)
        if (acts := sums.get(id(held))) is None:
            acts = sums[id(held)] = np.concatenate([[0.0], np.cumsum(np.asarray(held, dtype=np.float64))])
        used = static - static[start]  # summed in the programme's order (stage_cost): the same floats
        if runs is not None:
            used = used + _range_max(runs, start, ends)
        if hold is not None and problem.holds is not None and problem.holds[s]:
            used = used + (hold - hold[start])
        used = used + (acts - acts[start]) * problem.in_flight[s]
        reach = (latest >= 0) & allowed & (used <= with_slack(limits[s]))
        if s < k - 1:
            reach[n] = False  # the later stages need nodes of their own
    return bool(reach[n])


def _banded(problem: CutProblem, limit: float) -> tuple[Bounds | None, float]:
    """The programme of :func:`cut_min_max` over the starts within ``limit`` compute of each end (see
    [Note: the band]): its boundaries, or None when its answer exceeds ``limit``; and its answer's slowest
    stage (inf when none exists within the band, or a stage's ends can reach none).

    The first stage starts at 0 and the last one ends at ``n``: their costs are one row each (a vector over
    the ends, a vector over the starts), so only the stages between them build the ``n x w`` band. A plan of
    one or two stages (most of a free search's cuts within memory) never builds it: the band of two stages
    is most of the chain wide.
    """
    n, k = problem.num_nodes, problem.num_stages
    prefix = problem._prefix
    ends = np.arange(n + 1)
    pace = problem.pace or (1.0,) * k
    if math.isinf(limit):
        lowest = np.zeros(n + 1, dtype=np.int64)
    else:  # two more starts than the sum says: rounding may not drop one that belongs
        # the quickest stage holds the most compute within the limit ([Note: a stage's pace])
        reach = limit if problem.pace is None else limit / min(pace) * (1 + 1e-9)
        lowest = np.maximum(np.searchsorted(prefix, prefix - reach, side="left") - 2, 0)
    width = max(1, int((ends - lowest).max()))
    w = np.asarray(problem.cut_s, dtype=np.float64).copy()
    w[0] = w[n] = 0.0
    allowed = None
    if problem.cuttable is not None:
        allowed = np.asarray(problem.cuttable, dtype=bool).copy()
        allowed[0] = allowed[n] = True
    memory = problem.memory_limit is not None
    ps = ph = None
    transient = None
    if memory:
        assert problem.static_bytes is not None and problem.activation_bytes is not None
        ps = np.concatenate([[0.0], np.cumsum(problem.static_bytes)])
        if problem.transient_bytes is not None and any(problem.transient_bytes):
            transient = np.asarray(problem.transient_bytes, dtype=np.float64)
        if problem.hold_bytes is not None and any(problem.hold_bytes):
            ph = np.concatenate([[0.0], np.cumsum(problem.hold_bytes)])
    lowest_held: dict[int, float] = {}

    def least_held(held: tuple[float, ...]) -> float:
        if (found := lowest_held.get(id(held))) is None:
            found = lowest_held[id(held)] = min(held)
        return found

    # per held bytes (the problem's activations, or its deferred ones: two tuples the problem keeps), their
    # prefix sums; by identity, as hashing a chain's tuple each time cost more than the sums
    act_prefix: dict[int, np.ndarray] = {}

    def acts(held: tuple[float, ...]) -> np.ndarray:
        if (found := act_prefix.get(id(held))) is None:
            found = act_prefix[id(held)] = np.concatenate([[0.0], np.cumsum(held)])
        return found

    def over_memory(s: int, j: np.ndarray, i: np.ndarray, window: np.ndarray | None) -> np.ndarray | None:
        """Where stage ``s`` running nodes ``[i, j)`` exceeds its memory (None: no limit); ``window``: the
        transient bytes' maximum over the same nodes. The same float operations as the band's."""
        held = problem.held_bytes(s)
        if not memory or held is None:
            return None
        assert ps is not None and problem.memory_limit is not None and problem.in_flight is not None
        static = ps[j] - ps[i]
        if window is not None:
            static = static + window
        if ph is not None and problem.holds is not None and problem.holds[s]:
            static = static + (ph[j] - ph[i])
        pa = acts(held)
        room = with_slack(problem.memory_limit[s])
        over: np.ndarray = static + (pa[j] - pa[i]) * problem.in_flight[s] > room
        return over

    def paced(compute: np.ndarray, s: int) -> np.ndarray:
        """Stage ``s``'s compute at its pace: the same floats as ``CutProblem.stage_time``."""
        return compute if pace[s] == 1.0 else compute * pace[s]

    # the first stage, [0, j) for every end j: where the band reaches the start 0
    first = (paced(prefix - prefix[0], 0) + w[0]) + w
    bad = (lowest != 0) | (ends == 0)
    if allowed is not None:
        bad |= ~allowed
    over = over_memory(0, ends, np.zeros(n + 1, dtype=np.int64),
                       None if transient is None else _prefix_max(transient))
    if over is not None:
        bad |= over
    best = np.where(bad, np.inf, first)
    choice = np.zeros((k, n + 1), dtype=np.int64)
    if k > 2:  # the stages between the first and the last: the band, ends x starts
        # [Note: the ends' window] Stage s's end j leads to an answer within ``limit`` only if the s + 1
        # stages up to it hold at most (s + 1) limit of compute and the k - 1 - s after it at most
        # (k - 1 - s) limit (a stage costs its compute and transfers, never less): ends outside that
        # window are left infinite, which changes no value or minimiser within ``limit`` (as the band
        # does not). Two more ends each side, and a margin on the sums, for rounding. The band's rows
        # are built for the ends some stage's window holds.
        windows = [(0, n + 1)] * k
        if not math.isinf(limit):
            earliest, past = _ends_windows(problem, limit, w, allowed)
            windows = list(zip(earliest.tolist(), past.tolist(), strict=True))
        r0, r1 = windows[1][0], max(windows[k - 2][1], windows[1][0] + 1)
        # [Note: a stage's own band] A stage's bytes grow as its start moves back, so for each end the
        # starts before the earliest that fits its memory (its static bytes and activations alone, with a
        # margin for the sums' rounding, two starts more) cannot fit: each stage between the first and the
        # last reads the band from its own first column, and the band is as wide as the widest of them.
        # A cut bound by memory spans a wide band for its stages holding few microbatches (1F1B's last)
        # and a few columns of it for those holding many (its first).
        first = [0] * k
        # (the memory terms left out only add: where a count is below 0 the band is read whole)
        if memory and min(min(problem.static_bytes or (0.0,)), min(problem.transient_bytes or (0.0,)),
                          min(problem.hold_bytes or (0.0,))) >= 0:
            assert ps is not None and problem.memory_limit is not None and problem.in_flight is not None
            for s in range(1, k - 1):
                held = problem.held_bytes(s)
                lo, hi = max(windows[s][0], r0), min(windows[s][1], r1)
                if held is None or lo >= hi or least_held(held) < 0:
                    continue
                used = ps + acts(held) * problem.in_flight[s]
                room = problem.memory_limit[s]
                room += 1e-6 * abs(room) + 1e-9 * float(used[n])
                fits_from = np.searchsorted(used, used[lo:hi] - room, side="left") - 2  # per end: a start
                first[s] = min(max(int((fits_from - ends[lo:hi]).min()) + width, 0), width - 1)
        trimmed = min(first[1:k - 1])
        across = width - trimmed  # the band's columns
        first = [max(0, c - trimmed) for c in first]
        rows_at = ends[r0:r1]
        # starts[j, t]: ascending; t = across - 1 is j - 1 (row j - r0)
        starts = rows_at[:, None] - across + np.arange(across)[None, :]
        outside = starts < lowest[r0:r1, None]
        starts = np.maximum(starts, 0)
        # the same float operations as the dense cost[i, j]: (prefix[j] - prefix[i]) * pace + w[i] + w[j]
        spent = prefix[r0:r1, None] - prefix[starts]
        invalid = outside | (starts >= rows_at[:, None])
        if allowed is not None:
            invalid |= ~allowed[starts] | ~allowed[r0:r1, None]
        costs: dict[float, np.ndarray] = {}  # per pace

        def cost_at(s: int) -> np.ndarray:
            if pace[s] not in costs:
                costs[pace[s]] = np.where(invalid, np.inf, paced(spent, s) + w[starts] + w[r0:r1, None])
            return costs[pace[s]]

        window = None if transient is None else _band_max(problem.transient_bytes or (), across)[r0:r1]
        masked: dict[tuple[object, ...], np.ndarray] = {}  # stages alike in memory share their costs

        def memory_key(s: int) -> tuple[object, ...] | None:
            held = problem.held_bytes(s)
            if not memory or held is None:
                return None
            assert problem.memory_limit is not None and problem.in_flight is not None
            return (pace[s], id(held), problem.in_flight[s], problem.memory_limit[s],
                    problem.holds is not None and problem.holds[s])

        keys = [memory_key(s) for s in range(k)]
        counted = Counter(keys[1:k - 1])
        alike = {key for key, count in counted.items() if key is not None and count > 1}

        def stage_cost(s: int, rows: slice, cols: slice) -> np.ndarray:
            key, cost = keys[s], cost_at(s)
            if key is None:
                return cost[rows, cols]
            if key in alike:  # built once over every row, for every stage alike
                if key not in masked:
                    over = over_memory(s, rows_at[:, None], starts, window)
                    masked[key] = cost if over is None else np.where(over, np.inf, cost)
                return masked[key][rows, cols]
            over = over_memory(s, rows_at[rows, None], starts[rows, cols],
                               None if window is None else window[rows, cols])
            return cost[rows, cols] if over is None else np.where(over, np.inf, cost[rows, cols])


        # a stage's pass is a few numpy calls on a band of a few thousand cells (hundreds of stages a cut at
        # cluster size): its buffers and row numbers are made once. [Note: the band as a view] The values
        # ``best[starts[j, t]]`` a pass reads are a window sliding along ``best`` (row j + 1 starts one node
        # later), so they are read through a strided view of it rather than gathered: ``best`` is kept after
        # ``across`` infinite entries, where the band's starts before node 0 fall (their costs are infinite
        # too: such a start is outside every band), and a pass's picks are start numbers by arithmetic.
        spans = np.arange(r1 - r0)
        pad = across
        padded = (np.full(pad + n + 1, np.inf), np.full(pad + n + 1, np.inf))
        held_best = np.full(pad + n + 1, np.inf)
        held_best[pad:] = best
        # per buffer, its sliding views of ``across`` entries: view[i, t] = buffer[i + t] (made once)
        slide = np.lib.stride_tricks.sliding_window_view
        views_of = {id(b): slide(b, across) for b in (held_best, *padded)}
        for s in range(1, k - 1):
            lo, hi = max(windows[s][0], r0), min(windows[s][1], r1)
            following = padded[s % 2]  # the other one holds ``held_best`` (or is unused yet)
            following[pad:].fill(np.inf)
            if lo < hi:
                col = first[s]
                rows, cols = slice(lo - r0, hi - r0), slice(col, across)
                height, breadth = hi - lo, across - col
                # before[j, t] = best[starts[lo - r0 + j, col + t]]: the stages before s end there
                before = views_of[id(held_best)][lo:hi, col:]
                cand = np.maximum(before, stage_cost(s, rows, cols), order="C")
                pick = cand.argmin(axis=1)  # the first minimum, the earliest start: as the dense one
                choice[s][lo:hi] = np.maximum(ends[lo:hi] + (col - across) + pick, 0)
                following[pad + lo:pad + hi] = cand.ravel()[spans[:height] * breadth + pick]
            # every 8th stage (a min each pass cost 5% of a 400-stage cut): no end of stage s here, no cut
            if s % 8 == 1 and (not lo < hi or math.isinf(following[pad + lo:pad + hi].min())):
                return None, math.inf
            held_best = following
        best = held_best[pad:]
    if k > 1:  # the last stage, [i, n) for the starts i within the band of n
        row = n - width + np.arange(width)
        outside_n = row < lowest[n]
        row = np.maximum(row, 0)
        last = paced(prefix[n] - prefix[row], k - 1) + w[row] + w[n]
        bad = outside_n | (row >= n)
        if allowed is not None:
            bad |= ~allowed[row]
        over = over_memory(k - 1, np.full(width, n), row,
                           None if transient is None else _suffix_max(transient)[row])
        if over is not None:
            bad |= over
        cand_n = np.maximum(best[row], np.where(bad, np.inf, last))
        pick_n = int(np.argmin(cand_n))
        choice[k - 1][n] = row[pick_n]
        final = float(cand_n[pick_n])
    else:
        final = float(best[n])
    if not (math.isfinite(final) and final <= limit):
        return None, final
    bounds = [n]
    for s in range(k - 1, 0, -1):
        bounds.append(int(choice[s][bounds[-1]]))
    bounds.append(0)
    return tuple(reversed(bounds)), final


def _ends_windows(problem: CutProblem, limit: float, w: np.ndarray, allowed: np.ndarray | None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Per stage, the ends ``[earliest, past)`` that can lead to an answer within ``limit`` ([Note: the ends'
    window]): the band's rows, and the compiled programme's ends (``compiled_cut.py``). ``w``: the cuts'
    transfers with ``w[0] = w[n] = 0``; ``allowed``: the cuttable positions with both ends allowed, or
    None."""
    n, k = problem.num_nodes, problem.num_stages
    prefix = problem._prefix
    pace = problem.pace or (1.0,) * k
    margin = limit * (1 + 1e-9) + 1e-12
    # the stages up to each one, and after it, in stages of pace 1 (k - 1 - s and s + 1 when alike)
    upto: np.ndarray = np.arange(1, k + 1, dtype=np.float64)
    later = upto[-1] - upto
    if problem.pace is not None:  # each sum taken on its own side, and a hair more for its rounding
        quick = np.array([1 / x for x in pace])
        upto = np.cumsum(quick) * (1 + 1e-9)
        later = np.concatenate([np.cumsum(quick[::-1])[::-1][1:], [0.0]]) * (1 + 1e-9)
    most_upto, most_later = upto * margin, later * margin  # the most compute before and after an end
    # [Note: the ends' window, with the cuts paid] A stage also pays the cuts at its ends within
    # the limit: stages 0..s pay s cuts twice and stage s's end once; the k - 1 - s stages after it
    # pay one cut once and the rest twice. Those are distinct positions, so they cost at least the
    # cheapest cuts, and they leave the stages that much less compute (over the slowest pace at
    # most). Where the cuts cost a sizeable share of a stage (GPU stages beside the links' fixed
    # costs), this narrows each stage's window of ends: 12% fewer cells over a two-generation GPU
    # search's cuts.
    inner = w[1:n] if allowed is None else w[1:n][allowed[1:n]]
    if len(inner) >= k - 1:
        cheap = np.concatenate([[0.0], np.cumsum(np.sort(inner)[:k - 1])])  # the t cheapest: cheap[t]
        stages = np.arange(k - 1)  # s = 0..k-2 (the last stage's end is n: no window)
        slowest_pace = max(pace) / (1 - 1e-9)  # and a hair less, for the sums' rounding
        most_upto[:k - 1] -= (cheap[stages] + cheap[stages + 1]) / slowest_pace
        most_later[:k - 1] -= (cheap[k - 2 - stages] + cheap[k - 1 - stages]) / slowest_pace
    after = prefix[n] - most_later  # the least compute up to a stage's end
    earliest = np.maximum(np.searchsorted(prefix, after, side="left") - 2, 0)
    past = np.minimum(np.searchsorted(prefix, most_upto, side="right") + 2, n + 1)
    return earliest, past


def _run_maxima(values: np.ndarray) -> np.ndarray:
    """The maxima of ``values`` over every power-of-two run (:func:`_range_max`'s table): ``table[lv, i] =
    max(values[i:i + 2**lv])`` (0 past the runs that fit: never read)."""
    n = len(values)
    rows = [np.asarray(values, dtype=np.float64)]
    while 2 * (1 << (len(rows) - 1)) <= n:
        half, prev = 1 << (len(rows) - 1), rows[-1]
        rows.append(np.maximum(prev[:-half], prev[half:]))
    table = np.zeros((len(rows), max(n, 1)))
    for lv, runs in enumerate(rows):
        table[lv, :len(runs)] = runs
    return table


def _range_max(table: np.ndarray, starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """``out[t] = max(values[starts[t]:ends[t]])`` (0 where that is empty), from ``values``' table of the
    maxima over every power-of-two run (:func:`_run_maxima`): two lookups a range, every range at once."""
    length = ends - starts
    empty = length <= 0
    level = np.frexp(np.maximum(length, 1))[1] - 1  # floor(log2(length)): the longest run within it
    last = table.shape[1] - 1  # an empty range's lookups are kept in the table, and not used
    first = np.minimum(np.maximum(starts, 0), last)
    second = np.minimum(np.maximum(ends - np.left_shift(1, level), 0), last)
    out: np.ndarray = np.where(empty, 0.0, np.maximum(table[level, first], table[level, second]))
    return out


def _prefix_max(values: np.ndarray) -> np.ndarray:
    """``out[j] = max(values[:j])`` (0 for j = 0)."""
    return np.concatenate([[0.0], np.maximum.accumulate(values)])


def _suffix_max(values: np.ndarray) -> np.ndarray:
    """``out[i] = max(values[i:])`` (0 for i = n)."""
    return np.concatenate([np.maximum.accumulate(values[::-1])[::-1], [0.0]])


def _band_max(values: Sequence[float], width: int) -> np.ndarray:
    """``out[j, t] = max(values[j - width + t : j])`` (0 where that is empty or starts before 0)."""
    v = np.concatenate([np.asarray(values, dtype=np.float64), [0.0]])
    n = len(values)
    ends = np.arange(n + 1)
    out = np.zeros((n + 1, width))
    running = np.full(n + 1, -np.inf)
    for t in range(width - 1, -1, -1):  # the start j - width + t moves left: one more node each time
        i = ends - width + t
        running = np.where(i >= 0, np.maximum(running, v[np.maximum(i, 0)]), running)
        out[:, t] = np.where(np.isinf(running), 0.0, running)
    return out


def cut_even(problem: CutProblem) -> Bounds:
    """Equal node counts per stage (the first ``n % k`` stages get one more node).

    A boundary at an uncuttable position moves to the nearest free one; memory is not
    considered.

    Raises:
        CutError: If the uncuttable positions leave fewer than ``num_stages`` stages.
    """
    n, k = problem.num_nodes, problem.num_stages
    sizes = [n // k + (1 if s < n % k else 0) for s in range(k)]
    wanted = [sum(sizes[:s]) for s in range(1, k)]
    free = [c for c in range(1, n) if problem.cuttable is None or problem.cuttable[c]]
    chosen: list[int] = []
    for c in wanted:
        options = sorted((x for x in free if x not in chosen and (not chosen or x > chosen[-1])),
                         key=lambda x: (abs(x - c), x))
        if not options:
            raise CutError(f"too few cuttable positions for {k} stages of {n} nodes")
        chosen.append(options[0])
    return (0, *chosen, n)


CUTTERS: dict[str, Cutter] = {"minmax": cut_min_max, "even": cut_even}


def register_cutter(name: str, cutter: Cutter) -> None:
    """Makes ``cutter`` selectable by ``name`` (replacing a previous one of that name)."""
    CUTTERS[name] = cutter


def get_cutter(cutter: str | Cutter) -> Cutter:
    """Resolves a cutter given by name or as a callable.

    Raises:
        ValueError: If a name is not registered.
    """
    if callable(cutter):
        return cutter
    try:
        return CUTTERS[cutter]
    except KeyError:
        raise ValueError(f"unknown cutter {cutter!r}; registered: {', '.join(CUTTERS)}") from None
