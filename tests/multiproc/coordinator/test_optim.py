"""The optimizer section: LR schedulers, clipping by the global norm and gradient accumulation, on every plan.

Each job trains 5 steps in float64 and must end within 1e-9 of one process training the same
model on the same global batches with torch's own ``lr_scheduler``, ``clip_grad_norm_`` and a
loss divided by the accumulation count (``coordinator/runtime/reference.py``). The features
are checked together on each plan (data parallel, 1F1B, 2x2, parameter server), each alone on
one plan, with a skipped non-finite step (the scheduler still steps), and across a resume on
another plan mid-schedule. One harness of four workers serves every job of this module.
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
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
B = "tests.multiproc.coordinator.bad_models"
STEPS, TOL, MAX_NORM = 5, 1e-9, 0.25  # the gradient norms of these jobs are 0.28-1.0: most steps clip
STEP_LR = {"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}}
ONE_CYCLE = {"name": "OneCycleLR", "kwargs": {"max_lr": 0.3, "total_steps": 12}}  # cycles momentum too
ALL = dict(scheduler=STEP_LR, clip_grad_norm=MAX_NORM, accumulate=2)
PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "1f1b2x2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="1f1b"),
    "pp2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b"),
    # deferred weight gradients added to the ones the step starts with (accumulate), over replicas
    "zb2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="zb-h1"),
    "ps2": dict(data_parallel=2, num_stages=1, num_microbatches=2, mode="parameter_server"),
    # 2 workers x 2 chunks (every stage with parameters: a stage of Tanh alone has none to optimize)
    "interleaved2x2": dict(data_parallel=1, num_stages=4, chunks=2, num_microbatches=2,
                           schedule="interleaved-1f1b", balance=[2, 1, 2, 1]),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:mlp", f"{M}:mse", f"{M}:regression", f"{B}:nan_at"]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-optim", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(plan: str, **fields: Any) -> Job:
    fields = {"data": f"{M}:regression", "seed": 5, **PLANS[plan], **fields}
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", optimizer="SGD",
               optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, global_batch=16, resources=Resources.local(4),
               step_timeout_s=30, **fields)


def fit_and_compare(harness: LocalHarness, job: Job) -> tuple[FitResult, FitResult]:
    """``job`` trained on the harness and by one process; checked equal (parameters, losses, norms)."""
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"{job.plan().summary()}: max abs diff {diff:.3g}"
    pairs = [(a, b) for a, b in zip(result.losses, ref.losses, strict=True) if math.isfinite(b)]
    assert max(abs(a - b) for a, b in pairs) < TOL
    for mine, theirs in zip(result.grad_norms, ref.grad_norms, strict=True):  # collective: every step's
        if mine is not None and theirs is not None and math.isfinite(theirs):
            assert abs(mine - theirs) < TOL * max(1.0, theirs)
    return result, ref


def differs(job: Job, **without: Any) -> float:
    """How far one process's result moves when the job's optimizer section lacks ``without``."""
    section = job.config.optimizer.model_copy(update=without)
    other = Job(job.config.model_copy(update={"optimizer": section}), resources=job.resources)
    return max_abs_diff(train_reference(job, STEPS).state_dict, train_reference(other, STEPS).state_dict)


@pytest.mark.parametrize("plan", list(PLANS))
def test_scheduler_clipping_and_accumulation_together_match_one_process(harness: LocalHarness,
                                                                        plan: str) -> None:
    job = make_job(plan, **ALL)
    result, ref = fit_and_compare(harness, job)
    assert sum(n is not None and n > MAX_NORM for n in ref.grad_norms) >= 4  # clipping acts on most steps
    assert all(r.num_samples == 32 for r in result.steps)  # a step is 2 global batches of 16
    if plan != "ps2":
        assert all(n is not None for n in result.grad_norms)
    if plan == "dp2":  # each feature changes the result: none of them is silently ignored
        for feature, off in (("scheduler", None), ("clip_grad_norm", None), ("accumulate", 1)):
            assert differs(job, **{feature: off}) > 1e-4, feature


def test_accumulation_alone_synchronises_once_per_step_and_holds_one_batch_of_activations(
        harness: LocalHarness) -> None:
    gpipe = make_job("pp2xdp2", accumulate=3, schedule="gpipe")
    result, _ = fit_and_compare(harness, gpipe)
    events = result.steps[-1].events
    for stage in (0, 1):
        mine = [e for e in events if e.stage == stage and e.replica == 0]
        assert sum(e.name == "all_reduce" for e in mine) == 1  # once per optimizer step, not per batch
        assert sum(e.action is not None and e.action.kind == "F" for e in mine) == 3 * 2  # 3 batches x 2
        held = peak = 0  # GPipe repeats its list per batch: at most one batch's 2 microbatches in flight
        for e in sorted((e for e in mine if e.action is not None), key=lambda e: e.start):
            held += {"F": 1, "B": -1}.get(e.action.kind if e.action else "", 0)
            peak = max(peak, held)
        assert peak <= 2


def test_clipping_alone_on_a_pipeline(harness: LocalHarness) -> None:
    _, ref = fit_and_compare(harness, make_job("1f1b2x2", clip_grad_norm=MAX_NORM))
    assert sum(n is not None and n > MAX_NORM for n in ref.grad_norms) >= 4


@pytest.mark.parametrize("plan", ["dp2", "ps2"])
def test_a_skipped_step_still_steps_the_scheduler(harness: LocalHarness, plan: str) -> None:
    # sample 20 is NaN; without shuffling step 2 (index 1) holds it: its update is dropped
    job = make_job(plan, data=f"{B}:nan_at", data_kwargs={"indices": [20], "value": "nan"}, shuffle=False,
                   nonfinite="skip", scheduler=ONE_CYCLE)
    result, _ = fit_and_compare(harness, job)
    assert [r.skipped for r in result.steps] == [False, True, False, False, False]


def test_a_resume_mid_schedule_on_another_plan_equals_an_uninterrupted_run(harness: LocalHarness,
                                                                           tmp_path: Path) -> None:
    features = dict(scheduler=ONE_CYCLE, clip_grad_norm=MAX_NORM, accumulate=2,
                    checkpoint_directory=str(tmp_path))
    first = make_job("dp2", **features)
    with first.attach(harness):
        first.fit(3)
    saved = read_trainer(newest(tmp_path))  # type: ignore[arg-type]
    # 3 steps of 2 global batches of 16 out of 64 samples: epoch 1, 32 samples in
    assert (saved.step, saved.accumulate, saved.epoch, saved.offset) == (3, 2, 1, 32)
    second = make_job("ps2", **features)
    with second.attach(harness, resume=True):
        resumed = second.fit(STEPS - 3)
    ref = train_reference(second, STEPS)
    assert [r.step for r in resumed.steps] == [3, 4]
    assert max_abs_diff(resumed.state_dict, ref.state_dict) < TOL
    assert max(abs(a - b) for a, b in zip(resumed.losses, ref.losses[3:], strict=True)) < TOL
    other = make_job("dp2", **{**features, "accumulate": 1})
    with pytest.raises(ValueError, match=r"optimizer\.accumulate is 1 here, 2 in the checkpoint"), \
            other.attach(harness, resume=True):
        pass


def test_an_interleaved_run_resumes_on_another_plan(harness: LocalHarness, tmp_path: Path) -> None:
    features = dict(scheduler=STEP_LR, accumulate=2, checkpoint_directory=str(tmp_path))
    first = make_job("interleaved2x2", **features)
    with first.attach(harness):
        first.fit(2)
    second = make_job("1f1b2x2", **features)  # the checkpoint is keyed by parameter name, not by stage
    with second.attach(harness, resume=True):
        resumed = second.fit(STEPS - 2)
    ref = train_reference(second, STEPS)
    assert [r.step for r in resumed.steps] == [2, 3, 4]
    assert max_abs_diff(resumed.state_dict, ref.state_dict) < TOL
