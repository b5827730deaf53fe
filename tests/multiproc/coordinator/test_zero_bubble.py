"""zb-h1 (each backward split into I and W, the linear layers' weight gradients deferred and batched)
trains to the parameters one process reaches (float64, < 1e-9 after 5 steps).

The parity machinery and its harness of four workers are ``test_parity``'s; the tied-weight case is
one of ``test_tied``'s plans.
"""

from __future__ import annotations

from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from tests.multiproc.coordinator.test_parity import DATA, TOL64, M, fit_and_compare, harness

__all__ = ["harness"]  # the fixture, used here too

pytestmark = pytest.mark.timeout(120)

OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
PLANS: dict[str, dict[str, Any]] = {
    "zb2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4),
    "zb4x8": dict(data_parallel=1, num_stages=4, num_microbatches=8),
    "zb2x4xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=4),
}


def make_job(model: str, optimizer: str, plan: str, **fields: Any) -> Job:
    data, loss = DATA[model]
    name, kwargs = OPTIMIZERS[optimizer]
    return Job(model=f"{M}:{model}", loss=f"{M}:{loss}", data=f"{M}:{data}", optimizer=name,
               optimizer_kwargs=kwargs, model_kwargs={"dtype": "float64"},
               data_kwargs={"dtype": "float64"} if data == "regression" else {}, global_batch=16, seed=5,
               resources=Resources.local(workers=4), step_timeout_s=30, schedule="zb-h1",
               **PLANS[plan], **fields)


@pytest.mark.parametrize(("model", "plan", "optimizer", "fields"), [
    ("mlp", "zb2x4", "sgd", {}),
    ("mlp", "zb2x4", "adamw", {}),
    ("mlp", "zb4x8", "adamw", {"balance": [2, 2, 1, 1]}),  # a Linear on every stage
    ("skip_model", "zb2x4", "adamw", {"balance": [2, 2]}),  # a tuple, then a dict, crosses the cut
    ("mlp", "zb2x4xdp2", "sgd", {}),
    ("transformer", "zb2x4xdp2", "adamw", {}),  # LayerNorm, attention (out_proj used functionally), replicas
    ("mlp", "zb4x8", "adamw", {"balance": [1, 1, 2, 2]}),  # stage 1 is a lone Tanh: no parameters to update
    ("wide_mlp", "zb2x4", "adamw", {}),  # wide layers, few rows: the W's are held for the last run
], ids=["mlp-2x4-sgd", "mlp-2x4-adamw", "mlp-4x8-adamw", "skip-2x4-adamw", "mlp-2x4xdp2-sgd",
        "transformer-2x4xdp2-adamw", "mlp-4x8-paramless-stage", "wide-2x4-adamw"])
def test_zero_bubble_matches_one_process(harness: LocalHarness, model: str, plan: str, optimizer: str,
                                         fields: dict[str, Any]) -> None:
    job = make_job(model, optimizer, plan, **fields)
    shape = job.plan()
    assert shape.schedule_name == "zb-h1"
    result = fit_and_compare(harness, job, TOL64)
    p, m = shape.num_stages, shape.num_microbatches
    kinds = {e.name for e in result.steps[-1].events}
    assert {"0F0", "0I0", "0W0", f"{p - 1}I{m - 1}", f"{p - 1}W{m - 1}"} <= kinds  # I and W ran
    assert not any(k[1:].startswith("B") for k in kinds)
    if shape.data_parallel > 1:
        assert "all_reduce" in kinds
