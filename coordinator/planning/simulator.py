"""Plays a schedule's action lists against compute and transfer times: step time, idle, bubble, memory.

The model (the same one the cutter optimises, see [Note: transfer cost] in
``coordinator/planning/cutting.py``):

- each rank (a worker of the pipeline: one stage, or the virtual stages of an interleaved
  or V schedule) runs its merged order (``Schedule.rank_actions``) one action after
  another, never two at once, from its start time (the ``StageCosts.start_s`` of its
  stages, one after the other: the rank applies their updates in turn; 0 by default);
- F, B, I and W take the stage's per-microbatch compute time (I and W: the two halves of
  its backward, ``StageCosts.input_backward_s``/``weight_backward_s``);
- a SEND keeps the sender busy for the transfer time of what crosses the cut; the
  tensors are available to the receiver when the send ends (eager sends, see
  [Note: send semantics] in ``services/compute/actions.py``);
- a RECV waits (idle) until the matching send has ended, then keeps the receiver busy for
  the same transfer time. A hand-over between two stages of one rank (the V's turn) is such
  a pair too, costed as its cut says (a local copy: give it a small time);
- a microbatch's activations are held from the start of its forward to the end of its
  backward: its B, or its W when the backward is split (I frees nothing);
- a stage's ``StageCosts.tail_s`` is work after its last backward's ``SEND_B`` (after its last
  backward, on the first stage): the step's last weight gradients, which the stage before does not
  wait for. The rank stays busy for it (the send's or backward's span ends with it, as the executor
  times it) but the gradients arrive when the transfer ends.

A :class:`~coordinator.planning.schedules.Schedule` is valid by construction, deadlock
freedom included, so every action gets played.

[Note: shared cores] Played with a :class:`Sharing`, the ranks' work is not a fixed time but an
amount of it, done at a rate that follows what else runs on the same hosts (a processor-sharing
model). A rank stands for its stage's replicas, which play the same timeline, so it *wants*
``cores[h]`` of host ``h``: the threads of its workers there. At any moment, with ``k`` cores
wanted on a host of ``c`` by the ranks busy there (computing, sending, receiving, applying their
update; a rank waiting for a receive sleeps), each of them runs at ``min(1, c / k)`` of its pace;
a forward, backward, I or W runs at ``1 / slowdown`` of that again while more than one *worker*
of the host is busy (``forward_slowdown``, ``backward_slowdown``: the shared caches and memory
bandwidth, which the profile, taken by one process alone, does not see), and at ``1 / turns_slowdown``
of that again throughout on a host whose ranks, busy or not, want more cores than it has (its workers
take turns on the cores, and a turn finds the caches holding another worker's weights: after a wait a
rank's data is cold whether or not others are busy at that moment; and as a slower pace of the rank, it
stays in every bound the planner takes before playing). A rank on several hosts runs at the rate of its
*home*, the host where it wants the most cores (:meth:`Sharing.homes`). The
play is then event by event: at each start or end of an action the rates are taken again, and the
next end is the earliest one at those rates. Without a host holding two busy workers this is the
plain play above, which :func:`play` runs then (it is the faster of the two).

[Note: a crowded host's slowdown] The planner bounds a shape's step before it plays it
(``coordinator/planning/closed_form.py``), and on hosts of CPU workers the bound at each rank's own
pace fell 8-10% short of the play: eight workers of a host are nearly always busy together, so
nearly every forward and backward runs slowed. What the slowdown costs at least, whatever the
order of events: write ``s`` for the larger slowdown and ``A_r`` for the time rank ``r`` is busy
while no other worker of its home is (*alone*). A forward of ``F`` seconds at its own pace takes at
least ``s_f F - (s_f - 1) a`` where ``a`` is its time alone (alone it runs at most at its pace,
otherwise at most at ``1 / s_f`` of it), so a rank whose bound at its own pace is ``e_r``, with
``F_r`` and ``B_r`` of forwards and backwards in it, ends no earlier than ``e_r + (s_f - 1) F_r +
(s_b - 1) B_r - (s - 1) A_r``. Two ranks of one home are never alone at once, so over any ``k`` of
them the ``A_r`` sum to at most the step ``T``: ``k T >= sum (e_r + ...) - (s - 1) T``, that is
``T >= sum (e_r + (s_f - 1) F_r + (s_b - 1) B_r) / (k + s - 1)`` (:meth:`Sharing.crowded_time` takes
the best ``k`` of each home). Eight equal ranks of a home with ``B = 2 F`` give about 1.1 times their
bound at their own pace.

That bound lets one rank be alone the whole step; but while rank ``r`` is alone, every other rank
of its home is idle. Take ``j >= s`` others (the two busiest, or more when ``s > 2``), each busy at
least ``O_q`` (its starts and actions, slowed as above, less ``(s - 1) A_q``): each is busy and
idle within the step, ``T >= O_q - (s - 1) A_q + sum of the other ranks' A``, and summed over the
``j`` the ``A_q`` terms are left with a factor ``j - 1 - (s - 1) >= 0``, so ``T >= mean O + A_r``.
With ``A_r >= (e_r + slowed work - T) / (s - 1)`` from above, ``T >= (e_r + its slowed work +
(s - 1) mean O) / s``. On the cluster case it lifted the winner's bound from 14.24 s to 14.67 s
(its step: 14.91 s). A test holds both against the play on random hosts, placements and
slowdowns (``tests/unit/coordinator/planning/test_fast_search.py``).

[Note: a rank never alone] A rank with two workers or more at its home crowds it by itself: whenever it
is busy the host holds two busy workers, so its forwards and backwards are slowed, whether another rank is
busy or not. The bounds from a host's cores (:meth:`Sharing.least_time`, :meth:`Sharing.spread_time`)
weigh each rank's work by its slowdowns and take as the most weighted work a host does a second the larger
of its cores and what one rank busy alone does, unslowed (``s min(k, c)``): for such a rank alone that is
``min(k, c)``, as crowded. On hosts whose workers want twice to eight times their cores, with a replica's
ranks spread alike over its hosts (all of them then call one host home), the plays had been 12.4-13% over
those bounds (1.15, the backward's slowdown): 134 shapes played where 2 are now (docs/benchmarks.md,
"Planning at cluster size").

Everything a rank spends waiting is idle; the bubble fraction is total idle time over
``num_ranks * step_time``. For equal stages and free transfers it is ``(p-1)/(m+p-1)``
for GPipe and 1F1B alike. Results are per rank (``SimResult.ranks`` says which stages
each holds); with one stage per rank, rank ``s`` is stage ``s``.
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from coordinator.planning.schedules import Schedule, Step
from services.protocol import Action, ActionKind

__all__ = ["Sharing", "SimResult", "StageCosts", "TimedAction", "Timing", "draw_timeline", "play", "simulate"]

DEFAULT_WEIGHT_FRACTION = 0.5  # W's share of an unmeasured backward (the paper's T_W ~ T_F ~ T_B / 2)


@dataclass(frozen=True)
class StageCosts:
    """Per-microbatch times of a pipeline's (virtual) stages, in seconds.

    Args:
        forward_s: Forward time of each stage (length p).
        backward_s: Whole-backward time of each stage (length p): a ``B``, or ``I`` plus ``W``.
        activation_transfer_s: ``[c]`` is the time to move one microbatch's activations
            across the cut between stage c and c+1 (length p-1); each endpoint pays it.
        gradient_transfer_s: The same for gradients flowing from c+1 back to c (length p-1).
        activation_bytes: Bytes one microbatch's activations hold on each stage (length p,
            or empty when memory is not of interest).
        start_s: When each stage can begin its first action (length p, or empty: at 0),
            e.g. after applying the previous step's update.
        weight_backward_s: The weight-gradient half (``W``) of each stage's backward (length p,
            at most ``backward_s``), or empty: unmeasured, :data:`DEFAULT_WEIGHT_FRACTION` of
            it. The input-gradient half ``I`` is the rest (:attr:`input_backward_s`).
        tail_s: Per stage, the work after its last backward's send (length p, or empty: none); see the
            module docstring.

    Raises:
        ValueError: On inconsistent lengths, negative times or a W longer than its backward.
    """

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    activation_transfer_s: tuple[float, ...]
    gradient_transfer_s: tuple[float, ...]
    activation_bytes: tuple[float, ...] = ()
    start_s: tuple[float, ...] = ()
    weight_backward_s: tuple[float, ...] = ()
    tail_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        p = len(self.forward_s)
        lengths = (len(self.backward_s), len(self.activation_transfer_s) + 1,
                   len(self.gradient_transfer_s) + 1)
        if (p < 1 or any(n != p for n in lengths)
                or any(len(t) not in (0, p) for t in (self.activation_bytes, self.start_s,
                                                       self.weight_backward_s, self.tail_s))):
            raise ValueError(f"inconsistent stage cost lengths for {p} stages: {lengths}")
        times = (*self.forward_s, *self.backward_s, *self.activation_transfer_s, *self.gradient_transfer_s,
                 *self.start_s, *self.weight_backward_s, *self.tail_s)
        if any(t < 0 for t in times):
            raise ValueError("stage costs must be >= 0")
        if over := [s for s, (w, b) in enumerate(zip(self.weight_backward_s, self.backward_s, strict=False))
                    if w > b]:
            raise ValueError(f"stage {over[0]}: its W ({self.weight_backward_s[over[0]]} s) is part of its "
                             f"backward ({self.backward_s[over[0]]} s), so cannot be longer")

    @property
    def num_stages(self) -> int:
        return len(self.forward_s)

    @property
    def weight_s(self) -> tuple[float, ...]:
        """Each stage's ``W`` time: ``weight_backward_s``, or the default share of its backward."""
        return self.weight_backward_s or tuple(b * DEFAULT_WEIGHT_FRACTION for b in self.backward_s)

    @property
    def input_backward_s(self) -> tuple[float, ...]:
        """Each stage's ``I`` time: its backward less its ``W``."""
        return tuple(b - w for b, w in zip(self.backward_s, self.weight_s, strict=True))

    @classmethod
    def uniform(cls, num_stages: int, forward_s: float, backward_s: float,
                transfer_s: float = 0.0, weight_s: float | None = None) -> StageCosts:
        """Equal stages with one transfer time for every cut and direction (``weight_s``: W's share)."""
        cuts = (transfer_s,) * (num_stages - 1)
        weights = () if weight_s is None else (weight_s,) * num_stages
        return cls((forward_s,) * num_stages, (backward_s,) * num_stages, cuts, cuts,
                   weight_backward_s=weights)


