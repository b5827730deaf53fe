"""Test-side plumbing for compute-service pipelines: specs, assignment, hand-written lists, the reference.

The schedules here are written out by hand in the printed form of an action (``0F0``,
``0SEND_F0``, ``0RECV_B0``...), not generated, so a test fails on the runtime, never on a
generator bug.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from comm.rpc import RpcClient, RpcError
from comm.wire import dtype_name
from services.compute.cell import as_cells, cell_parameters
from services.protocol import (
    Action,
    Assignment,
    AssignmentReply,
    BoundarySpec,
    BoundaryTensor,
    ComputeOptions,
    Empty,
    RunStep,
    StepReply,
    TensorsReply,
)
from tests.multiproc.services import models

SEED = 7
MODELS = "tests.multiproc.services.models"
FACTORIES = [f"{MODELS}:{name}" for name in ("mlp", "skip_model", "regression", "mse")]
"""What the workers of these tests may build (their job's factories)."""
CALL_TIMEOUT = timedelta(seconds=30)

# 2 stages x 4 microbatches. GPipe: all forwards, then all backwards (receives posted early).
GPIPE = {
    0: ("0F0 0SEND_F0 0F1 0SEND_F1 0F2 0SEND_F2 0F3 0SEND_F3 "
        "0RECV_B0 0RECV_B1 0RECV_B2 0RECV_B3 0B0 0B1 0B2 0B3"),
    1: ("1RECV_F0 1RECV_F1 1RECV_F2 1RECV_F3 1F0 1F1 1F2 1F3 "
        "1B0 1SEND_B0 1B1 1SEND_B1 1B2 1SEND_B2 1B3 1SEND_B3"),
}
# 1F1B: stage 0 warms up with one forward, then alternates; stage 1 alternates from the start.
ONE_F_ONE_B = {
    0: ("0F0 0SEND_F0 0RECV_B0 0F1 0SEND_F1 0RECV_B1 0B0 0F2 "
        "0SEND_F2 0RECV_B2 0B1 0F3 0SEND_F3 0RECV_B3 0B2 0B3"),
    1: ("1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1RECV_F2 1F1 1B1 "
        "1SEND_B1 1RECV_F3 1F2 1B2 1SEND_B2 1F3 1B3 1SEND_B3"),
}
MICROBATCHES = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def parse_actions(text: str) -> list[Action]:
    return [Action.parse(word) for word in text.split()]


def spec_of(value: Any, batch_size: int) -> BoundarySpec:
    """The boundary spec of a real value (what the coordinator derives from its graph)."""
    if isinstance(value, torch.Tensor):
        structure, items = "tensor", [("x", value)]
    elif isinstance(value, dict):
        structure, items = "dict", list(value.items())
    else:
        structure, items = type(value).__name__, [(f"t{i}", v) for i, v in enumerate(value)]
    tensors = [BoundaryTensor(name=n, dtype=dtype_name(t.dtype), shape=list(t.shape),
                              requires_grad=t.requires_grad, batch_dim=0) for n, t in items]
    return BoundarySpec(structure=structure, batch_size=batch_size, tensors=tensors)  # type: ignore[arg-type]


def cut_spec(factory: Callable[[], Sequence[nn.Module]], cut: int, batch_size: int = 4) -> BoundarySpec:
    torch.manual_seed(SEED)
    cells = as_cells(factory())
    x, _ = models.regression(batch_size)
    with torch.enable_grad():
        value = nn.Sequential(*cells[:cut])(x)
    return spec_of(value, batch_size)


def assign_pipeline(addresses: Sequence[str], service: str, *, model: str, cut: int, num_cells: int,
                    registry: str, prefix: str, backend: str = "zmq",
                    spec: BoundarySpec | None = None, data: str = f"{MODELS}:regression") -> None:
    """Assign a two-stage pipeline, stage 0 first (its assignment must return before stage 1 exists)."""
    spec = spec or cut_spec(getattr(models, model), cut)
    for stage, (address, nodes) in enumerate(zip(addresses, ([0, cut], [cut, num_cells]), strict=True)):
        options = ComputeOptions(stage=stage, num_stages=2, comm_backend=backend,  # type: ignore[arg-type]
                                 registry=registry, comm_prefix=prefix, comm_timeout_ms=20_000,
                                 data=data, loss=f"{MODELS}:mse",
                                 incoming=spec if stage == 1 else None, outgoing=spec if stage == 0 else None)
        with RpcClient(address, timeout=CALL_TIMEOUT) as c:
            assignment = Assignment(service=service, kind="compute", factory=f"{MODELS}:{model}",
                                    nodes=nodes, seed=SEED, options=options.model_dump())
            c.call("worker", "assign", assignment, AssignmentReply)


def call_stages(addresses: Sequence[str], service: str, method: str, requests: Sequence[Any],
                reply_type: type[Any], *, timeout: timedelta = CALL_TIMEOUT) -> list[Any]:
    """Call every stage at once; each result is ``(reply, tensors)`` or the RpcError it raised."""

    def one(address: str, request: Any) -> Any:
        with RpcClient(address, timeout=timeout) as c:
            try:
                return c.call(service, method, request, reply_type)
            except RpcError as exc:
                return exc

    with ThreadPoolExecutor(len(addresses)) as pool:
        return list(pool.map(one, addresses, requests))


def run_step(addresses: Sequence[str], service: str, lists: dict[int, str], step: int = 0,
             timeout_ms: int = 20_000) -> list[StepReply]:
    requests = [RunStep(step=step, microbatches=MICROBATCHES, actions=parse_actions(lists[s]),
                        timeout_ms=timeout_ms) for s in range(len(addresses))]
    results = call_stages(addresses, service, "run_step", requests, StepReply)
    for r in results:
        if isinstance(r, Exception):
            raise r
    return [reply for reply, _ in results]


def fetch(addresses: Sequence[str], service: str, what: str) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for result in call_stages(addresses, service, what, [Empty()] * len(addresses), TensorsReply):
        assert not isinstance(result, Exception), result
        reply, tensors = result
        assert list(tensors) == reply.names
        out.update({k: v.clone() for k, v in tensors.items()})
    return out


def reference(model: str, steps: int = 1, optimizer: Callable[[Any], torch.optim.Optimizer] | None = None
              ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[float]]:
    """One process on the whole batch: last step's gradients, final parameters, first losses."""
    torch.manual_seed(SEED)
    cells = as_cells(getattr(models, model)())
    torch.manual_seed(SEED)
    x, y = models.regression()
    whole = nn.Sequential(*cells)
    params = cell_parameters(cells)
    opt = optimizer([p for _, p in params]) if optimizer is not None else None
    samples = torch.tensor([i for mb in MICROBATCHES for i in mb])
    with torch.no_grad():
        losses = [float(nn.functional.mse_loss(whole(x[mb]), y[mb])) for mb in MICROBATCHES]
    for _ in range(steps):
        for _, p in params:
            p.grad = None
        torch.autograd.backward(nn.functional.mse_loss(whole(x[samples]), y[samples]))
        if opt is not None:
            opt.step()
    grads = {n: p.grad.detach().clone() for n, p in params if p.grad is not None}
    return grads, {n: p.detach().clone() for n, p in params}, losses


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max(float((a[k] - b[k]).abs().max()) for k in a)
