"""With no restarts left (``runtime.max_restarts=0``), a worker killed with -9 mid-step ends the job within
the lease time, naming the worker; nothing is left. (Surviving it is ``test_recovery.py``.)"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobFailed
from coordinator.runtime.factories import job_factories
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job

pytestmark = pytest.mark.timeout(90)

M = "tests.multiproc.coordinator.models"
LEASE = timedelta(seconds=6)  # the killed worker's card goes with its process; the survivor's must hold
STOP_WITHIN_S = 5.0  # from the kill until the job stops naming it


@pytest.mark.parametrize("plan", [dict(data_parallel=1, num_stages=2, num_microbatches=2, balance=[3, 4]),
                                  dict(data_parallel=2, num_stages=1, num_microbatches=1)])
def test_worker_killed_mid_step_stops_the_job_naming_it(plan: dict[str, object], tmp_path: Path) -> None:
    job = Job(model=f"{M}:slow_mlp", model_kwargs={"seconds": 0.3}, loss=f"{M}:mse", data=f"{M}:regression",
              global_batch=16, resources=Resources.local(2), step_timeout_s=60,
              lease_ttl_s=LEASE.total_seconds(), max_restarts=0, steps_per_request=1,  # the callback paces
              **plan)  # type: ignore[arg-type]
    # the killed worker's log is kept (it did not exit cleanly): in the test's directory, not the host's
    harness = LocalHarness(["local-0", "local-1"], job="t-faults", lease_ttl=LEASE,
                           factories=job_factories(job.config), log_dir=tmp_path)
    killed_at: list[float] = []

    def kill_mid_step(record: object) -> None:
        if not killed_at:  # after step 0: the kill lands inside step 1, during a 0.3 s forward
            threading.Timer(0.15, lambda: (killed_at.append(time.monotonic()),
                                           harness.kill("local-1", signal.SIGKILL))).start()

    failed: JobFailed | None = None
    with harness:
        with job.attach(harness):
            try:
                job.fit(100, callback=kill_mid_step)
            except JobFailed as exc:
                failed, stopped = exc, time.monotonic() - killed_at[0]
            teardown = time.monotonic()
        released = time.monotonic() - teardown
    assert failed is not None, "the job did not fail"
    message = str(failed)
    assert failed.worker == "local-1" and "local-1" in message, message
    assert failed.step == 1 and "step 1" in message, message
    assert failed.service.endswith(("compute-r0-s1", "compute-r1-s0")), message
    assert stopped < STOP_WITHIN_S, f"the job took {stopped:.1f}s to stop: {message}"
    assert released < 5, f"releasing the survivors' services took {released:.1f}s"
    assert all(p.poll() is not None for p in harness.procs.values()), "a worker outlived the harness"
