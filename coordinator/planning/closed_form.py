"""A closed-form lower bound on a schedule's simulated step, from its stages' costs alone.

The planner ranks every shape by this bound and plays only the shapes whose bound could beat the best
plan played so far (``coordinator/planning/planner.py``, [Note: the fast search]). The bound never
exceeds what :func:`~coordinator.planning.simulator.play` returns for the same costs, for GPipe, 1F1B,
ZB-H1 and interleaved 1F1B, and is within a few percent of it for GPipe and 1F1B with equal stages.

[Note: the bound] Three facts of the simulator's model, true of every standard schedule:

- a rank runs its actions one at a time, from its start (its stages' optimizer steps): it ends no
  earlier than its first action starts plus the sum of all its actions' times (``W_r``);
- microbatch 0 reaches rank ``r`` (holding stage ``r``: the first chunk) only after stages
  ``0..r-1`` each received it, ran its forward and sent it on: rank ``r``'s first action (its
  ``RECV_F``) starts no earlier than ``h_r``, ``h_0`` its start, ``h_r = max(start_r, h_{r-1} +
  recv_{r-1} + F_{r-1} + send_{r-1})``;
- rank ``r``'s last action sends the gradients of microbatch ``m - 1`` to stage ``r - 1`` (GPipe,
  1F1B, interleaved: every backward of stage ``j < r`` for that microbatch is also its rank's last), so
  after it stages ``r-1..0`` each receive, run the backward and send: ``t_r = sum_{j<r} (recv_j + B_j
  + send_j)``.

So the step is at least ``max_r h_r + W_r + t_r``. An interleaved schedule's rank holds several
chunks, and the same two chains bound each stage ``s`` (:func:`stage_bounds`): it runs its ``m``
forwards and backwards after microbatch 0's forward came down stages ``0..s-1`` (every chunk before its
own, each on its rank) and before microbatch ``m - 1``'s gradients go back up them. Where the replica
has fewer microbatches than ranks, that chain through every chunk is most of the step: 500 stages on
125 ranks and 64 microbatches played 38 s a step against 25 s from the ranks' chains alone, once a cut
balanced by speed evened the ranks' work. ZB-H1 splits the backward: stage ``s`` runs
``min(s + 1, m)`` of its ``W`` s after it sent microbatch ``m - 1``'s input gradients, and so does every
stage below it after its own ``I``: the bound follows that chain instead. Transfers are the simulator's
(both endpoints pay), compute includes whatever the caller puts in (the per-action overhead, a shared
host's slowdown when it is certain). For equal stages GPipe and 1F1B play about ``(m + p - 1)(F + B)``
plus transfers, which the bound follows; for uneven stages, interleaved and ZB-H1 it is lower by what
the schedule's steady state stalls (down to half on random costs), and the simulator decides.

[Note: the bound over every cut] Before a shape is cut, :func:`cut_free_bound` bounds the bound above
from below over every cut of the chain into ``p`` stages, from totals alone. Write ``c_j`` for stage
``j``'s forward and backward of one microbatch (its actions' overheads included), ``c'_j`` for that plus
the transfers at both its ends, ``C`` and ``C'`` for their sums (``C'`` at least ``C`` plus both ends of
the ``p - 1`` cheapest cuts) and ``S`` for the stages' starts together. For every schedule the busiest
rank does at least the mean, ``(m C' + S) / R``, and the rank of the heaviest node ``m`` times it. Then
per schedule, from the chains of [Note: the bound]:

- GPipe and 1F1B: rank ``r`` ends no earlier than ``sum_{j<r} c'_j + m c'_r``; the least ``t`` all
  ``p`` of those reach with ``sum c'_j = C'`` has them equal: ``t = C' / (1 - (1 - 1/m)^p)``;
- ZB-H1 keeps the fill: ``sum_{j<r} F_j + m c_r``, with ``F_j >= phi c_j`` (``phi``: the least
  share of its forward any node, or an action's overhead, has), so ``t = phi C / (1 - (1 - phi/m)^p)``;
  and its last rank's chain: it receives microbatch 0 after stages ``0..p-2`` ran its forward, runs every
  ``F`` and ``I`` of its own before it sends microbatch ``m - 1``'s input gradients, which stages
  ``p-2..0`` then each run an ``I`` of, every cut crossed once each way: ``sum_j (F_j + I_j) + (m - 1)
  (F + I)_{p-1}`` plus the cuts. A stage's ``I`` is its nodes' input gradients, or an unmeasured split's
  ``1 - DEFAULT_WEIGHT_FRACTION`` of its backward: at least that share of its nodes' least backwards
  (a measured one holds none of the overhead, which its ``W`` carries). So ``t = C_I + (m - 1) c_I +
  (p - 1) x``, ``C_I`` the chain's forwards and those shares, ``c_I`` the least of a stage (the deep
  pipelines' bound, where ``phi`` is small);
- interleaved: stage ``s`` (any chunk) runs its ``m`` forwards and backwards after microbatch 0's forward
  reached it and before microbatch ``m - 1``'s gradients go down from it, so GPipe's form holds over its
  ``p`` stages; and rank ``r`` waits for the first chunk's stages ``0..r-1`` forward and backward, each
  at least the lightest node (``c_min``) and its ``2 r - 1`` transfers at least the cheapest cut's
  (``x``): the mean over the ranks of ``r c_min + (2r - 1) x`` plus the mean work.

Every term is one the exact bound is at least, so the cut-free bound never exceeds it (checked against
:func:`pipeline_bound` on random chains and cuts).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

__all__ = ["cut_free_bound", "paced_fill_bound", "pipeline_bound", "rank_bounds", "stage_bounds"]

# schedule kinds of :func:`cut_free_bound`
FILL_AND_DRAIN, FILL, CHUNKS, BUSIEST = 0, 1, 2, 3
KINDS = {"gpipe": FILL_AND_DRAIN, "1f1b": FILL_AND_DRAIN, "zb-h1": FILL, "interleaved-1f1b": CHUNKS}


def pipeline_bound(name: str, num_microbatches: int, num_ranks: int, forward_s: Sequence[float],
                   backward_s: Sequence[float], activation_s: Sequence[float], gradient_s: Sequence[float],
                   start_s: Sequence[float], weight_s: Sequence[float] | None = None) -> float:
    """A lower bound on the simulated step of schedule ``name`` (see [Note: the bound]): the largest of
    :func:`rank_bounds` and :func:`stage_bounds`, with the same arguments."""
    args = (name, num_microbatches, num_ranks, forward_s, backward_s, activation_s, gradient_s, start_s)
    return max(*rank_bounds(*args, weight_s)[0], stage_bounds(*args))


def stage_bounds(name: str, num_microbatches: int, num_ranks: int, forward_s: Sequence[float],
                 backward_s: Sequence[float], activation_s: Sequence[float], gradient_s: Sequence[float],
                 start_s: Sequence[float]) -> float:
    """For an interleaved schedule, a lower bound on the simulated step from each stage's chains (see
    [Note: the bound]): microbatch 0's forward through every stage before it, the stage's own ``m``
    forwards and backwards with their transfers, microbatch ``m - 1``'s gradients back through every stage
    before it; 0 for any other schedule (its stages are its ranks: :func:`rank_bounds` holds it). The
    arguments are :func:`rank_bounds`'."""
    if name != "interleaved-1f1b":
        return 0.0
    m, p, rr = num_microbatches, len(forward_s), num_ranks
    begin = [0.0] * rr
    for s in range(p):
        begin[s % rr] += start_s[s]
    best, head, tail = 0.0, begin[0], 0.0
    for s in range(p):
        if s > 0:  # microbatch 0 through stage s - 1 (received, forward, sent), on its rank
            head = max(begin[s % rr], head + (activation_s[s - 2] if s > 1 else 0.0) + forward_s[s - 1]
                       + activation_s[s - 1])
            tail += gradient_s[s - 1] + backward_s[s - 1] + (gradient_s[s - 2] if s > 1 else 0.0)
        ends = (activation_s[s - 1] + gradient_s[s - 1] if s > 0 else 0.0) + (
            activation_s[s] + gradient_s[s] if s < p - 1 else 0.0)
        best = max(best, head + m * (forward_s[s] + backward_s[s] + ends) + tail)
    return best


