"""A coordinator process for the registry-outage tests, and the job they train.

``python -m tests.multiproc.coordinator.outage_coordinator REGISTRY JOB WORKERS``: REGISTRY is an
``etcd://`` URL, or ``serve`` to serve an embedded registry of its own (as a local run does: the
registry then dies with this process). It prints the registry's URL as its first line, waits for
WORKERS workers of JOB, then trains :func:`make_job` printing ``step`` after each step, until it is
killed.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from datetime import timedelta

from comm.registry import RegistryServer
from coordinator.planning.resources import Resources
from coordinator.runtime.cluster import ClusterWorkers
from coordinator.runtime.job import Job

__all__ = ["FACTORIES", "make_job"]

M = "tests.multiproc.coordinator.models"
FACTORIES = [f"{M}:mlp", f"{M}:regression", f"{M}:mse"]


def make_job(resources: Resources) -> Job:
    """Two data-parallel replicas of the float64 MLP, so the data plane (an all-reduce) runs every step; one
    step per request, so steps go on while the callback paces them (a window would run ahead of it)."""
    return Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="SGD",
               optimizer_kwargs={"lr": 0.05, "momentum": 0.9}, model_kwargs={"dtype": "float64"},
               data_kwargs={"dtype": "float64"}, global_batch=16, seed=5, resources=resources,
               step_timeout_s=30, data_parallel=2, num_stages=1, num_microbatches=1, steps_per_request=1,
               lease_ttl_s=3.0)  # the test's workers' lease: the coordinator's presence (etcd) lives as long


def main(argv: Sequence[str]) -> int:
    url, job_name, workers = argv[0], argv[1], int(argv[2])
    server = RegistryServer(host="127.0.0.1").start() if url == "serve" else None
    if server is not None:
        url = server.address
    print(url, flush=True)
    with ClusterWorkers(url, job_name, workers, timeout=timedelta(seconds=60)) as pool:
        job = make_job(pool.resources())
        with job.attach(pool):
            job.fit(1_000_000, callback=lambda record: print("step", flush=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
