"""The examples built from ready-made cells train on real plans to what one process reaches.

``examples/gpt.py`` and ``examples/resnet.py``, made tiny through their factories' keywords and
run in float64, train 5 steps on a 2-stage pipeline (and the GPT with its head tied to its
embedding on data parallel 2, where both uses of the table sit on one stage), and must end
within 1e-9 of ``coordinator.runtime.reference.train_reference``. One harness of two worker
processes serves every job of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from examples import gpt, resnet

pytestmark = pytest.mark.timeout(120)

STEPS = 5
TOL64 = 1e-9
TINY_GPT = {"width": 16, "heads": 2, "blocks": 2, "seq": 8, "dtype": "float64"}
TINY_RESNET = {"width": 4, "depths": [1, 1], "dtype": "float64"}
PIPELINE = {"data_parallel": 1, "num_stages": 2, "num_microbatches": 4}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"examples.{m}:{f}" for m in ("gpt", "resnet") for f in ("model", "data", "loss")]
    with LocalHarness(["local-0", "local-1"], job="t-library", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def gpt_job(model_kwargs: dict[str, Any], **plan: Any) -> Job:
    return Job(model=gpt.model, data=gpt.data, loss=gpt.loss, model_kwargs=model_kwargs,
               data_kwargs={"seq": 8, "stride": 8, "num_samples": 64}, optimizer="AdamW",
               optimizer_kwargs={"lr": 0.01, "weight_decay": 0.01}, global_batch=16, seed=3,
               resources=Resources.local(workers=2), step_timeout_s=30, **plan)


def fit_and_compare(harness: LocalHarness, job: Job) -> dict[str, Any]:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL64, f"{job.plan().summary()}: max abs diff {diff:.3g} >= {TOL64:g}"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-7
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"
    job.build_model().load_state_dict(result.state_dict, strict=True)
    return result.state_dict


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_gpt_on_a_two_stage_pipeline_matches_one_process(harness: LocalHarness, schedule: str) -> None:
    job = gpt_job(TINY_GPT, schedule=schedule, **PIPELINE)
    stages = job.plan().stages
    assert [(st.start, st.stop) for st in stages] == [(0, 2), (2, 4)]  # embed, block0 | block1, head
    fit_and_compare(harness, job)


def test_gpt_with_a_tied_head_on_data_parallel_matches_one_process(harness: LocalHarness) -> None:
    job = gpt_job({**TINY_GPT, "tie": True}, data_parallel=2, num_stages=1, num_microbatches=2)
    state = fit_and_compare(harness, job)
    assert state["0.module.tok.weight"].equal(state["3.module.out.weight"])  # still one table


def test_resnet_on_a_two_stage_pipeline_matches_one_process(harness: LocalHarness) -> None:
    job = Job(model=resnet.model, data=resnet.data, loss=resnet.loss, model_kwargs=TINY_RESNET,
              data_kwargs={"num_samples": 64, "size": 8, "dtype": "float64"}, optimizer="SGD",
              optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, global_batch=16, seed=4,
              resources=Resources.local(workers=2), step_timeout_s=30, schedule="1f1b", **PIPELINE)
    assert job.plan().num_stages == 2
    fit_and_compare(harness, job)
