"""The coordinator's Prometheus metrics, defined once (``cellmesh coordinator`` and ``cellmesh run``).

``cellmesh coordinator --metrics-port P`` (pod mode, ``coordinator/commands/server.py``) and
``cellmesh run --metrics-port P`` (a local run, ``coordinator/commands/output.py``) both
serve a :class:`RunMetrics` registry through :class:`~services.host.health.HealthServer`'s
``/metrics``; each finished step updates it through :meth:`RunMetrics.observe`.

====================================== ===============================================================
``cellmesh_step``                      steps finished
``cellmesh_steps``                     steps the job trains
``cellmesh_loss``                      loss of the last finished step
``cellmesh_samples_per_second``        samples per second of the last step
``cellmesh_step_seconds``              histogram of the steps' wall time
``cellmesh_coordinator_seconds``       the coordinator's own time in the last step
``cellmesh_workers``                   workers the job trains on
``cellmesh_done``                      1 once the final state_dict is written
``cellmesh_eval_loss``                 mean loss over the held-out samples at the last evaluation
``cellmesh_eval_metric``               mean metric over the held-out samples at the last evaluation
``cellmesh_eval_step``                 steps done at the last evaluation
``cellmesh_bytes_sent_total``          tensor bytes sent, by ``backend`` (``zmq``, ``gloo``, ``nccl``)
``cellmesh_refused_frames_total``      messages from peers refused, by ``reason``
``cellmesh_refused_connections_total`` handshakes refused, by ``reason``
====================================== ===============================================================

The ``eval`` gauges appear at a job's first evaluation (``coordinator/runtime/evaluation.py``;
``cellmesh_eval_metric`` if it has a metric). The last three are the job's traffic: the sum of
every worker's latest counters (each reports its process's with its step replies, kept on
``StepRecord.traffic``) and the coordinator process's own, read at scrape time. Their names and meaning are
:class:`~services.host.health.TrafficCollector`'s, which a worker's own ``/metrics`` shows
for its process alone.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Gauge, Histogram

from comm.traffic import TrafficCounts, snapshot, total
from coordinator.runtime.records import StepRecord
from services.host.health import TrafficCollector

__all__ = ["STEP_SECONDS_BUCKETS", "RunMetrics", "samples_per_second"]

STEP_SECONDS_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


def samples_per_second(record: StepRecord) -> float:
    """The step's own throughput: its samples over its wall time."""
    return record.num_samples / max(record.seconds, 1e-9)


class RunMetrics:
    """The metrics of one training run, in a registry of their own (:attr:`registry`)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.step = Gauge("cellmesh_step", "Steps finished", registry=r)
        self.steps = Gauge("cellmesh_steps", "Steps the job trains", registry=r)
        self.loss = Gauge("cellmesh_loss", "Loss of the last finished step", registry=r)
        self.samples_per_s = Gauge("cellmesh_samples_per_second", "Samples per second of the last step",
                                   registry=r)
        self.workers = Gauge("cellmesh_workers", "Workers the job trains on", registry=r)
        self.done = Gauge("cellmesh_done", "1 once the final state_dict is written", registry=r)
        self.step_seconds = Histogram("cellmesh_step_seconds", "Wall time of a step", registry=r,
                                      buckets=STEP_SECONDS_BUCKETS)
        self.coordinator_seconds = Gauge("cellmesh_coordinator_seconds",
                                         "Coordinator's own time in the last step", registry=r)
        self._eval: dict[str, Gauge] = {}  # made at the first evaluation: a job without one shows none
        self.workers_traffic: dict[str, TrafficCounts] = {}  # each worker's latest, replaced per step
        r.register(TrafficCollector(self.traffic))

    def traffic(self) -> TrafficCounts:
        """The job's traffic: every worker's latest counters and this process's own, summed."""
        return total([snapshot(), *self.workers_traffic.values()])

    def observe(self, record: StepRecord) -> None:
        """Count a finished step: step, loss, throughput, step time, the coordinator's share, traffic, and
        the evaluation after it if one ran."""
        self.step.inc()
        self.loss.set(record.loss)
        self.samples_per_s.set(samples_per_second(record))
        self.step_seconds.observe(record.seconds)
        self.coordinator_seconds.set(record.coordinator_s)
        # a new dict, never one changed in place: a scrape reads it from another thread
        self.workers_traffic = {**self.workers_traffic, **record.traffic}
        if record.eval is not None:
            values = {"step": record.eval.step, "loss": record.eval.loss, "metric": record.eval.metric}
            for name, value in values.items():
                if value is not None:
                    self._eval_gauge(name).set(value)

    def _eval_gauge(self, name: str) -> Gauge:
        """The gauge ``cellmesh_eval_{name}`` (registered on first use)."""
        if name not in self._eval:
            what = "Steps done" if name == "step" else f"Mean {name} over the held-out samples"
            self._eval[name] = Gauge(f"cellmesh_eval_{name}", f"{what} at the last evaluation",
                                     registry=self.registry)
        return self._eval[name]
