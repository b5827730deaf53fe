"""The preflight's checks of a model's random draws and BatchNorm layers (no worker starts)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job

M = "tests.multiproc.coordinator.models"
R = "tests.multiproc.coordinator.random_models"


def job(**fields: Any) -> Job:
    given: dict[str, Any] = {"model": f"{R}:dropout_mlp", "data": f"{M}:regression", "loss": f"{M}:mse",
                             "global_batch": 16, "resources": Resources.local(2), **fields}
    return Job(**given)


def test_a_model_dropping_along_dim_0_passes() -> None:
    assert len(job().check().chain) == 5


def test_a_draw_with_the_batch_on_another_dim_is_named_with_the_fix() -> None:
    with pytest.raises(JobError) as info:
        job(model=f"{R}:sequence_first").check()
    assert str(info.value) == (
        f"model factory '{R}:sequence_first': module '1.drop' draws random tensors of shape [3, 2, 12] for "
        "2 samples and [3, 3, 12] for 3: its size follows the batch but not along dim 0, and cellmesh keys "
        "random values per sample along dim 0 only, so every plan would draw other values than one process "
        "does; put the batch first (batch_first=True)")


def test_batch_norm_layers_are_found_and_fixed_microbatches_refused_before_profiling() -> None:
    bn = {"model": f"{R}:bn_net", "data": f"{R}:images"}
    assert job(**bn).check().batch_norm == ("1 (BatchNorm2d)", "5 (BatchNorm1d)")
    assert job().check().batch_norm == ()
    with pytest.raises(PlanningError, match=r"^BatchNorm layer 1 \(BatchNorm2d\) .* num_microbatches=4"):
        job(**bn, num_microbatches=4).check()


def test_a_draw_in_code_fx_traces_into_is_refused_naming_the_module_and_the_leaves_fix() -> None:
    plain = f"{R}:plain_dropping"
    with pytest.raises(JobError) as info:
        job(model=plain).check()
    assert str(info.value).startswith(
        f"model factory '{plain}': submodule 'a' draws random numbers (dropout) in code torch.fx traces into")
    fix = "list it in model.leaves (model: {leaves: [DropBlock]}, Job(leaves=['DropBlock']))"
    assert fix in str(info.value)  # both blocks are DropBlocks: the class name stands for both
    for leaves in (["DropBlock"], ["a", "c"]):  # the fix: each block one node, keyed by its name
        checked = job(model=plain, leaves=leaves).check()
        assert [nd.name for nd in checked.chain.nodes] == ["inp", "a", "c", "out"]
