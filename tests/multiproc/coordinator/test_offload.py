"""CPU offload of the optimizer (``plan.offload``) trains to the parameters one process reaches (float64, 5
steps): plain data parallelism and ZeRO 1, 2 and 3 on 2 workers, SGD with momentum and AdamW.

One harness of two worker processes serves every job. The workers run on the CPU, where offload saves
nothing (the driver warns) but still runs: the optimizer steps a separate host copy of what it would step
(``services/params/offload.py``), which each replica's held bytes show. Where torch has CUDA the path
runs on a GPU too, its masters pinned in host memory (skipped without, as ``test_devices_cuda.py``). The
jobs and the comparison are ``test_zero.py``'s; the model is its ``mixed`` one (dim 0 of 7, 5 and 3, a
0-dim scale and a frozen one).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from coordinator.planning.resources import Resources, Worker
from coordinator.runtime.errors import JobError
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from tests.multiproc.coordinator.test_zero import STEPS, TOL64, M, Z, dp, fit_and_compare, make_job

pytestmark = pytest.mark.timeout(120)

WARNING = "plan.offload saves no memory on CPU workers"
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="requires 2 CUDA devices")


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:{name}" for name in ("mlp", "regression", "mse")] + [f"{Z}:mixed"]
    with LocalHarness(["local-0", "local-1"], job="t-offload", lease_ttl=timedelta(seconds=5),
                      factories=factories) as h:
        yield h


def offloaded(zero: int, **fields: Any) -> dict[str, Any]:
    return dp(zero, 2) | dict(offload=True) | fields


def held(result: FitResult) -> list[int]:
    return [body.held_bytes or 0 for _, body in sorted(result.steps[-1].replies, key=lambda r: r[0].replica)]


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_offloaded_steps_match_one_process(harness: LocalHarness, caplog: pytest.LogCaptureFixture,
                                           zero: int, optimizer: str) -> None:
    caplog.set_level(logging.WARNING, logger="coordinator.runtime.driver")
    result = fit_and_compare(harness, make_job("mixed", optimizer, **offloaded(zero)))
    assert result.plan is not None and (result.plan.offload, result.plan.zero_stage) == (True, zero)
    assert any(WARNING in r.getMessage() for r in caplog.records), "no warning that offload saves nothing"


def test_the_host_copy_is_a_copy(harness: LocalHarness) -> None:
    """Each replica holds its masters (float64: 8 bytes per element of its rows) on top of what the same
    plan holds without offload: the optimizer steps a copy, not the parameters themselves."""
    model = make_job("mlp", "adamw", **dp(0, 2)).build_model()
    params = sum(p.numel() * 8 for p in model.parameters())
    figures: dict[tuple[int, bool], list[int]] = {}
    for zero in (0, 2):
        for offload in (False, True):
            job = make_job("mlp", "adamw", **dp(zero, 2) | dict(offload=offload))
            with job.attach(harness):
                figures[zero, offload] = held(job.fit(2))
    print(f"parameters {params} B; held bytes per replica (zero, offload): {figures}")
    assert [b - a for a, b in zip(figures[0, False], figures[0, True], strict=True)] == [params] * 2
    extra = [b - a for a, b in zip(figures[2, False], figures[2, True], strict=True)]
    assert sum(extra) == params and all(abs(e - params / 2) <= 8 * 12 for e in extra), extra


def test_a_checkpoint_of_offloaded_state_resumes_without_offload_and_back(harness: LocalHarness,
                                                                          tmp_path: Path) -> None:
    """Saved under offload and ZeRO-2, resumed as plain data parallelism, then offloaded under ZeRO-3: the
    optimizer's state (AdamW's moments) travels by parameter name, so the run ends as one process's."""
    ckpt = tmp_path / "ckpt"

    def job(**plan: Any) -> Job:
        return make_job("mixed", "adamw", checkpoint_directory=str(ckpt), checkpoint_keep=10, **plan)

    with job(**offloaded(2)).attach(harness) as first:
        first.fit(2)
    with job(**dp(0, 2)).attach(harness, resume=True) as second:
        assert [r.step for r in second.fit(2).steps] == [2, 3]
    third = job(**offloaded(3))
    with third.attach(harness, resume=True):
        final = third.fit(STEPS - 4)
    assert [r.step for r in final.steps] == [4]
    ref = train_reference(third, STEPS)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL64


def test_offload_in_parameter_server_mode_is_refused_naming_the_fix(harness: LocalHarness) -> None:
    job = make_job("mlp", "sgd", data_parallel=2, num_stages=1, num_microbatches=1, mode="parameter_server",
                   offload=True)
    refused = r"parameter-server mode the shards run the optimizer.*drop plan\.offload"
    with pytest.raises(JobError, match=refused), job.attach(harness):
        job.fit(1)


def gpu(name: str) -> Worker:
    return Worker(name=name, device="cuda", gpus=1, memory_bytes=1 << 30, host="this-host")


@needs_cuda
@pytest.mark.gpu
def test_a_gpu_replica_steps_on_the_host_as_one_process(harness: LocalHarness) -> None:
    """A GPU worker (its moments and masters in pinned host memory) and a CPU one under ZeRO-2 over zmq."""
    job = make_job("mixed", "adamw", **offloaded(2))
    job.resources = Resources(workers=(gpu("local-0"), Worker(name="local-1", memory_bytes=1 << 30,
                                                              host="this-host")))
    result = fit_and_compare(harness, job)
    assert result.plan is not None and result.plan.offload


@two_gpus
@pytest.mark.gpu
def test_two_gpus_offload_under_zero3_over_nccl_and_checkpoint_by_name(harness: LocalHarness,
                                                                       tmp_path: Path) -> None:
    """The state's gather for the checkpoint moves the host's rows to the GPU for NCCL."""
    def job(**plan: Any) -> Job:
        made = make_job("mixed", "adamw", checkpoint_directory=str(tmp_path / "ckpt"), checkpoint_keep=10,
                        **plan)
        made.resources = Resources(workers=(gpu("local-0"), gpu("local-1")))
        return made

    with job(**offloaded(3)).attach(harness) as first:
        first.fit(3)
    last = job(**dp(0, 2))
    with last.attach(harness, resume=True):
        final = last.fit(STEPS - 3)
    ref = train_reference(last, STEPS)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL64
