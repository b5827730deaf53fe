"""The one action type and its one validator: printed form, wire, per-stage rules, cross-stage rules."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError
from torch.distributed.pipelining.schedules import _Action

from comm.codec import pack, unpack
from services.compute.actions import ScheduleError, format_schedule, validate_schedule, validate_stage
from services.protocol import Action, ActionKind, RunStep


def acts(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split()]


# two stages, two microbatches, written out by hand (not generated)
GPIPE_2X2 = ["0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
             "1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1"]


@pytest.mark.parametrize("kind", get_args(ActionKind))
def test_printed_form_round_trips_for_every_kind(kind: ActionKind) -> None:
    for stage, microbatch in [(0, 0), (1, 3), (12, 105)]:
        action = Action(stage=stage, kind=kind, microbatch=microbatch)
        text = str(action)
        assert text == f"{stage}{kind}{microbatch}"
        assert Action.parse(text) == action
        assert Action.parse(f"  {text}\n") == action
        assert repr(_Action.from_str(text)) == text  # torch.distributed.pipelining reads it the same way


def test_the_kind_fixes_the_peer() -> None:
    peers = {str(a): a.peer for a in acts("1F0 1B0 1SEND_F0 1RECV_F0 1SEND_B0 1RECV_B0")}
    assert peers == {"1F0": None, "1B0": None, "1SEND_F0": 2, "1RECV_F0": 0, "1SEND_B0": 0, "1RECV_B0": 2}


@pytest.mark.parametrize("text", ["", "F3", "0X3", "0F", "0SEND3", "0F3->1", "0S3->1", "1R3<-0", "-1F0",
                                  "0F3 0B3", "0send_f3", "0FORWARD3"])
def test_bad_text_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="cannot parse action"):
        Action.parse(text)


def test_fields_are_checked() -> None:
    for fields in [dict(stage=-1, kind="F", microbatch=0), dict(stage=0, kind="forward", microbatch=0),
                   dict(stage=0, kind="F", microbatch="1"), dict(stage=0, kind="F", microbatch=0, peer=1)]:
        with pytest.raises(ValidationError):
            Action.model_validate(fields)


def test_run_step_carries_actions_over_the_wire() -> None:
    request = RunStep(step=3, microbatches=[[0, 1], [2, 3]], actions=acts(GPIPE_2X2[1]))
    back = unpack(pack(request), RunStep)
    assert back == request and [str(a) for a in back.actions] == GPIPE_2X2[1].split()


@pytest.mark.parametrize("stage", [0, 1])
def test_hand_written_lists_are_valid_and_train(stage: int) -> None:
    assert validate_stage(acts(GPIPE_2X2[stage]), stage=stage, num_stages=2, num_microbatches=2) is True


def test_a_list_without_backwards_is_an_evaluation_step() -> None:
    assert validate_stage(acts("1RECV_F0 1F0 1SEND_F0"), stage=1, num_stages=3, num_microbatches=1) is False


def test_a_backward_split_into_input_and_weight_halves_trains() -> None:
    # zero-bubble style: the gradients go out after I, W comes later; B and I/W may mix by microbatch
    text = "1RECV_F0 1F0 1RECV_F1 1F1 1I0 1SEND_B0 1B1 1SEND_B1 1W0"
    assert validate_stage(acts(text), stage=1, num_stages=2, num_microbatches=2) is True
    assert validate_stage(acts("0F0 0SEND_F0 0RECV_B0 0I0 0W0"), stage=0, num_stages=2, num_microbatches=1)


def test_gradient_receives_may_be_posted_before_the_forward() -> None:
    assert validate_stage(acts("0RECV_B0 0F0 0SEND_F0 0B0"), stage=0, num_stages=2, num_microbatches=1)


# (stage of 2, list, microbatches, what the error says: the action and the rule)
PER_STAGE = {
    "names another stage": (0, "1F0", 1, r"action #0 \(1F0\): names stage 1"),
    "microbatch out of range": (0, "0F0 0SEND_F0 0F2", 2, r"action #2 \(0F2\): microbatch 2 is not one of "
                                                          r"the step's 2"),
    "first stage receives activations": (0, "0RECV_F0 0F0", 1, r"\(0RECV_F0\): stage 0 is the first stage"),
    "first stage sends gradients": (0, "0F0 0SEND_F0 0RECV_B0 0B0 0SEND_B0", 1,
                                    r"action #4 \(0SEND_B0\): stage 0 is the first stage"),
    "last stage sends activations": (1, "1RECV_F0 1F0 1SEND_F0", 1,
                                     r"\(1SEND_F0\): stage 1 is the last of 2"),
    "last stage receives gradients": (1, "1RECV_B0", 1, r"\(1RECV_B0\): stage 1 is the last of 2"),
    "repeated action": (0, "0F0 0F0", 1, r"action #1 \(0F0\): repeats action #0"),
    "forward before its activations": (1, "1F0 1RECV_F0", 1, r"action #0 \(1F0\): 1RECV_F0 must come before"),
    "send before its forward": (0, "0SEND_F0 0F0", 1, r"action #0 \(0SEND_F0\): 0F0 must come before it"),
    "backward before its forward": (1, "1RECV_F0 1B0 1F0", 1, r"action #1 \(1B0\): 1F0 must come before it"),
    "backward before its gradients": (0, "0F0 0SEND_F0 0B0 0RECV_B0", 1,
                                      r"action #2 \(0B0\): 0RECV_B0 must come before it"),
    "gradient send before its backward": (1, "1RECV_F0 1F0 1SEND_B0 1B0", 1,
                                          r"action #2 \(1SEND_B0\): 1B0 \(or 1I0\) must come before it"),
    "missing forward": (0, "0F0 0SEND_F0", 2, r"stage 0: the list has no 0F1(?:\n|$)"),
    "missing activation send": (0, "0F0 0F1 0SEND_F0", 2, r"stage 0: the list has no 0SEND_F1(?:\n|$)"),
    "backward of some microbatches": (1, "1RECV_F0 1RECV_F1 1F0 1F1 1B0 1SEND_B0", 2,
                                      r"stage 1: the list has no 1B1 \(a step runs the backward of every"),
    "missing gradient send": (1, "1RECV_F0 1F0 1B0", 1, r"stage 1: the list has no 1SEND_B0"),
    "missing gradient receive": (0, "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B1 0B0 0B1", 2,
                                 r"action #5 \(0B0\): 0RECV_B0 must come before it"),
    "gradients in an evaluation step": (0, "0F0 0SEND_F0 0RECV_B0", 1,
                                        r"action #2 \(0RECV_B0\): a list without backwards is an evaluation"),
    "weight half before its input half": (1, "1RECV_F0 1F0 1W0 1I0 1SEND_B0", 1,
                                          r"action #2 \(1W0\): 1I0 must come before it"),
    "input half before its forward": (1, "1RECV_F0 1I0 1F0", 1, r"action #1 \(1I0\): 1F0 must come before"),
    "input half before its gradients": (0, "0F0 0SEND_F0 0I0 0RECV_B0", 1,
                                        r"action #2 \(0I0\): 0RECV_B0 must come before it"),
    "gradient send before the input half": (1, "1RECV_F0 1F0 1SEND_B0 1I0 1W0", 1,
                                            r"action #2 \(1SEND_B0\): 1B0 \(or 1I0\) must come before it"),
    "both B and I": (1, "1RECV_F0 1F0 1I0 1B0", 1, r"action #3 \(1B0\): microbatch 0's backward is either B"),
    "input half without its weight half": (1, "1RECV_F0 1F0 1I0 1SEND_B0", 1,
                                           r"stage 1: the list has no 1W0 \(a step runs the backward"),
}


@pytest.mark.parametrize("case", list(PER_STAGE))
def test_each_per_stage_rule_is_named(case: str) -> None:
    stage, text, m, says = PER_STAGE[case]
    with pytest.raises(ScheduleError, match=says) as err:
        validate_stage(acts(text), stage=stage, num_stages=2, num_microbatches=m)
    assert err.value.actions and all(str(a) in str(err.value) for a in err.value.actions)
    # the same rule, met by the whole-schedule check (the other stage's list is valid)
    lists = [acts(t) for t in _gpipe_text(m)]
    lists[stage] = acts(text)
    with pytest.raises(ScheduleError, match=says):
        validate_schedule(lists, m)


def test_a_stage_outside_the_pipeline_is_refused() -> None:
    with pytest.raises(ScheduleError, match="stage 2 is not one of the pipeline's 2 stages"):
        validate_stage(acts("2F0"), stage=2, num_stages=2, num_microbatches=1)


def test_hand_written_schedule_is_valid_and_prints_as_a_step_by_stage_table() -> None:
    lists = [acts(t) for t in GPIPE_2X2]
    validate_schedule(lists, 2)
    # worked by hand: one action per step, a receive at the earliest one step after its send
    assert format_schedule(lists) == "\n".join([
        "step  stage 0   stage 1",
        "    0 0F0",
        "    1 0SEND_F0",
        "    2 0F1       1RECV_F0",
        "    3 0SEND_F1  1F0",
        "    4           1RECV_F1",
        "    5           1F1",
        "    6           1B0",
        "    7           1SEND_B0",
        "    8 0RECV_B0  1B1",
        "    9 0B0       1SEND_B1",
        "   10 0RECV_B1",
        "   11 0B1",
    ])


def test_every_transfer_needs_its_other_end() -> None:
    evaluates, trains = acts("0F0 0SEND_F0"), acts("1RECV_F0 1F0 1B0 1SEND_B0")
    with pytest.raises(ScheduleError, match="1SEND_B0 has no other end: stage 0's list has no 0RECV_B0"
                       ) as err:
        validate_schedule([evaluates, trains], 1)
    assert err.value.actions == (Action.parse("1SEND_B0"),)
    assert str(err.value).endswith("\n    5             *1SEND_B0*")  # the table, the action marked
    with pytest.raises(ScheduleError, match=r"0RECV_B0 has no other end: stage 1's list has no 1SEND_B0"):
        validate_schedule([acts("0F0 0SEND_F0 0RECV_B0 0B0"), acts("1RECV_F0 1F0")], 1)


def test_deadlock_is_found_named_and_shown() -> None:
    # Stage 0 waits for gradient 0 before it sends microbatch 1; stage 1 waits for microbatch 1
    # before it runs (and sends) backward 0. Each list is valid alone; together they wait forever.
    lists = [acts("0F0 0SEND_F0 0RECV_B0 0B0 0F1 0SEND_F1 0RECV_B1 0B1"),
             acts("1RECV_F0 1F0 1RECV_F1 1F1 1B0 1SEND_B0 1B1 1SEND_B1")]
    for s, stage_list in enumerate(lists):
        validate_stage(stage_list, stage=s, num_stages=2, num_microbatches=2)
    with pytest.raises(ScheduleError, match=r"deadlock: stage 0 waits at 0RECV_B0; stage 1 waits at 1RECV_F1"
                       ) as err:
        validate_schedule(lists, 2)
    assert err.value.actions == (Action.parse("0RECV_B0"), Action.parse("1RECV_F1"))
    table = str(err.value).splitlines()[1:]
    assert table[:5] == ["step  stage 0     stage 1", "    0 0F0", "    1 0SEND_F0",
                         "    2             1RECV_F0", "    3             1F0"]
    assert table[5] == "never runs:" and table[6] == "      *0RECV_B0*  *1RECV_F1*"


def _gpipe_text(m: int) -> tuple[str, str]:
    """Two stages' GPipe lists of ``m`` microbatches, as text."""
    return (" ".join([*(f"0F{i} 0SEND_F{i}" for i in range(m)), *(f"0RECV_B{i} 0B{i}" for i in range(m))]),
            " ".join([*(f"1RECV_F{i} 1F{i}" for i in range(m)), *(f"1B{i} 1SEND_B{i}" for i in range(m))]))


