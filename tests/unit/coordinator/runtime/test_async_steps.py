"""Asynchronous plans' bookkeeping: which step each replica may be sent, and when a step is complete."""

from __future__ import annotations

from coordinator.runtime.async_steps import AsyncProgress
from coordinator.runtime.records import _Service
from services.protocol import StepReply


def reply(step: int, stage: int) -> StepReply:
    return StepReply(step=step, stage=stage, losses=[], starts=[], ends=[])


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
