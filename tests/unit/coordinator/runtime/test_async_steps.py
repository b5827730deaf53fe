"""Asynchronous plans: which step each replica may be sent, when a step is complete, what is refused."""

from __future__ import annotations

import re
from typing import Any

import pytest

from coordinator.planning.plan import Plan
from coordinator.planning.resources import Resources
from coordinator.runtime.async_steps import AsyncProgress, refuse_unsupported
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job
from coordinator.runtime.records import _Service
from services.protocol import StepReply


def reply(step: int, stage: int) -> StepReply:
    return StepReply(step=step, stage=stage, losses=[])


def finish(progress: AsyncProgress, replica: int, ids: list[int]) -> None:
    """Every stage of ``replica`` answers its running step (requests ``ids``, one per stage)."""
    step = progress.replicas[replica].running
    assert step is not None
    for stage, rid in enumerate(ids):
        done = progress.answered(replica, rid, _Service("w", f"s{stage}", replica, stage), reply(step, stage))
        assert (done is None) == (stage < len(ids) - 1)


def test_a_replica_is_sent_its_next_step_within_the_window_and_below_the_end() -> None:
    progress = AsyncProgress(replicas=2, staleness=2, first=5)
    assert progress.sendable(5, end=20) == [(0, 5), (1, 5)]
    progress.sent(0, 5, [1, 2], committing=False)
    progress.sent(1, 5, [3, 4], committing=False)
    assert progress.sendable(5, end=20) == []  # both busy
    finish(progress, 0, [1, 2])
    assert progress.replicas[0].uncommitted == 5 and not progress.complete(5)
    assert progress.sendable(5, end=20) == [(0, 6)]
    progress.sent(0, 6, [5, 6], committing=True)
    assert progress.replicas[0].commits == 1 and progress.replicas[0].uncommitted is None
    finish(progress, 0, [5, 6])
    progress.sent(0, 7, [7, 8], committing=True)
    finish(progress, 0, [7, 8])
    assert progress.sendable(5, end=20) == []  # step 8 > 5 + S: replica 1 still runs step 5
    assert progress.sendable(5, end=8) == []
    finish(progress, 1, [3, 4])
    assert progress.complete(5) and [len(progress.finished[5][r]) for r in (0, 1)] == [2, 2]
    assert progress.sendable(6, end=8) == [(1, 6)]  # replica 0's next step 8 is the end
    assert progress.sendable(6, end=9) == [(0, 8), (1, 6)]
    assert progress.idle()


M = "tests.multiproc.coordinator.models"


@pytest.fixture(scope="module")
def planned() -> tuple[Job, Plan]:
    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1}, global_batch=16, mode="parameter_server", staleness=1,
              data_parallel=2, num_stages=1, num_microbatches=1, resources=Resources.local(workers=2))
    return job, job.plan()


@pytest.mark.parametrize(("fields", "says"), [
    ({}, None),
    ({"scheduler": {"name": "StepLR", "kwargs": {"step_size": 2}}}, "optimizer.scheduler"),
    ({"clip_grad_norm": 1.0}, "optimizer.clip_grad_norm"),
    ({"nonfinite": "skip"}, "runtime.nonfinite: skip"),
    ({"checkpoint_directory": "/tmp/ckpt"}, "checkpoint.directory"),
    ({"eval": f"{M}:regression"}, "eval"),
])
def test_what_async_cannot_run_is_named_with_the_fix(planned: tuple[Job, Plan], fields: dict[str, Any],
                                                     says: str | None) -> None:
    _, plan = planned
    config = Job(**{**_fields(), **fields}).config
    if says is None:
        refuse_unsupported(config, plan)
        return
    with pytest.raises(JobError, match=rf"staleness=1 .*{re.escape(says)} needs .*set plan\.staleness: 0"):
        refuse_unsupported(config, plan)
    refuse_unsupported(config, plan.model_copy(update={"staleness": 0, "mode": "parameter_server"}))


def test_fp16_is_refused(planned: tuple[Job, Plan]) -> None:
    _, plan = planned
    with pytest.raises(JobError, match=r"plan\.precision: fp16"):
        refuse_unsupported(planned[0].config, plan.model_copy(update={"precision": "fp16"}))


def _fields() -> dict[str, Any]:
    return dict(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
                optimizer_kwargs={"lr": 0.1}, global_batch=16, mode="parameter_server", staleness=1,
                data_parallel=2, num_stages=1, num_microbatches=1)