def test_a_long_table_shows_the_rows_near_the_offending_actions() -> None:
    stage0, stage1 = _gpipe_text(30)
    validate_schedule([acts(stage0), acts(stage1)], 30)
    swapped = stage0.replace("0F25 0SEND_F25", "0SEND_F25 0F25")  # stage 0 never waits here: step = position
    with pytest.raises(ScheduleError) as err:
        validate_schedule([acts(swapped), acts(stage1)], 30)
    lines = str(err.value).splitlines()
    assert lines[0] == "stage 0, action #50 (0SEND_F25): 0F25 must come before it"
    assert lines[1].startswith("step  stage 0") and lines[2] == lines[-1] == "  ..."
    assert [line[:5] for line in lines[3:-1]] == [f"{t:>5}" for t in range(46, 56)]
    assert lines[7].startswith("   50 *0SEND_F25*") and lines[8].startswith("   51 *0F25*")


def test_a_long_table_without_marks_shows_its_beginning() -> None:
    stage0, stage1 = _gpipe_text(30)
    with pytest.raises(ScheduleError, match=r"stage 1: the list has no 1B20 \(a step runs") as err:
        validate_schedule([acts(stage0), acts(stage1.replace(" 1B20 1SEND_B20", ""))], 30)
    lines = str(err.value).splitlines()
    assert len(lines) == 1 + 1 + 40 + 1 and lines[-1] == "  ..." and lines[-2].startswith("   39")


def test_a_schedule_needs_a_stage() -> None:
    with pytest.raises(ScheduleError, match="at least one stage"):
        validate_schedule([], 1)
