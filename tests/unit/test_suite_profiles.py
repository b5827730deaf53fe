"""The suite's kept profiles ([Note: the suite's profiles] in tests/harness/profiles.py): one profile per
computation, a new one for any change a profile would see, and the real profiler where a test asks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from coordinator.planning.graph import Graph, build_graph
from coordinator.planning.profile import Profile, profile_graph
from coordinator.runtime import job
from services.compute.cell import Cell
from tests.harness.profiles import ProfileMemo, fingerprint


class Scaled(nn.Module):
    """A leaf module whose setting the traced code does not show."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def extra_repr(self) -> str:
        return f"factor={self.factor}"


def model(width: int = 32, *, act: type[nn.Module] = nn.ReLU, dtype: torch.dtype = torch.float32,
          factor: float = 2.0) -> list[Cell]:
    return [Cell("in", nn.Linear(8, width, dtype=dtype)), Cell("act", act()), Cell("scale", Scaled(factor)),
            Cell("out", nn.Linear(width, 2, dtype=dtype))]


def graph_of(cells: list[Cell], batch: int = 4, dtype: torch.dtype = torch.float32
             ) -> tuple[Graph, torch.Tensor]:
    sample = torch.randn(batch, 8, dtype=dtype)
    return build_graph(cells, sample), sample


def key(cells: list[Cell], batch: int = 4, dtype: torch.dtype = torch.float32, **options: Any
        ) -> tuple[Any, ...]:
    graph, sample = graph_of(cells, batch, dtype)
    return fingerprint(graph, sample, repeats=3, **options)


def test_the_same_computation_has_one_fingerprint_and_every_change_another() -> None:
    same = key(model())
    assert key(model()) == same  # built again, other weights, another sample's values
    changed = [key(model(64)), key(model(act=nn.GELU)), key(model(factor=3.0)), key(model(), batch=6),
               key(model(dtype=torch.float64), dtype=torch.float64), key(model(), optimizer="sgd")]
    assert same not in changed and len(set(changed)) == len(changed)
    frozen = model()
    frozen[0].module.weight.requires_grad_(False)  # one gradient fewer: another backward
    assert key(frozen) != same


def test_the_memo_profiles_each_computation_once_and_keeps_the_latest() -> None:
    calls: list[int] = []

    def profiler(graph: Graph, sample: Any, **options: Any) -> Profile:
        calls.append(len(graph))
        return profile_graph(graph, sample, **options)

    memo = ProfileMemo(profiler, size=2)
    first = memo(*graph_of(model()), repeats=1, num_threads=1)
    assert memo(*graph_of(model()), repeats=1, num_threads=1) is first and memo.taken == 1
    wide = memo(*graph_of(model(64)), repeats=1, num_threads=1)
    assert wide is not first and wide.nodes[0].param_bytes == (8 * 64 + 64) * 4 and memo.taken == 2
    memo(*graph_of(model(16)), repeats=1, num_threads=1)  # the third: the least recent (32 wide) goes
    assert memo(*graph_of(model(64)), repeats=1, num_threads=1) is wide and memo.taken == 3
    assert memo(*graph_of(model()), repeats=1, num_threads=1) is not first and memo.taken == 4
    assert len(calls) == 4


def test_jobs_get_the_memo() -> None:
    assert isinstance(job.profile_graph, ProfileMemo)


@pytest.mark.fresh_profile
def test_a_test_marked_fresh_profile_gets_the_profiler() -> None:
    assert job.profile_graph is profile_graph
