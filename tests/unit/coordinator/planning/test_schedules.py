"""Schedules as data: GPipe, 1F1B, ZB-H1 are valid, print and parse back, broken action lists are refused."""

from __future__ import annotations

import dataclasses

import pytest

from comm.codec import pack, unpack
from coordinator.planning.schedules import (
    CHUNKED,
    Schedule,
    build_schedule,
    chunked_fits,
    gpipe,
    one_f_one_b,
    peak_in_flight,
    schedule_problem,
    zb_h1,
)
from services.compute.actions import ScheduleError, validate_stage
from services.protocol import Action, RunStep

GRID = [(p, m) for p in range(1, 6) for m in range(1, 9)]


def acts(text: str) -> tuple[Action, ...]:
    return tuple(Action.parse(word) for word in text.split())


@pytest.mark.parametrize(("p", "m"), GRID)
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_generated_schedules_are_valid(name: str, p: int, m: int) -> None:
    sched = build_schedule(name, p, m)  # a Schedule validates itself
    assert sched.num_stages == len(sched.actions) == p and sched.num_microbatches == m
    for s, stage_list in enumerate(sched.actions):
        assert all(a.stage == s for a in stage_list)
        # every stage: m forwards, m backwards, a receive per forward (but stage 0) and per backward
        # (but the last stage), a send per forward (but the last) and per backward (but stage 0)
        assert len(stage_list) == 2 * m + (s > 0) * 2 * m + (s < p - 1) * 2 * m
        # what a worker checks on receipt, with the same code
        assert validate_stage(stage_list, stage=s, num_stages=p, num_microbatches=m) is True


@pytest.mark.parametrize(("p", "m"), GRID)
def test_peak_in_flight_gpipe_holds_m_1f1b_at_most_p(p: int, m: int) -> None:
    for stage_list in gpipe(p, m).actions:
        assert peak_in_flight(stage_list) == m
    for s, stage_list in enumerate(one_f_one_b(p, m).actions):
        assert peak_in_flight(stage_list) == min(p - s, m)
    for stage_list in zb_h1(p, m).actions:  # held from F to W: the paper's "same peak as 1F1B" on every stage
        assert peak_in_flight(stage_list) == min(p, m)


def test_1f1b_by_hand() -> None:
    # stage s warms up with p - s - 1 forwards, then alternates forward and backward, then cools down
    assert [" ".join(map(str, stage_list)) for stage_list in one_f_one_b(3, 2).actions] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1B0 1SEND_B0 1RECV_B1 1B1 1SEND_B1",
        "2RECV_F0 2F0 2B0 2SEND_B0 2RECV_F1 2F1 2B1 2SEND_B1",
    ]


def test_zb_h1_by_hand() -> None:
    # 1F1B's order with each B split: I (then SEND_B at once), and stage s runs its W's s I's late,
    # the last ones in the drain
    assert [" ".join(map(str, stage_list)) for stage_list in zb_h1(3, 3).actions] == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0RECV_B0 0I0 0W0 0RECV_B1 0I1 0W1 0RECV_B2 0I2 0W2",
        "1RECV_F0 1F0 1SEND_F0 1RECV_F1 1F1 1SEND_F1 1RECV_B0 1I0 1SEND_B0 1RECV_F2 1F2 1SEND_F2 "
        "1RECV_B1 1I1 1SEND_B1 1W0 1RECV_B2 1I2 1SEND_B2 1W1 1W2",
        "2RECV_F0 2F0 2I0 2SEND_B0 2RECV_F1 2F1 2I1 2SEND_B1 2RECV_F2 2F2 2I2 2SEND_B2 2W0 2W1 2W2",
    ]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
def test_schedule_prints_parses_and_travels_in_run_steps(name: str) -> None:
    sched = build_schedule(name, 3, 4)
    assert Schedule.parse(str(sched)) == sched
    lines = str(sched).splitlines()
    assert lines[0] == f"{name}: 3 stages x 4 microbatches"
    assert lines[1].startswith("stage 0: 0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 ")
    for stage_list in sched.actions:  # the coordinator sends each stage its list as it is
        request = RunStep(step=0, microbatches=[[i] for i in range(4)], actions=list(stage_list))
        assert tuple(unpack(pack(request), RunStep).actions) == stage_list