def rank_bounds(name: str, num_microbatches: int, num_ranks: int, forward_s: Sequence[float],
                backward_s: Sequence[float], activation_s: Sequence[float], gradient_s: Sequence[float],
                start_s: Sequence[float], weight_s: Sequence[float] | None = None
                ) -> tuple[list[float], list[float]]:
    """Per rank ``r``, a lower bound on the simulated step from ``r``'s chain alone (see [Note: the
    bound]): when ``r``'s first action may start, plus its actions' times, plus what must follow its last;
    and the time ``r`` is busy (its starts and its actions). Each bound is that rank's actions' times plus
    a term they do not change: a rank whose actions take longer (a shared host's slowdown,
    :meth:`~coordinator.planning.simulator.Sharing.crowded_time`) moves its bound by as much.

    Args:
        name: ``gpipe``, ``1f1b``, ``zb-h1`` or ``interleaved-1f1b`` (any other: the busiest rank's work).
        num_microbatches: ``m``.
        num_ranks: Workers per replica ``R``; stage ``s`` runs on rank ``s % R``.
        forward_s: Per stage, one microbatch's forward (``p`` entries).
        backward_s: Per stage, its whole backward (``I`` and ``W`` together for ZB-H1).
        activation_s: Per inner cut ``c`` (between stages ``c`` and ``c+1``), what each endpoint pays
            to move the activations (``p - 1`` entries).
        gradient_s: The same for the gradients.
        start_s: Per stage, when it may start (its optimizer step); a rank starts after all of its.
        weight_s: Per stage, its ``W`` (ZB-H1), default none.
    """
    m, p, rr = num_microbatches, len(forward_s), num_ranks
    inner = [a + g for a, g in zip(activation_s, gradient_s, strict=True)]
    work = [m * (forward_s[s] + backward_s[s] + (inner[s - 1] if s > 0 else 0.0)
                 + (inner[s] if s < p - 1 else 0.0)) for s in range(p)]
    begin = [0.0] * rr
    busy = [0.0] * rr
    for s in range(p):
        begin[s % rr] += start_s[s]
        busy[s % rr] += work[s]
    occupied = [b + w for b, w in zip(begin, busy, strict=True)]
    if name not in ("gpipe", "1f1b", "zb-h1", "interleaved-1f1b"):
        return occupied, occupied
    head = [begin[0]]  # when rank r's first action may start
    for r in range(1, rr):
        s = r - 1  # the stage before, on rank r - 1 (its first chunk)
        arrive = head[-1] + (activation_s[s - 1] if s > 0 else 0.0) + forward_s[s] + activation_s[s]
        head.append(max(begin[r], arrive))
    bounds: list[float] = []
    if name == "zb-h1":
        # [Note: ZB-H1's drain, in one pass] rank r's last I's gradients leave when its W's after it
        # (``late``) are all that is left; from there they reach each rank j < r after the gradients' sends
        # and the I's between (``c_i``, i = j..r-1), and rank j then runs its own W's after its last I:
        # ``end_r - late_r + sum_{i=j}^{r-1} c_i + min(j + 1, m) W_j``. With ``D_j = sum_{i<j} c_i`` that is
        # ``end_r - late_r + D_r + (min(j + 1, m) W_j - D_j)``, whose last term's maximum over ``j < r``
        # runs along with ``r``: a pass over the ranks, where the sum from each rank back was ``R^2``
        # (pipelines of hundreds of ranks: 28 million steps in one search).
        assert weight_s is not None
        drained = 0.0  # D_r
        most = -math.inf  # the largest min(j + 1, m) W_j - D_j over j < r
        for r in range(rr):
            end = head[r] + busy[r]
            late = min(r + 1, m) * weight_s[r]  # the W's after the last I and its send
            bounds.append(end if r == 0 else max(end, end - late + drained + most))
            most = max(most, min(r + 1, m) * weight_s[r] - drained)
            if r < rr - 1:  # c_r: the gradients' way from rank r + 1 through rank r's I
                before = gradient_s[r - 1] if r > 0 else 0.0
                drained += gradient_s[r] + (backward_s[r] - weight_s[r]) + before
        return bounds, occupied
    tail = 0.0  # the drain below rank r, stages r-1..0
    for r in range(rr):
        end = head[r] + busy[r]
        if r > 0:
            j = r - 1
            tail += gradient_s[j] + backward_s[j] + (gradient_s[j - 1] if j > 0 else 0.0)
        bounds.append(end + tail)
    return bounds, occupied