@dataclass(frozen=True)
class Sharing:
    """How a plan's ranks share their hosts' cores (see [Note: shared cores]).

    Args:
        cores: Each host's cores (hosts numbered from 0).
        wants: Per rank, ``(host, cores, workers)`` for every host it runs on: the cores its workers
            there want while busy (their threads) and how many workers that is. A rank on no shared
            host (a GPU's, a host of its own) has none and runs at its own pace.
        forward_slowdown: A forward's pace divided by this while another worker of its host is busy.
        backward_slowdown: The same for a backward (B, I and W).
        turns_slowdown: A forward's or backward's pace divided by this again, throughout, on a host whose
            ranks (busy or not) want more cores than it has (:meth:`turns`).

    Raises:
        ValueError: On a host that is not numbered, no cores, or a slowdown below 1.
    """

    cores: tuple[float, ...]
    wants: tuple[tuple[tuple[int, float, int], ...], ...]
    forward_slowdown: float = 1.0
    backward_slowdown: float = 1.0
    turns_slowdown: float = 1.0

    def __post_init__(self) -> None:
        if any(c <= 0 for c in self.cores):
            raise ValueError(f"every host needs cores > 0: {self.cores}")
        entries = list(itertools.chain.from_iterable(self.wants))  # one pass in C: a cluster's has thousands
        if entries and (set(map(len, entries)) != {3} or not self._wants_valid(*zip(*entries, strict=True))):
            raise ValueError(f"each want is (host in 0..{len(self.cores) - 1}, cores > 0, workers >= 1): "
                             f"{self.wants}")
        if min(self.forward_slowdown, self.backward_slowdown, self.turns_slowdown) < 1:
            raise ValueError("a slowdown is >= 1: another busy worker never speeds one up")

    def _wants_valid(self, hosts: Sequence[int], cores: Sequence[float], workers: Sequence[int]) -> bool:
        return min(hosts) >= 0 and max(hosts) < len(self.cores) and min(cores) > 0 and min(workers) >= 1

    @property
    def crowded(self) -> bool:
        """Whether some host holds two workers or more (else every rank runs at its own pace)."""
        return any(n > 1 for n in self._host_sums[1])

    @functools.cached_property
    def _host_sums(self) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """Per host, the cores every rank wants there and its workers there (the bounds ask them of every
        shape: a cluster's sharing holds thousands of wants, so once)."""
        wanted, workers = [0.0] * len(self.cores), [0] * len(self.cores)
        for want in self.wants:
            for h, k, n in want:
                wanted[h] += k
                workers[h] += n
        return tuple(wanted), tuple(workers)

    @functools.cached_property
    def _at_home(self) -> tuple[tuple[float, int], ...]:
        """Per rank, the cores it wants at its home and its workers there ((0, 0) without one)."""
        return tuple((0.0, 0) if h is None else next((k, n) for g, k, n in want if g == h)
                     for want, h in zip(self.wants, self.homes(), strict=True))

    @functools.cached_property
    def _home_cores(self) -> tuple[float, ...]:
        """Per rank, the cores it wants at its home (0 without one)."""
        return tuple(k for k, _ in self._at_home)

    @functools.cached_property
    def _home_slowed(self) -> tuple[bool, ...]:
        """Per rank, whether it has two workers or more at its home: busy, it crowds that host by itself, so
        its forwards and backwards are slowed even while no other rank is busy ([Note: a rank never
        alone])."""
        return tuple(n > 1 for _, n in self._at_home)

    def turns(self, host: int) -> float:
        """What a forward's or backward's pace is divided by on ``host`` beyond the slowdowns of a crowd:
        ``turns_slowdown`` where two workers or more want more cores than it has (they take turns), else 1."""
        return self._turns[host]

    @functools.cached_property
    def _turns(self) -> tuple[float, ...]:
        return _turns(self.cores, self.wants, self.turns_slowdown)

    def homes(self) -> tuple[int | None, ...]:
        """Per rank, the host whose pace it runs at: where it wants the most cores (None: no shared host)."""
        return self._homes

    @functools.cached_property
    def _homes(self) -> tuple[int | None, ...]:
        return tuple(max(w, key=lambda x: x[1])[0] if w else None for w in self.wants)

    def least_time(self, forward: Sequence[float], backward: Sequence[float],
                   other: Sequence[float], ready: Sequence[float] | None = None) -> float:
        """A lower bound on the step when rank ``r`` has ``forward[r]``, ``backward[r]`` and ``other[r]``
        seconds of work at its own pace.

        On a host of ``c`` cores, a rank wanting ``k`` of them that runs at pace ``x`` uses ``k x`` of
        them, and does ``x / slowdown`` of its forward or backward while another worker is busy: so the
        host's ranks together do at most ``c`` seconds of work, each weighted by its slowdown and the
        cores it wants, per second, while two workers or more are busy; and one alone at most
        ``slowdown min(k, c) / c`` times that. A host's turns (:meth:`turns`) divide every pace there
        throughout, alone or not: one more weight. The weighted work of the ranks at the host's pace over
        ``c`` times the larger of the two is the bound.

        ``ready[r]``, when given, is a time before which rank ``r`` starts no forward or backward (its
        first microbatch's arrival: [Note: a host's fill]); a host's forwards and backwards then fit between
        its ranks' ``ready`` and the step's end, at most at the rate of the ranks ready so far
        (:func:`_filled_by`).
        """
        homes = self.homes()
        workers, wanted = self._host_sums[1], self._home_cores
        worst = max(self.forward_slowdown, self.backward_slowdown)
        load = [0.0] * len(self.cores)
        computed = [0.0] * len(self.cores)  # the forwards and backwards alone
        alone = [1.0] * len(self.cores)
        arrivals: list[list[tuple[float, float, float]]] = [[] for _ in self.cores]  # (ready, k, one's rate)
        for r, home in enumerate(homes):
            if home is None:
                continue
            h = home
            k = wanted[r]
            crowded = workers[h] > 1
            f, b = (self.forward_slowdown, self.backward_slowdown) if crowded else (1.0, 1.0)
            t = self.turns(h)  # throughout: a weight like the others, alone or not
            work = k * (t * f * forward[r] + t * b * backward[r])
            load[h] += work + k * other[r]
            computed[h] += work
            # the most one busy rank does a second: unslowed, unless it crowds its home by itself
            one = (worst if crowded and not self._home_slowed[r] else 1.0) * min(k, self.cores[h])
            arrivals[h].append((ready[r] if ready is not None else 0.0, k, one))
            alone[h] = max(alone[h], one / self.cores[h])
        # a host no rank calls home carries no load: its term is 0, as the default
        rate = [c * a for c, a in zip(self.cores, alone, strict=True)]  # the most weighted work a second
        return max((max(load[h] / rate[h], _filled_by(arrivals[h], computed[h], self.cores[h]))
                    for h in set(homes) if h is not None), default=0.0)

    def spread_time(self, forward: float, backward: float, other: float = 0.0) -> float:
        """A lower bound on the step when the ranks' forwards together hold at least ``forward`` seconds at
        their own paces, their backwards ``backward`` and their other work ``other`` (as
        :meth:`least_time`'s), however a cut splits them among the ranks: :meth:`least_time`'s homes added up
        (the busiest does at least their mean), each kind at the least weight any rank gives it there (the
        cores it wants at home; for a forward or a backward also its home's turns and, where its home is
        crowded, the kind's slowdown); 0 where a rank has no home. The weights and the homes' rate are the
        sharing's own: taken once."""
        spread = self._spread
        if spread is None:
            return 0.0
        weights, rate = spread
        return (weights[0] * forward + weights[1] * backward + weights[2] * other) / rate

    @functools.cached_property
    def _spread(self) -> tuple[tuple[float, float, float], float] | None:
        """:meth:`spread_time`'s least weights of a forward, a backward and other work, and the most weighted
        work the homes do a second (None where a rank has no home)."""
        homes = self.homes()
        if not homes or any(h is None for h in homes):
            return None
        workers, wanted = self._host_sums[1], self._home_cores
        worst = max(self.forward_slowdown, self.backward_slowdown)
        forward = backward = other = math.inf
        alone: dict[int, float] = {}
        for r, home in enumerate(homes):
            assert home is not None
            crowded = workers[home] > 1
            k = wanted[r]
            forward = min(forward, k * self.turns(home) * (self.forward_slowdown if crowded else 1.0))
            backward = min(backward, k * self.turns(home) * (self.backward_slowdown if crowded else 1.0))
            other = min(other, k)
            one = (worst if crowded and not self._home_slowed[r] else 1.0) * min(k, self.cores[home])
            alone[home] = max(alone.get(home, 1.0), one / self.cores[home])
        rate = sum(self.cores[h] * a for h, a in alone.items())  # the most weighted work they do a second
        return (forward, backward, other), rate

    def crowded_time(self, ends: Sequence[float], occupied: Sequence[float], forward: Sequence[float],
                     backward: Sequence[float]) -> float:
        """A lower bound on the step when rank ``r`` could end no earlier than ``ends[r]`` at its own pace,
        is busy ``occupied[r]`` at that pace, and ``forward[r]`` and ``backward[r]`` of that are forwards
        and backwards not yet slowed (see [Note: a crowded host's slowdown]); 0 where none is slowed."""
        extra = max(self.forward_slowdown, self.backward_slowdown) - 1.0
        if extra <= 0.0:
            return 0.0
        fs, bs = self.forward_slowdown - 1.0, self.backward_slowdown - 1.0
        by_home: dict[int, list[int]] = {}
        for r, home in enumerate(self.homes()):
            if home is not None:
                by_home.setdefault(home, []).append(r)
        others = max(2, math.ceil(1.0 + extra))  # the busiest others a rank alone keeps idle, at least
        best = 0.0
        for ranks in by_home.values():
            slowed = [fs * forward[r] + bs * backward[r] for r in ranks]
            late = sorted((ends[r] + x for r, x in zip(ranks, slowed, strict=True)), reverse=True)
            total = 0.0
            for k, v in enumerate(late, start=1):  # any k of them together
                total += v
                best = max(best, total / (k + extra))
            if len(ranks) <= others:
                continue
            busy = sorted(((occupied[r] + x, i) for i, (r, x) in enumerate(zip(ranks, slowed, strict=True))),
                          reverse=True)
            for i, r in enumerate(ranks):  # one rank, and the busiest others idle while it is alone
                idle = [b for b, j in busy[:others + 1] if j != i][:others]
                mean = sum(idle) / others
                best = max(best, mean, (ends[r] + slowed[i] + extra * mean) / (1.0 + extra))
        return best

    def least_stretch(self) -> tuple[float, ...]:
        """Per rank, what its pace is divided by at least whenever it is busy: the cores it wants at its home
        over the cores there, at least 1 (busy, it is among the ranks whose wanted cores share them); 1 where
        no host holds two workers, whose play is the plain one."""
        return self._least_stretch

    @functools.cached_property
    def _least_stretch(self) -> tuple[float, ...]:
        homes = self.homes()
        if not self.crowded:
            return (1.0,) * len(homes)
        return tuple(1.0 if h is None else max(1.0, k / self.cores[h])
                     for h, k in zip(homes, self._home_cores, strict=True))

    def most_stretch(self) -> float:
        """The most any busy rank's pace can be divided by: its host's cores all wanted, its kind slowed."""
        wanted = self._host_sums[0]
        share = max((max(1.0, k / c) for k, c in zip(wanted, self.cores, strict=True)), default=1.0)
        turns = self.turns_slowdown if share > 1.0 else 1.0  # wanted more than the cores: turns throughout
        return share * max(self.forward_slowdown, self.backward_slowdown) * turns


