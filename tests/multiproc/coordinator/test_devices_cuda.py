"""The invariant on GPUs: pipelines and data parallelism on CUDA, over NCCL and staged through the CPU, train
to the parameters one process reaches (float64, < 1e-9 after 5 steps).

Skipped where torch has no CUDA (and the two-GPU cases where there is one GPU). One harness of two worker
processes serves every job; without a ``LOCAL_RANK`` of their own, ``local-i`` runs on ``cuda:i``
(coordinator/planning/devices.py). The backends a job used are read from the bytes each sent.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from coordinator.planning.resources import Resources, Worker
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(180),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]
two_gpus = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2,
                              reason="requires 2 CUDA devices")

M = "tests.multiproc.coordinator.models"
STEPS = 5
TOL64 = 1e-9
NAMES = ["local-0", "local-1"]


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    with LocalHarness(NAMES, job="t-devices-cuda", lease_ttl=timedelta(seconds=6),
                      factories=[f"{M}:{name}" for name in ("mlp", "regression", "mse")]) as h:
        yield h


def gpu(name: str) -> Worker:
    return Worker(name=name, device="cuda", gpus=1, memory_bytes=1 << 30, host="this-host")


def cpu(name: str) -> Worker:
    return Worker(name=name, memory_bytes=1 << 30, host="this-host")


def fit_and_compare(harness: LocalHarness, resources: Resources, **fields: Any) -> dict[str, int]:
    """Train, compare with one process (on the CPU), and return the bytes each backend carried."""
    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="Adam",
              optimizer_kwargs={"lr": 0.01}, global_batch=16, seed=5, resources=resources, step_timeout_s=60,
              **fields)
    with job.attach(harness):
        result: FitResult = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL64, f"{job.plan().summary()}: max abs diff {diff:.3g}"
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"
    first, last = result.steps[0].traffic, result.steps[-1].traffic
    return {b: sum(last[w].bytes_sent.get(b, 0) - first[w].bytes_sent.get(b, 0) for w in last)
            for b in ("zmq", "gloo", "nccl")}


@two_gpus
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_two_stage_pipeline_on_two_gpus_over_nccl(harness: LocalHarness, schedule: str) -> None:
    sent = fit_and_compare(harness, Resources(workers=(gpu("local-0"), gpu("local-1"))), data_parallel=1,
                           num_stages=2, num_microbatches=4, schedule=schedule)
    assert sent["nccl"] > 0 and sent["zmq"] == sent["gloo"] == 0, sent


@two_gpus
@pytest.mark.parametrize("mode", ["collective", "parameter_server"])
def test_two_way_data_parallel_on_two_gpus(harness: LocalHarness, mode: str) -> None:
    sent = fit_and_compare(harness, Resources(workers=(gpu("local-0"), gpu("local-1"))), data_parallel=2,
                           num_stages=1, num_microbatches=2, mode=mode)
    if mode == "collective":  # the gradients are averaged over NCCL; the parameter server's travel over rpc
        assert sent["nccl"] > 0 and sent["zmq"] == sent["gloo"] == 0, sent


@two_gpus
def test_gpus_in_a_cpu_backends_groups_stage_through_host_memory(harness: LocalHarness) -> None:
    sent = fit_and_compare(harness, Resources(workers=(gpu("local-0"), gpu("local-1"))), data_parallel=2,
                           num_stages=1, num_microbatches=2, comm_backend="gloo")
    assert sent["gloo"] > 0 and sent["nccl"] == 0, sent


@pytest.mark.parametrize("plan", [dict(data_parallel=1, num_stages=2, num_microbatches=4),
                                  dict(data_parallel=2, num_stages=1, num_microbatches=2)],
                         ids=["pipeline", "data_parallel"])
def test_a_gpu_and_a_cpu_worker_train_together_through_zmq(harness: LocalHarness,
                                                           plan: dict[str, int]) -> None:
    sent = fit_and_compare(harness, Resources(workers=(gpu("local-0"), cpu("local-1"))), **plan)
    assert sent["zmq"] > 0 and sent["nccl"] == sent["gloo"] == 0, sent
