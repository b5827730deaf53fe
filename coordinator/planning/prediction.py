"""A plan's predicted step, replayed: the :class:`StageCosts` a :class:`Plan` keeps, and their simulation.

The planner simulates each candidate's schedule (``coordinator/planning/planner.py``) but the
plan keeps only per-stage totals: forward, backward, optimizer, and ``transfer_s``, the time a
stage spends on both of its cuts ([Note: transfer cost] in ``coordinator/planning/cutting.py``).
The per-cut times follow from the chain (stage 0 has only cut 0, stage ``s`` has cuts
``s-1`` and ``s``); a cut's time is split evenly between the activations going forward and the
gradients coming back, which moves no step time (both endpoints pay both directions) and only
shifts where inside a step a transfer sits.

Where CPU workers share a host, the planner played each action at the pace the host allowed at that
moment ([Note: shared cores] in ``coordinator/planning/simulator.py``) and the plan keeps each stage's
mean forward and backward (and a split list's ``W``, and the tail of weight gradients a stage computes
after its last send: ``StagePlan.weight_s``, ``tail_s``, as the planner priced them): replayed at those
means the step lands near the planner's, not on it (within a few percent where the pace varies most,
a light stage beside a heavy one).

Used by the trace (the predicted tracks beside the measured ones), the run record (the
predicted bubble) and ``cellmesh plan --timeline``.
"""

from __future__ import annotations

from coordinator.planning.plan import Plan
from coordinator.planning.simulator import SimResult, StageCosts, simulate

__all__ = ["plan_costs", "predict"]


def plan_costs(plan: Plan) -> StageCosts:
    """The per-microbatch times ``plan`` was planned with (see the module docstring)."""
    cuts: list[float] = []
    for stage in plan.stages[:-1]:
        inner = cuts[-1] if cuts else 0.0
        cuts.append(max(0.0, stage.transfer_s - inner))
    half = tuple(c / 2 for c in cuts)
    weights = tuple(s.weight_s for s in plan.stages)
    tails = tuple(s.tail_s for s in plan.stages)
    return StageCosts(tuple(s.forward_s for s in plan.stages), tuple(s.backward_s for s in plan.stages),
                      half, half, start_s=tuple(s.optimizer_s for s in plan.stages),
                      weight_backward_s=weights if any(weights) else (), tail_s=tails if any(tails) else ())


def predict(plan: Plan) -> SimResult:
    """The simulator's timeline of one step of ``plan``'s schedule."""
    return simulate(plan.schedule(), plan_costs(plan))
