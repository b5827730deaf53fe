"""The asynchronous parameter server (``plan.staleness > 0``): exact alone, bounded and ahead together.

* One replica: each push applied on arrival is sequential SGD, so the run equals one process
  training on the same batches (``train_reference``, float64, < 1e-9), on one stage and on two.
* Two replicas, worker ``local-1`` slowed (its forwards sleep): the replica it hosts falls behind,
  the other runs ahead (its step ``k + 1`` starts before the slow one's step ``k`` ends), and no
  pull is served to a replica more than ``S`` steps ahead of the slowest (each step reply's ``lead``:
  the shards' clocks as they served its pull).
* The demo model (``examples/charlm.py``, made small): asynchronous training's loss after N steps
  is within a stated factor of synchronous training's.

One harness of two worker processes serves every job of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobError
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from tests.multiproc.coordinator.async_models import DELAY_ENV

pytestmark = pytest.mark.timeout(240)

M = "tests.multiproc.coordinator.models"
A = "tests.multiproc.coordinator.async_models"
C = "examples.charlm"
SLOW_WORKER, DELAY_S = "local-1", 0.25
TOL = 1e-9


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{A}:slowed_mlp", f"{M}:mlp", f"{M}:regression", f"{M}:mse", f"{C}:model", f"{C}:data",
                 f"{C}:loss"]
    with LocalHarness(["local-0", "local-1"], job="t-async", lease_ttl=timedelta(seconds=6),
                      factories=factories, worker_env={SLOW_WORKER: {DELAY_ENV: str(DELAY_S)}}) as h:
        yield h


def mlp_job(staleness: int, **plan: Any) -> Job:
    workers = plan.pop("workers", 2)
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
               optimizer_kwargs={"lr": 0.05, "momentum": 0.9}, global_batch=16, seed=4,
               mode="parameter_server", staleness=staleness, resources=Resources.local(workers=workers),
               step_timeout_s=30, **plan)


@pytest.mark.parametrize("plan", [dict(data_parallel=1, num_stages=1, num_microbatches=2, workers=1),
                                  dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b")],
                         ids=["one-stage", "two-stages"])
def test_one_asynchronous_replica_trains_as_one_process(harness: LocalHarness, plan: dict[str, Any]) -> None:
    job = mlp_job(2, **plan)
    with job.attach(harness):
        result = job.fit(5)
    assert result.plan is not None and result.plan.staleness == 2 and result.plan.data_parallel == 1
    ref = train_reference(job, 5)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"max abs diff {diff:.3g} from one process"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-12


def replica_times(result: FitResult, replica: int) -> list[tuple[float, float]]:
    """Each step's (first action's start, last action's end) on ``replica``, over its stages."""
    out = []
    for record in result.steps:
        mine = [body for sv, body in record.replies if sv.replica == replica]
        out.append((min(min(b.starts) for b in mine), max(max(b.ends) for b in mine)))
    return out


@pytest.mark.parametrize("staleness", [1, 2])
def test_a_fast_replica_runs_ahead_within_the_bound(harness: LocalHarness, staleness: int) -> None:
    steps = 8
    job = Job(model=f"{A}:slowed_mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
              optimizer_kwargs={"lr": 0.05}, global_batch=16, seed=4, mode="parameter_server",
              staleness=staleness, data_parallel=2, num_stages=1, num_microbatches=1,
              resources=Resources.local(workers=2), step_timeout_s=30)
    with job.attach(harness):
        result = job.fit(steps)
    plan = result.plan
    assert plan is not None and plan.data_parallel == 2 and plan.staleness == staleness
    slow = next(r for r in range(2) if plan.placement[r][0] == SLOW_WORKER)
    fast = 1 - slow
    leads = {r: [body.lead for record in result.steps for sv, body in record.replies if sv.replica == r]
             for r in range(2)}
    assert leads[fast][0] is None and leads[slow][0] is None  # step 0 applies no commit
    seen = [lead for r in range(2) for lead in leads[r][1:]]
    assert all(lead is not None and 0 <= lead <= staleness for lead in seen), leads
    assert max(leads[fast][1:]) == staleness, leads  # it ran as far ahead as the bound lets it
    fast_times, slow_times = replica_times(result, fast), replica_times(result, slow)
    ahead = [k for k in range(steps - 1) if fast_times[k + 1][0] < slow_times[k][1]]
    assert len(ahead) >= steps // 2, (ahead, fast_times, slow_times)
    # the slow replica's steps take the delay; the fast one's far less
    assert slow_times[-1][1] - slow_times[-1][0] >= DELAY_S
    assert all(abs(v) < 1e3 for v in result.losses)


def charlm_job(staleness: int) -> Job:
    return Job(model=f"{C}:model", data=f"{C}:data", loss=f"{C}:loss", optimizer="AdamW",
               optimizer_kwargs={"lr": 3e-3, "weight_decay": 0.01}, global_batch=16, seed=0,
               model_kwargs={"width": 32, "heads": 2, "blocks": 1}, mode="parameter_server",
               staleness=staleness, data_parallel=2, num_stages=1, num_microbatches=1,
               resources=Resources.local(workers=2), step_timeout_s=60)


CONVERGENCE_STEPS = 30
CONVERGENCE_FACTOR = 1.25  # async's mean loss over the last 5 steps at most this times sync's


def test_asynchronous_training_of_the_demo_model_converges_as_sync_does(harness: LocalHarness) -> None:
    """Asynchronous SGD steps on each replica's half batch, with stale values: its loss after N steps
    stays within :data:`CONVERGENCE_FACTOR` of sync's, and both fell well below the start."""
    losses = {}
    for staleness in (0, 2):
        job = charlm_job(staleness)
        with job.attach(harness):
            losses[staleness] = job.fit(CONVERGENCE_STEPS).losses
    sync, asynchronous = (sum(losses[s][-5:]) / 5 for s in (0, 2))
    assert sync < 0.8 * losses[0][0] and asynchronous < 0.8 * losses[2][0], losses
    assert asynchronous < CONVERGENCE_FACTOR * sync, (asynchronous, sync)


@pytest.mark.parametrize(("extra", "says"), [
    (dict(scheduler={"name": "StepLR", "kwargs": {"step_size": 2}}), "optimizer.scheduler"),
    (dict(nonfinite="skip"), "runtime.nonfinite: skip"),
    (dict(clip_grad_norm=1.0), "optimizer.clip_grad_norm"),
    (dict(checkpoint_directory="/nonexistent/ckpt"), "checkpoint.directory"),
])
def test_what_async_cannot_run_is_refused_with_the_fix(harness: LocalHarness, extra: dict[str, Any],
                                                       says: str) -> None:
    job = mlp_job(1, data_parallel=2, num_stages=1, num_microbatches=1, **extra)
    with pytest.raises(JobError, match=rf"{says}.*set plan\.staleness: 0"), job.attach(harness):
        job.fit(1)
