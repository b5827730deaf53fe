"""What a run leaves behind while it trains: its record, log, trace, metrics and TensorBoard scalars.

A :class:`RunRecorder` belongs to one run directory (``coordinator/commands/rundir.py``).
``cellmesh run`` (``coordinator/commands/run.py``'s ``train``) makes one per run; the
coordinator of a cluster job (``coordinator/commands/server.py``) makes one too and
reads its :meth:`~RunRecorder.status` for the ``status`` RPC. Inside ``with recorder:``

* the coordinator process's log records also go to ``coordinator.log`` (``comm/logs.py``);
* every finished step (:meth:`~RunRecorder.on_step`) updates the record (step, loss,
  samples/s, the measured and predicted pipeline bubble: ``bubbles``, and the evaluation
  after it, if one ran: ``evals``), the Prometheus metrics
  (``coordinator/commands/metrics.py``; the job's traffic from the workers' counters on the
  step record among them), the trace
  (``coordinator/runtime/trace.py``) and, with a TensorBoard directory (the config's
  ``logging.tensorboard_dir``), the scalars ``loss`` and ``samples_per_s`` at global step
  ``record.step + 1`` (the step's number as the progress lines count it), and ``eval/loss``
  and ``eval/metric`` at the steps evaluated;
* with a metrics port (``logging.metrics_port``) it serves ``/metrics`` (and ``/healthz``,
  ``/readyz``) on 127.0.0.1 at that port;
* ``run.json`` is rewritten at each change of phase; at the end, ``trace.json`` is written
  and a run that did not reach ``done`` is recorded as ``failed`` with its error.

The step callback's cost is a few gauge updates and a reference kept: no I/O but
TensorBoard's buffered writer.
"""

from __future__ import annotations

import contextlib
import json
import threading
from pathlib import Path
from types import TracebackType
from typing import Any

from comm.logs import log_to_file
from coordinator.commands.metrics import RunMetrics, samples_per_second
from coordinator.commands.rundir import MAX_BUBBLES, BubbleEntry, EvalEntry, RunDir, RunRecord, write_atomic
from coordinator.planning.plan import Plan
from coordinator.planning.prediction import predict
from coordinator.runtime.bubble import measured_bubble, predicted_bubble
from coordinator.runtime.records import StepRecord
from coordinator.runtime.trace import TraceRecorder
from services.host.health import HealthServer

__all__ = ["METRICS_HOST", "RunRecorder", "open_tensorboard"]

METRICS_HOST = "127.0.0.1"  # a local run's metrics stay on loopback


