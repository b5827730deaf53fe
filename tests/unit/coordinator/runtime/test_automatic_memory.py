"""What a job lets the planner pick by itself to save memory (``Job._automatic``)."""

from __future__ import annotations

from typing import Any

from coordinator.planning.memory import AUTOMATIC
from coordinator.planning.resources import Resources
from coordinator.runtime.job import Job

M = "tests.multiproc.coordinator.models"
E = "tests.multiproc.coordinator.eval_models"


def job(**fields: Any) -> Job:
    return Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", global_batch=16,
               resources=Resources.local(2), **fields)


def test_a_plain_job_may_get_every_zero_stage_and_recompute() -> None:
    auto = job()._automatic()
    assert (auto.zero, auto.recompute, auto.offload) == ((0, 1, 2, 3), True, False) == (
        AUTOMATIC.zero, AUTOMATIC.recompute, AUTOMATIC.offload)


def test_an_eval_section_rules_out_nothing() -> None:  # ZeRO-3 evaluates with padding forwards
    assert job(eval=f"{E}:heldout")._automatic().zero == (0, 1, 2, 3)


def test_an_optimizer_that_is_not_elementwise_rules_out_sharding() -> None:
    assert job(optimizer="LBFGS")._automatic().zero == (0,)


def test_batch_norm_layers_rule_out_recompute() -> None:
    j = job()
    j._batch_norm = ("bn",)  # what Job.plan finds in a model with BatchNorm layers
    assert j._automatic().recompute is False
