"""A data factory's samples: inputs and targets of one length, a loader that returns one row per index."""

from __future__ import annotations

import pytest
import torch

from services.compute.stage import SampleError, SampleSource, sample_count

WHAT = "data factory 'pkg.data:samples'"


def test_a_pair_counts_its_rows_and_loads_by_index() -> None:
    x, y = torch.arange(12.0).reshape(6, 2), torch.arange(6)
    source = SampleSource((x, y), what=WHAT)
    assert source.num_samples == 6
    inputs, targets = source.load([4, 1])
    assert torch.equal(inputs, x[[4, 1]]) and torch.equal(targets, y[[4, 1]])
    nested = ({"a": torch.zeros(5, 3), "b": torch.zeros(5)}, [torch.zeros(5, 1), torch.zeros(5, 2)])
    assert sample_count(*nested, what=WHAT) == 5


@pytest.mark.parametrize(("inputs", "targets", "says"), [
    (torch.zeros(256, 4), torch.zeros(200, 1), "returns 256 inputs but 200 targets"),
    ((torch.zeros(8, 2), torch.zeros(7, 2)), torch.zeros(8), "returns 8 inputs.0/targets but 7 inputs.1"),
    ({"ids": torch.zeros(3, 2)}, {"y": torch.zeros(4)}, "returns 3 inputs.ids but 4 targets.y"),
    (torch.zeros(4, 2), torch.tensor(1.0), "targets is a 0-dim tensor"),
    ([], (), "hold no tensor"),
])
def test_inputs_and_targets_of_different_lengths_are_refused(inputs: object, targets: object,
                                                             says: str) -> None:
    with pytest.raises(SampleError, match="^" + WHAT) as info:
        SampleSource((inputs, targets), what=WHAT)
    assert says in str(info.value), str(info.value)


def test_a_loader_must_return_one_row_per_index() -> None:
    def short(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(indices), 2), torch.zeros(len(indices) - 1)

    def more(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(len(indices) + 1, 2), torch.zeros(len(indices) + 1)

    def good(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor(indices, dtype=torch.float64)[:, None], torch.tensor(indices)

    with pytest.raises(SampleError, match=r"load\(4 indices\) returns 4 inputs but 3 targets"):
        SampleSource(short, what=WHAT).load([0, 1, 2, 3])
    with pytest.raises(SampleError, match=r"load\(2 indices\) returned 3 samples; it must return one per"):
        SampleSource(more, what=WHAT).load([0, 1])
    inputs, targets = SampleSource(good, what=WHAT).load([3, 5])
    assert inputs.tolist() == [[3.0], [5.0]] and targets.tolist() == [3, 5]
