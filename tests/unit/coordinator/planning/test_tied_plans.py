"""Tied weights in the planner: the profile knows which nodes hold one parameter, and a plan whose cut
puts them on different stages never runs ZeRO-2 or 3 (their stages sum the tied gradient whole)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from coordinator.planning.config import PlanConfig
from coordinator.planning.graph import build_graph
from coordinator.planning.planner import candidate_plans, choose_plan
from coordinator.planning.profile import Profile, profile_graph
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources, Worker

MiB = 1 << 20


class TiedLM(nn.Module):
    """Embedding, two layers and a head that shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.b(torch.tanh(self.a(self.emb(idx))))))


def test_the_profile_lists_the_nodes_that_share_a_parameter() -> None:
    sample = torch.randint(0, 16, (4, 5))
    prof = profile_graph(build_graph(TiedLM(), sample), sample, repeats=1, warmup=0)
    assert [n.name for n in prof.nodes] == ["emb", "a", "b", "head"]
    assert prof.ties == ((0, 3),)
    assert Profile.model_validate_json(prof.model_dump_json()).ties == ((0, 3),)
    untied = TiedLM()
    untied.head.weight = nn.Parameter(untied.emb.weight.detach().clone())
    assert profile_graph(build_graph(untied, sample), sample, repeats=1, warmup=0).ties == ()


def tied_profile() -> Profile:
    """4 nodes of 8 MiB parameters, the first and the last holding one parameter (embedding and head)."""
    prof = Profile.synthetic([1e-3] * 4, param_bytes=[8 * MiB] * 4, activation_bytes=[MiB] * 4,
                             cut_bytes=[256 * 1024] * 3, microbatch_size=4)
    return prof.model_copy(update={"ties": ((0, 3),)})


def workers(num: int, memory: int = 4096 * MiB) -> Resources:
    return Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=memory, host="h") for i in range(num)))


def test_tied_across_says_whether_a_cut_separates_the_holders() -> None:
    prof = tied_profile()
    assert not prof.tied_across((0, 4))
    assert prof.tied_across((0, 2, 4)) and prof.tied_across((0, 1, 4)) and prof.tied_across((0, 3, 4))
    for bad in ((3, 0),), ((1,),), ((2, 4),):
        with pytest.raises(ValidationError, match="a tie"):
            Profile.model_validate(prof.model_dump() | {"ties": bad})


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_2_and_3_are_not_planned_across_a_tie(zero: int) -> None:
    prof = tied_profile()
    pipeline = PlanConfig(num_stages=2, data_parallel=2, zero=zero, shard_factor=2)
    cands = candidate_plans(prof, workers(4), pipeline, global_batch=16)
    assert cands and not any(c.fits for c in cands)
    assert all("tied parameter" in c.reason for c in cands if c.plan is not None)
    with pytest.raises(PlanningError, match=r"no plan the request allows can run .*tied parameter.*Without "
                                            r"fixing .*, this plan fits") as raised:
        choose_plan(prof, workers(4), pipeline, global_batch=16)
    assert "memory" not in str(raised.value)
    # one stage holds both: sharded as any other; ZeRO-1 keeps whole gradients across the stages
    one = choose_plan(prof, workers(4), PlanConfig(num_stages=1, data_parallel=4, zero=zero, shard_factor=4),
                      global_batch=16)
    assert one.zero_stage == zero
    z1 = choose_plan(prof, workers(4), PlanConfig(num_stages=2, data_parallel=2, zero=1, shard_factor=2),
                     global_batch=16)
    assert (z1.num_stages, z1.zero_stage) == (2, 1)
