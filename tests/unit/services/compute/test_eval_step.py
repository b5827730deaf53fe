"""An evaluation step (``RunStep.source = "eval"``) on a one-stage compute service in this process.

It reads the held-out data, reports each microbatch's loss and metric sum as one process computes
them in eval mode, and leaves the parameters, buffers, gradients and the RNG as they were.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from comm.rpc import RpcClient, RpcError, ServiceHost
from coordinator.runtime.factories import build_data, build_model
from services.compute.cell import Cell, as_cells
from services.compute.executor import evaluating
from services.compute.service import CellComputeService
from services.compute.stage import metric_sum
from services.factories import FactoryAllowList
from services.protocol import Action, Assignment, ComputeOptions, Empty, RunStep, StepReply, TensorsReply
from tests.multiproc.coordinator import eval_models

M = "tests.multiproc.coordinator.models"
E = "tests.multiproc.coordinator.eval_models"
HERE = "tests.unit.services.compute.test_eval_step"
SEED = 3


class Noise(nn.Module):
    """Adds nothing, but draws from torch's global RNG at every forward, in either mode."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0 * torch.rand_like(x)


def noisy_bn_model() -> list[nn.Module]:
    """``eval_models.bn_model`` with a global-RNG consumer after the BatchNorm."""
    cells = eval_models.bn_model()
    return [*cells[:2], Cell("noise", Noise()), *cells[2:]]


def actions(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split()]


def service(**options: str) -> CellComputeService:
    names = [f"{HERE}:noisy_bn_model", f"{M}:regression", f"{M}:mse", f"{E}:heldout", f"{E}:abs_error"]
    compute = ComputeOptions(stage=0, num_stages=1, data=f"{M}:regression", loss=f"{M}:mse", **options)
    return CellComputeService.from_assignment(Assignment(
        service="c", kind="compute", factory=f"{HERE}:noisy_bn_model", nodes=[0, 6], seed=SEED,
        options=compute.model_dump()), FactoryAllowList.of(names, "a test"))


@pytest.fixture
def stage() -> Iterator[RpcClient]:
    host = ServiceHost().start()
    host.add("c", service(eval_data=f"{E}:heldout", metric=f"{E}:abs_error"))
    try:
        with RpcClient(host.address) as client:
            yield client
    finally:
        host.shutdown()


def test_an_evaluation_reports_one_process_numbers_and_changes_nothing(stage: RpcClient) -> None:
    # a model with BatchNorm trains one microbatch per step
    train = RunStep(step=0, microbatches=[[0, 1, 2, 3, 4, 5, 6, 7]], actions=actions("0F0 0B0"))
    stage.call("c", "run_step", train, StepReply)
    _, before = stage.call("c", "state", Empty(), TensorsReply)
    _, grads = stage.call("c", "gradients", Empty(), TensorsReply)
    rng = torch.random.get_rng_state()

    uneven = [[0, 1, 2], [3, 4], [36]]
    evaluation = RunStep(step=1, microbatches=uneven, actions=actions("0F0 0F1 0F2"), source="eval",
                         zero_grad=False)
    reply, _ = stage.call("c", "run_step", evaluation, StepReply)

    _, after = stage.call("c", "state", Empty(), TensorsReply)
    _, grads_after = stage.call("c", "gradients", Empty(), TensorsReply)
    assert all(torch.equal(before[k], after[k]) for k in before)  # the BatchNorm's statistics too
    assert all(torch.equal(grads[k], grads_after[k]) for k in grads)
    assert torch.equal(torch.random.get_rng_state(), rng)  # the stage's thread shares this RNG

    cells = as_cells(build_model(f"{HERE}:noisy_bn_model", {}, SEED))  # one process, from the stage's state
    for cell in cells:
        own = {k.removeprefix(f"{cell.name}."): v for k, v in after.items() if k.startswith(f"{cell.name}.")}
        cell.module.load_state_dict(own, strict=True)
    model = nn.Sequential(*cells)
    model.eval()
    held_out = build_data(f"{E}:heldout", {}, SEED)  # seeded as the stage builds it
    with torch.no_grad():
        for m, indices in enumerate(uneven):
            x, y = held_out.load(indices)
            out = model(x)
            assert abs(reply.losses[m] - float(nn.functional.mse_loss(out, y))) < 1e-12
            assert abs(reply.metric_sums[m] - float((out - y).abs().mean(dim=1).sum())) < 1e-12


@pytest.mark.parametrize(("text", "microbatches", "says"), [
    ("0F0 0B0", [[0, 1]], "step 0: an evaluation step .* runs no backward"),
    ("0F0", [[36, 37]], r"step 0: microbatch 0: sample indices \[37\] are beyond the 37 samples of the "
                        "held-out data"),
])
def test_a_bad_evaluation_is_refused(stage: RpcClient, text: str, microbatches: list[list[int]],
                                     says: str) -> None:
    request = RunStep(step=0, microbatches=microbatches, actions=actions(text), source="eval",
                      zero_grad=False)
    with pytest.raises(RpcError, match=says) as err:
        stage.call("c", "run_step", request, StepReply)
    assert err.value.code == "bad_request"


def test_a_stage_without_held_out_data_refuses_to_evaluate() -> None:
    host = ServiceHost().start()
    host.add("c", service())
    try:
        with RpcClient(host.address) as client, pytest.raises(RpcError, match="has no held-out data"):
            request = RunStep(step=0, microbatches=[[0]], actions=actions("0F0"), source="eval")
            client.call("c", "run_step", request, StepReply)
    finally:
        host.shutdown()


def test_a_metric_needs_held_out_data() -> None:
    with pytest.raises(ValueError, match=r"missing or invalid \['eval_data \(with a metric\)'\]"):
        ComputeOptions(stage=0, num_stages=1, data="a:d", loss="a:l", metric="a:m")


def test_evaluating_restores_each_module_mode_and_the_rng() -> None:
    frozen = nn.BatchNorm1d(3)
    frozen.eval()  # a module its owner keeps in eval mode
    model = nn.Sequential(nn.Linear(3, 3), frozen, nn.Dropout(0.5))
    rng = torch.random.get_rng_state()
    with evaluating(model):
        assert not any(m.training for m in model.modules())
        torch.rand(5)
    assert [m.training for m in model.modules()] == [True, True, False, True]
    assert torch.equal(torch.random.get_rng_state(), rng)


def test_a_metric_sums_its_values_per_sample_or_its_mean() -> None:
    assert metric_sum(torch.tensor([1.0, 2.0, 4.0]), 3, what="m") == 7.0
    assert metric_sum(torch.tensor(2.5), 4, what="m") == 10.0  # one value: the mean of 4
    assert metric_sum(torch.tensor([[2.5]]), 1, what="m") == 2.5
    with pytest.raises(ValueError, match=r"the metric returned a tensor of shape \[2, 3\] for 3 samples; "
                                         r"return one value per sample \(shape \[n\]\) or their mean"):
        metric_sum(torch.zeros(2, 3), 3, what="the metric")
    with pytest.raises(ValueError, match="returned float for 3 samples"):
        metric_sum(1.0, 3, what="the metric")