def paced_fill_bound(paces: Sequence[float], work: float, share: float, num_microbatches: int,
                     overhead_s: float = 0.0) -> float:
    """A lower bound on the step over every cut of a chain of ``work`` (seconds at speed 1) into
    ``len(paces)`` stages, stage ``s`` at pace ``paces[s]``, each running ``m`` microbatches after
    ``share`` of what the stages before it take: see [Note: a pipeline's fill at its stages' paces].

    [Note: a pipeline's fill at its stages' paces] Stage ``s`` runs its ``m`` forwards and backwards after
    microbatch 0's forward came down stages ``0..s-1`` and, for GPipe, 1F1B and an interleaved schedule
    (every chunk a stage), before microbatch ``m - 1``'s gradients go back up them ([Note: the bound]):
    with ``u_j`` stage ``j``'s forward and backward of one microbatch at its pace (``c_j / v_j``, its
    overhead ``o`` added), the step ``T >= share * sum_{j<s} u_j + m u_s`` for every ``s`` (``share`` 1;
    ZB-H1 keeps the forwards' fill only, at least ``phi`` of each stage's compute, ``phi <= 1/2``, with its
    forward's overhead, at least ``phi o``). Over every cut, ``sum_j c_j`` is the chain's work. The least
    such ``T`` is a linear programme; its dual gives a bound without solving it: for weights ``y_s >= 0``
    with ``m y_j + share * sum_{s>j} y_s >= v_j`` for every ``j``, multiplying stage ``s``'s inequality
    by ``y_s`` and adding them gives ``work <= T sum_s y_s - o sum_s y_s (share * s + m)``. The least such
    weights, taken from the last stage back (``y_j = max(0, (v_j - share * sum_{s>j} y_s) / m)``), give
    the programme's optimum where every stage holds work (on alike paces: ``share C / (1 - (1 -
    share / m)^p)``, :func:`cut_free_bound`'s form) and a bound below it anywhere. It knows what the
    bound over every cut does not, which stages run slower: on two generations of workers a pipeline
    over both fills at the paces of the stages before each, where the bound over every cut took the
    fastest worker's. The transfers are left out (they only add).
    """
    m = float(num_microbatches)
    total = weighted = 0.0
    for s in range(len(paces) - 1, -1, -1):
        y = max(0.0, (paces[s] - share * total) / m)
        total += y
        weighted += y * (share * s + m)
    return (work + overhead_s * weighted) / total


