"""Windows of steps: one request per stage runs several steps, the stages committing each but the last.

Each job trains in float64 and must end within 1e-9 of one process training the same batches
(``coordinator/runtime/reference.py``), with the requests counted: a window of ``K`` steps costs one
``run_step`` per stage. The stages decide each commit inside a window themselves ([Note: a window of
steps] in ``services/protocol/compute.py``): clipping by the global norm over stages, a step that is
not finite (skipped, or stopping the job with the steps before it counted), a checkpoint that ends a
window, and plans that take no windows (replicas). One harness of two workers serves every job.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import newest, read_trainer
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.nonfinite import NonFiniteStep
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
B = "tests.multiproc.coordinator.bad_models"
TOL, MAX_NORM, BATCH = 1e-9, 0.25, 16
PIPE = dict(data_parallel=1, num_stages=2, num_microbatches=2)


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:mlp", f"{M}:mse", f"{M}:regression", f"{B}:nan_at"]
    with LocalHarness(["local-0", "local-1"], job="t-windows", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(**fields: Any) -> Job:
    fields = {"data": f"{M}:regression", "seed": 7, "schedule": "1f1b", **PIPE, **fields}
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", optimizer="AdamW", optimizer_kwargs={"lr": 0.05},
               global_batch=BATCH, resources=Resources.local(2), step_timeout_s=30, **fields)


def fit(harness: LocalHarness, job: Job, steps: int) -> tuple[FitResult, dict[str, int]]:
    """``job`` trained ``steps`` steps; its result and the requests its coordinator sent, by method."""
    with job.attach(harness):
        session = job._session
        assert session is not None and session.loop is not None
        before = dict(session.loop.requests)
        result = job.fit(steps)
        sent = {k: v - before.get(k, 0) for k, v in session.loop.requests.items()}
    return result, sent


def check_parity(job: Job, result: FitResult, steps: int) -> None:
    ref = train_reference(job, steps)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < TOL
    for mine, theirs in zip(result.grad_norms, ref.grad_norms, strict=True):
        assert mine is not None and abs(mine - theirs) < TOL * max(1.0, theirs)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "zb-h1"])
def test_windows_with_clipping_and_a_scheduler_match_one_process(harness: LocalHarness,
                                                                 schedule: str) -> None:
    job = make_job(schedule=schedule, steps_per_request=4, clip_grad_norm=MAX_NORM,
                   scheduler={"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}})
    result, sent = fit(harness, job, 10)
    check_parity(job, result, 10)
    ref = train_reference(job, 10)
    assert sum(n is not None and n > MAX_NORM for n in ref.grad_norms) >= 5  # the stages' clipping acts
    assert sent["run_step"] == 2 * 3  # windows of 4, 4 and 2 steps: one request per stage each
    assert [r.step for r in result.steps] == list(range(10))
    for before, after in zip(result.steps, result.steps[1:], strict=False):
        assert before.end <= after.start + 1e-6 and before.start < before.end


def test_one_step_per_request_when_asked(harness: LocalHarness) -> None:
    job = make_job(steps_per_request=1)
    result, sent = fit(harness, job, 4)
    check_parity(job, result, 4)
    assert sent["run_step"] == 2 * 4


@pytest.mark.parametrize("plan", ["dp2", "zero1"])
def test_replicas_agree_on_every_commit_of_a_window(harness: LocalHarness, plan: str) -> None:
    zero = {"zero": 1, "shard_factor": 2} if plan == "zero1" else {}
    job = make_job(steps_per_request=3, data_parallel=2, num_stages=1, num_microbatches=1,
                   clip_grad_norm=MAX_NORM, **zero)
    result, sent = fit(harness, job, 6)
    check_parity(job, result, 6)
    assert sent["run_step"] == 2 * 2  # windows of 3: one request per replica each


def test_a_sharded_gradient_takes_no_windows(harness: LocalHarness) -> None:
    job = make_job(steps_per_request=8, data_parallel=2, num_stages=1, num_microbatches=1, zero=2,
                   shard_factor=2)
    result, sent = fit(harness, job, 4)
    check_parity(job, result, 4)
    assert sent["run_step"] == 2 * 4  # each replica's norm is a part: the coordinator adds them, per step


def test_a_loss_not_finite_in_one_replica_is_dropped_by_every_replica(harness: LocalHarness) -> None:
    job = nan_job("skip", data_parallel=2, num_stages=1, num_microbatches=1)
    result, sent = fit(harness, job, 4)
    assert sent["run_step"] == 2  # one window on each replica
    assert [r.skipped for r in result.steps] == [False, True, False, False]
    ref = train_reference(job, 4)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL


def nan_job(nonfinite: str, **plan: Any) -> Job:
    """Sample 20 holds a NaN: without shuffling, step 2 (index 1) of global batches of 16 takes it (in
    replica 0's half under data parallel 2)."""
    return Job(model=f"{M}:mlp", data=f"{B}:nan_at", data_kwargs={"indices": [20], "value": "nan"},
               loss=f"{M}:mse", optimizer="SGD", optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
               global_batch=BATCH, shuffle=False, seed=3, resources=Resources.local(2), step_timeout_s=30,
               nonfinite=nonfinite, steps_per_request=4, **{**PIPE, **plan})


def test_a_step_that_is_not_finite_inside_a_window_is_skipped_by_every_stage(harness: LocalHarness) -> None:
    job = nan_job("skip")
    result, sent = fit(harness, job, 4)
    assert sent["run_step"] == 2
    assert [r.skipped for r in result.steps] == [False, True, False, False]
    ref = train_reference(job, 4)  # skips alike
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL
    assert math.isnan(result.losses[1])


def test_a_step_that_is_not_finite_inside_a_window_stops_the_job_there(harness: LocalHarness) -> None:
    job = nan_job("stop")
    with pytest.raises(NonFiniteStep) as info, job.attach(harness):
        job.fit(4)
    assert (info.value.step, info.value.stage) == (1, 1)
    assert job.steps_done == 1  # the window's first step was committed, and counted
    assert [r.step for r in info.value.before] == [0]


def test_a_checkpoint_ends_a_window_and_the_run_resumes_from_it(harness: LocalHarness,
                                                                tmp_path: Path) -> None:
    features = dict(steps_per_request=4, checkpoint_directory=str(tmp_path), checkpoint_every_steps=3,
                    checkpoint_keep=3)
    first = make_job(**features)
    _, sent = fit(harness, first, 4)
    assert sent["run_step"] == 2 * 2  # steps 0-2, then 3: the save of step 3 rides on the next commit
    assert read_trainer(newest(tmp_path)).step == 4  # type: ignore[arg-type]  # the final one
    assert (tmp_path / "step-00000003").is_dir()
    second = make_job(**features)
    with second.attach(harness, resume=True):
        resumed = second.fit(5)
    assert [r.step for r in resumed.steps] == [4, 5, 6, 7, 8]
    ref = train_reference(second, 9)
    assert max_abs_diff(resumed.state_dict, ref.state_dict) < TOL
    assert max(abs(a - b) for a, b in zip(resumed.losses, ref.losses[4:], strict=True)) < TOL
