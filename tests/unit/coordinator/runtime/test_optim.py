"""The optimizer section's coordinator parts: its config, the preflight of the scheduler, accumulation's
batches and action lists, and the clipping coefficient of a step's replies."""

from __future__ import annotations

import math
from typing import Any, get_args

import pytest
import torch

from coordinator.planning.config import FLAT_KEYS, ConfigError, SchedulerKwargs, from_flat, setting_value
from coordinator.planning.data import BatchSampler, split_batch
from coordinator.planning.schedules import build_schedule, peak_in_flight
from coordinator.runtime.accumulation import accumulated_schedule, step_batches
from coordinator.runtime.clipping import global_norm, grad_scale, norm_parts
from coordinator.runtime.errors import JobError
from coordinator.runtime.job import Job
from coordinator.runtime.preflight import check_optimizer
from coordinator.runtime.records import _Service
from services.protocol import SchedulerKwargs as OnTheWire
from services.protocol import StepReply

M = "tests.multiproc.coordinator.models"
BASE = {"model": f"{M}:mlp", "data": f"{M}:regression", "loss": f"{M}:mse"}


def test_the_fields_are_flat_keywords_spec_keys_and_settings() -> None:
    assert (FLAT_KEYS["scheduler"], FLAT_KEYS["clip_grad_norm"], FLAT_KEYS["accumulate"]) == (
        "optimizer.scheduler", "optimizer.clip_grad_norm", "optimizer.accumulate")
    config = from_flat({**BASE, "scheduler": {"name": "StepLR", "kwargs": {"step_size": 2, "gamma": 0.5}},
                        "clip_grad_norm": 1, "accumulate": 4})
    section = config.optimizer
    assert section.scheduler is not None and section.scheduler.kwargs == {"step_size": 2, "gamma": 0.5}
    assert (section.clip_grad_norm, section.accumulate) == (1.0, 4)
    assert from_flat(BASE).optimizer.model_dump(include={"scheduler", "clip_grad_norm", "accumulate"}) == {
        "scheduler": None, "clip_grad_norm": None, "accumulate": 1}  # the defaults change nothing
    text = setting_value("optimizer.scheduler", "{name: MultiStepLR, kwargs: {milestones: [2, 4]}}")
    changed = config.updated({"optimizer.scheduler": text, "optimizer.clip_grad_norm": None})
    assert changed.optimizer.scheduler is not None and changed.optimizer.scheduler.name == "MultiStepLR"
    assert changed.optimizer.scheduler.kwargs == {"milestones": [2, 4]}
    assert changed.optimizer.clip_grad_norm is None
    deeper = config.updated({"optimizer.scheduler.kwargs.gamma": 0.1})  # --set into the scheduler's mapping
    assert deeper.optimizer.scheduler is not None and deeper.optimizer.scheduler.kwargs["gamma"] == 0.1
    assert get_args(SchedulerKwargs) == get_args(OnTheWire)  # the wire type is the config's


