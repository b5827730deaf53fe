"""``Job(config)`` or ``Job(**fields)``: one config either way, checked when the job is made."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from coordinator.planning.config import ConfigError, parse_config
from coordinator.planning.resources import Resources
from coordinator.runtime.job import Job
from tests.multiproc.coordinator import models

M = "tests.multiproc.coordinator.models"


def test_flat_fields_and_a_whole_config_make_the_same_job() -> None:
    flat = Job(model=models.mlp, data=f"{M}:regression", loss=f"{M}:mse", optimizer=torch.optim.Adam,
               optimizer_kwargs={"lr": 0.1, "betas": (0.9, 0.95)}, global_batch=16, num_stages=2, workers=3,
               steps=4, step_timeout_s=30)
    config = parse_config({
        "model": {"factory": f"{M}:mlp"}, "data": {"factory": f"{M}:regression", "global_batch": 16},
        "loss": {"factory": f"{M}:mse"},
        "optimizer": {"name": "Adam", "kwargs": {"lr": 0.1, "betas": [0.9, 0.95]}},
        "plan": {"num_stages": 2}, "runtime": {"workers": 3, "step_timeout_s": 30}, "steps": 4})
    assert flat.config == config
    whole = Job(config)
    assert whole.config is config and whole.resources == flat.resources == Resources.local(3)
    assert whole.optimizer == flat.optimizer and flat.optimizer.kwargs["betas"] == [0.9, 0.95]
    spec = whole.run_spec("workers", "run-1")
    assert (spec.model, spec.seed, spec.step_timeout.total_seconds()) == (f"{M}:mlp", 0, 30.0)


def test_given_resources_replace_the_local_workers() -> None:
    job = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", resources=Resources.local(4))
    assert job.resources.num_workers == 4 and job.config.runtime.workers == 2


@pytest.mark.parametrize(("kwargs", "error", "message"), [
    (dict(num_stagez=2), ConfigError, r"unknown job field\(s\) \['num_stagez'\]"),
    (dict(num_stages=0), ConfigError, r"field 'plan.num_stages': Input should be greater than or equal to 1"),
    (dict(optimizer="Adamm"), ValueError, r"optimizer 'Adamm' is not a torch.optim optimizer class"),
    (dict(model=f"{M}:no_such_model"), ValueError, r"model factory '.*:no_such_model'.* has no attribute"),
    (dict(model=lambda: []), ValueError, r"cannot be imported by name by the workers"),
])
def test_a_bad_field_is_refused_when_the_job_is_made(kwargs: dict[str, object], error: type[Exception],
                                                     message: str) -> None:
    fields: dict[str, object] = {"model": f"{M}:mlp", "data": f"{M}:regression", "loss": f"{M}:mse", **kwargs}
    with pytest.raises(error, match=message):
        Job(**fields)


def test_a_config_and_fields_together_are_refused() -> None:
    config = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse").config
    with pytest.raises(TypeError, match="not both"):
        Job(config, num_stages=2)


def test_replanning_on_one_worker_left_drops_a_fixed_zero_stage_it_cannot_shard_over(
        caplog: pytest.LogCaptureFixture) -> None:
    """A worker lost for good (elastic): ZeRO-3 over 2 replicas on the 1 worker left trains replicated, and
    back on 2 workers sharded again (before: 'no plan fits the 1 workers left (local-0): plan.zero=3 shards
    a stage's state across 2 or more collective replicas ...', and the job stopped)."""
    job = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", global_batch=16, data_parallel=2,
              num_stages=1, num_microbatches=1, zero=3, shard_factor=2, resources=Resources.local(2))
    assert job.plan().zero_stage == 3
    with caplog.at_level("WARNING"):
        alone = job.replan(Resources.local(1))
    assert (alone.num_workers, alone.zero_stage) == (1, 0), alone.summary()
    assert "plan.zero, plan.shard_factor do not fit 1 workers" in caplog.text
    assert job.replan(Resources.local(2)).zero_stage == 3


class _EightRows(nn.Module):
    """Runs on microbatches of 8 samples only (a reshape that fixes the batch)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(models.IN, models.OUT, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.reshape(8, -1))


def eight_rows() -> list[nn.Module]:
    return [_EightRows()]


def test_the_plan_is_priced_on_timings_at_its_own_microbatch_size(caplog: pytest.LogCaptureFixture) -> None:
    """[Note: the plan's own size]: the search weighs plans on the 8-sample profile; one microbatch of 16 is
    then timed at 16 samples and the same plan priced on it."""
    fields = dict(data=f"{M}:regression", loss=f"{M}:mse", global_batch=16, resources=Resources.local(1))
    job = Job(model=f"{M}:mlp", num_microbatches=1, **fields)
    with caplog.at_level("INFO", logger="coordinator.runtime.job"):
        plan = job.plan()
    assert job.weighed is not None and job.weighed.microbatch_size == plan.microbatch_size == 16
    shape = ("bounds", "placement", "schedule_name", "num_microbatches", "chunks", "mode", "zero_stage")
    assert all(getattr(plan, f) == getattr(job.weighed, f) for f in shape)
    assert plan.step_time_s != job.weighed.step_time_s  # timed anew
    assert "the plan priced on 16-sample microbatches" in caplog.text
    # microbatches of the profile's own 8 samples: priced as weighed
    again = Job(model=f"{M}:mlp", num_microbatches=2, **fields)
    assert again.plan().microbatch_size == 8 and again.weighed is None
    # a model whose batch the graph cannot follow (it runs on 8 samples only) keeps the search's price
    fixed = Job(model=eight_rows, num_microbatches=1, **fields)
    with caplog.at_level("WARNING", logger="coordinator.runtime.job"):
        assert fixed.plan().microbatch_size == 16 and fixed.weighed is None
    said = "the plan keeps the price of the 8-sample profile: timing it on its own microbatch of 16 samples"
    assert said in caplog.text


def test_the_search_says_how_long_it_took_and_how_a_slow_one_narrows(caplog: pytest.LogCaptureFixture,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A search over every stage count that took longer than ``SLOW_SEARCH_S`` names ``plan.num_stages``;
    one with the stage count set does not (it searched only those plans)."""
    from coordinator.runtime import job as job_module
    monkeypatch.setattr(job_module, "SLOW_SEARCH_S", 0.0)  # every search is slow
    fields = dict(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", global_batch=16,
                  resources=Resources.local(2))
    with caplog.at_level("INFO", logger="coordinator.runtime.job"):
        free = Job(**fields)  # type: ignore[arg-type]
        free.plan()
    assert "the planner searched the plans for 2 worker(s) in" in caplog.text
    assert free.search_s is not None and free.search_hint is not None
    assert free.search_hint in caplog.text and "a job that sets plan.num_stages" in free.search_hint
    caplog.clear()
    with caplog.at_level("INFO", logger="coordinator.runtime.job"):
        fixed = Job(num_stages=1, **fields)  # type: ignore[arg-type]
        fixed.plan()
    assert "the planner searched the plans for 2 worker(s) in" in caplog.text
    assert fixed.search_hint is None and "plan.num_stages" not in caplog.text
