"""Schedules as data: GPipe and 1F1B are valid, print and parse back, and broken action lists are refused."""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from coordinator.planning.schedules import (
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build_schedule,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    validate_schedule,
)

F, B, S, R = ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.SEND, ActionKind.RECV
GRID = [(p, m) for p in range(1, 6) for m in range(1, 9)]


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_generated_schedules_are_valid(name: str, p: int, m: int) -> None:
    sched = build_schedule(name, p, m)
    validate_schedule(sched)
    assert len(sched.actions) == p
    for s, acts in enumerate(sched.actions):
        assert all(a.stage == s for a in acts)
        # every stage: m forwards, m backwards, a receive per forward (but stage 0) and per backward
        # (but the last stage), a send per forward (but the last) and per backward (but stage 0)
        assert len(acts) == 2 * m + (s > 0) * 2 * m + (s < p - 1) * 2 * m


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight_gpipe_holds_m_1f1b_at_most_p(p: int, m: int) -> None:
    for acts in gpipe(p, m).actions:
        assert peak_in_flight(acts) == m
    for s, acts in enumerate(one_f_one_b(p, m).actions):
        assert peak_in_flight(acts) == min(p - s, m)


def test_compact_form_of_actions() -> None:
    assert str(Action(0, F, 3)) == "0F3"
    assert str(Action(1, B, 2)) == "1B2"
    assert str(Action(0, S, 3, 1)) == "0S3->1"
    assert str(Action(1, R, 3, 0)) == "1R3<-0"
    for text in ["0F3", "1B2", "0S3->1", "1R3<-0", "12F105", "3S7->2"]:
        assert str(Action.parse(text)) == text
    assert Action.parse("0S3->1").carries_gradient is False
    assert Action.parse("1S3->0").carries_gradient is True
    assert Action.parse("0R3<-1").carries_gradient is True
    kinds = [Action.parse(t).stage_kind for t in ["1F0", "1B0", "1S0->2", "1R0<-0", "1S0->0", "1R0<-2"]]
    assert kinds == ["forward", "backward", "send_act", "recv_act", "send_grad", "recv_grad"]


@pytest.mark.parametrize("text", ["", "F3", "0X3", "0F", "0S3", "0R3->1", "0F3->1", "0S3->0", "-1F0",
                                  "0F3 0B3"])
def test_bad_action_text_is_refused(text: str) -> None:
    with pytest.raises(ScheduleError):
        Action.parse(text)


def test_actions_need_sensible_peers() -> None:
    with pytest.raises(ScheduleError, match="needs a peer"):
        Action(0, S, 1)
    with pytest.raises(ScheduleError, match="takes no peer"):
        Action(0, F, 1, 1)
    with pytest.raises(ScheduleError, match="cannot send to or receive from"):
        Action(1, R, 0, 1)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedule_prints_parses_and_goes_over_msgpack(name: str) -> None:
    sched = build_schedule(name, 3, 4)
    assert Schedule.parse(str(sched)) == sched
    wire = msgpack.unpackb(msgpack.packb(sched.to_wire()))
    assert Schedule.from_wire(wire) == sched
    assert str(sched).splitlines()[1].startswith("stage 0: 0F0 0S0->1 0F1")


def _with(sched: Schedule, stage: int, acts: list[Action]) -> Schedule:
    lists = list(sched.actions)
    lists[stage] = tuple(acts)
    return dataclasses.replace(sched, actions=tuple(lists))


def test_send_without_receive_is_refused() -> None:
    sched = gpipe(2, 2)
    acts = list(sched.actions[1])
    acts.insert(acts.index(Action(1, B, 0)) + 1, Action(1, S, 0, 0))  # second gradient send of microbatch 0
    with pytest.raises(ScheduleError, match="duplicate"):
        validate_schedule(_with(sched, 1, acts))
    acts = [a for a in sched.actions[0] if a != Action(0, R, 1, 1)]  # stage 0 never receives gradient 1
    with pytest.raises(ScheduleError, match=r"0B1: comes before 0R1<-1"):
        validate_schedule(_with(sched, 0, acts))


def test_unmatched_send_is_refused() -> None:
    sched = gpipe(2, 1)
    extra = Schedule("x", 2, 1, (sched.actions[0], tuple(a for a in sched.actions[1] if a.kind is not S)))
    with pytest.raises(ScheduleError, match=r"receive 0R0<-1 has no matching send"):
        validate_schedule(extra)


def test_backward_before_forward_is_refused() -> None:
    sched = gpipe(1, 2)
    with pytest.raises(ScheduleError, match="backward before the forward"):
        acts = [Action(0, B, 0), Action(0, F, 0), Action(0, F, 1), Action(0, B, 1)]
        validate_schedule(_with(sched, 0, acts))


def test_missing_microbatch_is_refused() -> None:
    with pytest.raises(ScheduleError, match=r"no BACKWARD for microbatches \[1\]"):
        validate_schedule(Schedule("x", 1, 2, ((Action(0, F, 0), Action(0, F, 1), Action(0, B, 0)),)))


def test_action_listed_under_another_stage_is_refused() -> None:
    sched = gpipe(2, 1)
    swapped = Schedule("x", 2, 1, (sched.actions[1], sched.actions[0]))
    with pytest.raises(ScheduleError, match="listed under stage 0 but names stage 1"):
        validate_schedule(swapped)


def test_non_adjacent_peer_is_refused() -> None:
    with pytest.raises(ScheduleError, match="adjacent"):
        skip = (Action(0, F, 0), Action(0, S, 0, 2), Action(0, B, 0))
        validate_schedule(Schedule("x", 3, 1, (skip, (), ())))


def test_deadlock_is_found_and_named() -> None:
    # Stage 0 waits for gradient 0 before it sends microbatch 1; stage 1 waits for microbatch 1
    # before it runs (and sends) backward 0. Each is valid alone; together they wait forever.
    p0 = (Action(0, F, 0), Action(0, S, 0, 1), Action(0, R, 0, 1), Action(0, B, 0),
          Action(0, F, 1), Action(0, S, 1, 1), Action(0, R, 1, 1), Action(0, B, 1))
    p1 = (Action(1, R, 0, 0), Action(1, F, 0), Action(1, R, 1, 0), Action(1, F, 1),
          Action(1, B, 0), Action(1, S, 0, 0), Action(1, B, 1), Action(1, S, 1, 0))
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits at 0R0<-1; stage 1 waits at 1R1<-0"):
        validate_schedule(Schedule("x", 2, 2, (p0, p1)))


def test_wire_refuses_garbage() -> None:
    with pytest.raises(ScheduleError):
        Schedule.from_wire({"name": "x", "num_stages": 1})
    with pytest.raises(ScheduleError):
        Schedule.from_wire({"name": "x", "num_stages": 1, "num_microbatches": 1, "actions": [["0F0"]]})


def test_unknown_schedule_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        gpipe(0, 2)
