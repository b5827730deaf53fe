"""ZeRO-3's stage units: the leaf modules of a stage's graph in order, and the parameters none of them holds
alone (the stage's own unit); an optimizer that cannot step row shards is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job
from coordinator.runtime.preflight import check_optimizer
from services.compute.chain import trace_chain
from services.params.sharded_path import stage_units

M = "tests.multiproc.coordinator.models"


def test_a_stage_s_units_are_its_leaf_modules_in_graph_order() -> None:
    model = [nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2), nn.LayerNorm(2)]
    chain = trace_chain(model)
    units, own = stage_units(chain.stage_module(1, 4))
    assert own == []
    assert [name for name, _ in units] == ["cell1", "cell2", "cell3"]
    assert [type(m.module) for _, m in units] == [nn.Tanh, nn.Linear, nn.LayerNorm]


class Free(nn.Module):
    """Parameters its forward uses outside the leaves, one two leaves share, one read beside its leaf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.gain = nn.Parameter(torch.ones(3))
        self.twin = nn.Linear(3, 3)
        self.twin.weight = self.lin.weight
        self.out = nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.twin(self.lin(x) * self.gain)) + self.out.bias.sum()


def test_parameters_no_leaf_module_holds_alone_are_the_stage_s_own() -> None:
    chain = trace_chain(Free())
    module = chain.stage_module(0, len(chain))
    units, own = stage_units(module)
    assert [name for name, _ in units] == ["lin", "twin", "out"]
    assert sorted(name for name, _ in own) == ["gain", "lin.weight", "out.bias"]
    assert all(p is module.get_parameter(name) for name, p in own)


def test_an_optimizer_that_is_not_elementwise_is_refused_with_zero3() -> None:
    job = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", data_parallel=2, optimizer="LBFGS",
              zero=3)
    with pytest.raises(JobError, match="optimizer LBFGS is not elementwise"):
        check_optimizer(job.config)
