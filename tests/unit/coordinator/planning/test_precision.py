"""``plan.precision``: one config field, settable everywhere, carried by the plan and printed with it."""

from __future__ import annotations

from typing import get_args

import pytest
from pydantic import ValidationError

from coordinator.planning.config import FLAT_KEYS, ConfigError, PlanConfig, Precision, from_flat, parse_config
from coordinator.planning.plan import Plan
from coordinator.planning.planner import choose_plan
from coordinator.planning.profile import Profile
from coordinator.planning.request import PlanningError
from coordinator.planning.resources import Resources, Worker

BASE = {"model": {"factory": "pkg.m:mlp"}, "data": {"factory": "pkg.m:data"},
        "loss": {"factory": "torch.nn:MSELoss"}}
MiB = 2**20


def test_fp32_by_default_and_settable_in_the_spec_the_api_and_on_the_command_line() -> None:
    assert parse_config(BASE).plan.precision == "fp32"
    assert parse_config({**BASE, "plan": {"precision": "bf16"}}).plan.precision == "bf16"
    assert FLAT_KEYS["precision"] == "plan.precision"
    flat = from_flat({"model": "pkg.m:mlp", "data": "pkg.m:data", "loss": "torch.nn:MSELoss",
                      "precision": "fp16"})
    assert flat.plan.precision == "fp16"
    assert parse_config(BASE).updated({"plan.precision": "bf16"}).plan.precision == "bf16"


def test_an_unknown_precision_is_refused_naming_the_key_and_the_choices() -> None:
    with pytest.raises(ConfigError, match=r"field 'plan.precision': Input should be 'fp32', 'bf16' or 'fp16' "
                                          r"\(got 'fp8'\)"):
        parse_config({**BASE, "plan": {"precision": "fp8"}})
    with pytest.raises(ValidationError):
        PlanConfig(precision="float16")  # type: ignore[arg-type]


def test_the_config_and_the_wire_name_the_same_precisions() -> None:
    from services.protocol import Precision as OnTheWire

    assert get_args(Precision) == get_args(OnTheWire)


def test_the_command_line_has_a_flag_for_it(capsys: pytest.CaptureFixture[str]) -> None:
    from coordinator.commands import cli

    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "--plan.precision" in capsys.readouterr().out


def test_every_plan_carries_it_and_prints_it() -> None:
    prof = Profile.synthetic([1e-3] * 4, param_bytes=[MiB] * 4, cut_bytes=[1024] * 3, microbatch_size=4)
    resources = Resources(workers=tuple(Worker(name=f"w{i}", memory_bytes=2**30, host="h") for i in range(2)))
    fp32 = choose_plan(prof, resources, PlanConfig(num_stages=2), global_batch=16)
    assert fp32.precision == "fp32" and "autocast" not in str(fp32) + fp32.summary()
    bf16 = choose_plan(prof, resources, PlanConfig(num_stages=2, precision="bf16"), global_batch=16)
    assert bf16.precision == "bf16" and bf16.model_copy(update={"precision": "fp32"}) == fp32
    assert "cut by minmax, bf16 autocast" in str(bf16).splitlines()[0]
    assert "collective, bf16 autocast: step" in bf16.summary()
    fp16 = choose_plan(prof, resources, PlanConfig(precision="fp16"), global_batch=16)
    assert "fp16 autocast + loss scaling" in str(fp16)
    assert Plan.from_json(fp16.to_json()) == fp16


def test_a_refusal_does_not_count_it_among_the_fixed_fields() -> None:
    prof = Profile.synthetic([1e-3] * 4, param_bytes=[64 * MiB] * 4, microbatch_size=4)
    tiny = Resources(workers=(Worker(name="w0", memory_bytes=MiB, host="h"),))
    with pytest.raises(PlanningError) as info:
        choose_plan(prof, tiny, PlanConfig(precision="bf16"), global_batch=16)
    assert "no fixed fields" in str(info.value) and "precision" not in str(info.value)


def test_a_model_autocast_would_not_cast_is_refused_before_any_worker_starts() -> None:
    from coordinator.runtime.errors import JobError
    from coordinator.runtime.job import Job

    m = "tests.multiproc.coordinator.models"
    job = Job(model=f"{m}:mlp", loss=f"{m}:mse", data=f"{m}:regression", global_batch=16, precision="bf16",
              resources=Resources.local(2))  # the factories' float64
    with pytest.raises(JobError, match=r"plan.precision=bf16 autocasts float32 tensors only, but parameter "
                                       r"cell0.weight is float64: build the model in float32"):
        job.check()
    in_float32 = Job(job.config.updated({"model.kwargs.dtype": "float32", "data.kwargs.dtype": "float32"}))
    assert in_float32.plan().precision == "bf16"
