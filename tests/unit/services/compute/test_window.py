"""The verdict on a step inside a window (``services/compute/window.py``) against the coordinator's own
decision on the same replies (``coordinator/runtime/nonfinite.py``, ``coordinator/runtime/clipping.py``),
and the reports and verdicts through their tensors."""

from __future__ import annotations

import math

import pytest

from coordinator.runtime.clipping import grad_scale
from coordinator.runtime.nonfinite import first_nonfinite
from coordinator.runtime.records import _Service
from services.compute.window import Report, Verdict, decide
from services.protocol import StepReply


def replies(*specs: tuple[list[float], list[str], float | None]) -> list[tuple[_Service, StepReply]]:
    return [(_Service(f"w{i}", f"s{i}", 0, i), StepReply(step=0, stage=i, losses=losses, nonfinite_grads=bad,
                                                         grad_sq_norm=sq))
            for i, (losses, bad, sq) in enumerate(specs)]


CASES = [
    ([([], [], 0.5), ([1.0, 2.0], [], 0.25)], None),
    ([([], [], 0.5), ([1.0, 2.0], [], 0.25)], 0.3),
    ([([], [], 0.01), ([1.0], [], 0.02)], 5.0),  # under the limit: 1
    ([([], [], None), ([1.0], [], 0.02)], 0.3),  # a stage without a norm: no clipping, as the coordinator
    ([([], [], 0.5), ([math.nan, 2.0], [], 0.25)], 0.3),
    ([([], [], 0.5), ([1.0, math.inf], [], 0.25)], None),
    ([([], ["cell0.weight"], math.inf), ([1.0], [], 0.25)], 0.3),
]


@pytest.mark.parametrize(("specs", "clip"), CASES)
@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_the_stages_decide_as_the_coordinator_would(specs: list[tuple[list[float], list[str], float | None]],
                                                   clip: float | None, nonfinite: str) -> None:
    bodies = replies(*specs)
    verdict = decide([Report.of(body) for _, body in bodies], clip, nonfinite)  # type: ignore[arg-type]
    if first_nonfinite(bodies) is not None:
        assert verdict == Verdict(action=nonfinite)  # type: ignore[arg-type]
    else:
        assert verdict.action == "commit"
        assert verdict.grad_scale == pytest.approx(grad_scale(bodies, clip), rel=1e-15)


@pytest.mark.parametrize("report", [Report(True, 0.125), Report(False, None), Report(True, None),
                                    Report(False, math.inf), Report(True, 0.5, closing=True)])
def test_a_report_crosses_as_a_tensor(report: Report) -> None:
    back = Report.from_tensor(report.tensor("cpu"))
    assert (back.finite, back.sq_norm, back.closing) == (report.finite, report.sq_norm, report.closing)


def test_a_stage_closing_stops_the_window_whatever_the_step() -> None:
    for finite in (True, False):
        reports = [Report(True, 0.25), Report(finite, 0.5, closing=True)]
        assert decide(reports, 0.1, "skip") == Verdict("stop")


@pytest.mark.parametrize("verdict", [Verdict("commit", 0.37), Verdict("skip"), Verdict("stop")])
def test_a_verdict_crosses_as_a_tensor(verdict: Verdict) -> None:
    assert Verdict.from_tensor(verdict.tensor("cpu")) == verdict
