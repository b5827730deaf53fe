"""A loss that becomes NaN or Inf: ``Job.fit`` stops at that step (``nonfinite: stop``) or drops its update.

The data has NaN or Inf in the inputs of sample 20; without shuffling, global batches of 16
put it in step 2 (index 1). ``skip`` must end at the parameters of one process that trains
the same batches and skips that step's update (computed here, independently of cellmesh's
reference); ``stop`` must raise at that step, naming it, the stage and the last good loss.
A loss that is finite over gradients that are not (``sqrt(|x|)`` at 0) stops the job too.
One harness of two workers serves every job of this module.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.nonfinite import NonFiniteStep
from coordinator.runtime.reference import max_abs_diff, train_reference
from tests.multiproc.coordinator import bad_models, models

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
B = "tests.multiproc.coordinator.bad_models"
SEED, BATCH, STEPS, LR, BAD_SAMPLE = 3, 16, 4, 0.1, 20


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:mlp", f"{M}:mse", f"{M}:regression", f"{B}:nan_at", f"{B}:infinite_gradient"]
    with LocalHarness(["local-0", "local-1"], job="t-nonfinite", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:  # a shared harness names every job's factories
        yield h


def make_job(value: str, **fields: Any) -> Job:
    return Job(model=f"{M}:mlp", data=f"{B}:nan_at", data_kwargs={"indices": [BAD_SAMPLE], "value": value},
               loss=f"{M}:mse", optimizer="SGD", optimizer_kwargs={"lr": LR, "momentum": 0.9},
               global_batch=BATCH, shuffle=False, seed=SEED, resources=Resources.local(2), step_timeout_s=30,
               **fields)


def one_process_skipping_bad_steps(value: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """SGD with momentum on the same batches; a step whose loss is not finite updates nothing."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = nn.Sequential(*models.mlp())
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        x, y = bad_models.nan_at([BAD_SAMPLE], value)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses = []
    for step in range(STEPS):
        first = step * BATCH % x.shape[0]
        loss = nn.functional.mse_loss(model(x[first:first + BATCH]), y[first:first + BATCH])
        losses.append(float(loss.detach()))
        if math.isfinite(losses[-1]):
            optimizer.zero_grad()
            loss.backward()  # type: ignore[no-untyped-call]  # torch stub
            optimizer.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_skip_drops_the_update_of_the_step_that_is_not_finite(harness: LocalHarness) -> None:
    job = make_job("nan", nonfinite="skip", data_parallel=2, num_stages=1, num_microbatches=2)
    with job.attach(harness):
        result = job.fit(STEPS)
    losses, state = one_process_skipping_bad_steps("nan")
    assert [r.skipped for r in result.steps] == [False, True, False, False]
    assert math.isnan(result.losses[1]) and math.isnan(losses[1])
    finite = [i for i in range(STEPS) if i != 1]
    assert max(abs(result.losses[i] - losses[i]) for i in finite) < 1e-9
    assert max_abs_diff(result.state_dict, state) < 1e-9
    assert all(bool(torch.isfinite(t).all()) for t in result.state_dict.values())
    reference = train_reference(job, STEPS)  # cellmesh's own reference skips alike
    assert max_abs_diff(reference.state_dict, state) < 1e-9


def test_stop_names_the_step_the_stage_and_the_last_good_loss(harness: LocalHarness) -> None:
    job = make_job("inf", num_stages=2, num_microbatches=2)
    losses, _ = one_process_skipping_bad_steps("inf")
    with pytest.raises(NonFiniteStep) as info, job.attach(harness):
        job.fit(STEPS)
    error = info.value
    assert (error.step, error.stage) == (1, 1)
    assert error.last_good_loss is not None and abs(error.last_good_loss - losses[0]) < 1e-9
    text = str(error)
    assert "\n" not in text and text.startswith("step 2: the loss of microbatch 0 is ")
    assert "on stage 1 (worker local-1, replica 0); the job stopped before applying it (the last good loss " \
           f"was {losses[0]:.6g} at step 1)" in text
    assert "runtime.nonfinite: skip" in text
    with pytest.raises(NonFiniteStep, match="step 2: "):
        train_reference(job, STEPS)


def test_gradients_that_are_not_finite_stop_the_job_though_the_loss_is(harness: LocalHarness) -> None:
    job = Job(model=f"{B}:infinite_gradient", data=f"{M}:regression", loss=f"{M}:mse", global_batch=BATCH,
              seed=SEED, resources=Resources.local(2), step_timeout_s=30, num_stages=2)
    with pytest.raises(NonFiniteStep) as info, job.attach(harness):
        job.fit(STEPS)
    assert (info.value.step, info.value.stage, info.value.last_good_loss) == (0, 0, None)
    assert str(info.value).startswith(
        "step 1: the gradients of cell0.weight, cell0.bias are not finite (while the loss is) on stage 0 "
        "(worker local-0, replica 0); the job stopped before applying it (no step before it had a finite "
        "loss)")
