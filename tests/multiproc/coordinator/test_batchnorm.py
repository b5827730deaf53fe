"""BatchNorm trains on the statistics of the global batch, or the plan is refused naming the layer.

Plans of one microbatch per replica are exact: a pipeline's stages each see the whole batch,
and data-parallel replicas all-reduce the statistics (``services/compute/batchnorm.py``), so the
parameters, the running statistics and ``num_batches_tracked`` end as one process's. One
harness of two worker processes serves every job of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
R = "tests.multiproc.coordinator.random_models"
STEPS = 5
TOL = 1e-9


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    with LocalHarness(["local-0", "local-1"], job="t-batchnorm", lease_ttl=timedelta(seconds=6),
                      factories=[f"{R}:bn_net", f"{R}:images", f"{M}:mse"]) as h:
        yield h


def make_job(**plan: Any) -> Job:
    return Job(model=f"{R}:bn_net", loss=f"{M}:mse", data=f"{R}:images", optimizer="SGD",
               optimizer_kwargs={"lr": 0.05, "momentum": 0.9}, global_batch=16, seed=4,
               resources=Resources.local(workers=2), step_timeout_s=30, **plan)


@pytest.mark.parametrize("plan", [
    dict(data_parallel=1, num_stages=2, num_microbatches=1, schedule="gpipe", balance=[3, 4]),
    dict(data_parallel=2, num_stages=1, num_microbatches=1),
], ids=["pipeline2x1", "dp2-synced"])
def test_exact_plans_train_batch_norm_as_one_process(harness: LocalHarness, plan: dict[str, Any]) -> None:
    job = make_job(**plan)
    chosen = job.plan()
    assert chosen.num_microbatches == 1 and chosen.mode == "collective"
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"{chosen.summary()}: max abs diff {diff:.3g} from one process"
    for key in ("1.num_batches_tracked", "5.num_batches_tracked"):
        assert int(result.state_dict[key]) == STEPS == int(ref.state_dict[key])
    initial = job.build_model().state_dict()
    assert max_abs_diff({"m": initial["1.running_mean"]}, {"m": ref.state_dict["1.running_mean"]}) > 1e-2


def test_the_planner_chooses_only_exact_plans() -> None:
    for plan in (dict(strategy="auto"), dict(strategy="data_parallel"), dict(strategy="pipeline")):
        chosen = make_job(**plan).plan()
        assert (chosen.num_microbatches, chosen.mode) == (1, "collective"), chosen.summary()


@pytest.mark.parametrize(("plan", "why"), [
    (dict(num_stages=2, num_microbatches=2), r"num_microbatches=2 each microbatch is normalised on its own"),
    (dict(data_parallel=2, num_stages=1, mode="parameter_server"),
     r"parameter-server mode has no data-parallel"),
])
def test_plans_that_split_the_batch_of_batch_norm_are_refused_naming_the_layer(plan: dict[str, Any],
                                                                               why: str) -> None:
    with pytest.raises(PlanningError, match=rf"BatchNorm layer 1 \(BatchNorm2d\) .*{why}.*one microbatch per "
                                            r"replica.*GroupNorm"):
        make_job(**plan).plan()