def _filled_by(arrivals: Sequence[tuple[float, float, float]], work: float, cores: float) -> float:
    """The least time by which a host's ranks do ``work`` (weighted as :meth:`Sharing.least_time` weighs it)
    when each ``(ready, k, one)`` of ``arrivals`` does none before ``ready``: [Note: a host's fill].

    [Note: a host's fill] A host's busy ranks do at most ``min(c, sum k)`` weighted seconds of work a
    second together (each ``k`` times its share of the ``c`` cores), and one busy rank alone at most ``one``
    (its kind's slowdown times ``min(k, c)``: alone it is not slowed); so while only the ranks ready so far
    can compute, the host's rate is at most the larger of the two over them. In a deep pipeline on a host of
    few cores, the first ranks compute alone while the first microbatch goes down the stages, and the
    host's cores idle: the work then ends at least that idle time over the rate later than ``work / rate``
    (a fill the bound over the cores alone, from the earliest ``ready`` on, left out)."""
    if work <= 0.0 or not arrivals:
        return 0.0
    order = sorted(arrivals)
    done, wanted, single = 0.0, 0.0, 0.0
    for j, (at, k, one) in enumerate(order):
        wanted += k
        single = max(single, one)
        pace = max(min(cores, wanted), single)
        until = order[j + 1][0] if j + 1 < len(order) else math.inf
        if done + pace * (until - at) >= work:
            return at + (work - done) / pace
        done += pace * (until - at)
    return math.inf  # unreachable: the last rank's segment is unbounded


