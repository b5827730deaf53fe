"""A stage's device: the options that carry it, the worker's check that it has it, samples moved onto it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from pydantic import ValidationError

from comm.rpc import RpcClient, RpcError, ServiceHost
from services.compute.executor import _gradient_channel
from services.compute.service import CellComputeService
from services.compute.stage import to_device
from services.factories import FactoryAllowList
from services.protocol import Assignment, ComputeOptions, Empty, RunStep, StepReply, TensorsReply
from tests.multiproc.services.compute_checks import MICROBATCHES, MODELS, SEED, parse_actions, reference

FACTORIES = FactoryAllowList.of([f"{MODELS}:{n}" for n in ("skip_model", "regression", "mse")], "a test")
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")


def _options(**fields: Any) -> ComputeOptions:
    return ComputeOptions(stage=0, num_stages=1, data=f"{MODELS}:regression", loss=f"{MODELS}:mse", **fields)


def test_the_options_carry_a_device_and_concrete_backends() -> None:
    assert _options().device == "cpu" and _options().data_parallel_backend == "zmq"
    gpu = _options(device="cuda:1", comm_backend="nccl", dp_backend="gloo")
    assert (gpu.device, gpu.comm_backend, gpu.data_parallel_backend) == ("cuda:1", "nccl", "gloo")
    assert _options(comm_backend="gloo").data_parallel_backend == "gloo"  # unset: the pipeline's
    with pytest.raises(ValidationError, match="dp_backend 'nccl' moves CUDA tensors, but the stage runs on"):
        _options(dp_backend="nccl")
    for bad in ({"device": "gpu"}, {"device": "cuda"}, {"comm_backend": "auto"}):  # the coordinator resolves
        with pytest.raises(ValidationError):
            _options(**bad)


def _assign(options: ComputeOptions) -> CellComputeService:
    return CellComputeService.from_assignment(Assignment(
        service="c", kind="compute", factory=f"{MODELS}:skip_model", nodes=[0, 4], seed=SEED,
        options=options.model_dump()), FACTORIES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_a_worker_without_cuda_refuses_a_stage_placed_on_a_gpu() -> None:
    with pytest.raises(RpcError, match=r"stage 0: the coordinator placed the stage on cuda:0, but this "
                                       r"worker's torch sees 0 CUDA device\(s\)") as info:
        _assign(_options(device="cuda:0"))
    assert info.value.code == "bad_request"


def test_samples_move_to_the_device_in_their_structure() -> None:
    x, y = torch.ones(2, 3), torch.zeros(2)
    moved = to_device(({"x": x, "n": 3}, [y]), torch.device("cpu"))
    assert moved[0]["x"] is x and moved[0]["n"] == 3 and moved[1][0] is y and isinstance(moved[1], list)


@requires_cuda
def test_a_one_stage_pipeline_on_a_gpu_matches_one_process() -> None:
    service = _assign(_options(device="cuda:0"))
    assert all(p.is_cuda for _, p in service._stage.parameters())
    host = ServiceHost().start()
    host.add("c", service)
    try:
        with RpcClient(host.address) as client:
            n = len(MICROBATCHES)
            actions = " ".join([f"0F{m}" for m in range(n)] + [f"0B{m}" for m in reversed(range(n))])
            request = RunStep(step=0, microbatches=MICROBATCHES, actions=parse_actions(actions))
            reply, _ = client.call("c", "run_step", request, StepReply)
            _, grads = client.call("c", "gradients", Empty(), TensorsReply)
    finally:
        host.shutdown()
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((grads[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10


class _Pipeline:
    """Stands in for a pipeline communicator: its backend, and the groups made of it."""

    def __init__(self, backend: str) -> None:
        self.backend, self.world_size, self.groups = backend, 2, 0

    def new_group(self, ranks: range) -> _Pipeline:
        assert list(ranks) == [0, 1]
        self.groups += 1
        return _Pipeline(self.backend)


def test_nccl_pipelines_send_gradients_on_a_communicator_of_their_own() -> None:
    # [Note: one NCCL communicator per direction]
    nccl, zmq = _Pipeline("nccl"), _Pipeline("zmq")
    channel = _gradient_channel(nccl)  # type: ignore[arg-type]
    assert channel is not nccl and _gradient_channel(nccl) is channel and nccl.groups == 1  # made once
    assert _gradient_channel(zmq) is zmq and zmq.groups == 0  # type: ignore[arg-type]
    assert _gradient_channel(None) is None
