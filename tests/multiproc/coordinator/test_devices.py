"""Devices and backends on CPU workers: ``auto`` picks zmq, a backend named per group is the one used, a stage
asked onto a GPU a worker does not have is refused before any step; each training run matches one process.

One harness of four worker processes serves every job (``Job.attach``); the backends a job used are read
from the bytes each sent (the step records' traffic counters, ``comm/traffic.py``) between its first step
and its last.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.resources import Resources, Worker
from coordinator.runtime.errors import JobFailed
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
STEPS = 5
TOL64 = 1e-9
NAMES = [f"local-{i}" for i in range(4)]


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    with LocalHarness(NAMES, job="t-devices", lease_ttl=timedelta(seconds=6),
                      factories=[f"{M}:{name}" for name in ("mlp", "regression", "mse")]) as h:
        yield h


def make_job(resources: Resources | None = None, **fields: Any) -> Job:
    """Two replicas of a two-stage pipeline: both kinds of group talk every step. One step per request:
    the bytes are read from the first and the last step's records (a window's records share its end's)."""
    fields = {"steps_per_request": 1, **fields}
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="Adam",
               optimizer_kwargs={"lr": 0.01}, global_batch=16, seed=5, data_parallel=2, num_stages=2,
               num_microbatches=2, resources=resources or Resources.local(workers=4), step_timeout_s=30,
               **fields)


def sent(result: FitResult) -> dict[str, int]:
    """Bytes each backend carried over all workers between the first step's end and the last's."""
    first, last = result.steps[0].traffic, result.steps[-1].traffic
    return {backend: sum(last[w].bytes_sent.get(backend, 0) - first[w].bytes_sent.get(backend, 0)
                         for w in last) for backend in ("zmq", "gloo", "nccl")}


def fit_and_compare(harness: LocalHarness, job: Job) -> FitResult:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL64, f"{job.plan().summary()}: max abs diff {diff:.3g}"
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"
    return result


def test_auto_picks_zmq_on_cpu_workers_and_trains_like_one_process(harness: LocalHarness) -> None:
    job = make_job()
    assert job.config.runtime.comm_backend == "auto" and job.config.runtime.device == "auto"
    assert {d for st in job.plan().stages for d in st.devices} == {"cpu"}
    bytes_sent = sent(fit_and_compare(harness, job))
    assert bytes_sent["zmq"] > 0 and bytes_sent["gloo"] == bytes_sent["nccl"] == 0, bytes_sent


def test_a_backend_named_per_group_is_the_one_each_group_uses(harness: LocalHarness) -> None:
    def backends(**fields: Any) -> dict[str, int]:
        return sent(fit_and_compare(harness, make_job(**fields)))

    gloo_pipes = backends(pipeline_backend="gloo", data_parallel_backend="zmq")
    zmq_pipes = backends(comm_backend="gloo", pipeline_backend="zmq")  # the data-parallel groups: gloo
    # per step, activations and gradients cross the cuts (pipelines), gradients are averaged (groups)
    assert gloo_pipes["gloo"] > 0 and gloo_pipes["zmq"] > 0 and gloo_pipes["nccl"] == 0, gloo_pipes
    assert (zmq_pipes["gloo"], zmq_pipes["zmq"]) == (gloo_pipes["zmq"], gloo_pipes["gloo"]), (gloo_pipes,
                                                                                              zmq_pipes)


def test_a_stage_put_on_a_gpu_its_worker_lacks_is_refused_or_runs_on_the_cpu(harness: LocalHarness) -> None:
    host = "this-host"
    listed = Resources(workers=tuple(Worker(name=n, device="cuda", gpus=1, memory_bytes=1 << 30, host=host)
                                     for n in NAMES))  # GPUs these workers' torch does not see
    job = make_job(listed, device="cuda")
    assert {d for st in job.plan().stages for d in st.devices} == {"cuda"} and " cuda  " in str(job.plan())
    with pytest.raises(JobFailed, match=r"placing the stages: worker local-\d: runtime.device is 'cuda' but "
                                        r"its process sees no CUDA device") as failed, job.attach(harness):
        job.fit(STEPS)
    assert failed.value.step is None  # before any step
    bytes_sent = sent(fit_and_compare(harness, make_job(listed)))  # auto: the CPU, with zmq
    assert bytes_sent["zmq"] > 0 and bytes_sent["gloo"] == bytes_sent["nccl"] == 0, bytes_sent
