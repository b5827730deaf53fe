"""ZeRO's refusals: an optimizer that is not elementwise cannot step row shards (named before any worker)."""

from __future__ import annotations

import pytest

from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job
from coordinator.runtime.preflight import check_optimizer
from services.params.zero import NOT_ELEMENTWISE, check_elementwise

M = "tests.multiproc.coordinator.models"
BASE = {"model": f"{M}:mlp", "data": f"{M}:regression", "loss": f"{M}:mse", "data_parallel": 2}


@pytest.mark.parametrize("name", sorted(NOT_ELEMENTWISE))
def test_an_optimizer_that_is_not_elementwise_is_refused_with_zero(name: str) -> None:
    with pytest.raises(ValueError, match=f"optimizer {name} is not elementwise.*drop plan.zero"):
        check_elementwise(name)
    with pytest.raises(JobError, match=f"optimizer {name} is not elementwise"):
        check_optimizer(Job(**BASE, optimizer=name, zero=2).config)


@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"])
def test_elementwise_optimizers_pass(name: str) -> None:
    check_elementwise(name)
    check_optimizer(Job(**BASE, optimizer=name, optimizer_kwargs={"lr": 0.01}, zero=1).config)


def test_without_zero_any_optimizer_is_checked_as_before() -> None:
    check_optimizer(Job(**BASE, optimizer="LBFGS", optimizer_kwargs={"lr": 0.1}).config)


@pytest.mark.parametrize(("kwargs", "zero", "warned"), [
    ({"lr": 0.01}, 1, True),  # plain SGD keeps no state: ZeRO-1 would only add an all-gather
    ({"lr": 0.01, "momentum": 0.9}, 1, False),  # a momentum buffer per parameter: worth sharding
    ({"lr": 0.01}, 2, False),  # ZeRO-2 still shards the gradients
])
def test_zero1_with_an_optimizer_that_keeps_no_state_is_warned(caplog: pytest.LogCaptureFixture,
                                                               kwargs: dict[str, float], zero: int,
                                                               warned: bool) -> None:
    with caplog.at_level("WARNING", logger="coordinator.runtime.preflight"):
        check_optimizer(Job(**BASE, optimizer="SGD", optimizer_kwargs=kwargs, zero=zero).config)
    assert any("keeps none" in r.getMessage() for r in caplog.records) == warned, caplog.text
