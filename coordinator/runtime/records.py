"""What a step leaves behind: its record (loss, samples, timings, checkpoint parts, the evaluation after
it) and its events."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from comm.traffic import TrafficCounts
from services.protocol import Action, SavedPart
from services.protocol.compute import StepReport

__all__ = ["ActionEvent", "DetailBudget", "EvalRecord", "Recovery", "StepRecord"]


@dataclass(frozen=True)
class ActionEvent:
    """One timed action or phase of one stage: ``0F3``, ``0SEND_F3``, ``all_reduce``, ``optimizer``...

    ``action`` is the action itself (None for a phase); ``name`` its printed form or the phase's name.
    """

    worker: str
    replica: int
    stage: int
    name: str
    start: float
    end: float
    action: Action | None = None


@dataclass(frozen=True)
class _Service:
    worker: str
    name: str
    replica: int
    stage: int


@dataclass(frozen=True)
class EvalRecord:
    """An evaluation on the held-out data (``coordinator/runtime/evaluation.py``).

    ``step`` counts the steps done when it ran (the model after that many updates); ``loss`` and
    ``metric`` (None without a metric) are means over the ``num_samples`` held-out samples.
    """

    step: int
    loss: float
    metric: float | None
    num_samples: int
    seconds: float = 0.0


@dataclass
class StepRecord:
    """A finished step: its loss, its samples, and the event log of every action.

    The step's update is committed with the next step (or by ``Runtime.commit``), so the
    ``optimizer`` / ``push_pull`` phases in a step's events are the previous step's commit,
    applied before the step's first action. A ``skipped`` step's update is never applied (see
    [Note: a step that is not finite]). The event log is built on first access.

    ``traffic``: each placed worker's latest counters (``comm/traffic.py``), from its step replies.
    ``eval``: the evaluation run right after the step, if one was due.

    A run keeps the detail (``replies``, ``traffic``, hence ``events``) of its latest steps only
    ([Note: the detail a run keeps]): an older record is :meth:`thinned <thin>` to its loss, samples,
    times, norm, checkpoint parts and evaluation, and ``detailed`` is False.
    """

    step: int
    loss: float
    num_samples: int
    start: float
    end: float
    coordinator_s: float  # time the coordinator itself spent (not waiting for replies)
    skipped: bool = False  # its loss or gradients were not finite: its update was dropped
    loss_scale: float = 1.0  # fp16: the loss scale it ran with (coordinator/runtime/scaler.py)
    # the L2 norm of the whole gradient before clipping (collective mode; None on the parameter-server
    # path, whose shards alone hold the averaged gradient): coordinator/runtime/clipping.py
    grad_norm: float | None = None
    saved: list[SavedPart] = field(default_factory=list, repr=False)  # checkpoint parts written since last
    replies: list[tuple[_Service, StepReport]] = field(default_factory=list, repr=False)
    actions: Sequence[Sequence[Action]] = field(default_factory=list, repr=False)  # [stage][k]: action k
    traffic: dict[str, TrafficCounts] = field(default_factory=dict, repr=False)  # by worker
    eval: EvalRecord | None = None
    detailed: bool = field(default=True, init=False)  # False once thinned (no replies, traffic or events)
    _events: list[ActionEvent] | None = field(default=None, init=False, repr=False)

    @property
    def seconds(self) -> float:
        return self.end - self.start

    def thin(self) -> None:
        """Let go of the step's per-stage detail (its replies, their timings and counters, the events made of
        them); keep the rest."""
        self.replies, self.traffic, self._events, self.detailed = [], {}, None, False

    @property
    def events(self) -> list[ActionEvent]:
        """Every action and phase of every stage of every replica, as timed by the stages (none once the
        record is thinned: ``detailed`` False)."""
        if self._events is None:
            events: list[ActionEvent] = []
            for sv, body in self.replies:
                events += [ActionEvent(sv.worker, sv.replica, sv.stage, str(a), start, end, a)
                           for a, start, end in zip(self.actions[sv.stage], body.starts, body.ends,
                                                    strict=True)]
                events += [ActionEvent(sv.worker, sv.replica, sv.stage, p.name, p.start, p.end)
                           for p in body.phases]
            self._events = events
        return self._events


class DetailBudget:
    """Keeps the detail of a run's latest records within ``replies`` stage replies (at least the latest
    record's, whatever its size), thinning older records as newer ones come.

    [Note: the detail a run keeps]

    A step's record holds every stage's reply (the actions' timings, the phases, the worker's counters):
    about 2 KB a reply, so kept for every step they grow as steps x workers (64 hollow workers: 1,950 bytes
    a step and worker, measured; a 512-worker run of 100,000 steps would hold about 100 GB in the
    coordinator), and the cyclic collector walks them, more the more are kept (1.3 ms of the coordinator's
    4.1 ms a step over 3,000 steps of 64 hollow workers). What reads the detail reads it as the step ends,
    through the step callback: the run record's bubble (``coordinator/commands/recorder.py``), the trace
    (its first and last steps), the metrics' traffic. So a run keeps the detail of its latest steps only,
    ``runtime.detail_replies`` replies (10,000 by default, 15-20 MB: the last 5,000 steps of 2 workers, the
    last 19 of 512), and the older records keep what is O(1) a step (28 bytes a step and worker at 64
    workers with no detail kept; 128 with the default). A step redone after a recovery is a new record;
    the one it replaced is thinned or dropped like any other. What the collector still spends on the kept
    detail is one scan a reply as its request ends, and the full collection once a minute ([Note: a run's
    collections, on its own schedule] in ``comm/heap.py``).
    """

    def __init__(self, replies: int) -> None:
        if replies < 0:
            raise ValueError(f"replies must be >= 0, got {replies}")
        self.replies = replies
        self.kept = 0  # the replies of the detailed records in _detailed
        self._detailed: deque[StepRecord] = deque()

    def add(self, record: StepRecord) -> None:
        """``record`` is the newest: thin the oldest detailed records until the rest fit (it stays)."""
        self._detailed.append(record)
        self.kept += len(record.replies)
        while len(self._detailed) > 1 and self.kept > self.replies:
            old = self._detailed.popleft()
            self.kept -= len(old.replies)
            old.thin()


@dataclass(frozen=True)
class Recovery:
    """One failure the session survived, for the run record and the terminal: one per lost worker (two
    lost in one step are two records, with the step training went on from in both)."""

    at: float  # when it was noticed (time.time())
    step: int | None  # the step that was running
    worker: str
    reason: str
    action: str  # "replaced" or "re-planned on N workers" / "re-planned on N workers (one came back)"
    resumed_step: int  # the step training went on from (a checkpoint's, or 0)
    plan: str  # the plan after it
    seconds: float  # from noticing to the new runtime placed
