"""Plans for a model with BatchNorm: only those whose every BatchNorm forward sees the global batch."""

from __future__ import annotations

import pytest

from coordinator.planning.config import PlanConfig
from coordinator.planning.request import PlanningError, batch_norm_request, check_batch_norm_plan

LAYERS = ["blocks.0.bn (BatchNorm2d)", "head.bn (BatchNorm1d)"]


def test_without_batch_norm_the_request_is_unchanged() -> None:
    request = PlanConfig(num_microbatches=4, mode="parameter_server")
    assert batch_norm_request(request, []) is request
    check_batch_norm_plan([], 4, 2, "parameter_server")


def test_the_planner_is_asked_for_one_microbatch_and_collective_replicas() -> None:
    narrowed = batch_norm_request(PlanConfig(strategy="data_parallel"), LAYERS)
    assert (narrowed.num_microbatches, narrowed.mode, narrowed.strategy) == (1, "collective", "data_parallel")
    assert batch_norm_request(PlanConfig(num_microbatches=1, data_parallel=1, mode="parameter_server"),
                              LAYERS).mode == "parameter_server"  # one replica: nothing to share


@pytest.mark.parametrize(("request_", "why"), [
    (PlanConfig(num_microbatches=4), r"with num_microbatches=4 each microbatch is normalised on its own and "
                                     r"the running statistics move 4 times a step"),
    (PlanConfig(mode="parameter_server"), r"parameter-server mode has no data-parallel group"),
])
def test_a_request_fixing_what_splits_the_batch_is_refused(request_: PlanConfig, why: str) -> None:
    expected = (rf"^BatchNorm layer blocks\.0\.bn \(BatchNorm2d\) normalises with the statistics of the "
                rf"batch it sees: {why}.*, unlike one process.*one microbatch per replica .*GroupNorm, "
                r"LayerNorm")
    with pytest.raises(PlanningError, match=expected):
        batch_norm_request(request_, LAYERS)


def test_a_complete_plan_is_checked_too() -> None:
    check_batch_norm_plan(LAYERS, 1, 2, "collective")
    with pytest.raises(PlanningError, match=r"the plan \(1 replica\(s\), 2 microbatch\(es\), collective\) "
                                            r"does not train BatchNorm layer blocks\.0\.bn"):
        check_batch_norm_plan(LAYERS, 2, 1, "collective")
    with pytest.raises(PlanningError, match=r"parameter-server mode"):
        check_batch_norm_plan(LAYERS, 1, 2, "parameter_server")
