"""The measured bubble of a step: the idle share of its pipeline, from the actions the stages timed.

The same quantity the simulator predicts (``coordinator/planning/simulator.py``), measured: for
each replica, the step spans from its first action's start to its last action's end over all
stages; a worker is busy while one of its compute actions (F, B, I, W) runs (overlapping actions
count once; a worker holding several stages, as interleaved plans place them, while any of theirs
runs) and idle for the rest of that span, fill and drain included. Transfers count as idle: a
receive's time is mostly the wait for its peer, the very bubble measured, and posting a send or
a receive takes microseconds. The bubble is the idle time of all workers over
``workers x span`` (the simulator's ranks); a job of several replicas gets the mean of theirs.
Phases (gradient all-reduce, optimizer, push/pull) are not actions: they fall outside the span
or count as idle, as the simulator's pipeline time leaves them out too. :func:`predicted_bubble`
applies the same
arithmetic to the simulator's timeline (whose own ``bubble_fraction`` counts the optimizer before
the first action as busy), so the two numbers of the run record compare like with like.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from coordinator.planning.simulator import SimResult
from coordinator.runtime.records import ActionEvent, StepRecord

__all__ = ["bubble_fraction", "measured_bubble", "predicted_bubble"]

Interval = tuple[float, float]
_COMPUTE = frozenset({"F", "B", "I", "W"})  # the kinds that keep a worker busy


def _busy(intervals: Sequence[Interval]) -> float:
    """Time covered by ``intervals``, each instant once."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        start = max(start, reach)
        if end > start:
            total += end - start
        reach = max(reach, end)
    return total


def bubble_fraction(stages: Sequence[Sequence[Interval]]) -> float | None:
    """Idle over ``len(stages) x span`` of one pipeline's ``(start, end)`` actions per stage (None: empty)."""
    spans = [t for acts in stages for t in acts]
    if not spans:
        return None
    span = max(end for _, end in spans) - min(start for start, _ in spans)
    if span <= 0:
        return None
    return sum(span - _busy(acts) for acts in stages) / (len(stages) * span)


def predicted_bubble(result: SimResult) -> float | None:
    """:func:`bubble_fraction` of the simulator's played actions."""
    return bubble_fraction([[(t.start, t.end) for t in played if t.action.kind in _COMPUTE]
                            for played in result.timeline])


def measured_bubble(record: StepRecord) -> float | None:
    """The idle fraction of ``record``'s pipeline (see the module docstring); None without actions."""
    # per worker: a worker holding several stages (interleaved) is busy while any of them runs
    by_replica: dict[int, dict[str, list[ActionEvent]]] = defaultdict(lambda: defaultdict(list))
    for e in record.events:
        if e.action is not None and e.action.kind in _COMPUTE:
            by_replica[e.replica][e.worker].append(e)
    fractions = [bubble_fraction([[(e.start, e.end) for e in acts] for acts in stages.values()])
                 for stages in by_replica.values()]
    kept = [f for f in fractions if f is not None]
    return sum(kept) / len(kept) if kept else None
