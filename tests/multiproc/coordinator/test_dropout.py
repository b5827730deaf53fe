"""Dropout survives the cut: every plan trains a dropping model to the parameters one process reaches.

Each random draw is keyed by (seed, step, module, call, sample, element)
(``services/compute/randomness/``), so data parallel, GPipe, 1F1B and the parameter server draw,
for each sample, the masks one process draws for it, and a resumed run draws them again. One
harness of two worker processes serves every job of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
R = "tests.multiproc.coordinator.random_models"
STEPS = 5
TOL = 1e-9
PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "gpipe2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="gpipe"),
    "1f1b2x2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="1f1b"),
    "zb2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="zb-h1"),
    "ps2": dict(data_parallel=2, num_stages=1, num_microbatches=2, mode="parameter_server"),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{R}:dropout_mlp", f"{R}:dropout_transformer", f"{R}:plain_dropping", f"{M}:regression",
                 f"{M}:mse", f"{M}:tokens", f"{M}:token_loss"]
    with LocalHarness(["local-0", "local-1"], job="t-dropout", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(plan: str, *, p: float = 0.3, **extra: Any) -> Job:
    return Job(model=f"{R}:dropout_mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
               optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, model_kwargs={"p": p}, global_batch=16, seed=7,
               resources=Resources.local(workers=2), step_timeout_s=30, **PLANS[plan], **extra)


@pytest.fixture(scope="module")
def trained(harness: LocalHarness) -> dict[str, FitResult]:
    results = {}
    for plan in PLANS:
        job = make_job(plan)
        with job.attach(harness):
            results[plan] = job.fit(STEPS)
    return results


@pytest.mark.parametrize("plan", list(PLANS))
def test_every_plan_trains_a_dropping_model_as_one_process(trained: dict[str, FitResult], plan: str) -> None:
    result, job = trained[plan], make_job(plan)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"{plan}: max abs diff {diff:.3g} from one process"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-12
    shape = result.plan
    assert shape is not None and shape.num_stages == PLANS[plan]["num_stages"]


def test_the_plans_end_equal_and_dropout_mattered(trained: dict[str, FitResult]) -> None:
    first, *others = trained.values()
    for other in others:
        assert max_abs_diff(first.state_dict, other.state_dict) < TOL
    without = train_reference(make_job("dp2", p=0.0), STEPS)
    assert max_abs_diff(first.state_dict, without.state_dict) > 1e-3, "the dropout did not change training"


def test_attention_and_residual_dropout_across_a_pipeline(harness: LocalHarness) -> None:
    job = Job(model=f"{R}:dropout_transformer", loss=f"{M}:token_loss", data=f"{M}:tokens", optimizer="Adam",
              optimizer_kwargs={"lr": 0.01}, global_batch=8, seed=3, resources=Resources.local(workers=2),
              step_timeout_s=30, **PLANS["1f1b2x2"])
    with job.attach(harness):
        result = job.fit(STEPS)
    diff = max_abs_diff(result.state_dict, train_reference(job, STEPS).state_dict)
    assert diff < TOL, f"max abs diff {diff:.3g} from one process"


def test_a_plain_module_with_dropping_blocks_as_leaves_trains_as_one_process(harness: LocalHarness) -> None:
    """No cells: torch.fx cuts the model, and the blocks drawing with F.dropout are leaves (model.leaves,
    as the preflight asks), so each block's draws are keyed by its name on every stage."""
    job = Job(model=f"{R}:plain_dropping", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1}, global_batch=16, seed=3, leaves=["a", "c"], balance=[2, 2],
              resources=Resources.local(workers=2), step_timeout_s=30, **PLANS["gpipe2x4"])
    with job.attach(harness):
        result = job.fit(STEPS)
    assert tuple(job.plan().bounds) == (0, 2, 4)  # the cut falls between the two dropping blocks
    diff = max_abs_diff(result.state_dict, train_reference(job, STEPS).state_dict)
    assert diff < TOL, f"max abs diff {diff:.3g}"


def test_a_resumed_run_draws_what_the_uninterrupted_one_draws(harness: LocalHarness, tmp_path: Path,
                                                               trained: dict[str, FitResult]) -> None:
    """Saved on 2 stages after 3 steps, resumed data parallel: nothing about the draws is stored."""
    first = make_job("1f1b2x2", checkpoint_directory=str(tmp_path), checkpoint_keep=2)
    with first.attach(harness):
        first.fit(3)
    second = make_job("dp2", checkpoint_directory=str(tmp_path), checkpoint_keep=2)
    with second.attach(harness, resume=True):
        resumed = second.fit(STEPS - 3)
    assert [r.step for r in resumed.steps] == [3, 4]
    diff = max_abs_diff(resumed.state_dict, trained["dp2"].state_dict)
    assert diff < TOL, f"the resumed run is {diff:.3g} from the uninterrupted one"
