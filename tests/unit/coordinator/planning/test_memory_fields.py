"""The plan's memory fields (ZeRO stage, shard factor, recompute, offload, staleness): checked and carried."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from coordinator.planning.config import PlanConfig
from coordinator.planning.plan import Plan
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources
from services.protocol import ComputeOptions

MiB = 2**20


def small_model() -> Profile:
    return Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, cut_bytes=[4096] * 3, microbatch_size=4)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"zero": 2, "mode": "parameter_server"}, "parameter-server mode shards it"),
    ({"zero": 0, "shard_factor": 2}, "plan.shard_factor sizes the sharding groups"),
    ({"staleness": 2}, "set plan.mode: parameter_server"),
    ({"staleness": 2, "mode": "collective"}, "set plan.mode: parameter_server"),
])
def test_contradicting_memory_fields_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        PlanConfig.model_validate(kwargs)


def test_a_fixed_zero_stage_reaches_the_plan_and_its_text() -> None:
    plan = choose_plan(small_model(), Resources.local(workers=4),
                       PlanConfig(zero=2, strategy="data_parallel", data_parallel=4, shard_factor=2),
                       global_batch=16)
    assert (plan.zero_stage, plan.shard_factor, plan.data_parallel) == (2, 2, 4)
    assert "ZeRO-2 over 4 replicas in groups of 2" in str(plan)
    assert "ZeRO-2 over 4 replicas in groups of 2" in plan.summary()
    assert Plan.from_json(plan.to_json()) == plan
    whole = choose_plan(small_model(), Resources.local(workers=2), PlanConfig(zero=1, data_parallel=2),
                        global_batch=16)
    assert (whole.zero_stage, whole.shard_factor) == (1, 2)


def test_no_sharding_unless_asked() -> None:
    plan = choose_plan(small_model(), Resources.local(workers=2), PlanConfig(data_parallel=2),
                       global_batch=16)
    assert (plan.zero_stage, plan.shard_factor, plan.recompute, plan.offload, plan.staleness) == (
        0, 1, False, False, 0)


def test_a_zero_stage_no_shape_can_hold_is_refused() -> None:
    with pytest.raises(PlanningError, match=r"plan\.zero=3 shards a stage's state across 2 or more"):
        choose_plan(small_model(), Resources.local(workers=1), PlanConfig(zero=3), global_batch=16)
    with pytest.raises(PlanningError, match=r"groups of plan\.shard_factor=4"):
        choose_plan(small_model(), Resources.local(workers=2), PlanConfig(zero=1, shard_factor=4),
                    global_batch=16)


def test_plans_and_options_refuse_inconsistent_sharding() -> None:
    plan = choose_plan(small_model(), Resources.local(workers=2), PlanConfig(data_parallel=2),
                       global_batch=16)
    with pytest.raises(ValidationError, match="shards across groups of shard_factor"):
        Plan.model_validate({**plan.model_dump(), "zero_stage": 1, "shard_factor": 3})
    with pytest.raises(ValidationError, match="without sharding"):
        Plan.model_validate({**plan.model_dump(), "shard_factor": 2})
    with pytest.raises(ValidationError, match="needs parameter-server mode"):
        Plan.model_validate({**plan.model_dump(), "staleness": 1})
    with pytest.raises(ValidationError, match="groups of shard_factor"):
        ComputeOptions(stage=0, num_stages=1, num_replicas=4, zero_stage=2, shard_factor=3)