def open_tensorboard(directory: str) -> Any:
    """A ``torch.utils.tensorboard.SummaryWriter`` on ``directory``.

    Raises:
        ValueError: The ``tensorboard`` package is not installed (names the extra that brings it).
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ValueError("logging.tensorboard_dir (--tensorboard) needs the tensorboard package: "
                         f"pip install 'cellmesh[tensorboard]' ({exc})") from exc
    return SummaryWriter(log_dir=directory, flush_secs=10)


class RunRecorder:
    """The record, log file, metrics, trace and TensorBoard writer of one run (see the module docstring).

    Args:
        run_dir: The run's directory (created).
        job: The job's name.
        steps: Steps the run trains.
        metrics_port: Serve the metrics on 127.0.0.1 at this port (0: any free one; None: do not).
        tensorboard_dir: Write TensorBoard scalars here (None: do not).
        spec_sha256: The job file's digest, kept in the record.
        metrics: The metrics to update (a new :class:`RunMetrics` by default; the cluster
            coordinator passes the ones its probe endpoint serves).
    """

    def __init__(self, run_dir: RunDir, *, job: str, steps: int, metrics_port: int | None = None,
                 tensorboard_dir: str | None = None, spec_sha256: str = "",
                 metrics: RunMetrics | None = None) -> None:
        self.run_dir = run_dir
        self.metrics_port = metrics_port
        self.tensorboard_dir = tensorboard_dir
        self.metrics = metrics or RunMetrics()
        self.metrics.steps.set(steps)
        self.trace = TraceRecorder()
        self._predicted_bubble: float | None = None  # of the plan, once written
        self._lock = threading.Lock()
        self._record = RunRecord(job=job, phase="starting", run_dir=str(run_dir.path), steps=steps,
                                 output=str(run_dir.model), spec_sha256=spec_sha256)
        self._tensorboard: Any = None
        self._server: HealthServer | None = None
        self._stack = contextlib.ExitStack()

    # -- the record -----------------------------------------------------------------------

    def status(self) -> RunRecord:
        with self._lock:
            return self._record

    def update(self, **changes: object) -> None:
        """Change the record's fields and rewrite ``run.json``; phase ``done`` also sets ``cellmesh_done``."""
        with self._lock:
            self._record = self._record.model_copy(update=changes)
            record = self._record
        if record.phase == "done":
            self.metrics.done.set(1)
        self.run_dir.write_record(record)

    def write_plan(self, plan: Plan) -> None:
        """``plan.json`` (it reads back with ``Plan.from_json``) and ``plan.txt`` (as printed); the plan's
        predicted step goes to the trace and its bubble to each step's entry in the record."""
        self.trace.predicted = predict(plan)
        self._predicted_bubble = predicted_bubble(self.trace.predicted)
        write_atomic(self.run_dir.plan_json, plan.to_json())
        write_atomic(self.run_dir.plan_txt, str(plan) + "\n")

    def on_step(self, record: StepRecord) -> None:
        """Count a finished step in the record, the metrics, the trace and TensorBoard."""
        speed = samples_per_second(record)
        done = record.eval
        with self._lock:
            update: dict[str, object] = {"step": record.step + 1, "loss": record.loss, "samples_per_s": speed}
            bubble = BubbleEntry(step=record.step, measured=measured_bubble(record),
                                 predicted=self._predicted_bubble)
            kept = [b for b in self._record.bubbles if b.step < record.step]  # a step trained again replaces
            update["bubbles"] = [*kept[-(MAX_BUBBLES - 1):], bubble]
            if done is not None:  # a step trained again after a failure replaces its evaluation
                entry = EvalEntry(step=done.step, loss=done.loss, metric=done.metric,
                                  num_samples=done.num_samples)
                update["evals"] = [*(e for e in self._record.evals if e.step < done.step), entry]
            self._record = self._record.model_copy(update=update)
        self.metrics.observe(record)
        self.trace.add(record)
        if self._tensorboard is not None:
            self._tensorboard.add_scalar("loss", record.loss, record.step + 1)
            self._tensorboard.add_scalar("samples_per_s", speed, record.step + 1)
            if done is not None:
                self._tensorboard.add_scalar("eval/loss", done.loss, done.step)
                if done.metric is not None:
                    self._tensorboard.add_scalar("eval/metric", done.metric, done.step)

    def write_trace(self, path: Path) -> None:
        """The kept steps, measured and predicted, as a Chrome trace at ``path`` (``runtime/trace.py``)."""
        write_atomic(path, json.dumps(self.trace.trace()))

    # -- lifecycle ------------------------------------------------------------------------

    @property
    def metrics_url(self) -> str | None:
        """Where ``/metrics`` is served (None without a metrics port)."""
        return self._server.url if self._server is not None else None

    def _live(self) -> tuple[bool, str]:
        record = self.status()
        return record.phase != "failed", f"run of {record.job}: {record.phase}"

    def _ready(self) -> tuple[bool, str]:
        record = self.status()
        return record.phase != "starting", f"run of {record.job}: {record.phase}"

    def __enter__(self) -> RunRecorder:
        """Open the log file, the TensorBoard writer and the metrics endpoint; write ``run.json``.

        Raises:
            ValueError: TensorBoard is not installed, or the metrics port cannot be bound.
        """
        try:
            if self.tensorboard_dir is not None:
                self._tensorboard = open_tensorboard(self.tensorboard_dir)
                self._stack.callback(self._tensorboard.close)
            if self.metrics_port is not None:
                try:
                    self._server = HealthServer(live=self._live, ready=self._ready,
                                                metrics=self.metrics.registry, host=METRICS_HOST,
                                                port=self.metrics_port).start()
                except OSError as exc:
                    raise ValueError(f"cannot serve metrics on {METRICS_HOST}:{self.metrics_port}: "
                                     f"{exc.strerror or exc}; choose another logging.metrics_port "
                                     "(--metrics-port)") from exc
                self._stack.callback(self._server.close)
            self._stack.enter_context(log_to_file(self.run_dir.coordinator_log))
            self.run_dir.write_record(self.status())
        except BaseException:
            self._stack.close()
            raise
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Write ``trace.json`` and the final record (``failed`` with the error unless done); close."""
        try:
            self.write_trace(self.run_dir.trace)
            if self.status().phase != "done":
                error = " ".join(str(exc).split()) if exc is not None else "stopped before the end"
                self.update(phase="failed", error=error or type(exc).__name__)
        finally:
            self._stack.close()