@dataclass(frozen=True, slots=True)
class TimedAction:
    """One played action: it ran from ``start`` to ``end`` (a RECV's wait precedes ``start``)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True)
class SimResult:
    """What :func:`simulate` predicts for one step, per rank (a worker: one stage or several).

    Attributes:
        ranks: The stages each rank holds (``(s,)`` for rank ``s`` when each has one).
        step_time_s: When the last rank finishes its last action.
        timeline: Per rank, its played actions in order.
        busy_s: Per rank, time spent computing, sending or receiving.
        idle_s: Per rank, ``step_time_s - busy_s`` (waiting, fill and drain included).
        bubble_fraction: ``sum(idle_s) / (num_ranks * step_time_s)``.
        held: Per rank, ``(time, microbatches held)`` after every change (a microbatch held by
            two of its stages counts twice: two sets of activations).
        peak_in_flight: Per rank, the most microbatches held at once.
        peak_activation_bytes: Per rank, the most activation bytes held at once (0 if unknown).
    """

    schedule_name: str
    ranks: tuple[tuple[int, ...], ...]
    step_time_s: float
    timeline: tuple[tuple[TimedAction, ...], ...]
    busy_s: tuple[float, ...]
    idle_s: tuple[float, ...]
    bubble_fraction: float
    held: tuple[tuple[tuple[float, int], ...], ...]
    peak_in_flight: tuple[int, ...]
    peak_activation_bytes: tuple[float, ...]

    def track(self, rank: int) -> str:
        """A rank's label: ``stage 3`` when it holds one stage, ``rank 1 (1,6)`` when several."""
        stages = self.ranks[rank]
        if len(stages) == 1 and all(len(r) == 1 for r in self.ranks):
            return f"stage {stages[0]}"
        return f"rank {rank} ({','.join(map(str, stages))})"

    def summary(self) -> str:
        """A small table: one row per rank (busy, idle, peak microbatches held)."""
        labels = [self.track(r) for r in range(len(self.ranks))]
        width = max(5, *map(len, labels))
        rows = [f"{self.schedule_name}: step {self.step_time_s * 1e3:.3f} ms, "
                f"bubble {self.bubble_fraction:.1%}",
                f"{'':>{width}} {'busy ms':>10} {'idle ms':>10} {'peak held':>9}"]
        for label, busy, idle, peak in zip(labels, self.busy_s, self.idle_s, self.peak_in_flight,
                                           strict=True):
            rows.append(f"{label:>{width}} {busy * 1e3:>10.3f} {idle * 1e3:>10.3f} {peak:>9}")
        return "\n".join(rows)


