"""The optimizer section's service parts: schedulers by name, the clipping arithmetic, a shard's held rounds.

Each is checked against torch's own code in this process: ``clip_grad_norm_`` on the whole
gradient, a scheduler stepped without interruption, ``torch.optim.SGD`` on the averaged gradient.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from comm.rpc import RpcClient, RpcError, ServiceHost
from services.params import scheduling
from services.params.clipping import clip_coefficient, squared_norm
from services.params.server import ParamServerService
from services.params.sharding import join_pieces, split_pieces
from services.protocol import (
    ApplyRound,
    Empty,
    OptimizerSpec,
    ParamInfo,
    PullReply,
    PullRequest,
    PushReply,
    PushRequest,
    RoundNorm,
    RoundNormRequest,
    SchedulerSpec,
    ShardInfo,
    ShardSetup,
)

STEPWISE: list[tuple[str, dict[str, Any]]] = [
    ("StepLR", {"step_size": 2, "gamma": 0.5}),
    ("MultiStepLR", {"milestones": [1, 3], "gamma": 0.3}),
    ("ExponentialLR", {"gamma": 0.8}),
    ("ConstantLR", {"factor": 0.5, "total_iters": 3}),
    ("LinearLR", {"start_factor": 0.2, "total_iters": 4}),
    ("PolynomialLR", {"total_iters": 5, "power": 2.0}),
    ("CosineAnnealingLR", {"T_max": 4, "eta_min": 0.01}),
    ("CosineAnnealingWarmRestarts", {"T_0": 2, "T_mult": 2}),
    ("CyclicLR", {"base_lr": 0.01, "max_lr": 0.1, "step_size_up": 2}),
    ("OneCycleLR", {"max_lr": 0.2, "total_steps": 20}),
]


def _sgd(param: torch.Tensor) -> torch.optim.Optimizer:
    return torch.optim.SGD([param], lr=0.1, momentum=0.9)


def _hyper(optimizer: torch.optim.Optimizer) -> list[tuple[str, Any]]:
    group = optimizer.param_groups[0]
    return [(k, group[k]) for k in ("lr", "momentum") if k in group]


@pytest.mark.parametrize(("name", "kwargs"), STEPWISE, ids=[n for n, _ in STEPWISE])
def test_a_scheduler_rebuilt_at_a_step_equals_one_stepped_there(name: str, kwargs: dict[str, Any]) -> None:
    # what a resume (and a skipped step) relies on: see [Note: a scheduler's position]
    spec = SchedulerSpec(name=name, kwargs=kwargs)
    param = torch.nn.Parameter(torch.zeros(2))
    stepped = _sgd(param)
    uninterrupted = scheduling.build_scheduler(spec, stepped)
    history = [_hyper(stepped)]  # history[k]: after k steps
    for _ in range(7):
        param.grad = torch.ones(2)
        stepped.step()
        uninterrupted.step()  # torch's own loop
        history.append(_hyper(stepped))
    for k in (0, 3, 7):
        rebuilt_optimizer = _sgd(torch.nn.Parameter(torch.zeros(2)))
        rebuilt = scheduling.build_scheduler(spec, rebuilt_optimizer)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # advance() keeps torch's order warning quiet
            assert scheduling.advance(rebuilt, k) == k
        assert scheduling.advance(rebuilt, k) == 0  # at its position: nothing to do
        assert _hyper(rebuilt_optimizer) == history[k]  # exactly: the same float operations
    with pytest.raises(ValueError, match=f"the {name} scheduler is at step 7, past the update of step 2"):
        scheduling.advance(uninterrupted, 2)


@pytest.mark.parametrize(("name", "kwargs", "says"), [
    ("StepLr", {}, r"unknown scheduler 'StepLr': name a torch.optim.lr_scheduler class, one of .*StepLR"),
    ("ReduceLROnPlateau", {}, r"ReduceLROnPlateau is not supported: it follows a metric"),
    ("LambdaLR", {}, r"LambdaLR is not supported: it takes a Python callable"),
    ("SequentialLR", {}, r"SequentialLR is not supported: it takes other scheduler objects"),
    ("LRScheduler", {}, r"LRScheduler is not supported: it is the abstract base class"),
    ("_LRScheduler", {}, r"_LRScheduler is not supported"),
    ("StepLR", {"gamma": 0.5}, r"scheduler StepLR\(gamma=0.5\): .*step_size"),
    ("StepLR", {"step_size": 2, "gama": 0.5}, r"scheduler StepLR\(step_size=2, gama=0.5\): .*gama"),
    ("OneCycleLR", {"max_lr": 0.1}, r"scheduler OneCycleLR\(max_lr=0.1\): .*total_steps"),
])
def test_bad_schedulers_are_one_clear_error(name: str, kwargs: dict[str, Any], says: str) -> None:
    with pytest.raises(ValueError, match=says):
        scheduling.build_scheduler(SchedulerSpec(name=name, kwargs=kwargs),
                                   _sgd(torch.nn.Parameter(torch.zeros(1))))


def test_a_scheduler_that_runs_out_names_itself() -> None:
    optimizer = _sgd(torch.nn.Parameter(torch.zeros(1)))
    spec = SchedulerSpec(name="OneCycleLR", kwargs={"max_lr": 0.1, "total_steps": 3})
    one_cycle = scheduling.build_scheduler(spec, optimizer)  # a job of 3 steps: 3 updates, 3 steps
    assert scheduling.advance(one_cycle, 3) == 3
    with pytest.raises(ValueError, match=r"the OneCycleLR scheduler cannot step after 3 steps: .*total steps "
                                         r"is 3 \(its arguments must cover every step of the job\)"):
        scheduling.advance(one_cycle, 4)


def test_clipping_in_parts_equals_clip_grad_norm_on_the_whole() -> None:
    torch.manual_seed(0)
    grads = [torch.randn(6, 4, dtype=torch.float64), torch.randn(4, dtype=torch.float64),
             torch.randn(3, 4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)]
    for max_norm in (0.5, 1e3):  # clips, and does not (the coefficient clamps to 1)
        params = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads]
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        total = float(torch.nn.utils.clip_grad_norm_(params, max_norm))
        stages = [grads[:2], grads[2:]]  # two holders report their parts; the coordinator adds them
        sq = sum(squared_norm(part) for part in stages)
        assert math.sqrt(sq) == pytest.approx(total, rel=1e-14)
        scale = clip_coefficient(sq, max_norm)
        assert scale == (1.0 if max_norm > total else pytest.approx(max_norm / (total + 1e-6), rel=1e-14))
        for p, g in zip(params, grads, strict=True):
            assert float((p.grad - g * scale).abs().max()) < 1e-15
    assert squared_norm([]) == 0.0 and clip_coefficient(0.0, 1.0) == 1.0
    assert math.isnan(clip_coefficient(math.inf, 1.0)) and math.isnan(clip_coefficient(math.nan, 1.0))


# -- a shard's held rounds (in this process) --------------------------------------------------------

VALUES = {"w": torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=torch.float64),
          "b": torch.tensor([0.25, -0.75], dtype=torch.float64)}
SCHEDULE = SchedulerSpec(name="StepLR", kwargs={"step_size": 1, "gamma": 0.5})


@pytest.fixture
def shard() -> Iterator[RpcClient]:
    host = ServiceHost().start()
    host.add("ps", ParamServerService("ps"))
    try:
        with RpcClient(host.address) as client:
            yield client
    finally:
        host.shutdown()


def _setup(client: RpcClient, *, hold: bool) -> None:
    infos = [ParamInfo(name=n, dtype="float64", shape=list(t.shape)) for n, t in VALUES.items()]
    request = ShardSetup(mode="sync", replicas=2, params=infos, hold_rounds=hold,
                         optimizer=OptimizerSpec(name="SGD", kwargs={"lr": 0.1, "momentum": 0.9},
                                                 scheduler=SCHEDULE))
    client.call("ps", "setup", request, ShardInfo,
                tensors=[p for n, t in VALUES.items() for p in split_pieces(n, t)])


def _push(client: RpcClient, replica: int, version: int, grads: dict[str, torch.Tensor],
          train_step: int | None = None) -> None:
    client.call("ps", "push", PushRequest(replica=replica, step=version, seq=version, train_step=train_step),
                PushReply, tensors=[p for n, g in grads.items() for p in split_pieces(n, g)])


def _pull(client: RpcClient, version: int) -> dict[str, torch.Tensor]:
    _, tensors = client.call("ps", "pull", PullRequest(replica=0, min_version=version, timeout_ms=2000),
                             PullReply)
    return {name: torch.cat([t for _, t in sorted(pieces.items())]).view(VALUES[name].shape)
            for name, pieces in join_pieces(tensors).items()}


def test_a_held_round_waits_for_its_coefficient_and_applies_it_as_torch_would(shard: RpcClient) -> None:
    _setup(shard, hold=True)
    torch.manual_seed(1)
    grads = [{n: torch.randn_like(t) for n, t in VALUES.items()} for _ in range(2)]
    params = {n: torch.nn.Parameter(t.clone()) for n, t in VALUES.items()}  # one process, torch's code
    reference = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(reference, step_size=1, gamma=0.5)
    with pytest.raises(RpcError, match="step 0 is not complete yet") as early:
        shard.call("ps", "apply_round", ApplyRound(version=0, grad_scale=1.0, train_step=0), Empty)
    assert early.value.code == "bad_request"
    for version, train_step in ((0, 0), (1, 3)):  # steps 1 and 2 skipped: the scheduler catches up
        _push(shard, 0, version, grads[0])
        _push(shard, 1, version, grads[1])
        asked = RoundNormRequest(version=version, timeout_ms=2000)
        norm, _ = shard.call("ps", "round_norm", asked, RoundNorm)
        for p in params.values():
            p.grad = None
        for g in grads:  # the mean of the replicas' gradients, as one process's mean loss gives it
            for n, p in params.items():
                p.grad = g[n] / 2 if p.grad is None else p.grad + g[n] / 2
        while schedule.last_epoch < train_step:
            schedule.step()
        total = float(torch.nn.utils.clip_grad_norm_(list(params.values()), 0.5))
        assert math.sqrt(norm.sq_norm) == pytest.approx(total, rel=1e-14)
        scale = clip_coefficient(norm.sq_norm, 0.5)
        apply = ApplyRound(version=version, grad_scale=scale, train_step=train_step)
        shard.call("ps", "apply_round", apply, Empty)
        reference.step()
        schedule.step()
        pulled = _pull(shard, version + 1)
        assert max(float((pulled[n] - p.detach()).abs().max()) for n, p in params.items()) < 1e-15
    for code, request in (("step_closed", RoundNormRequest(version=0, timeout_ms=10)),
                          ("step_ahead", RoundNormRequest(version=5, timeout_ms=10))):
        with pytest.raises(RpcError) as refused:
            shard.call("ps", "round_norm", request, RoundNorm)
        assert refused.value.code == code
    with pytest.raises(RpcError, match=r"waited 0.1s for pushes from replicas \[0, 1\]") as waited:
        shard.call("ps", "round_norm", RoundNormRequest(version=2, timeout_ms=100), RoundNorm)
    assert waited.value.code == "timeout"


def test_a_shard_that_applies_its_rounds_refuses_the_coordinators_round(shard: RpcClient) -> None:
    _setup(shard, hold=False)
    with pytest.raises(RpcError, match="applies its rounds itself") as refused:
        shard.call("ps", "round_norm", RoundNormRequest(version=0, timeout_ms=10), RoundNorm)
    assert refused.value.code == "bad_request"
    grads = {n: torch.ones_like(t) for n, t in VALUES.items()}
    _push(shard, 0, 0, grads, train_step=2)  # the round's first part brings the scheduler to step 2
    _push(shard, 1, 0, grads, train_step=2)
    lr = 0.1 * 0.5 ** 2
    pulled = _pull(shard, 1)
    assert max(float((pulled[n] - (VALUES[n] - lr)).abs().max()) for n in VALUES) < 1e-15