@pytest.mark.parametrize(("fields", "says"), [
    ({"clip_grad_norm": 0}, r"field 'optimizer.clip_grad_norm': Input should be greater than 0 \(got 0\)"),
    ({"accumulate": 0}, r"field 'optimizer.accumulate': Input should be greater than or equal to 1"),
    ({"scheduler": {"kwargs": {}}}, r"field 'optimizer.scheduler.name': missing"),
    ({"scheduler": {"name": "StepLR", "args": {}}}, r"field 'optimizer.scheduler.args': unknown field"),
    ({"scheduler": {"name": "Step LR"}}, r"field 'optimizer.scheduler.name': String should match"),
])
def test_bad_values_name_their_key(fields: dict[str, Any], says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        from_flat({**BASE, **fields})


@pytest.mark.parametrize(("scheduler", "says"), [
    ({"name": "Steplr"}, r"optimizer.scheduler: unknown scheduler 'Steplr': name a torch.optim.lr_scheduler "
                         r"class, one of .*CosineAnnealingLR.*; fix optimizer.scheduler.name or"),
    ({"name": "ReduceLROnPlateau", "kwargs": {"patience": 2}}, r"ReduceLROnPlateau is not supported: it "
                                                               r"follows a metric, not the step count"),
    ({"name": "StepLR", "kwargs": {"step_size": 2, "gama": 0.5}}, r"scheduler StepLR\(step_size=2, gama=0.5\)"
                                                                  r": .*'gama'; fix optimizer.scheduler"),
    ({"name": "CyclicLR", "kwargs": {"base_lr": 0.1, "max_lr": 0.2, "mode": "sideways"}}, r"CyclicLR.*mode"),
])
def test_a_bad_scheduler_is_one_error_before_any_worker_starts(scheduler: dict[str, Any], says: str) -> None:
    job = Job(**BASE, scheduler=scheduler)
    with pytest.raises(JobError, match=says):
        check_optimizer(job.config)
    with pytest.raises(JobError, match=says):  # what plan() runs first, before any worker
        job.plan()


def test_a_fixed_plan_skips_the_preflight_but_not_the_scheduler_check() -> None:
    plan = Job(**BASE, data_parallel=2, num_stages=1).plan()
    job = Job(Job(**BASE, scheduler={"name": "Nope"}).config, plan=plan)
    with pytest.raises(JobError, match=r"optimizer.scheduler: unknown scheduler 'Nope'"):
        job.fit(1)  # refused before the local harness starts a worker


def test_the_optimizers_arguments_are_checked_with_it() -> None:
    with pytest.raises(JobError, match=r"optimizer: optimizer SGD\(\{'lr': 0.1, 'momentum': -1.0\}\): "
                                       r".*momentum"):
        check_optimizer(Job(**BASE, optimizer_kwargs={"lr": 0.1, "momentum": -1.0}).config)
    check_optimizer(Job(**BASE, optimizer="AdamW", scheduler={"name": "OneCycleLR", "kwargs": {
        "max_lr": 0.1, "total_steps": 10}}).config)  # OneCycleLR cycles Adam's betas: accepted


def test_a_step_takes_its_global_batches_in_order_each_split_as_alone() -> None:
    sampler = BatchSampler(64, 16, shuffle=True, seed=3)
    for step in (0, 1, 5):  # step 5 of 3 batches: batches 15..17, across an epoch's end (4 per epoch)
        got = step_batches(sampler, step, 3, 2, 2)
        alone = [split_batch(sampler.indices(step * 3 + a), 2, 2) for a in range(3)]
        assert got == [[mb for a in range(3) for mb in alone[a][r]] for r in range(2)]
    assert step_batches(sampler, 2, 1, 2, 2) == split_batch(sampler.indices(2), 2, 2)


@pytest.mark.parametrize("num_stages", [2, 3])
def test_accumulated_action_lists_keep_every_stages_peak_of_activations(num_stages: int) -> None:
    for name in ("gpipe", "1f1b"):
        one = build_schedule(name, num_stages, 2)
        assert accumulated_schedule(one, 1) is one
        three = accumulated_schedule(one, 3)  # validated by Schedule itself: every rule, no deadlock
        assert three.num_microbatches == 6 and three.num_stages == num_stages
        for mine, alone in zip(three.actions, one.actions, strict=True):
            assert peak_in_flight(mine) == peak_in_flight(alone)
            assert sorted((a.kind, a.microbatch) for a in mine if a.kind in ("F", "B")) == sorted(
                (k, m) for k in ("F", "B") for m in range(6))
    # 1F1B holds min(p - s, m) microbatches: over 6 instead of 2 the same when p = 2, more when p = 3
    longer = build_schedule("1f1b", num_stages, 6)
    assert (accumulated_schedule(build_schedule("1f1b", num_stages, 2), 3) == longer) == (num_stages == 2)
    repeated = accumulated_schedule(build_schedule("gpipe", num_stages, 2), 2)
    assert [str(a) for a in repeated.actions[0][:4]] == ["0F0", "0SEND_F0", "0F1", "0SEND_F1"]
    with pytest.raises(ValueError, match="accumulate must be >= 1"):
        accumulated_schedule(build_schedule("gpipe", num_stages, 2), 0)


@pytest.mark.parametrize(("m", "accumulate", "longer"), [(4, 2, True), (2, 3, False), (1, 5, False)])
def test_accumulating_an_interleaved_plan_keeps_its_ranks_and_each_workers_peak(m: int, accumulate: int,
                                                                                 longer: bool) -> None:
    one = build_schedule("interleaved-1f1b", 4, m, 2)  # 2 workers x 2 chunks
    many = accumulated_schedule(one, accumulate)  # validated with its ranks' orders: no deadlock
    assert (many.name == "interleaved-1f1b") == longer  # m=1 x 5: 5 does not split in groups of 2
    assert many.ranks == one.ranks and many.num_microbatches == m * accumulate
    for r in range(2):
        assert peak_in_flight(many.rank_actions(r)) <= peak_in_flight(one.rank_actions(r)) or longer
        assert sum(a.kind == "F" for a in many.rank_actions(r)) == 2 * m * accumulate


def _reply(stage: int, sq: float | None) -> StepReply:
    return StepReply(step=0, stage=stage, losses=[], grad_sq_norm=sq)


def test_the_coefficient_adds_one_replica_per_stage() -> None:
    grads = [torch.full((3,), 2.0, dtype=torch.float64), torch.full((4,), 1.0, dtype=torch.float64)]
    total = float(torch.nn.utils.get_total_norm(grads))  # sqrt(12 + 4) = 4
    bodies = [(_Service("w0", "s0", 0, 0), _reply(0, 12.0)), (_Service("w1", "s1", 0, 1), _reply(1, 4.0)),
              (_Service("w2", "s0b", 1, 0), _reply(0, 12.0)), (_Service("w3", "s1b", 1, 1), _reply(1, 4.0))]
    assert global_norm(bodies) == 4.0 and total == pytest.approx(4.0, rel=1e-15)
    assert grad_scale(bodies, 2.0) == 2.0 / (4.0 + 1e-6) and grad_scale(bodies, 8.0) == 1.0
    assert grad_scale(bodies, None) == 1.0
    server = [(_Service("w0", "s0", 0, 0), _reply(0, None)), (_Service("w1", "s0b", 1, 0), _reply(0, None))]
    assert global_norm(server) is None and grad_scale(server, 2.0) == 1.0  # the shards clip instead
    assert math.isnan(grad_scale([(_Service("w0", "s0", 0, 0), _reply(0, math.inf))], 1.0))


def test_sharded_gradients_add_the_first_groups_parts() -> None:
    # ZeRO-2/3, 4 replicas in groups of 2 (hybrid): each replica reports its rows' part; the groups hold the
    # same rows
    rows = [torch.tensor([3.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 4.0], dtype=torch.float64)]
    whole = float(torch.nn.utils.get_total_norm(rows))  # 5
    parts = norm_parts(2, 2)
    bodies = [(_Service(f"w{r}", f"s{r}", r, 0), _reply(0, float(rows[r % 2].square().sum())))
              for r in range(4)]
    assert parts == 2 and norm_parts(1, 2) == 1 and norm_parts(3, 4) == 4 and norm_parts(0, 1) == 1
    assert global_norm(bodies, parts=parts) == pytest.approx(whole, rel=1e-15)
    assert global_norm(bodies) == 3.0  # replica 0's alone: one part, what a replicated plan reads
    assert grad_scale(bodies, 2.5, parts=parts) == pytest.approx(2.5 / (5.0 + 1e-6), rel=1e-15)
    bad = [*bodies[:1], (_Service("w1", "s1", 1, 0), _reply(0, math.nan)), *bodies[2:]]
    assert math.isnan(grad_scale(bad, 1.0, parts=parts))  # a NaN in any part of the group