def _durations(costs: StageCosts) -> dict[ActionKind, tuple[float, ...]]:
    """Each compute kind's per-stage time."""
    return {"F": costs.forward_s, "B": costs.backward_s, "I": costs.input_backward_s, "W": costs.weight_s}


_PEER = {"SEND_F": 1, "RECV_F": -1, "SEND_B": -1, "RECV_B": 1}  # the peer stage, relative


@dataclass(frozen=True)
class Timing:
    """What :func:`play` predicts: per rank, when each of its actions ran (``starts``/``ends``, in its
    order), its busy time, and the step (the planner's view of a :class:`SimResult`, without objects per
    action)."""

    schedule_name: str
    ranks: tuple[tuple[int, ...], ...]
    steps: tuple[tuple[Step, ...], ...]
    starts: tuple[tuple[float, ...], ...]
    ends: tuple[tuple[float, ...], ...]
    step_time_s: float
    busy_s: tuple[float, ...]
    tails: tuple[tuple[int, ...], ...] = ()  # per rank: the actions whose span ends with a stage's tail

    @property
    def bubble_fraction(self) -> float:
        idle = sum(self.step_time_s - b for b in self.busy_s)
        return idle / (len(self.ranks) * self.step_time_s) if self.step_time_s > 0 else 0.0

    def played_costs(self, costs: StageCosts) -> StageCosts:
        """``costs`` with each stage's forward and backward (and W) the mean of its played ones: what they
        took at the pace the shared cores allowed ([Note: shared cores]); as given where none was played."""
        p = costs.num_stages
        took: dict[tuple[int, ActionKind], list[float]] = {}
        tails = self.tails or ((),) * len(self.steps)
        for steps, starts, ends, tailed in zip(self.steps, self.starts, self.ends, tails, strict=True):
            for k, (a, t0, t1) in enumerate(zip(steps, starts, ends, strict=True)):
                if a.kind in _COMPUTE and k not in tailed:  # a backward with a tail: not one alone
                    took.setdefault((a.stage, a.kind), []).append(t1 - t0)

        def mean(stage: int, kind: ActionKind, planned: float) -> float:
            times = took.get((stage, kind))
            return sum(times) / len(times) if times else planned

        weight = costs.weight_s
        forward = tuple(mean(s, "F", costs.forward_s[s]) for s in range(p))
        split = [(s, "I") in took for s in range(p)]
        weights = tuple(mean(s, "W", weight[s]) if split[s] else weight[s] for s in range(p))
        backward = tuple(mean(s, "I", costs.input_backward_s[s]) + weights[s] if split[s]
                         else mean(s, "B", costs.backward_s[s]) for s in range(p))
        # an unsplit stage's W keeps its share of the stretched backward
        weights = tuple(w if split[s] else w * backward[s] / costs.backward_s[s] if costs.backward_s[s] else w
                        for s, w in enumerate(weights))
        return dataclasses.replace(costs, forward_s=forward, backward_s=backward,
                                   weight_backward_s=weights if costs.weight_backward_s or any(split) else ())


def play(name: str, steps: Sequence[Sequence[Step]], ranks: Sequence[Sequence[int]],
         costs: StageCosts, sharing: Sharing | None = None) -> Timing:
    """Plays every rank's order ``steps[r]`` (holding stages ``ranks[r]``) against ``costs``: the model of
    the module docstring, one action after another per rank, a RECV waiting for its SEND; with
    ``sharing``, at the pace the hosts' cores allow ([Note: shared cores]).

    Raises:
        ValueError: If the stage counts differ, or ``sharing`` describes other ranks.
    """
    p = sum(len(r) for r in ranks)
    if costs.num_stages != p:
        raise ValueError(f"schedule has {p} stages, costs describe {costs.num_stages}")
    compute = _durations(costs)
    transfer = {"SEND_F": costs.activation_transfer_s, "RECV_F": costs.activation_transfer_s,
                "SEND_B": costs.gradient_transfer_s, "RECV_B": costs.gradient_transfer_s}
    durations: list[list[float]] = []
    waits: list[list[tuple[int, int, int] | None]] = []  # a RECV's (src, dst, microbatch)
    sends: list[list[tuple[int, int, int] | None]] = []  # a SEND's
    heavy: list[list[int]] = []  # per action: 0 a transfer, 1 a forward, 2 a backward (B, I, W)
    played: list[list[Step]] = []  # each rank's actions, and its stages' tails after their anchors
    extra: list[list[int]] = []  # per rank: the positions of the tails in ``played``
    for acts in steps:
        dur: list[float] = []
        wait: list[tuple[int, int, int] | None] = []
        send: list[tuple[int, int, int] | None] = []
        kinds: list[int] = []
        heavy.append(kinds)
        anchors = _tail_anchors(acts, costs.tail_s)
        order: list[Step] = []
        added: list[int] = []
        for k, a in enumerate(acts):  # each action read once (a play of 64 stages has tens of thousands)
            order.append(a)
            stage, kind = a.stage, a.kind
            times = compute.get(kind)
            if times is not None:
                dur.append(times[stage])
                wait.append(None)
                send.append(None)
                kinds.append(1 if kind == "F" else 2)
            else:
                kinds.append(0)
                peer = stage + _PEER[kind]
                dur.append(transfer[kind][stage if stage < peer else peer])
                if kind[0] == "R":  # RECV_F, RECV_B
                    wait.append((peer, stage, a.microbatch))
                    send.append(None)
                else:
                    wait.append(None)
                    send.append((stage, peer, a.microbatch))
            if anchors and k in anchors:  # the stage's last weight gradients: a backward's, waiting on none
                added.append(len(order))
                order.append(Step(a.stage, "W", a.microbatch))
                dur.append(costs.tail_s[a.stage])
                wait.append(None)
                send.append(None)
                kinds.append(2)
        durations.append(dur)
        waits.append(wait)
        sends.append(send)
        played.append(order)
        extra.append(added)
    timing = _play(name, played, ranks, costs, sharing, durations, waits, sends, heavy)
    return _merge_tails(timing, steps, extra) if any(extra) else timing


