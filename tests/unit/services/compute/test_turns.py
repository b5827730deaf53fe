"""Turns: two stages of one worker, each on its own thread, run their actions in the worker's order."""

from __future__ import annotations

import threading
import time

import pytest

from coordinator.planning.schedules import build_schedule
from services.compute import turns
from services.protocol import Action

SCHEDULE = build_schedule("interleaved-1f1b", 4, 4, 2)
ORDER = SCHEDULE.rank_actions(0)  # stages 0 and 2


def run_stage(rank: turns.RankTurns, stage: int, ran: list[Action], step: int = 0, *, fail_at: int = -1,
              deadline_s: float = 10.0) -> list[BaseException]:
    """Stage ``stage``'s list run under the turns, appending each action as it runs; the error, if any."""
    actions = SCHEDULE.actions[stage]
    errors: list[BaseException] = []
    try:
        with rank.step(step, stage, rank.positions(stage, actions), time.monotonic() + deadline_s) as st:
            for k, a in enumerate(actions):
                st.wait(k)
                if k == fail_at:
                    raise RuntimeError("injected")
                ran.append(a)
                time.sleep(0.0005)  # the other thread would slip in here without the turns
                st.done(k)
    except (RuntimeError, TimeoutError) as exc:
        errors.append(exc)
    return errors


def both(rank: turns.RankTurns, step: int = 0, **kwargs: int
         ) -> tuple[list[Action], dict[int, list[BaseException]]]:
    ran: list[Action] = []
    errors: dict[int, list[BaseException]] = {}

    def go(stage: int) -> None:
        errors[stage] = run_stage(rank, stage, ran, step, fail_at=kwargs.get(f"fail{stage}", -1))

    threads = [threading.Thread(target=go, args=(s,)) for s in (2, 0)]  # the later stage starts first
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    return ran, errors


def test_two_stages_run_in_the_workers_order_step_after_step() -> None:
    rank = turns.RankTurns("job/r0/rank0", ORDER)
    for step in (0, 1, 1):  # the same step again once it ended (a replay)
        ran, errors = both(rank, step)
        assert errors == {0: [], 2: []} and tuple(ran) == ORDER


def test_a_failing_stage_fails_the_other_at_once_and_the_step_can_run_again() -> None:
    rank = turns.RankTurns("job/r0/rank0", ORDER)
    start = time.monotonic()
    ran, errors = both(rank, 3, fail0=6)  # stage 0's 7th action fails; stage 2 waits for a later turn
    assert time.monotonic() - start < 5  # not at the deadline
    assert "injected" in str(errors[0][0])
    assert "another stage of this worker failed step 3" in str(errors[2][0])
    ran, errors = both(rank, 3)  # every stage left: the step may run again
    assert errors == {0: [], 2: []} and tuple(ran) == ORDER


def test_a_turn_that_never_comes_times_out_naming_the_action_and_where_the_order_stands() -> None:
    rank = turns.RankTurns("job/r0/rank0", ORDER)
    ran: list[Action] = []
    errors = run_stage(rank, 2, ran, deadline_s=0.3)  # stage 0 never runs: stage 2 waits for position 4
    assert ran == [] and len(errors) == 1
    message = str(errors[0])
    assert "2RECV_F0's turn (position 4" in message and "position 0 (0F0)" in message, message


def test_a_list_that_is_not_the_stages_part_of_the_order_is_refused() -> None:
    rank = turns.RankTurns("k", ORDER)
    with pytest.raises(ValueError, match=r"stage 0 shares its worker with stages \[2\]"):
        rank.positions(0, SCHEDULE.actions[0][1:])
    assert turns.positions(rank, 0, SCHEDULE.actions[0][1:], "eval") is None  # evaluation: no turns
    assert turns.positions(None, 0, SCHEDULE.actions[0], "train") is None


def test_the_services_of_a_rank_share_its_turns_until_the_last_releases_them() -> None:
    a = turns.acquire("run/r0/rank1", SCHEDULE.rank_actions(1))
    assert turns.acquire("run/r0/rank1", SCHEDULE.rank_actions(1)) is a
    with pytest.raises(ValueError, match="different orders"):
        turns.acquire("run/r0/rank1", ORDER)
    turns.release("run/r0/rank1")
    turns.release("run/r0/rank1")
    assert turns.acquire("run/r0/rank1", SCHEDULE.rank_actions(1)) is not a
    turns.release("run/r0/rank1")
