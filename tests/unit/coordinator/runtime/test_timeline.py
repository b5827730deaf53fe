"""The measured timeline beside the predicted one, without workers.

Covers coordinator/runtime/bubble.py (the measured bubble's arithmetic on hand-made step
records), coordinator/planning/prediction.py (a plan's predicted step) and the predicted
tracks of coordinator/runtime/trace.py; the trace of a real run is
tests/multiproc/coordinator/test_timeline_run.py's.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.planning.config import PlanConfig
from coordinator.planning.planner import choose_plan
from coordinator.planning.prediction import plan_costs, predict
from coordinator.planning.profile import Profile
from coordinator.planning.resources import Resources, Worker
from coordinator.planning.schedules import gpipe, one_f_one_b
from coordinator.planning.simulator import StageCosts, simulate
from coordinator.runtime.bubble import bubble_fraction, measured_bubble, predicted_bubble
from coordinator.runtime.records import ActionEvent, StepRecord
from coordinator.runtime.trace import PREDICTED_PID, chrome_trace
from services.protocol import Action


def _event(replica: int, stage: int, start: float, end: float, name: str = "") -> ActionEvent:
    """An action of ``stage`` (a phase when ``name`` is given) timed ``start..end``."""
    action = None if name else Action(stage=stage, kind="F", microbatch=0)
    return ActionEvent(f"w{replica}{stage}", replica, stage, name or str(action), start, end, action)


def _record(events: list[ActionEvent], step: int = 0) -> StepRecord:
    record = StepRecord(step=step, loss=1.0, num_samples=8, start=0.0, end=1.0, coordinator_s=0.0)
    record._events = events
    return record


def test_the_measured_bubble_by_hand() -> None:
    # replica 0 spans 0..4: stage 0 busy 0..2 (2 s), stage 1 busy 1..2 and 3..4 (the action inside 3..4
    # counts once): idle 2 + 2 over 2 stages x 4 s = 0.5. Its optimizer before the step is no action.
    # replica 1: both stages busy its whole span 10..11: no bubble. The job: the mean, 0.25.
    events = [_event(0, 0, -1.0, 0.0, name="optimizer"), _event(0, 0, 0.0, 1.0), _event(0, 0, 1.0, 2.0),
              _event(0, 1, 1.0, 2.0), _event(0, 1, 3.0, 4.0), _event(0, 1, 3.5, 4.0),
              _event(1, 0, 10.0, 11.0), _event(1, 1, 10.0, 11.0)]
    assert measured_bubble(_record(events[:6])) == pytest.approx(0.5)
    assert measured_bubble(_record(events)) == pytest.approx(0.25)
    assert measured_bubble(_record([_event(0, 0, 0.0, 1.0, name="all_reduce")])) is None
    assert bubble_fraction([]) is None and bubble_fraction([[(1.0, 1.0)]]) is None


def test_a_receive_waiting_for_its_peer_counts_as_idle() -> None:
    # stage 1 posts its receive at 0 and gets the activations at 2, when stage 0's forward (0..2) and send
    # are done; it computes 2..3. Busy: stage 0 for 2 s, stage 1 for 1 s, of 2 x 3 s: the bubble is 0.5
    # (0 had the receive counted as work)
    def act(stage: int, kind: str, start: float, end: float) -> ActionEvent:
        action = Action(stage=stage, kind=kind, microbatch=0)  # type: ignore[arg-type]  # a literal kind
        return ActionEvent(f"w{stage}", 0, stage, str(action), start, end, action)

    events = [act(0, "F", 0.0, 2.0), act(0, "SEND_F", 2.0, 2.0),
              act(1, "RECV_F", 0.0, 2.0), act(1, "F", 2.0, 3.0)]
    assert measured_bubble(_record(events)) == pytest.approx(0.5)


@pytest.mark.parametrize("schedule", [gpipe(3, 4), one_f_one_b(3, 4)], ids=["gpipe", "1f1b"])
def test_the_predicted_bubble_is_the_simulators_on_its_played_actions(schedule: Any) -> None:
    result = simulate(schedule, StageCosts.uniform(3, 1.0, 2.0))
    assert predicted_bubble(result) == pytest.approx(result.bubble_fraction)
    assert predicted_bubble(result) == pytest.approx(2 / 6)  # (p-1)/(m+p-1)
    # the measured arithmetic on the same intervals, as events, gives the same number
    events = [_event(0, s, t.start, t.end) for s, played in enumerate(result.timeline) for t in played]
    assert measured_bubble(_record(events)) == pytest.approx(2 / 6)


def test_a_plans_predicted_step_is_the_planners() -> None:
    prof = Profile.synthetic([1e-3, 2e-3, 1e-3, 3e-3], param_bytes=[1024] * 4, activation_bytes=[1024] * 4,
                             cut_bytes=[4096] * 3, microbatch_size=4)
    res = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=1 << 30, host="h") for i in range(3)))
    plan = choose_plan(prof, res, PlanConfig(num_stages=3, data_parallel=1, schedule="1f1b",
                                             num_microbatches=4), global_batch=16)
    costs = plan_costs(plan)
    assert costs.forward_s == tuple(s.forward_s for s in plan.stages)
    assert costs.start_s == tuple(s.optimizer_s for s in plan.stages)
    for s, stage in enumerate(plan.stages):  # each stage pays both directions of both its cuts
        cuts = [c for c in (s - 1, s) if 0 <= c < plan.num_stages - 1]
        paid = sum(costs.activation_transfer_s[c] + costs.gradient_transfer_s[c] for c in cuts)
        assert paid == pytest.approx(stage.transfer_s)
    result = predict(plan)
    # three workers of one host slow each other while two or more compute, not all the time: the plan keeps
    # each stage's mean, and the replay at those means lands near the planner's play, not on it
    assert result.step_time_s == pytest.approx(plan.pipeline_time_s, rel=0.1)
    assert [[t.action for t in played] for played in result.timeline] == [
        list(acts) for acts in plan.schedule().actions]


def test_the_trace_puts_the_prediction_under_each_measured_step() -> None:
    predicted = simulate(one_f_one_b(2, 2), StageCosts.uniform(2, 0.5, 1.0))
    records = [_record([_event(0, s, 100.0 + 10 * k + s, 101.0 + 10 * k + s) for s in range(2)], step=k)
               for k in range(2)]
    trace = chrome_trace(records, predicted=predicted)
    listed: list[dict[str, Any]] = trace["traceEvents"]  # type: ignore[assignment]
    names = {m["pid"]: m["args"]["name"] for m in listed if m["name"] == "process_name"}
    assert names == {0: "stage 0", 1: "stage 1", PREDICTED_PID: "predicted: stage 0",
                     PREDICTED_PID + 1: "predicted: stage 1"}
    for s, played in enumerate(predicted.timeline):
        events = [e for e in listed if e["ph"] == "X" and e["pid"] == PREDICTED_PID + s]
        assert [e["name"] for e in events] == [str(t.action) for t in played] * 2  # once per kept step
        for k in range(2):  # step k starts where its first measured event did: 10 k s after the first
            mine = [e for e in events if e["args"]["step"] == k]
            assert [e["ts"] for e in mine] == pytest.approx([(10 * k + t.start) * 1e6 for t in played])
            assert [e["dur"] for e in mine] == pytest.approx([(t.end - t.start) * 1e6 for t in played])
