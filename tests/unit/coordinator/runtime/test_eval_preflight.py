"""A bad eval section is one line naming the factory and the fix, before any worker starts (``Job.check``)."""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job

M = "tests.multiproc.coordinator.models"
E = "tests.multiproc.coordinator.eval_models"


def job(**evaluation: Any) -> Job:
    return Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", global_batch=16,
               resources=Resources.local(2), **{"eval": f"{E}:heldout", **evaluation})


def refusal(**evaluation: Any) -> str:
    with pytest.raises(JobError) as info:
        job(**evaluation).check()
    text = str(info.value)
    assert "\n" not in text, text
    return text


def test_a_good_eval_section_passes() -> None:
    job(eval_metric=f"{E}:abs_error").check()
    job(eval=f"{E}:heldout_loader", eval_num_samples=37, eval_metric="torch.nn:L1Loss").check()


@pytest.mark.parametrize(("evaluation", "says"), [
    ({"eval": f"{E}:raising_heldout"},
     f"eval factory '{E}:raising_heldout' raised RuntimeError: the held-out file is missing (injected) (at "),
    ({"eval": f"{E}:heldout_loader"},
     f"eval factory '{E}:heldout_loader' returns a loader: give eval.num_samples"),
    ({"eval_num_samples": 40},
     f"eval.num_samples=40 but eval factory '{E}:heldout' returns 37 samples: lower eval.num_samples"),
    ({"eval": f"{E}:misfit_heldout"},
     f"model factory '{M}:mlp': cell 'cell0' (Linear(in_features=6, out_features=12, bias=True)) fails on "
     f"the inputs of eval factory '{E}:misfit_heldout', [8, 8] float64: mat1 and mat2 shapes cannot be "),
    ({"eval_metric": f"{E}:failing_metric"},
     f"eval metric factory '{E}:failing_metric': on the model's output, [8, 3] float64, and the targets of "
     f"eval factory '{E}:heldout', [8, 3] float64: the metric cannot handle these outputs (injected)"),
    ({"eval_metric": f"{E}:whole_batch_metric"},
     "the metric returned a tensor of shape [2] for 8 samples; return one value per sample (shape [n]) or "
     "their mean"),
])
def test_a_bad_eval_section_is_named_with_the_fix(evaluation: dict[str, Any], says: str) -> None:
    assert says in refusal(**evaluation)


def test_a_metric_factory_that_does_not_import_is_refused_when_the_job_is_made() -> None:
    with pytest.raises(ValueError, match=f"eval metric factory '{E}:no_such_metric': .* has no attribute"):
        job(eval_metric=f"{E}:no_such_metric")
    with pytest.raises(ValueError, match="eval metric factory 'os:getcwd': 'os' is part of Python's"):
        job(eval_metric="os:getcwd")
