"""Sample assignment: epochs, global batches, replica and microbatch splits; factory names."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from coordinator.planning.data import BatchSampler, split_batch
from coordinator.planning.graph import CutInfo, TensorMeta
from coordinator.runtime.factories import factory_path
from coordinator.runtime.job import optimizer_spec
from coordinator.runtime.runspec import boundary_spec


@given(n=st.integers(1, 200), b=st.integers(1, 200), shuffle=st.booleans(), seed=st.integers(0, 5))
def test_every_sample_of_an_epoch_at_most_once(n: int, b: int, shuffle: bool, seed: int) -> None:
    if b > n:
        with pytest.raises(ValueError, match="global_batch"):
            BatchSampler(n, b)
        return
    sampler = BatchSampler(n, b, shuffle=shuffle, seed=seed)
    for epoch in range(2):
        first = epoch * sampler.steps_per_epoch
        used = [i for k in range(sampler.steps_per_epoch) for i in sampler.indices(first + k)]
        assert len(used) == len(set(used)) == (n // b) * b
        assert set(used) <= set(range(n))
        if n % b == 0:
            assert sorted(used) == list(range(n))


@given(n=st.sampled_from([3, 64, 1000, 70_000]), seed=st.integers(0, 3),
       steps=st.lists(st.integers(0, 5_000), min_size=1, max_size=12))
def test_each_epoch_is_its_own_seeded_draw_in_any_order_of_steps(n: int, seed: int, steps: list[int]) -> None:
    """The orders drawn ahead are the ones drawn one epoch at a time, whatever steps are asked (a resume
    goes back), so a run's samples do not depend on the order its steps were asked in."""
    b = max(1, n // 7)
    sampler = BatchSampler(n, b, seed=seed)
    for step in steps:
        epoch, k = divmod(step, sampler.steps_per_epoch)
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
        assert sampler.indices(step) == order[k * b:(k + 1) * b]


def test_split_is_contiguous_replicas_then_microbatches() -> None:
    assert split_batch(list(range(8)), 2, 2) == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    with pytest.raises(ValueError, match="does not split into 3 replicas x 1 microbatches"):
        split_batch(list(range(8)), 3, 1)
    # every shape against the definition: replica r's microbatch k is the (r m + k)-th of d m equal parts
    for d, m, size in itertools.product([1, 2, 3, 5], [1, 2, 4], [1, 3]):
        indices = [7 * i % 101 for i in range(d * m * size)]
        parts = [indices[i * size:(i + 1) * size] for i in range(d * m)]
        assert split_batch(indices, d, m) == [[parts[r * m + k] for k in range(m)] for r in range(d)]


def module_level_factory() -> list[int]:
    return []


def test_factory_paths() -> None:
    assert factory_path(module_level_factory, what="model factory") == f"{__name__}:module_level_factory"
    assert factory_path("torch.nn:MSELoss", what="loss factory") == "torch.nn:MSELoss"
    with pytest.raises(ValueError, match="cannot be imported by name"):
        factory_path(lambda: None, what="model factory")
    with pytest.raises(ValueError, match="no attribute"):
        factory_path("torch.nn:Nope", what="model factory")


def test_optimizer_spec() -> None:
    import torch

    spec = optimizer_spec(torch.optim.Adam, {"lr": 0.1, "betas": (0.8, 0.9)})
    assert spec.name == "Adam" and spec.kwargs == {"lr": 0.1, "betas": [0.8, 0.9]}
    with pytest.raises(ValueError, match=r"not a torch\.optim optimizer"):
        optimizer_spec("Teleport", {})


def test_boundary_spec_from_a_dict_cut() -> None:
    h = TensorMeta(name="mix.h", shape=(4, 3), dtype="float64", requires_grad=True, nbytes=96, batch_dim=0)
    pos = TensorMeta(name="mix.pos", shape=(4, 3), dtype="int64", requires_grad=False, nbytes=96, batch_dim=0)
    metas = (h, pos)
    spec = boundary_spec(CutInfo(index=2, tensors=metas, structure="dict"), 4)
    assert [(t.name, t.dict_key, t.requires_grad) for t in spec.tensors] == [("mix.h", "h", True),
                                                                            ("mix.pos", "pos", False)]
    skips = boundary_spec(CutInfo(index=2, tensors=metas, structure="values"), 4)  # two values: a skip
    assert skips.structure == "values" and [(t.name, t.key) for t in skips.tensors] == [("mix.h", None),
                                                                                        ("mix.pos", None)]
    with pytest.raises(ValueError, match="cut 2 cannot lie between two stages: n is a int"):
        boundary_spec(CutInfo(index=2, tensors=metas, uncuttable_reason="n is a int"), 4)
