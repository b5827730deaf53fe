"""``cellmesh run --trace``: the measured steps of a real 2-stage 1F1B run beside the predicted ones.

One ``cellmesh run`` subprocess (as a user runs it) writes the trace; the test checks every
action of every worker of every kept step is there exactly once, in its stage's list order
(the order the schedule allows), that the predicted tracks hold the same actions, and that
the run record keeps each step's measured and predicted bubble.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest

from coordinator.commands.rundir import RunRecord
from coordinator.planning.plan import Plan
from coordinator.runtime.trace import PREDICTED_PID
from tests.multiproc.coordinator.test_run import SPEC, cellmesh

pytestmark = pytest.mark.timeout(90)

STEPS = 3


def test_a_traced_run_shows_every_action_once_and_the_prediction_beside(tmp_path: Path) -> None:
    spec, run_dir, trace_file = tmp_path / "tiny.json", tmp_path / "run", tmp_path / "trace.json"
    spec.write_text(json.dumps({**SPEC, "steps": STEPS, "plan": {"num_stages": 2, "num_microbatches": 4,
                                                                 "schedule": "1f1b"}}))
    proc = cellmesh("run", spec, "--workers", "2", "--run-dir", run_dir, "--trace", trace_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"written to {trace_file}" in proc.stdout
    plan = Plan.from_json((run_dir / "plan.json").read_text())
    assert (plan.num_stages, plan.schedule_name) == (2, "1f1b")
    schedule = [[str(a) for a in acts] for acts in plan.schedule().actions]

    trace = json.loads(trace_file.read_text())
    assert trace == json.loads((run_dir / "trace.json").read_text())
    assert trace["otherData"]["steps_kept"] == list(range(STEPS))
    events: list[dict[str, Any]] = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    measured: dict[tuple[int, int, int], list[str]] = defaultdict(list)  # (stage, worker, step) -> actions
    predicted: dict[tuple[int, int], list[str]] = defaultdict(list)  # (stage, step) -> actions
    for e in sorted(events, key=lambda e: e["ts"]):  # stable: ties keep the order written
        if e["pid"] >= PREDICTED_PID:
            predicted[(e["pid"] - PREDICTED_PID, e["args"]["step"])].append(e["name"])
        elif e["name"] in schedule[e["pid"]]:  # an action (the rest are phases: optimizer...)
            measured[(e["pid"], e["tid"], e["args"]["step"])].append(e["name"])
    workers = {(stage, tid) for stage, tid, _ in measured}
    assert sorted(stage for stage, _ in workers) == [0, 1]  # one worker per stage
    assert sorted(measured) == sorted((s, w, k) for s, w in workers for k in range(STEPS))
    for (stage, _, _), names in measured.items():  # each action once, in its stage's list order
        assert names == schedule[stage], (stage, names)
    assert sorted(predicted) == [(s, k) for s in range(2) for k in range(STEPS)]
    for (stage, _), names in predicted.items():
        assert names == schedule[stage], (stage, names)

    record = RunRecord.model_validate_json((run_dir / "run.json").read_text())
    assert [b.step for b in record.bubbles] == list(range(STEPS))
    for b in record.bubbles:  # 2 stages x 4 microbatches: at least the fill and drain are idle
        assert b.measured is not None and 0.0 < b.measured < 1.0
        assert b.predicted is not None and 0.0 < b.predicted < 1.0
