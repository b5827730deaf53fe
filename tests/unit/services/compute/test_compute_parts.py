"""The compute service's pieces in one process: action rules, boundary values, cells, a one-stage service."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from comm.rpc import RpcClient, RpcError, ServiceHost
from services.compute.actions import validate_stage
from services.compute.boundary import BoundaryError, empty_buffers, flatten, shapes_at, unflatten
from services.compute.cell import Cell, as_cells, cell_parameters
from services.compute.executor import check_grads
from services.compute.service import CellComputeService
from services.factories import FactoryAllowList
from services.protocol import (
    Assignment,
    BoundarySpec,
    BoundaryTensor,
    ComputeOptions,
    Empty,
    RunStep,
    StepReply,
    TensorsReply,
)
from tests.multiproc.services import models
from tests.multiproc.services.compute_checks import GPIPE, MODELS, ONE_F_ONE_B, parse_actions, reference

MICROBATCHES_4 = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


@pytest.mark.parametrize("stage", [0, 1])
@pytest.mark.parametrize("lists", [GPIPE, ONE_F_ONE_B], ids=["gpipe", "1f1b"])
def test_hand_written_lists_are_valid(lists: dict[int, str], stage: int) -> None:
    # the rules themselves are tests/unit/services/compute/test_actions.py's
    assert validate_stage(parse_actions(lists[stage]), stage=stage, num_stages=2, num_microbatches=4) is True


def _spec(structure: str, *names: str, dtype: str = "float64", grad: bool = True) -> BoundarySpec:
    return BoundarySpec(structure=structure, batch_size=4,  # type: ignore[arg-type]
                        tensors=[BoundaryTensor(name=n, dtype=dtype, shape=[4, 3], requires_grad=grad,
                                                batch_dim=0) for n in names])


def test_boundary_round_trip_and_scaling() -> None:
    spec = _spec("dict", "a", "b")
    value = {"b": torch.ones(2, 3, dtype=torch.float64, requires_grad=True),
             "a": torch.zeros(2, 3, dtype=torch.float64, requires_grad=True)}
    flat = flatten(spec, value, 2, where="here")
    assert flat[0] is value["a"] and flat[1] is value["b"]
    assert unflatten(spec, flat) == {"a": flat[0], "b": flat[1]}
    assert shapes_at(spec, 6) == [[6, 3], [6, 3]]
    assert [(i, list(b.shape)) for i, b in empty_buffers(spec, 2)] == [(0, [2, 3]), (1, [2, 3])]
    assert isinstance(unflatten(_spec("tuple", "x", "y"), flat), tuple)
    keyed = spec.model_copy(update={"tensors": [t.model_copy(update={"name": f"cell.{t.name}", "key": t.name})
                                                for t in spec.tensors]})
    assert all(x is y for x, y in zip(flatten(keyed, value, 2, where="here"), flat, strict=True))
    assert unflatten(keyed, flat) == {"a": flat[0], "b": flat[1]}
    with pytest.raises(BoundaryError, match="does not scale"):
        shapes_at(spec.model_copy(update={"batch_size": 3}), 2)


@pytest.mark.parametrize(("value", "says"), [
    ([torch.zeros(4, 3, dtype=torch.float64)] * 2, "the plan says tuple of 2, got list"),
    ((torch.zeros(4, 3, dtype=torch.float64),), "the plan says tuple of 2, got tuple"),
    ((torch.zeros(4, 3, dtype=torch.float64), torch.zeros(4, 3)), "tensor 'y': expected float64"),
    ((torch.zeros(4, 3, dtype=torch.float64), 3), "tensor 'y': .*got a int"),
])
def test_boundary_mismatches_are_named(value: object, says: str) -> None:
    with pytest.raises(BoundaryError, match=f"stage 0 microbatch 2 output: .*{says}"):
        flatten(_spec("tuple", "x", "y", grad=False), value, 4, where="stage 0 microbatch 2 output")


def test_integer_tensors_cannot_require_grad() -> None:
    with pytest.raises(ValueError, match="int64 tensor cannot require grad"):
        _spec("tensor", "x", dtype="int64")


def test_as_cells_names_and_checks() -> None:
    cells = as_cells([nn.Linear(2, 2), Cell("head", nn.Linear(2, 1))])
    assert [c.name for c in cells] == ["cell0", "head"]
    names = [n for n, _ in cell_parameters(cells)]
    assert names == ["cell0.weight", "cell0.bias", "head.weight", "head.bias"]
    assert [c.name for c in as_cells(nn.Sequential(nn.Tanh(), nn.ReLU()))] == ["cell0", "cell1"]
    with pytest.raises(ValueError, match="unique"):
        as_cells([Cell("a", nn.Tanh()), Cell("a", nn.ReLU())])


@pytest.fixture
def one_stage() -> Iterator[RpcClient]:
    """A one-stage pipeline (the whole model, no communicator) in this process."""
    options = ComputeOptions(stage=0, num_stages=1, data=f"{MODELS}:regression", loss=f"{MODELS}:mse")
    factories = FactoryAllowList.of([f"{MODELS}:{n}" for n in ("skip_model", "regression", "mse")], "a test")
    service = CellComputeService.from_assignment(Assignment(
        service="c", kind="compute", factory=f"{MODELS}:skip_model", nodes=[0, 4], seed=7,
        options=options.model_dump()), factories)
    host = ServiceHost().start()
    host.add("c", service)
    try:
        with RpcClient(host.address) as client:
            yield client
    finally:
        host.shutdown()


def test_one_stage_pipeline_matches_reference(one_stage: RpcClient) -> None:
    request = RunStep(step=0, microbatches=MICROBATCHES_4,
                      actions=parse_actions("0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0"))
    reply, _ = one_stage.call("c", "run_step", request, StepReply)
    reply_grads, grads = one_stage.call("c", "gradients", Empty(), TensorsReply)
    assert reply_grads.missing == []
    grads_ref, _, losses_ref = reference("skip_model")
    assert max(float((grads[k] - grads_ref[k]).abs().max()) for k in grads_ref) < 1e-10
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10
    assert models.NUM_SAMPLES == 32


@pytest.mark.parametrize(("text", "says"), [
    ("0F0 0SEND_F0", r"step 0: stage 0, action #1 \(0SEND_F0\): stage 0 is the last of 1; it has no next"),
    ("0B0 0F0", r"step 0: stage 0, action #0 \(0B0\): 0F0 must come before it"),
    ("0F0 0B0 0F1", r"step 0: stage 0: the list has no 0B1 \(a step runs the backward of every"),
    ("1F0 1B0", r"step 0: stage 0, action #0 \(1F0\): names stage 1"),
])
def test_refuses_a_list_that_breaks_a_rule_and_keeps_serving(one_stage: RpcClient, text: str, says: str
                                                              ) -> None:
    with pytest.raises(RpcError, match=says) as err:
        request = RunStep(step=0, microbatches=[[0], [1]], actions=parse_actions(text))
        one_stage.call("c", "run_step", request, StepReply)
    assert err.value.code == "bad_request"
    valid = RunStep(step=1, microbatches=MICROBATCHES_4,
                    actions=parse_actions("0F0 0F1 0F2 0F3 0B3 0B2 0B1 0B0"))
    reply, _ = one_stage.call("c", "run_step", valid, StepReply)
    _, _, losses_ref = reference("skip_model")
    assert max(abs(a - b) for a, b in zip(reply.losses, losses_ref, strict=True)) < 1e-10


def test_nonfinite_names_exactly_the_tensors_with_a_nan_or_an_inf() -> None:
    big = torch.full((4,), 3e38)  # finite, but its sum overflows to Inf: still finite
    both = torch.tensor([float("inf"), -float("inf")])  # its sum is NaN
    named = [("ok", torch.ones(3)), ("big", big), ("nan", torch.tensor([1.0, float("nan")])),
             ("inf", torch.tensor([float("inf")])), ("both", both), ("empty", torch.zeros(0))]
    assert check_grads(named)[0] == ["nan", "inf", "both"]
    assert check_grads([("ok", torch.ones(2)), ("big", big)])[0] == []
    assert check_grads([]) == ([], 0.0)


def test_the_squared_norm_of_finite_gradients_is_exact_past_their_dtype() -> None:
    big = torch.full((4,), 3e38)  # float32: its norm overflows, its float64 norm does not
    ok, sq = check_grads([("a", torch.tensor([3.0, 4.0], dtype=torch.float64)), ("big", big)])
    assert ok == [] and sq == pytest.approx(25.0 + 4 * float(big[0].double()) ** 2, rel=1e-12)
    grads = [torch.randn(5, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    total = torch.nn.utils.get_total_norm(grads)  # torch's own, as clip_grad_norm_ computes it
    assert check_grads([("x", grads[0]), ("y", grads[1])])[1] == pytest.approx(float(total) ** 2, rel=1e-14)


def test_a_released_stage_closes_its_communicators_even_when_no_thread_can_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker at its memory cap may have no room for a thread's stack: the release closes the
    communicators on its own thread instead of failing (and leaving them open)."""
    options = ComputeOptions(stage=0, num_stages=1, data=f"{MODELS}:regression", loss=f"{MODELS}:mse")
    factories = FactoryAllowList.of([f"{MODELS}:{n}" for n in ("skip_model", "regression", "mse")], "a test")
    closed: list[str] = []
    for refused in (False, True):
        service = CellComputeService.from_assignment(Assignment(
            service="c", kind="compute", factory=f"{MODELS}:skip_model", nodes=[0, 4], seed=7,
            options=options.model_dump()), factories)
        monkeypatch.setattr(service._link, "close", lambda: closed.append("link"))
        monkeypatch.setattr(service._path, "close", lambda: closed.append("path"))
        start = threading.Thread.start

        def no_stack(thread: threading.Thread, start: Any = start, refused: bool = refused) -> None:
            if refused and thread.name.startswith("close-stage"):
                raise RuntimeError("can't start new thread")
            start(thread)

        monkeypatch.setattr(threading.Thread, "start", no_stack)
        service.on_close()
        monkeypatch.undo()
        deadline = time.monotonic() + 10
        while len(closed) < 2 and time.monotonic() < deadline:  # the closing thread, where it started
            time.sleep(0.01)
        assert closed == ["link", "path"], (refused, closed)
        closed.clear()
