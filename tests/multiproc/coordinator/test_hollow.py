"""32 hollow workers (``services/host/hollow.py``) in three fleet processes, driven by the real coordinator.

One fleet serves every job of the module; each job fixes its plan (data parallel, a pipeline, both)
and trains a few steps. Every step must finish with a reply from every stage of every replica, every
worker must take part, and the pipelines' stages must have moved their boundary tensors over the
real communicator, within and across the fleet's processes. A crashed worker (its lease left to
lapse, as ``kill -9`` leaves it) stops a session with ``runtime.max_restarts=0`` naming it (the last
test: that worker, of the second process, stays down).
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from datetime import timedelta

import pytest

from bench.hollow import FACTORIES, make_job, plan_fields
from coordinator.runtime.errors import JobFailed
from coordinator.runtime.records import StepRecord
from services.host.hollow import HOLLOW_LOSS
from services.host.hollow_pool import HollowPool

pytestmark = pytest.mark.timeout(120)

WORKERS = 32
PER_PROCESS = 12  # three fleet processes: 12, 12 and 8 workers
STEPS = 2


@pytest.fixture(scope="module")
def fleet() -> Iterator[HollowPool]:
    with HollowPool(WORKERS, "t-hollow", factories=FACTORIES, lease_ttl=timedelta(seconds=3),
                    per_process=PER_PROCESS) as pool:
        assert len(set(pool.pids)) == 3
        yield pool


@pytest.mark.parametrize("kind", ["dp", "pp", "both"])
def test_every_worker_answers_every_step(fleet: HollowPool, kind: str) -> None:
    job = make_job(kind, WORKERS, f"t-hollow-{kind}", step_timeout_s=30)
    fields = plan_fields(kind, WORKERS)
    services = fields["data_parallel"] * fields["num_stages"]
    assert services == WORKERS
    with job.attach(fleet):
        result = job.fit(STEPS)
    assert [r.step for r in result.steps] == list(range(STEPS))
    assert result.losses == [HOLLOW_LOSS] * STEPS
    for record in result.steps:
        assert len(record.replies) == services, f"step {record.step}: {len(record.replies)} replies"
        assert {sv.worker for sv, _ in record.replies} == set(fleet.names)
        assert {(sv.replica, sv.stage) for sv, _ in record.replies} == {
            (r, s) for r in range(fields["data_parallel"]) for s in range(fields["num_stages"])}
        for _, body in record.replies:
            assert len(body.starts) == len(body.ends) == body.num_timed > 0
            assert all(s <= e for s, e in zip(body.starts, body.ends, strict=True))
        # each worker's counters ride on its replies only when they changed; the record keeps the latest
        assert set(record.traffic) == set(fleet.names)
    if fields["num_stages"] == 1:  # nothing crossed a pipeline: each worker's counters rode on one reply
        assert sum(body.traffic is not None for r in result.steps for _, body in r.replies) == services
    sent = sum(t.bytes_sent.get("zmq", 0) for t in result.steps[-1].traffic.values())
    if fields["num_stages"] > 1:  # activations and gradients crossed the cuts over the pipelines
        assert sent > 0
    assert set(result.state_dict) == set(job.build_model().state_dict())


def test_what_a_step_leaves_in_the_coordinator_does_not_grow_with_the_workers(fleet: HollowPool) -> None:
    """A long fit keeps each step's detail for the latest steps only (runtime.detail_replies): past them a
    step leaves a few objects in the coordinator, not one reply per worker (32 here, ~8 containers each:
    291 more tracked objects a step when every step's detail is kept)."""
    job = make_job("dp", WORKERS, "t-hollow-long", step_timeout_s=30, steps_per_request=10,
                   detail_replies=2 * WORKERS)
    tracked: dict[int, int] = {}

    def census(record: StepRecord) -> None:
        if record.step in (40, 160):
            gc.collect()
            tracked[record.step] = len(gc.get_objects())

    with job.attach(fleet):
        result = job.fit(170, callback=census)
    assert [r.detailed for r in result.steps[-3:]] == [False, True, True]
    assert sum(len(r.replies) for r in result.steps) == 2 * WORKERS
    per_step = (tracked[160] - tracked[40]) / 120
    assert per_step < 8, f"{per_step:.1f} tracked objects more per step (32 workers)"


def test_a_crashed_worker_stops_the_session_naming_it(fleet: HollowPool) -> None:
    """The module's last test: the fleet's worker local-14 (its second process's) stays crashed."""
    job = make_job("dp", 16, "t-hollow-lost", step_timeout_s=30)  # on local-0..15
    with job.attach(fleet):
        job.fit(1)
        threading.Timer(0.2, fleet.crash, args=("local-14",)).start()
        with pytest.raises(JobFailed, match=r"local-14 .*lost its registry lease") as failed:
            job.fit(10_000)
    assert failed.value.worker == "local-14"
