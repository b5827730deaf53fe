"""Recompute (``plan.recompute``): every plan trains a dropping model to the parameters one process reaches.

The reference is ``train_reference``: one process, plain autograd, no recompute, float64. The model
is ``dropout_mlp`` (three residual blocks dropping twice each), so a recomputation that drew other
masks than its forward, or a split backward that queued recomputed tensors under another microbatch,
ends far from it. One harness of two worker processes serves every job of this module.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(180)

M = "tests.multiproc.coordinator.models"
R = "tests.multiproc.coordinator.random_models"
STEPS = 5
TOL = 1e-9
PLANS: dict[str, dict[str, Any]] = {
    "one": dict(data_parallel=1, num_stages=1, num_microbatches=2, workers=1),
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "gpipe2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="gpipe"),
    "1f1b2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b"),
    "zb2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="zb-h1"),
    "interleaved2x2": dict(data_parallel=1, num_stages=4, chunks=2, num_microbatches=4,
                           schedule="interleaved-1f1b"),
}
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{R}:dropout_mlp", f"{R}:dropout_transformer", f"{R}:bn_net", f"{R}:images",
                 f"{M}:regression", f"{M}:mse", f"{M}:tokens", f"{M}:token_loss"]
    with LocalHarness(["local-0", "local-1"], job="t-recompute", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(plan: str, optimizer: str, *, recompute: bool = True, p: float = 0.3, dtype: str = "float64",
             **extra: Any) -> Job:
    name, kwargs = OPTIMIZERS[optimizer]
    fields = dict(PLANS[plan])
    workers = fields.pop("workers", 2)
    return Job(model=f"{R}:dropout_mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer=name,
               optimizer_kwargs=kwargs, model_kwargs={"p": p, "dtype": dtype}, data_kwargs={"dtype": dtype},
               global_batch=16, seed=7, recompute=recompute, resources=Resources.local(workers=workers),
               step_timeout_s=30, **fields, **extra)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("plan", list(PLANS))
def test_every_plan_recomputing_trains_as_one_process(harness: LocalHarness, plan: str,
                                                       optimizer: str) -> None:
    job = make_job(plan, optimizer)
    with job.attach(harness):
        result = job.fit(STEPS)
    assert result.plan is not None and result.plan.recompute
    assert result.plan.num_stages == PLANS[plan]["num_stages"]
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL, f"{plan} {optimizer}: max abs diff {diff:.3g} from one process"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-12


@pytest.mark.parametrize("plan", ["gpipe2x4", "1f1b2x4"])
def test_bf16_autocast_recomputes_what_its_forward_computed(harness: LocalHarness, plan: str) -> None:
    """bf16 autocast (float32 model): with recompute the run ends where the same run without ends, to the
    last bit, and far from float32 (autocast applied, in the recomputation too)."""
    results = {}
    for recompute, precision in ((True, "bf16"), (False, "bf16"), (True, "fp32")):
        job = make_job(plan, "sgd", recompute=recompute, dtype="float32", precision=precision)
        with job.attach(harness):
            results[recompute, precision] = job.fit(STEPS).state_dict
    assert max_abs_diff(results[True, "bf16"], results[False, "bf16"]) == 0.0
    assert max_abs_diff(results[True, "bf16"], results[True, "fp32"]) > 1e-4


def test_the_dropout_mattered() -> None:
    """The masks move the parameters far more than TOL: a recomputation drawing others would fail."""
    with_masks = train_reference(make_job("one", "sgd"), STEPS)
    without = train_reference(make_job("one", "sgd", p=0.0), STEPS)
    assert max_abs_diff(with_masks.state_dict, without.state_dict) > 1e-3


def test_attention_dropout_recomputed_across_a_pipeline(harness: LocalHarness) -> None:
    """Encoder blocks (attention and residual dropout inside nn.TransformerEncoderLayer), zb-h1."""
    job = Job(model=f"{R}:dropout_transformer", loss=f"{M}:token_loss", data=f"{M}:tokens", optimizer="Adam",
              optimizer_kwargs={"lr": 0.01}, global_batch=8, seed=3, resources=Resources.local(workers=2),
              step_timeout_s=30, recompute=True, **PLANS["zb2x4"])
    with job.attach(harness):
        result = job.fit(STEPS)
    diff = max_abs_diff(result.state_dict, train_reference(job, STEPS).state_dict)
    assert diff < TOL, f"max abs diff {diff:.3g} from one process"


def test_recompute_refuses_batchnorm_in_training(harness: LocalHarness) -> None:
    """Recomputing a BatchNorm's forward would update its running statistics twice: refused, with the fix."""
    job = Job(model=f"{R}:bn_net", loss=f"{M}:mse", data=f"{R}:images", optimizer="SGD",
              optimizer_kwargs={"lr": 0.1}, global_batch=16, seed=3, resources=Resources.local(workers=2),
              step_timeout_s=30, recompute=True, data_parallel=1, num_stages=1)
    with pytest.raises(Exception, match=r"BatchNorm.*recompute.*drop plan\.recompute"), job.attach(harness):
        job.fit(1)