def _tail_anchors(acts: Sequence[Step], tail_s: Sequence[float]) -> set[int]:
    """The positions in a rank's ``acts`` after which a stage's tail runs: its last ``SEND_B``, or its
    last backward (``B``/``I``) where it sends none (the first stage)."""
    if not any(tail_s):
        return set()
    last: dict[int, int] = {}
    sent: dict[int, int] = {}
    for k, a in enumerate(acts):
        if a.kind in ("B", "I"):
            last[a.stage] = k
        elif a.kind == "SEND_B":
            sent[a.stage] = k
    return {sent.get(s, k) for s, k in last.items() if tail_s[s] > 0}


def _merge_tails(timing: Timing, steps: Sequence[Sequence[Step]], extra: Sequence[Sequence[int]]) -> Timing:
    """``timing`` of the actions with tails, as one of ``steps``: each tail's end becomes its anchor's."""
    starts, ends, tails = [], [], []
    for begun, ended, added in zip(timing.starts, timing.ends, extra, strict=True):
        skip = set(added)
        s = [t for k, t in enumerate(begun) if k not in skip]
        e = list(ended)
        for k in added:
            e[k - 1] = e[k]
        e = [t for k, t in enumerate(e) if k not in skip]
        starts.append(tuple(s))
        ends.append(tuple(e))
        tails.append(tuple(k - 1 - n for n, k in enumerate(added)))
    return dataclasses.replace(timing, steps=tuple(tuple(a) for a in steps), starts=tuple(starts),
                               ends=tuple(ends), tails=tuple(tails))


def _play(name: str, steps: Sequence[Sequence[Step]], ranks: Sequence[Sequence[int]], costs: StageCosts,
          sharing: Sharing | None, durations: list[list[float]],
          waits: list[list[tuple[int, int, int] | None]], sends: list[list[tuple[int, int, int] | None]],
          heavy: list[list[int]]) -> Timing:
    """:func:`play` of the actions as timed (``durations``) and linked (``waits``, ``sends``)."""
    clock = [sum(costs.start_s[s] for s in stages) if costs.start_s else 0.0 for stages in ranks]
    if sharing is not None and sharing.crowded:
        if len(sharing.wants) != len(ranks):
            raise ValueError(f"sharing describes {len(sharing.wants)} ranks, the schedule has {len(ranks)}")
        return _play_shared(name, steps, ranks, durations, waits, sends, heavy, clock, sharing)
    arrival: dict[tuple[int, int, int], float] = {}  # (src, dst, microbatch) -> send end
    busy = list(clock)  # the time before the start counts as busy (applying an update)
    pos = [0] * len(ranks)
    starts: list[list[float]] = [[] for _ in ranks]
    ends: list[list[float]] = [[] for _ in ranks]
    progress = True
    while progress:
        progress = False
        for r, dur in enumerate(durations):
            i, now, spent, wait, send = pos[r], clock[r], busy[r], waits[r], sends[r]
            began, ended = starts[r], ends[r]
            while i < len(dur):
                start = now
                key = wait[i]
                if key is not None:
                    if key not in arrival:
                        break
                    start = max(start, arrival[key])
                end = start + dur[i]
                if (out := send[i]) is not None:
                    arrival[out] = end
                began.append(start)
                ended.append(end)
                spent += end - start
                now = end
                i += 1
            if i != pos[r]:
                pos[r], clock[r], busy[r], progress = i, now, spent, True
    assert pos == [len(d) for d in durations], "a Schedule is free of deadlocks by construction"
    return Timing(name, tuple(tuple(r) for r in ranks), tuple(tuple(a) for a in steps),
                  tuple(map(tuple, starts)), tuple(map(tuple, ends)), max(clock), tuple(busy))


