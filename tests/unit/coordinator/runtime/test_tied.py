"""Finding the parameters a plan ties across stages, and the options each holding stage gets."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from coordinator.planning.resources import Resources
from coordinator.runtime.job import Job
from coordinator.runtime.preflight import model_structure
from coordinator.runtime.tied import shared_parameters, tied_per_stage
from services.compute.cell import Cell
from services.compute.chain import trace_chain
from services.compute.stage import Stage
from services.protocol import ComputeOptions, TiedOptions, TiedParam
from tests.multiproc.coordinator import tied_models

T = "tests.multiproc.coordinator.tied_models"
M = "tests.multiproc.coordinator.models"


class Scaled(nn.Module):
    """Uses ``weight`` as given (another cell's Parameter, or its own)."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.weight


def scaled_cells(n: int) -> tuple[list[Cell], nn.Parameter]:
    """``n`` cells ``c0..`` each scaling by its own weight; the caller ties some of them."""
    shared = nn.Parameter(torch.ones(3))
    return [Cell(f"c{i}", Scaled(nn.Parameter(torch.ones(3)))) for i in range(n)], shared


def test_the_tied_gpt_shares_its_embedding_with_its_head() -> None:
    assert shared_parameters(trace_chain(tied_models.tied_gpt())) == {"embed.tok.weight": (0, 3)}


def test_a_parameter_used_twice_in_one_cell_is_not_shared() -> None:
    inner = nn.Linear(3, 3)
    twice = nn.Sequential(inner, inner)  # one Parameter under two names, within one cell
    assert shared_parameters(trace_chain([Cell("a", twice), Cell("b", nn.Linear(3, 3))])) == {}


def test_held_by_two_stages_is_tied_under_one_name_on_every_stage() -> None:
    shared = shared_parameters(trace_chain(tied_models.tied_gpt()))
    stage0, stage1 = tied_per_stage(shared, [(0, 2), (2, 4)])
    assert stage0 == stage1 == [TiedParam(name="embed.tok.weight", key="embed.tok.weight", stages=[0, 1])]
    assert stage0[0].owner == 0


def test_held_by_one_stage_only_is_not_tied() -> None:
    shared = shared_parameters(trace_chain(tied_models.tied_gpt()))
    assert tied_per_stage(shared, [(0, 4)]) == [[]]


def test_stages_between_the_holders_hold_nothing_and_the_stage_names_it_as_the_chain_does() -> None:
    cells, shared = scaled_cells(5)
    for i in (0, 2, 3):  # c0 on stage 0, c2 and c3 both on stage 1, none on stage 2
        cells[i].module.weight = shared
    chain = trace_chain(cells)
    found = shared_parameters(chain)
    assert found == {"c0.weight": (0, 2, 3)}
    per_stage = tied_per_stage(found, [(0, 2), (2, 4), (4, 5)])
    tied = TiedParam(name="c0.weight", key="c0.weight", stages=[0, 1])
    assert per_stage == [[tied], [tied], []]
    # what the stage itself calls it: the name Stage.parameters() gives
    stage1 = Stage(index=1, num_stages=3, start=2, stop=4, nodes=("c2", "c3"),
                   module=chain.stage_module(2, 4), tensors=chain.stage_tensors(2, 4), samples=None,
                   loss_fn=None, loss_reduction="mean", incoming=None, outgoing=None)
    assert [n for n, p in stage1.parameters() if p is shared] == ["c0.weight"]


def test_two_tied_parameters_with_different_holders() -> None:
    cells, a = scaled_cells(3)
    b = nn.Parameter(torch.ones(3))
    cells[0].module.weight = cells[2].module.weight = a
    cells[0].module.bias = cells[1].module.bias = b
    per_stage = tied_per_stage(shared_parameters(trace_chain(cells)), [(0, 1), (1, 2), (2, 3)])
    weight = TiedParam(name="c0.weight", key="c0.weight", stages=[0, 2])
    bias = TiedParam(name="c0.bias", key="c0.bias", stages=[0, 1])
    assert [sorted(ps, key=lambda p: p.name) for ps in per_stage] == [[bias, weight], [bias], [weight]]


def test_a_holding_node_outside_every_stage_is_an_error() -> None:
    shared = shared_parameters(trace_chain(tied_models.tied_gpt()))
    with pytest.raises(ValueError, match=r"node 3 \(holding 'embed.tok.weight'\) is in none of the"):
        tied_per_stage(shared, [(0, 3)])


def test_from_a_job_s_plan_and_its_model_on_the_meta_device() -> None:
    job = Job(model=f"{T}:tied_gpt", loss=f"{M}:token_loss", data=f"{M}:tokens", global_batch=8, num_stages=2,
              balance=[1, 3], resources=Resources.local(2))
    _, chain = model_structure(job.config)  # the coordinator's copy: identity is all that is needed
    plan = job.plan()
    per_stage = tied_per_stage(shared_parameters(chain), [(st.start, st.stop) for st in plan.stages])
    assert [[(p.name, p.stages) for p in ps] for ps in per_stage] == [
        [("embed.tok.weight", [0, 1])], [("embed.tok.weight", [0, 1])]]


def test_the_options_refuse_a_tied_entry_that_does_not_fit_the_stage() -> None:
    base = dict(stage=1, num_stages=2, registry="tcp://127.0.0.1:1", comm_prefix="/p", data="m:d", loss="m:l",
                incoming={"structure": "tensor", "batch_size": 1, "tensors": [
                    {"name": "x", "dtype": "float64", "shape": [1, 8], "requires_grad": True}]})
    ok = TiedOptions(prefix="/t", params=[TiedParam(name="head.out.weight", key="embed.tok.weight",
                                                    stages=[0, 1])])
    assert ComputeOptions.model_validate({**base, "tied": ok.model_dump()}).tied == ok
    for stages in ([0, 2], [2, 3]):  # not held by this stage; a stage beyond the pipeline
        bad = ok.model_copy(update={"params": [TiedParam(name="w", key="w", stages=stages)]})
        with pytest.raises(ValidationError, match=r"tied \(held by this stage"):
            ComputeOptions.model_validate({**base, "tied": bad.model_dump()})
    with pytest.raises(ValidationError, match="must be distinct"):
        TiedParam(name="w", key="w", stages=[1, 0])
    with pytest.raises(ValidationError, match="tied parameter keys repeat"):
        TiedOptions(prefix="/t", params=[TiedParam(name=n, key="k", stages=[0, 1]) for n in ("a", "b")])
