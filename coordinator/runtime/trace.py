"""The measured steps as a Chrome trace (``trace.json``): open it in Perfetto or ``chrome://tracing``.

Each :class:`~coordinator.runtime.driver.ActionEvent` of a recorded step (a forward,
backward, send or receive action, or a phase such as the gradient all-reduce or the
optimizer) becomes one complete event (``"ph": "X"``) with the pipeline stage as its
process (``pid``, named ``stage S``) and the worker that ran it as its thread (``tid``,
named ``WORKER (replica R)``); its ``args`` hold the step and the replica. Times are the
stages' own wall clocks in microseconds from the first recorded event.

With the plan's predicted step (``predicted``: the simulator's :class:`SimResult`, see
``coordinator/planning/prediction.py``) the trace also holds the prediction of every kept step
as a second set of processes, ``PREDICTED_PID + S`` named ``predicted: stage S``, one thread
each: a predicted step starts where the measured step's first event started, so in Perfetto
each stage's predicted actions sit under its measured ones and the gaps that differ show
where the cost model and the machine part ways.

Bounded: a run of many steps keeps only the first :data:`DEFAULT_FIRST` and the last
:data:`DEFAULT_LAST` steps (every step of a run no longer than both together), so the file
stays small (a few hundred kB for a pipeline of 4 stages) however long the run is;
``otherData`` names the steps kept and the steps run.
"""

from __future__ import annotations

from collections import deque

from coordinator.planning.simulator import SimResult
from coordinator.runtime.records import StepRecord

__all__ = ["DEFAULT_FIRST", "DEFAULT_LAST", "PREDICTED_PID", "TraceRecorder", "chrome_trace"]

DEFAULT_FIRST = 10  # steps kept from the start of a run (the warm-up shows there)
DEFAULT_LAST = 10  # steps kept from its end (the steady state)
PREDICTED_PID = 1000  # the predicted tracks' pids: PREDICTED_PID + stage (far above any stage's own)


def _predicted(records: list[StepRecord], predicted: SimResult, origin: float) -> list[dict[str, object]]:
    """The predicted step's actions once per record, each step starting where the measured one did."""
    events: list[dict[str, object]] = []
    for s in range(len(predicted.timeline)):
        events.append({"name": "process_name", "ph": "M", "pid": PREDICTED_PID + s,
                       "args": {"name": f"predicted: {predicted.track(s)}"}})
        events.append({"name": "thread_name", "ph": "M", "pid": PREDICTED_PID + s, "tid": 0,
                       "args": {"name": f"{predicted.schedule_name} (simulated)"}})
    for record in records:
        if not record.events:
            continue
        begin = min(e.start for e in record.events) - origin
        for s, played in enumerate(predicted.timeline):
            events += [{"name": str(t.action), "cat": "predicted", "ph": "X", "pid": PREDICTED_PID + s,
                        "tid": 0, "ts": round((begin + t.start) * 1e6, 3),
                        "dur": round((t.end - t.start) * 1e6, 3),
                        "args": {"step": record.step}} for t in played]
    return events


def chrome_trace(records: list[StepRecord], *, steps_run: int | None = None,
                 predicted: SimResult | None = None) -> dict[str, object]:
    """The Chrome trace (JSON object format) of ``records``' events; ``steps_run`` goes to ``otherData``.

    ``predicted``: the plan's simulated step, drawn under each kept step (see the module docstring).
    """
    events: list[dict[str, object]] = []
    origin = min((e.start for r in records for e in r.events), default=0.0)
    threads: dict[tuple[int, str], tuple[int, int]] = {}  # (stage, worker) -> (tid, replica)
    for record in records:
        for e in record.events:
            tid, _ = threads.setdefault((e.stage, e.worker), (len(threads), e.replica))
            events.append({"name": e.name, "cat": "action", "ph": "X", "pid": e.stage, "tid": tid,
                           "ts": round((e.start - origin) * 1e6, 3),
                           "dur": round(max(0.0, e.end - e.start) * 1e6, 3),
                           "args": {"step": record.step, "replica": e.replica}})
    meta: list[dict[str, object]] = []
    for stage in sorted({stage for stage, _ in threads}):
        meta.append({"name": "process_name", "ph": "M", "pid": stage, "args": {"name": f"stage {stage}"}})
    for (stage, worker), (tid, replica) in threads.items():
        meta.append({"name": "thread_name", "ph": "M", "pid": stage, "tid": tid,
                     "args": {"name": f"{worker} (replica {replica})"}})
    if predicted is not None:
        events += _predicted(records, predicted, origin)
    other = {"steps_kept": [r.step for r in records],
             "steps_run": len(records) if steps_run is None else steps_run}
    return {"traceEvents": meta + events, "displayTimeUnit": "ms", "otherData": other}


class TraceRecorder:
    """Keeps the first ``first`` and the last ``last`` step records of a run, for its trace.

    :meth:`add` is the ``fit`` callback's cost: a reference kept or dropped, no copy. ``predicted``
    (set once the plan is known) adds the plan's predicted tracks to :meth:`trace`.
    """

    def __init__(self, first: int = DEFAULT_FIRST, last: int = DEFAULT_LAST) -> None:
        if first < 0 or last < 0:
            raise ValueError(f"steps kept must be >= 0, got first={first}, last={last}")
        self.first = first
        self._head: list[StepRecord] = []
        self._tail: deque[StepRecord] = deque(maxlen=last)
        self.steps_run = 0
        self.predicted: SimResult | None = None

    def add(self, record: StepRecord) -> None:
        self.steps_run += 1
        if len(self._head) < self.first:
            self._head.append(record)
        elif self._tail.maxlen:
            self._tail.append(record)

    @property
    def records(self) -> list[StepRecord]:
        """The kept records, in step order."""
        return [*self._head, *self._tail]

    def trace(self) -> dict[str, object]:
        """The kept steps as a Chrome trace (:func:`chrome_trace`)."""
        return chrome_trace(self.records, steps_run=self.steps_run, predicted=self.predicted)