def _play_shared(name: str, steps: Sequence[Sequence[Step]], ranks: Sequence[Sequence[int]],
                 durations: list[list[float]], waits: list[list[tuple[int, int, int] | None]],
                 sends: list[list[tuple[int, int, int] | None]], heavy: list[list[int]], first: list[float],
                 sharing: Sharing) -> Timing:
    """:func:`play` at the pace the hosts' cores allow, event by event ([Note: shared cores]); ``first``:
    each rank's work before its first action (its updates).

    Every busy rank of a host doing one class of work (a transfer or update, a forward, a backward)
    runs at the same rate, so each (host, class) keeps one *virtual clock*, the work such a rank has
    done since the start, and a heap of its ranks' ends on that clock: a rate that changes moves the
    clock's pace, never the order of its ends, and an event costs a few heap operations whatever
    the number of ranks. A rank with workers on several hosts counts on each of them, and its own
    pace is that of the host where it wants the most cores.

    A class whose next end, recomputed where its host's busy ranks changed, falls at the very time its
    entry on the event heap already has keeps that entry (two fifths of the entries a search's plays
    pushed), one heap operation fewer each. The helpers are few and flat (a search plays about 10,000
    events per shape of 16 ranks x 64 microbatches): a quarter less time a play than with one helper per
    step, with the same float operations in the same order (the old loop's plays, compared to the last bit
    on 6,000 random crowded shapes and a search's: docs/benchmarks.md, "Planning at cluster size").
    """
    n = len(durations)
    cores, wants, homes = _host_classes(sharing)
    for r in range(n):  # a rank on no shared host: a host of its own, which never crowds
        if not wants[r]:
            wants[r] = [(len(cores), 1.0, 1)]
            cores.append(1.0)
    home = [h if h is not None else wants[r][0][0] for r, h in enumerate(homes)]
    hosts = len(cores)
    slow = (1.0, sharing.forward_slowdown, sharing.backward_slowdown)
    turns = _turns(cores, wants, sharing.turns_slowdown)
    # per host: what a class's pace divides its share by, crowded or not (the class 0: nothing)
    divisors = [((1.0, slow[1] * t, slow[2] * t), (1.0, t, t)) for t in turns]
    wanted = [0.0] * hosts  # cores wanted by each host's busy ranks
    crowd = [0] * hosts  # their workers
    pace = [[1.0] * 3 for _ in range(hosts)]  # per host and class: the rate of its busy ranks
    clock = [[0.0] * 3 for _ in range(hosts)]  # per host and class: the virtual clock at ``at[h]``
    at = [0.0] * hosts
    ends_at: list[list[list[tuple[float, int]]]] = [[[] for _ in range(3)] for _ in range(hosts)]
    stamp = [[0] * 3 for _ in range(hosts)]
    events: list[tuple[float, int, int, int]] = []  # (real time of the class's next end, stamp, host, class)
    due: list[list[float | None]] = [[None] * 3 for _ in range(hosts)]  # the time of its live entry
    arrival: dict[tuple[int, int, int], float] = {}
    waiting: dict[tuple[int, int, int], int] = {}  # a RECV's key -> the rank waiting for it
    pos = [0] * n
    doing: list[int | None] = [None] * n  # the action running (-1: the update), None: none
    occupied = [False] * n
    busy = [0.0] * n
    begun = [0.0] * n  # when the running action began
    starts: list[list[float]] = [[] for _ in range(n)]
    ends: list[list[float]] = [[] for _ in range(n)]
    now = 0.0
    touched: set[int] = set()
    push, pop = heapq.heappush, heapq.heappop

    def catch_up(h: int) -> None:
        """Move host ``h``'s clocks to ``now`` at their paces so far."""
        elapsed = now - at[h]
        if elapsed > 0:
            ck, pc = clock[h], pace[h]
            ck[0] += pc[0] * elapsed
            ck[1] += pc[1] * elapsed
            ck[2] += pc[2] * elapsed
            at[h] = now

    def finish(r: int) -> None:
        i = doing[r]
        busy[r] += now - begun[r]
        doing[r] = None
        if i is None or i < 0:
            return
        ends[r].append(now)
        pos[r] = i + 1
        if (out := sends[r][i]) is not None:
            arrival[out] = now
            if out in waiting:
                advance(waiting.pop(out))

    def advance(r: int) -> None:
        """Start rank ``r``'s next actions until one takes time or must wait; count it on its hosts while
        it is busy, and only then."""
        dur, wait, began = durations[r], waits[r], starts[r]
        count = len(dur)
        while doing[r] is None and (i := pos[r]) < count:
            key = wait[i]
            if key is not None and key not in arrival:
                waiting[key] = r
                break
            began.append(now)
            work = dur[i]
            doing[r], begun[r] = i, now
            if work <= 0:
                finish(r)
                continue
            c = heavy[r][i]
            h = home[r]
            catch_up(h)
            push(ends_at[h][c], (clock[h][c] + work, r))
            touched.add(h)
        on = doing[r] is not None
        if on != occupied[r]:
            occupied[r] = on
            sign = 1 if on else -1
            for h, k, w in wants[r]:
                catch_up(h)
                wanted[h] += sign * k
                crowd[h] += sign * w
                touched.add(h)

    for r in range(n):
        if first[r] > 0:
            doing[r], begun[r] = -1, now
            catch_up(home[r])
            push(ends_at[home[r]][0], (clock[home[r]][0] + first[r], r))
            touched.add(home[r])
            advance(r)  # busy with its update: counted on its hosts
        else:
            advance(r)
    while True:
        for h in touched:  # new paces where the busy ranks changed, and each class's next end
            catch_up(h)
            share = min(1.0, cores[h] / wanted[h]) if wanted[h] > 0 else 1.0
            div = divisors[h][0 if crowd[h] > 1 else 1]
            pc = pace[h] = [share, share / div[1], share / div[2]]  # share / 1.0 is share
            ck, heaps, st, live = clock[h], ends_at[h], stamp[h], due[h]
            for c in range(3):
                heap = heaps[c]
                if heap:
                    when = now + max(0.0, heap[0][0] - ck[c]) / pc[c]
                    if when == live[c]:  # its entry stands: the same time, to the last bit
                        continue
                    st[c] += 1
                    live[c] = when
                    push(events, (when, st[c], h, c))
                else:
                    st[c] += 1
                    live[c] = None
        touched.clear()
        while events and events[0][1] != stamp[events[0][2]][events[0][3]]:
            pop(events)  # stale: its pace or its first end changed since
        if not events:
            break
        now, _, h, c = pop(events)
        due[h][c] = None
        catch_up(h)
        heap = ends_at[h][c]
        reach = clock[h][c] * (1 + 1e-12) + 1e-15
        ending = []
        while heap and heap[0][0] <= reach:  # the end, and any within rounding
            ending.append(pop(heap)[1])
        if not ending:  # rounding put the event a hair early: take the first end
            ending.append(pop(heap)[1])
        touched.add(h)
        for r in ending:
            finish(r)
        for r in ending:
            advance(r)
    assert pos == [len(d) for d in durations], "a Schedule is free of deadlocks by construction"
    return Timing(name, tuple(tuple(r) for r in ranks), tuple(tuple(a) for a in steps),
                  tuple(map(tuple, starts)), tuple(map(tuple, ends)), now, tuple(busy))


def _turns(cores: Sequence[float], wants: Sequence[Sequence[tuple[int, float, int]]], slowdown: float
           ) -> tuple[float, ...]:
    """Per host, ``slowdown`` where its ranks, busy or not, want more cores than it has and are two workers
    or more (they take turns on its cores throughout), else 1."""
    wanted, workers = [0.0] * len(cores), [0] * len(cores)
    for want in wants:
        for h, k, n in want:
            wanted[h] += k
            workers[h] += n
    return tuple(slowdown if k > c and n > 1 else 1.0 for k, c, n in zip(wanted, cores, workers, strict=True))


MERGE_ALIKE_HOSTS = True
"""Whether :func:`_host_classes` merges hosts alike (off: every host played, the tests' reference)."""


def _host_classes(sharing: Sharing
                  ) -> tuple[list[float], list[list[tuple[int, float, int]]], list[int | None]]:
    """``sharing``'s hosts with the hosts alike merged: the cores, each rank's wants and its home (None: no
    shared host), over one host of each class.

    Hosts alike (the same cores, and every rank wanting there the same cores for the same number of
    workers) see the same ranks busy at every moment, so their clocks and paces are the same all along:
    playing one of them is playing each. A data-parallel plan over many hosts puts its replicas' workers
    alike on them (a pipeline of 16 stages over 128 hosts of 8 workers: two classes, not 128), and a
    rank's every busy or idle turn touched every host its replicas use.
    """
    if not MERGE_ALIKE_HOSTS:
        return list(sharing.cores), [list(w) for w in sharing.wants], list(sharing.homes())
    column: dict[int, list[tuple[int, float, int]]] = {}
    for r, want in enumerate(sharing.wants):
        for h, k, w in want:
            column.setdefault(h, []).append((r, k, w))
    classes: dict[tuple[object, ...], int] = {}
    of: dict[int, int] = {}  # host -> its class
    cores: list[float] = []
    for h in sorted(column):
        key = (sharing.cores[h], tuple(column[h]))
        if key not in classes:
            classes[key] = len(cores)
            cores.append(sharing.cores[h])
        of[h] = classes[key]
    wants: list[list[tuple[int, float, int]]] = []
    for want in sharing.wants:
        seen: set[int] = set()
        mine = []
        for h, k, w in want:  # a rank on two hosts of one class counts on that class once
            if of[h] not in seen:
                seen.add(of[h])
                mine.append((of[h], k, w))
        wants.append(mine)
    home = [None if h is None else of[h] for h in sharing.homes()]
    return cores, wants, home


