"""The coordinator's metrics sum the job's traffic: every worker's latest counters and its own process's."""

from __future__ import annotations

import re

from prometheus_client import generate_latest

from comm.traffic import TrafficCounts, snapshot
from coordinator.commands.metrics import RunMetrics
from coordinator.runtime.records import StepRecord


def _record(step: int, traffic: dict[str, TrafficCounts]) -> StepRecord:
    return StepRecord(step=step, loss=0.5, num_samples=8, start=0.0, end=1.0, coordinator_s=0.0,
                      traffic=traffic)


def _series(body: str, name: str, label: str, value: str) -> float:
    match = re.search(rf'^{name}{{{label}="{re.escape(value)}"}} (\S+)$', body, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_the_job_traffic_is_every_workers_latest_plus_the_coordinators_own() -> None:
    metrics = RunMetrics()
    w1 = TrafficCounts(bytes_sent={"zmq": 100}, refused_frames={"data/size": 2})
    metrics.observe(_record(0, {"w0": TrafficCounts(bytes_sent={"zmq": 100}), "w1": w1}))
    # step 1: w0's counts grew; w1 did not report (its counts stay as last reported)
    metrics.observe(_record(1, {"w0": TrafficCounts(bytes_sent={"zmq": 250, "gloo": 8},
                                                    refused_connections={"a key that is not the job's": 1})}))
    own = snapshot()  # nothing in this test sends or refuses in between
    body = generate_latest(metrics.registry).decode()

    def beyond_own(name: str, label: str, value: str, mine: dict[str, int]) -> float:
        return _series(body, name, label, value) - mine.get(value, 0)

    assert beyond_own("cellmesh_bytes_sent_total", "backend", "zmq", dict(own.bytes_sent)) == 350
    assert beyond_own("cellmesh_bytes_sent_total", "backend", "gloo", dict(own.bytes_sent)) == 8
    assert beyond_own("cellmesh_refused_frames_total", "reason", "data/size", own.refused_frames) == 2
    assert beyond_own("cellmesh_refused_connections_total", "reason", "a key that is not the job's",
                      own.refused_connections) == 1
    assert "# TYPE cellmesh_bytes_sent_total counter" in body
