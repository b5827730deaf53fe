"""The asynchronous parameter server (``plan.staleness > 0``): each replica steps at its own pace.

[Note: replicas at their own pace]
In synchronous mode the coordinator runs a step on every replica at once and commits it once all
finished: the replicas move in lock step. With ``plan.staleness = S > 0`` the shards run in
``async`` mode (``services/params/server.py``): each replica's push is one optimizer step of its
own gradient, applied on arrival, and a replica's pull waits until its clock (its steps applied)
is at most ``S`` ahead of the slowest replica's. The coordinator then drives each replica on its
own (:class:`AsyncProgress`, used by ``Runtime.run_step``):

* replica ``r``'s step ``j`` is sent as soon as its own step ``j - 1`` finished (every stage of
  ``r`` answered), carrying ``r``'s commit of ``j - 1`` (its push, then its pull), as a sync step
  carries the step's commit. Nothing waits for another replica but that pull, in the shards;
* the coordinator sends ahead only within the window ``j <= k + S``, ``k`` being the oldest step
  some replica has not finished (the step ``run_step`` reports), and never past the end of the
  ``fit`` call: a replica more than ``S`` ahead would only wait in its pull, up to the step's bound;
* a step's record is made once every replica finished it: its loss is the mean over the global
  batch, as in sync mode, and the replies of the replicas' steps keep their own times (a fast
  replica's step ``k + 1`` may have started before a slow one's step ``k`` ended);
* each replica's commit is decided on its own replies: a loss or gradient that is not finite
  stops the job (``runtime.nonfinite: stop``) before that replica pushes it;
* the final state: once every replica committed its last step, every push is applied, and the
  shards' values are the model's (replica 0 answers the buffers; the parameters are pulled from
  the shards, which replica 0's last pull may predate).

What async cannot do is refused before any worker starts (:func:`refuse_unsupported`): a
learning-rate scheduler and clipping by the global norm need every replica's gradient of one step
(a scheduler's position and a global norm belong to no one replica's push); fp16's loss scale is one
for all replicas and backs off on any overflow; ``runtime.nonfinite: skip`` would drop a step some
replicas already pushed; a checkpoint's optimizer state at a version is no step's state (the shards
refuse to save in async mode); an evaluation reads the replicas' parameters, which differ. Each
refusal names the fix: ``plan.staleness: 0`` (sync) keeps them all.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from coordinator.planning.config import JobConfig
from coordinator.planning.plan import Plan
from coordinator.runtime.errors import JobError
from coordinator.runtime.records import _Service
from services.protocol.compute import StepReport

__all__ = ["AsyncProgress", "refuse_unsupported"]

Replies = list[tuple[_Service, StepReport]]


def refuse_unsupported(config: JobConfig, plan: Plan) -> None:
    """Raise JobError naming what of ``config`` an asynchronous plan (``plan.staleness > 0``) cannot run.

    See [Note: replicas at their own pace] for why each is refused.
    """
    if not plan.staleness:
        return
    why = {
        "optimizer.scheduler": config.optimizer.scheduler is not None,
        "optimizer.clip_grad_norm": config.optimizer.clip_grad_norm is not None,
        "plan.precision: fp16": plan.precision == "fp16",
        "runtime.nonfinite: skip": config.runtime.nonfinite == "skip",
        "checkpoint.directory": config.checkpoint.directory is not None,
        "eval": config.eval is not None,
    }
    found = [name for name, present in why.items() if present]
    if found:
        raise JobError(f"plan.staleness={plan.staleness} runs the parameter server asynchronously, where "
                       f"each replica's update is its own step; {', '.join(found)} needs every replica's "
                       "step together: drop it, or set plan.staleness: 0 (synchronous)")


@dataclass
class _Replica:
    """One replica's progress."""

    next: int  # the next step to send it
    running: int | None = None  # the step it runs (None: idle)
    waiting: set[int] = field(default_factory=set)  # request ids of that step not answered yet
    replies: Replies = field(default_factory=list)  # that step's, so far
    commits: int = 0  # its updates committed (pushed): the step number of its next push
    uncommitted: int | None = None  # its last finished step, whose update awaits its commit


class AsyncProgress:
    """Which step each replica runs and which it may be sent (see [Note: replicas at their own pace]).

    Args:
        replicas: The plan's data-parallel replicas.
        staleness: The plan's staleness bound ``S``.
        first: The first step of the run.
    """

    def __init__(self, replicas: int, staleness: int, first: int) -> None:
        self.staleness = staleness
        self.replicas = [_Replica(first) for _ in range(replicas)]
        self.finished: dict[int, dict[int, Replies]] = {}  # step -> replica -> its replies

    def sendable(self, oldest: int, end: int) -> list[tuple[int, int]]:
        """The ``(replica, step)`` to send now: idle replicas whose next step is below ``end`` and within
        ``oldest + S``."""
        return [(r, rep.next) for r, rep in enumerate(self.replicas)
                if rep.running is None and rep.next < end and rep.next <= oldest + self.staleness]

    def sent(self, replica: int, step: int, ids: Sequence[int], committing: bool) -> None:
        """Replica ``replica``'s step ``step`` went out as requests ``ids`` (carrying its commit if
        ``committing``)."""
        rep = self.replicas[replica]
        rep.running, rep.next, rep.waiting, rep.replies = step, step + 1, set(ids), []
        if committing:
            rep.commits += 1
            rep.uncommitted = None

    def answered(self, replica: int, rid: int, sv: _Service, body: StepReport) -> Replies | None:
        """Note a reply; the replica's replies once its step is complete (it is idle again), else None."""
        rep = self.replicas[replica]
        rep.waiting.discard(rid)
        rep.replies.append((sv, body))
        if rep.waiting:
            return None
        assert rep.running is not None
        self.finished.setdefault(rep.running, {})[replica] = rep.replies
        rep.uncommitted, rep.running = rep.running, None
        return rep.replies

    def complete(self, step: int) -> bool:
        """Whether every replica finished ``step``."""
        return len(self.finished.get(step, {})) == len(self.replicas)

    def idle(self) -> bool:
        """Whether no replica runs a step."""
        return all(rep.running is None for rep in self.replicas)