def simulate(schedule: Schedule, costs: StageCosts, sharing: Sharing | None = None) -> SimResult:
    """Plays ``schedule`` against ``costs`` (see the module docstring for the model; :func:`play`).

    Args:
        schedule: The schedule (valid, so free of deadlocks).
        costs: Times of as many (virtual) stages as the schedule has.
        sharing: How its ranks share their hosts' cores (None: each computes at its own pace).

    Returns:
        The predicted step, per-rank idle time, bubble fraction and activations held.

    Raises:
        ValueError: If the stage counts differ.
    """
    p = schedule.num_stages
    if costs.num_stages != p:
        raise ValueError(f"schedule has {p} stages, costs describe {costs.num_stages}")
    ranks = tuple(schedule.stages_of(r) for r in range(schedule.num_ranks))
    lists = [schedule.rank_actions(r) for r in range(len(ranks))]
    timing = play(schedule.name, [[Step(a.stage, a.kind, a.microbatch) for a in acts] for acts in lists],
                  ranks, costs, sharing)
    act_bytes = costs.activation_bytes or (0.0,) * p
    played: list[list[TimedAction]] = []
    held: list[list[tuple[float, int]]] = []
    peak_bytes = []
    for acts, starts, ends in zip(lists, timing.starts, timing.ends, strict=True):
        track, count, nbytes, peak = [(0.0, 0)], 0, 0.0, 0.0
        for a, start, end in zip(acts, starts, ends, strict=True):
            if a.kind == "F":
                count += 1
                track.append((start, count))
                nbytes += act_bytes[a.stage]
                peak = max(peak, nbytes)
            elif a.kind in ("B", "W"):
                count -= 1
                track.append((end, count))
                nbytes -= act_bytes[a.stage]
        played.append([TimedAction(a, start, end) for a, start, end in zip(acts, starts, ends, strict=True)])
        held.append(track)
        peak_bytes.append(peak)
    step = timing.step_time_s
    return SimResult(
        schedule_name=schedule.name,
        ranks=ranks,
        step_time_s=step,
        timeline=tuple(tuple(t) for t in played),
        busy_s=timing.busy_s,
        idle_s=tuple(step - b for b in timing.busy_s),
        bubble_fraction=timing.bubble_fraction,
        held=tuple(tuple(h) for h in held),
        peak_in_flight=tuple(max(n for _, n in h) for h in held),
        peak_activation_bytes=tuple(peak_bytes),
    )


_COLOURS: dict[ActionKind, str] = {"F": "#4e79a7", "B": "#59a14f", "I": "#8cd17d", "W": "#f28e2b",
                                   "SEND_F": "#bab0ac", "SEND_B": "#bab0ac", "RECV_F": "#d7d2cb",
                                   "RECV_B": "#d7d2cb"}
_COMPUTE: frozenset[ActionKind] = frozenset({"F", "B", "I", "W"})


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def draw_timeline(result: SimResult, path: str | Path, *, title: str = "", width: int = 1200) -> Path:
    """Draws the predicted timeline (rank x time, one box per action) as an SVG file, or with matplotlib.

    One track per rank (labelled ``stage s``, or ``rank r (a,b)`` when ranks hold several
    stages). Forward boxes are blue, backward green (a split one: I light green, W orange),
    sends and receives grey and thin; each compute box is labelled with its kind and
    microbatch (and stage, when ranks hold several). Gaps are idle time. A path ending in ``.svg`` is
    written here with no dependency; any other suffix (``.png``, ``.pdf``) by matplotlib
    (``coordinator/planning/timeline_plot.py``, the optional extra ``plot``).

    Args:
        result: A simulation result.
        path: Where to write the picture (parent directories must exist).
        title: A caption; defaults to the schedule name, step time and bubble.
        width: SVG width in pixels.

    Returns:
        The path written.

    Raises:
        ValueError: A non-SVG picture without matplotlib, or in a format it cannot write.
    """
    caption = title or (f"{result.schedule_name}: step {result.step_time_s * 1e3:.3f} ms, "
                        f"bubble {result.bubble_fraction:.1%}")
    target = Path(path)
    if target.suffix.lower() != ".svg":
        from coordinator.planning.timeline_plot import plot_timeline

        return plot_timeline(result, target, caption)
    rows = len(result.timeline)
    labels = [result.track(r) for r in range(rows)]
    shared = any(len(stages) > 1 for stages in result.ranks)
    left, top, row_h, gap = 15 + 7 * max(map(len, labels)), 40, 28, 8
    scale = (width - left - 20) / result.step_time_s if result.step_time_s > 0 else 0.0
    height = top + rows * (row_h + gap) + 30
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'font-family="monospace" font-size="11">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{left}" y="20" font-size="14">{_escape(caption)}</text>']
    for r, played in enumerate(result.timeline):
        y = top + r * (row_h + gap)
        out.append(f'<text x="5" y="{y + row_h / 2 + 4}">{labels[r]}</text>')
        out.append(f'<line x1="{left}" y1="{y + row_h}" x2="{width - 20}" y2="{y + row_h}" stroke="#ddd"/>')
        for t in played:
            x, w = left + t.start * scale, max((t.end - t.start) * scale, 0.5)
            compute = t.action.kind in _COMPUTE
            h, dy = (row_h, 0) if compute else (row_h / 3, row_h * 2 / 3)
            out.append(f'<rect x="{x:.2f}" y="{y + dy:.2f}" width="{w:.2f}" height="{h:.2f}" '
                       f'fill="{_COLOURS[t.action.kind]}" stroke="white" stroke-width="0.5">'
                       f'<title>{_escape(str(t.action))} {t.start * 1e3:.3f}-{t.end * 1e3:.3f} ms'
                       '</title></rect>')
            text = str(t.action) if shared else f"{t.action.kind}{t.action.microbatch}"
            if compute and w > 7 * len(text):
                out.append(f'<text x="{x + w / 2:.2f}" y="{y + row_h / 2 + 4}" text-anchor="middle" '
                           f'fill="white">{text}</text>')
    axis_y = top + rows * (row_h + gap) + 15
    out.append(f'<text x="{left}" y="{axis_y}">0 ms</text>')
    out.append(f'<text x="{width - 20}" y="{axis_y}" text-anchor="end">'
               f'{result.step_time_s * 1e3:.3f} ms</text>')
    out.append("</svg>")
    target.write_text("\n".join(out) + "\n", encoding="utf-8")
    return target