def test_format_is_a_step_by_stage_table() -> None:
    table = gpipe(2, 2).format().splitlines()
    assert table[0] == "gpipe: 2 stages x 2 microbatches"
    assert table[1] == "step  stage 0   stage 1"
    assert table[3:6] == ["    1 0SEND_F0", "    2 0F1       1RECV_F0", "    3 0SEND_F1  1F0"]
    assert table[-1] == "   11 0B1" and len(table) == 2 + 12


def _with(sched: Schedule, stage: int, stage_list: tuple[Action, ...]) -> Schedule:
    lists = list(sched.actions)
    lists[stage] = stage_list
    return dataclasses.replace(sched, actions=tuple(lists))


def test_broken_lists_are_refused_naming_the_action() -> None:
    sched = gpipe(2, 2)
    stage1 = list(sched.actions[1])
    stage1.insert(stage1.index(Action.parse("1B0")) + 1, Action.parse("1SEND_B0"))  # a second gradient send
    with pytest.raises(ScheduleError, match=r"action #6 \(1SEND_B0\): repeats action #5"):
        _with(sched, 1, tuple(stage1))
    no_recv = tuple(a for a in sched.actions[0] if str(a) != "0RECV_B1")  # stage 0 never receives gradient 1
    with pytest.raises(ScheduleError, match=r"\(0B1\): 0RECV_B1 must come before it") as err:
        _with(sched, 0, no_recv)
    assert "*0B1*" in str(err.value)  # the table marks it
    with pytest.raises(ScheduleError, match=r"\(0B0\): 0F0 must come before it"):
        _with(gpipe(1, 2), 0, acts("0B0 0F0 0F1 0B1"))
    with pytest.raises(ScheduleError, match=r"stage 0: the list has no 0B1 \(a step runs the backward"):
        Schedule("x", 2, (acts("0F0 0F1 0B0"),))
    with pytest.raises(ScheduleError, match=r"stage 0, action #0 \(1RECV_F0\): names stage 1"):
        Schedule("x", 1, tuple(reversed(gpipe(2, 1).actions)))


def test_unmatched_transfer_is_refused() -> None:
    sched = gpipe(2, 1)
    evaluates = tuple(a for a in sched.actions[1] if a.kind not in ("B", "SEND_B"))  # no backward on stage 1
    with pytest.raises(ScheduleError, match="0RECV_B0 has no other end: stage 1's list has no 1SEND_B0"):
        _with(sched, 1, evaluates)


def test_deadlock_is_found_and_named() -> None:
    # Stage 0 waits for gradient 0 before it sends microbatch 1; stage 1 waits for microbatch 1
    # before it runs (and sends) backward 0. Each is valid alone; together they wait forever.
    p0 = acts("0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1")
    p1 = acts("1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1")
    with pytest.raises(ScheduleError, match="deadlock: stage 0 waits at 0RECV_B0; stage 1 waits at 1RECV_F1"):
        Schedule("x", 2, (p0, p1))


def test_parse_refuses_garbage() -> None:
    one = "x: 1 stages x 1 microbatches\n"
    for text, says in [("", "a schedule starts with"),
                       (one + "stage 0: 0F0 0X0", "stage 0: cannot parse action '0X0'"),
                       ("x: 2 stages x 1 microbatches\nstage 0: 0F0 0B0", "the header says 2 stages, 1 "),
                       (one + "stage 1: 1F0 1B0", "expected 'stage 0: <actions>'"),
                       ("x: 1 stages x 2 microbatches\nstage 0: 0F0 0B0", "the list has no 0F1"),
                       (one + "stage 0: 0F0 0B0 0F0", "repeats action #0")]:
        with pytest.raises(ScheduleError, match=says):
            Schedule.parse(text)


def test_unknown_schedule_and_bad_sizes() -> None:
    with pytest.raises(ValueError, match="unknown schedule"):
        build_schedule("zigzag", 2, 2)
    with pytest.raises(ValueError, match=">= 1"):
        gpipe(0, 2)


def test_a_chunked_schedule_fits_whatever_its_chunks_as_its_problem_says() -> None:
    for name in CHUNKED:
        for ranks in range(1, 17):
            for m in range(1, 41):
                for v in range(2, 7):
                    assert chunked_fits(name, ranks, m) == (schedule_problem(name, ranks * v, m, v) is None)
