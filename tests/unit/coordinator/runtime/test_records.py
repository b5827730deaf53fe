"""What a run's records keep: the detail of the latest steps within the reply budget, the rest thinned."""

from __future__ import annotations

from typing import Any

import pytest

from comm.traffic import TrafficCounts
from coordinator.runtime.records import DetailBudget, StepRecord


def record(step: int, replies: int) -> StepRecord:
    body: Any = object()  # the budget counts replies; it never reads them
    return StepRecord(step=step, loss=float(step), num_samples=8, start=step, end=step + 0.5,
                      coordinator_s=0.0, replies=[(body, body)] * replies, traffic={"w0": TrafficCounts()},
                      grad_norm=1.0)


def test_the_latest_steps_keep_their_detail_within_the_budget() -> None:
    budget = DetailBudget(10)
    records = [record(k, 4) for k in range(6)]
    for r in records:
        budget.add(r)
        assert budget.kept <= 10 or budget.kept == len(r.replies)
    assert [r.detailed for r in records] == [False] * 4 + [True] * 2
    assert budget.kept == 8
    for r in records[:4]:  # thinned: O(1) a step, the rest of the record intact
        assert (r.replies, r.traffic, r.events) == ([], {}, [])
        assert (r.loss, r.num_samples, r.seconds, r.grad_norm) == (float(r.step), 8, 0.5, 1.0)
    assert all(len(r.replies) == 4 and r.traffic for r in records[4:])


def test_the_newest_record_keeps_its_detail_even_past_the_budget() -> None:
    for replies in (0, 3):
        budget = DetailBudget(replies)
        records = [record(k, 8) for k in range(3)]
        for r in records:
            budget.add(r)
            assert r.detailed  # the callback after add() reads the whole step
        assert [r.detailed for r in records] == [False, False, True]


def test_uneven_steps_thin_the_oldest_first() -> None:
    budget = DetailBudget(12)
    sizes = [2, 9, 1, 4, 6]
    records = [record(k, n) for k, n in enumerate(sizes)]
    for r in records:
        budget.add(r)
    # newest first: 6 + 4 + 1 = 11 fit in 12, the 9 before them does not
    assert [r.detailed for r in records] == [False, False, True, True, True]
    assert budget.kept == 11


def test_a_negative_budget_is_refused() -> None:
    with pytest.raises(ValueError, match="replies must be >= 0"):
        DetailBudget(-1)
