"""A stage under mixed precision, in one process: autocast forwards, the loss scale, the commit's unscale.

The stage's gradients and update must be those torch's own recipe gives on the same
microbatches (``torch.autocast``, the loss times the scale, the gradients times its inverse),
and not those of float32 training.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from comm.rpc import RpcClient, ServiceHost
from services.compute.service import CellComputeService
from services.factories import FactoryAllowList
from services.protocol import (
    Action,
    Assignment,
    CommitReply,
    CommitStep,
    ComputeOptions,
    Empty,
    OptimizerSpec,
    RunStep,
    StepReply,
    TensorsReply,
)
from tests.multiproc.coordinator import models

M = "tests.multiproc.coordinator.models"
SEED, SCALE, LR = 3, 1024.0, 0.1
MICROBATCHES = [list(range(8)), list(range(8, 16))]
ACTIONS = [Action.parse(a) for a in ("0F0", "0F1", "0B0", "0B1")]


@pytest.fixture
def bf16_stage() -> Iterator[RpcClient]:
    """The float32 MLP as one stage computing in bf16, in this process."""
    options = ComputeOptions(stage=0, num_stages=1, data=f"{M}:regression", data_kwargs={"dtype": "float32"},
                             loss=f"{M}:mse", factory_kwargs={"dtype": "float32"}, precision="bf16")
    factories = FactoryAllowList.of([f"{M}:mlp", f"{M}:regression", f"{M}:mse"], "a test")
    service = CellComputeService.from_assignment(Assignment(
        service="c", kind="compute", factory=f"{M}:mlp", nodes=[0, 6], seed=SEED,
        options=options.model_dump()), factories)
    host = ServiceHost().start()
    host.add("c", service)
    try:
        with RpcClient(host.address) as client:
            yield client
    finally:
        host.shutdown()


def torch_recipe(*, bf16: bool) -> tuple[nn.Sequential, list[float]]:
    """The model after the backward of every microbatch's weighted, scaled loss (autocast or not)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = nn.Sequential(*models.mlp("float32"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        x, y = models.regression("float32")
    losses = []
    for samples in MICROBATCHES:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            loss = nn.functional.mse_loss(model(x[samples]), y[samples])
        (loss * (len(samples) / 16) * SCALE).backward()  # type: ignore[no-untyped-call]  # torch stub
        losses.append(float(loss.detach()))
    return model, losses


def test_forwards_run_in_bf16_the_loss_is_scaled_and_the_commit_unscales(bf16_stage: RpcClient) -> None:
    request = RunStep(step=0, microbatches=MICROBATCHES, actions=ACTIONS, loss_scale=SCALE)
    reply, _ = bf16_stage.call("c", "run_step", request, StepReply)
    _, grads = bf16_stage.call("c", "gradients", Empty(), TensorsReply)
    model, losses = torch_recipe(bf16=True)
    expected = {f"cell{k}": p.grad for k, p in model.named_parameters()}
    for name, grad in grads.items():  # cell-qualified ("cell0.weight"): the recipe's "0.weight"
        cell, _, param = name.partition(".")
        assert torch.equal(grad, expected[f"{cell}.{param}"]), name
    assert reply.losses == losses  # unscaled
    fp32_model, _ = torch_recipe(bf16=False)
    fp32_grads = dict(fp32_model.named_parameters())
    assert max(float((grads[f"cell{k}"] - p.grad).abs().max())  # type: ignore[operator]
               for k, p in fp32_grads.items()) > 1e-3 * SCALE / 1024
    assert reply.nonfinite_grads == []

    commit = CommitStep(step=0, optimizer=OptimizerSpec(name="SGD", kwargs={"lr": LR}), grad_scale=1 / SCALE)
    bf16_stage.call("c", "commit", commit, CommitReply)
    _, params = bf16_stage.call("c", "parameters", Empty(), TensorsReply)
    for p in model.parameters():  # the recipe: unscale, then the optimizer's step
        assert p.grad is not None
        p.grad.mul_(1 / SCALE)
    torch.optim.SGD(model.parameters(), lr=LR).step()
    for k, p in model.named_parameters():
        assert torch.equal(params[f"cell{k}"], p.detach()), k
