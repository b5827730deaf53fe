"""A stage's step programs: validated once when loaded, copied into each step naming them, bounded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comm.codec import pack, unpack
from services.compute.chain import trace_chain
from services.compute.programs import Programs, UnknownProgram
from services.compute.stage import SampleSource, Stage
from services.protocol import MAX_PROGRAMS, PROGRAM_FIELDS, Action, LoadProgram, RunStep, StepProgram


def _stage(*, batch_norm: bool = False) -> Stage:
    layers = [nn.Linear(3, 4), *([nn.BatchNorm1d(4)] if batch_norm else []), nn.Linear(4, 1)]
    chain = trace_chain(layers)
    data = SampleSource((torch.randn(8, 3), torch.randn(8, 1)), what="data")
    return Stage(index=0, num_stages=1, start=0, stop=len(layers), nodes=tuple(nd.name for nd in chain.nodes),
                 module=chain.stage_module(0, len(layers)), tensors=chain.stage_tensors(0, len(layers)),
                 samples=data, loss_fn=nn.MSELoss(), loss_reduction="mean", incoming=None, outgoing=None)


def _actions(text: str) -> list[Action]:
    return [Action.parse(a) for a in text.split()]


TRAIN = _actions("0F0 0F1 0B0 0B1")


def _load(name: str = "train", actions: list[Action] = TRAIN, **fields: object) -> LoadProgram:
    return LoadProgram.model_validate({"program": name, "num_microbatches": 2, "actions": actions, **fields})


def test_a_step_naming_a_program_runs_with_every_per_plan_field_of_it() -> None:
    programs = Programs(_stage(), [])
    programs.load(_load(zero_grad=False))
    step = RunStep(step=3, microbatches=[[0, 1], [2]], program="train", loss_scale=2.0)
    resolved, trains = programs.resolve(step)
    assert trains and resolved.actions == TRAIN and resolved.zero_grad is False
    assert {f: getattr(resolved, f) for f in PROGRAM_FIELDS} == {
        f: getattr(_load(zero_grad=False), f) for f in StepProgram.model_fields}
    assert (resolved.step, resolved.microbatches, resolved.loss_scale) == (3, [[0, 1], [2]], 2.0)
    # the step's own request stays small and reads back as sent (its program fields at their defaults)
    assert unpack(pack(step), RunStep) == step


def test_a_step_carrying_its_actions_is_checked_as_before() -> None:
    programs = Programs(_stage(), [])
    resolved, trains = programs.resolve(RunStep(step=0, microbatches=[[0], [1]], actions=_actions("0F0 0F1"),
                                                source="train"))
    assert not trains and resolved.actions == _actions("0F0 0F1")
    with pytest.raises(ValueError, match=r"action #0 \(0B0\): 0F0 must come before it"):
        programs.resolve(RunStep(step=0, microbatches=[[0]], actions=_actions("0B0 0F0")))


def test_unknown_programs_wrong_microbatches_and_bad_programs_are_refused() -> None:
    programs = Programs(_stage(), [])
    with pytest.raises(UnknownProgram, match=r"holds no program 'train' \(it holds none\): send it with "
                                             r"load_program first"):
        programs.resolve(RunStep(step=0, microbatches=[[0]], program="train"))
    programs.load(_load())
    with pytest.raises(ValueError, match="program 'train' runs 2 microbatches, the step brings 1"):
        programs.resolve(RunStep(step=0, microbatches=[[0]], program="train"))
    with pytest.raises(ValueError, match="names stage 1"):  # a failing load drops what the name held
        programs.load(_load(actions=_actions("1F0 1F1 1B0 1B1")))
    with pytest.raises(UnknownProgram, match="holds no program 'train'"):
        programs.resolve(RunStep(step=0, microbatches=[[0], [1]], program="train"))
    with pytest.raises(ValueError, match=r"evaluation step .* runs no backward"):
        programs.load(_load("eval", source="eval"))
    with pytest.raises(ValueError, match="a step naming program 'p' takes \\['actions'\\] from it"):
        RunStep(step=0, microbatches=[[0]], program="p", actions=TRAIN)
    with pytest.raises(ValueError, match="has no actions"):
        _load(actions=[])
    with pytest.raises(ValueError, match="program\n  String should match pattern"):
        RunStep(step=0, microbatches=[[0]], program="../train; rm")


def test_batch_norm_is_checked_when_the_program_is_loaded() -> None:
    programs = Programs(_stage(batch_norm=True), ["1 (BatchNorm1d)"])
    with pytest.raises(ValueError, match="2 microbatches would each be normalised on their own"):
        programs.load(_load())


def test_a_stage_holds_a_bounded_number_of_programs_and_a_name_loaded_again_replaces_its_program() -> None:
    programs = Programs(_stage(), [])
    for i in range(MAX_PROGRAMS):
        programs.load(_load(f"p{i}"))
    with pytest.raises(ValueError, match=f"holds {MAX_PROGRAMS} programs already"):
        programs.load(_load("one-more"))
    programs.load(_load("p0", actions=_actions("0F0 0F1")))  # replaces p0: no bound reached
    resolved, trains = programs.resolve(RunStep(step=0, microbatches=[[0], [1]], program="p0"))
    assert resolved.actions == _actions("0F0 0F1") and not trains