def cut_free_bound(kind: np.ndarray, num_microbatches: np.ndarray, num_stages: np.ndarray,
                   num_ranks: np.ndarray, compute_s: np.ndarray, transfer_s: np.ndarray, start_s: np.ndarray,
                   largest_s: np.ndarray, least_s: np.ndarray, least_cut_s: np.ndarray,
                   forward_share: np.ndarray, input_chain_s: np.ndarray, input_least_s: np.ndarray
                   ) -> np.ndarray:
    """A lower bound on the simulated step over every cut, per shape (see [Note: the bound over every cut]).

    Every argument is an array with one entry per shape.

    Args:
        kind: The schedule's kind, ``KINDS[name]`` (any other name: :data:`BUSIEST`).
        num_microbatches: ``m``.
        num_stages: ``p``.
        num_ranks: Workers per replica ``R``.
        compute_s: ``C``: every stage's forward and backward of one microbatch together.
        transfer_s: What the stage boundaries cost their endpoints per microbatch together (at least).
        start_s: ``S``: the stages' starts together (at least).
        largest_s: The heaviest node's forward and backward of one microbatch.
        least_s: The least forward and backward of one microbatch any stage has (its lightest node's).
        least_cut_s: The least any stage boundary costs one endpoint per microbatch.
        forward_share: ``phi``: the least share of its forward and backward a stage spends forward.
        input_chain_s: Every stage's forward and input gradient (``I``) of one microbatch together (at
            least: ZB-H1's last rank's chain).
        input_least_s: The least forward and input gradient of one microbatch any stage has.
    """
    m = num_microbatches.astype(np.float64)
    p = num_stages.astype(np.float64)
    ranks = num_ranks.astype(np.float64)
    work = compute_s + transfer_s
    bound = np.maximum((m * work + start_s) / ranks, m * largest_s)
    drain = work / (1.0 - (1.0 - 1.0 / m) ** p)
    bound = np.where((kind == FILL_AND_DRAIN) | (kind == CHUNKS), np.maximum(bound, drain), bound)
    with np.errstate(divide="ignore", invalid="ignore"):
        fill = forward_share * compute_s / (1.0 - (1.0 - forward_share / m) ** p)
    fill = np.where(forward_share > 0, fill, 0.0)
    # and its last rank's chain: microbatch 0 forward to it, m - 1's input gradients back from it
    chain = input_chain_s + (m - 1.0) * input_least_s + (p - 1.0) * least_cut_s
    bound = np.where(kind == FILL, np.maximum(bound, np.maximum(fill, chain)), bound)
    chunks = m * work / ranks + (ranks - 1) / 2 * least_s + (ranks - 1) ** 2 / ranks * least_cut_s
    out: np.ndarray = np.where(kind == CHUNKS, np.maximum(bound, chunks), bound)
    return out
