"""A stage with BatchNorm refuses what would split its batch: more microbatches, replicas without a group."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from comm.rpc import RpcError
from services.compute.chain import trace_chain
from services.compute.service import CellComputeService
from services.compute.stage import SampleSource, Stage
from services.protocol import Action, ComputeOptions, RunStep


def _stage() -> Stage:
    chain = trace_chain([nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 1)])
    data = SampleSource((torch.randn(8, 3), torch.randn(8, 1)), what="data")
    return Stage(index=0, num_stages=1, start=0, stop=3, nodes=tuple(nd.name for nd in chain.nodes),
                 module=chain.stage_module(0, 3), tensors=chain.stage_tensors(0, 3), samples=data,
                 loss_fn=nn.MSELoss(), loss_reduction="mean", incoming=None, outgoing=None)


def _options(**extra: object) -> ComputeOptions:
    return ComputeOptions.model_validate({"stage": 0, "num_stages": 1, "data": "d:d", "loss": "l:l", **extra})


def test_a_training_step_of_two_microbatches_is_a_bad_request_naming_the_layer() -> None:
    service = CellComputeService(_stage(), _options(), seed=0)
    try:
        actions = [Action.parse(a) for a in ("0F0", "0F1", "0B0", "0B1")]
        with pytest.raises(RpcError) as info:
            service.rpc_run_step(RunStep(step=0, microbatches=[[0, 1], [2, 3]], actions=actions), None)  # type: ignore[arg-type]
        assert info.value.code == "bad_request"
        assert info.value.message == (
            "step 0: 2 microbatches would each be normalised on their own by BatchNorm layer 1 "
            "(BatchNorm1d): a step of a model with BatchNorm takes one microbatch per replica")
    finally:
        service.on_close()


def test_replicas_in_parameter_server_mode_are_refused() -> None:
    options = _options(num_replicas=2, grad_path="parameter_server")
    with pytest.raises(ValueError, match=r"BatchNorm layer 1 \(BatchNorm1d\) needs the statistics of every "
                                         r"replica, and parameter-server mode has no data-parallel group"):
        CellComputeService(_stage(), options, seed=0)
