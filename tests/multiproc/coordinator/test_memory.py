"""A worker's memory cap, and the planner's predicted peak per worker against the measured one.

The cap (``--memory-limit``, [Note: the memory cap] in ``comm/memcap.py``): a step whose allocation
goes past it fails naming the worker, the cap and the action, and the job stops at once.
The prediction: ``Plan.stages[s].peak_memory_bytes`` (``coordinator/planning/memory.py``) against
``StepReply.peak_bytes`` (the worker's peak resident bytes since the stage's assignment) on a
16 MiB float32 MLP trained with Adam on 2 workers.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobFailed
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job

pytestmark = pytest.mark.timeout(180)

M = "tests.multiproc.coordinator.models"
W = "tests.multiproc.coordinator.memory_models"
MiB = 1 << 20
TOLERANCE = 0.2  # measured within 20% of predicted
WIDTH = 2048  # 4 x 16 MiB layers: 64 MiB of parameters


def make_job(width: int, depth: int, **plan: Any) -> Job:
    return Job(model=f"{W}:wide_mlp", model_kwargs={"width": width, "depth": depth}, loss=f"{M}:mse",
               data=f"{M}:regression", data_kwargs={"dtype": "float32"}, optimizer="Adam",
               optimizer_kwargs={"lr": 1e-3}, global_batch=16, seed=3,
               resources=Resources.local(2, memory_bytes=8 << 30), step_timeout_s=60,
               data_parallel=2, num_stages=1, num_microbatches=1, **plan)


def factories() -> list[str]:
    return [f"{W}:wide_mlp", f"{M}:mse", f"{M}:regression"]


def test_an_allocation_beyond_the_cap_fails_the_step_naming_worker_and_cap() -> None:
    """64 MiB of parameters under a 256 MiB cap: with their gradients and Adam's moments they do not fit."""
    cap = 256 * MiB
    names = ["local-0", "local-1"]
    with LocalHarness(names, job="t-memcap", lease_ttl=timedelta(seconds=2), factories=factories(),
                      memory_limits=dict.fromkeys(names, cap)) as harness:
        job = make_job(2048, 4)
        started = time.monotonic()
        with job.attach(harness), pytest.raises(JobFailed) as failed:
            job.fit(2)
        message = str(failed.value)
        assert "out_of_memory" in message and f"--memory-limit {cap}" in message, message
        assert "worker local-" in message and "can't allocate memory" in message, message
        assert "step" in message and "Fix:" in message, message
        assert not failed.value.lost  # a refusal: the worker lives on, nothing to replace
        assert time.monotonic() - started < 60
        assert all(p.poll() is None for p in harness.procs.values())


# Measured (2 workers, 64 MiB of float32 parameters, Adam, batch 16): the replicated plan peaks at
# 495 MiB against 289 MiB predicted (1.71; 1.99 before the optimizer step's temporaries were counted),
# ZeRO-1 at 2.2-2.4 x. Not counted yet: ~43 MiB the runtime maps after the assignment (communicators,
# threads), the gradient bucket in flight, and under ZeRO-1/2 the commit's all-gather buffer and the
# shard copies of parameters and gradients the sharded optimizer steps. At 130-200 M parameters the
# replicated plan is within 8% (bench/largest.py), ZeRO-1 is not (1.5 x).
@pytest.mark.xfail(strict=True, reason="the planner's memory model misses the runtime's fixed bytes and the "
                                       "sharded paths' buffers (see above)")
@pytest.mark.parametrize("plan", [{}, {"zero": 1}], ids=["replicated", "zero1"])  # the rest: bench/largest.py
def test_predicted_peak_is_within_20_percent_of_the_measured(plan: dict[str, Any]) -> None:
    extra = {"shard_factor": 2} if plan.get("zero") else {}
    job = make_job(WIDTH, 4, **plan, **extra)
    names = ["local-0", "local-1"]
    with LocalHarness(names, job="t-mempeak", lease_ttl=timedelta(seconds=2), factories=factories()) as h, \
            job.attach(h):
        result = job.fit(3)
    assert result.plan is not None
    predicted = result.plan.stages[0].peak_memory_bytes
    measured = [max(body.peak_bytes or 0 for step in result.steps for r, body in step.replies
                    if r.replica == k) for k in range(2)]
    ratios = [m / predicted for m in measured]
    print(f"{plan}: predicted {predicted / MiB:.1f} MiB ({result.plan.stages[0].memory.text()}), measured "
          f"{[round(m / MiB, 1) for m in measured]} MiB, ratio {[round(r, 3) for r in ratios]}")
    assert all(abs(r - 1) <= TOLERANCE for r in ratios), ratios
