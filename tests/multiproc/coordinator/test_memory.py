"""A worker's memory cap, and the planner's predicted peak per worker against the measured one.

The cap (``--memory-limit``, [Note: the memory cap] in ``comm/memcap.py``): a step whose allocation
goes past it fails naming the worker, the cap and the action, and the job stops at once.
The prediction: ``Plan.stages[s].peak_memory_bytes`` (``coordinator/planning/memory.py``) against
``StepReply.peak_bytes`` (the worker's peak resident bytes since the stage's assignment) on an MLP
whose one 4096 x 4096 float32 layer holds 64 MiB, trained with Adam on 2 workers, replicated and under
ZeRO-1, 2 and 3: each worker within 20% of the prediction.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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
# one 64 MiB layer: above the 32 MiB mmap threshold of comm/allocator.py, so a freed tensor leaves the
# process (below it the heap keeps every phase's transients: [Note: what the model does not see])
WIDTH, DEPTH = 4096, 1


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
    with LocalHarness(names, job="t-memcap", lease_ttl=timedelta(seconds=6), factories=factories(),
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


# Measured (2 workers under load, 64 MiB of float32 parameters in one layer, Adam, batch 16), worker peak /
# prediction: replicated 1.03 (537 / 519 MiB), ZeRO-1 0.92 (449 / 487), ZeRO-2 1.09 (498 / 455), ZeRO-3 1.02
# (531 / 519); with the all-gather behind the forward (2026-11-28): ZeRO-1 0.92 (390-394 / 423), ZeRO-2 1.07
# (453 / 423), ZeRO-3 0.94 (486-487 / 519). The same 64 MiB in four 16 MiB layers peaked at 462-579 MiB
# whatever the plan (1.3-1.6 x replicated and ZeRO-1/2, 2.0 x ZeRO-3): the heap keeps those layers'
# transients. Since workers load torch._dynamo at start (2026-11-29; the runtime's bytes 38 -> 11 MiB), one
# harness: replicated 0.96 (378 / 395, the first plan, with the runtime), ZeRO-1 0.90 (355 / 395), ZeRO-2 0.97
# (322 / 331), ZeRO-3 1.16 (420 / 363); the later plans' peaks lack the runtime's 11 MiB.
PLANS = {"replicated": {}, "zero1": {"zero": 1}, "zero2": {"zero": 2}, "zero3": {"zero": 3}}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    """One pair of workers for every plan: each assignment's probe starts after ``malloc_trim`` handed the
    previous job's freed heap back, but the runtime's own bytes stay, so only the first plan measures them
    (the later ones come out about 11 MiB lower)."""
    with LocalHarness(["local-0", "local-1"], job="t-mempeak", lease_ttl=timedelta(seconds=6),
                      factories=factories()) as h:
        yield h


@pytest.mark.parametrize("plan", list(PLANS.values()), ids=list(PLANS))
def test_predicted_peak_is_within_20_percent_of_the_measured(harness: LocalHarness,
                                                             plan: dict[str, Any]) -> None:
    extra = {"shard_factor": 2} if plan.get("zero") else {}
    job = make_job(WIDTH, DEPTH, **plan, **extra)
    with job.attach(harness):
        result = job.fit(2)  # the peak: the second step, after the first commit built the optimizer's state
    assert result.plan is not None
    predicted = result.plan.stages[0].peak_memory_bytes
    assert result.plan.stages[0].memory.runtime > 0  # measured (coordinator/planning/runtime_bytes.py)
    measured = [max(body.peak_bytes or 0 for step in result.steps for r, body in step.replies
                    if r.replica == k) for k in range(2)]
    ratios = [m / predicted for m in measured]
    print(f"{plan}: predicted {predicted / MiB:.1f} MiB ({result.plan.stages[0].memory.text()}), measured "
          f"{[round(m / MiB, 1) for m in measured]} MiB, ratio {[round(r, 3) for r in ratios]}")
    assert all(abs(r - 1) <= TOLERANCE for r in ratios), ratios
