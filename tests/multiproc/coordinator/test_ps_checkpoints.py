"""Parameter-server checkpoints: the shards' optimizer state is in them, so resuming or recovering is exact.

With Adam the optimizer state (moments, step count) changes every update: a PS run restored
with fresh shard optimizers drifts from the run without the break. Each test compares the
run that went through a checkpoint with the uninterrupted run and with one process training
on the same batches (``coordinator.runtime.reference.train_reference``), in float64.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch

from comm.rpc import RpcClient, RpcError
from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.checkpoint import dcp
from services.checkpoint.writer import part_dirs
from services.params.client import PushPullClient, ShardRef, setup_shards
from services.protocol import (
    Assignment,
    AssignmentReply,
    OptimizerSpec,
    SavedPart,
    SaveRequest,
    ShardSave,
)

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")]

M = "tests.multiproc.coordinator.models"
TOL64 = 1e-9
LEASE = timedelta(seconds=6)  # a killed worker's card goes with its process: the lease only has to hold
FACTORIES = [f"{M}:{name}" for name in ("mlp", "slow_mlp", "regression", "mse")]
PLANS: dict[str, dict[str, Any]] = {
    "ps2": dict(data_parallel=2, num_stages=1, num_microbatches=2, mode="parameter_server"),
    "ps-pipe": dict(data_parallel=1, num_stages=2, num_microbatches=2, mode="parameter_server"),
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=2, mode="collective"),
}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    with LocalHarness(["local-0", "local-1"], job="t-ps-ckpt", lease_ttl=LEASE, factories=FACTORIES) as h:
        yield h


def make_job(directory: Path, plan: str, *, model: str = "mlp", **extra: Any) -> Job:
    return Job(model=f"{M}:{model}", loss=f"{M}:mse", data=f"{M}:regression", optimizer="Adam",
               optimizer_kwargs={"lr": 0.01}, global_batch=16, seed=3, resources=Resources.local(2),
               step_timeout_s=30, lease_ttl_s=LEASE.total_seconds(), checkpoint_directory=str(directory),
               checkpoint_every_steps=3, checkpoint_keep=5, **PLANS[plan], **extra)


_shards = itertools.count()


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def optimizer_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    train = checkpoint / "train"
    return dcp.load(train, [k for k in dcp.keys(train) if k.startswith("optim.")])


def test_a_resumed_ps_run_equals_the_uninterrupted_one(harness: LocalHarness, tmp_path: Path) -> None:
    job = make_job(tmp_path / "full", "ps2")
    with job.attach(harness):
        full = job.fit(6)
    step3 = step_dir(tmp_path / "full", 3)
    parts = sorted(p.name for p in (step3 / "train" / "parts").iterdir())
    assert parts == ["ps-s0-0", "ps-s0-1", "r0-s0", "r1-s0"], parts
    # the shards saved Adam's state of every parameter, under the model's keys, after 3 updates
    state = optimizer_state(step3)
    model_keys = [k for k, v in job.build_model().state_dict().items() if v.is_floating_point()]
    entries = ("exp_avg", "exp_avg_sq", "step")
    assert sorted(state) == sorted(f"optim.{k}.{e}" for k in model_keys for e in entries)
    assert all(float(state[f"optim.{k}.step"]) == 3 for k in model_keys)
    assert all(float(state[f"optim.{k}.exp_avg_sq"].abs().max()) > 0 for k in model_keys)

    resumed_job = make_job(tmp_path / "resumed", "ps2")
    with resumed_job.attach(harness, resume=step3):
        resumed = resumed_job.fit(3)
    assert [r.step for r in resumed.steps] == [3, 4, 5]
    assert max(abs(a - b) for a, b in zip(resumed.losses, full.losses[3:], strict=True)) < 1e-12
    assert max_abs_diff(resumed.state_dict, full.state_dict) < 1e-12
    ref = train_reference(job, 6)
    diff = max_abs_diff(resumed.state_dict, ref.state_dict)
    assert diff < TOL64, f"the resumed run is {diff:.3g} from one process"
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"


def test_the_shards_state_is_what_collective_stages_save(harness: LocalHarness, tmp_path: Path) -> None:
    """The same keys and values (the shards' Adam against each collective stage's own torch Adam)."""
    saved = {}
    for plan in ("ps-pipe", "dp2"):
        job = make_job(tmp_path / plan, plan)
        with job.attach(harness):
            job.fit(3)
        saved[plan] = optimizer_state(step_dir(tmp_path / plan, 3))
    assert sorted(saved["ps-pipe"]) == sorted(saved["dp2"])
    assert max_abs_diff(saved["ps-pipe"], saved["dp2"]) < TOL64


@pytest.mark.parametrize(("saved_on", "resumed_on"),
                         [("ps2", "dp2"), ("dp2", "ps2"), ("ps-pipe", "ps2")])
def test_resume_on_another_mode_or_plan(harness: LocalHarness, tmp_path: Path, saved_on: str,
                                        resumed_on: str) -> None:
    source = make_job(tmp_path / "source", saved_on)
    with source.attach(harness):
        source.fit(3)
    job = make_job(tmp_path / "resumed", resumed_on)
    with job.attach(harness, resume=tmp_path / "source"):
        resumed = job.fit(3)
    assert resumed.plan is not None and resumed.plan.mode == PLANS[resumed_on]["mode"]
    ref = train_reference(job, 6)
    diff = max_abs_diff(resumed.state_dict, ref.state_dict)
    assert diff < TOL64, f"saved on {saved_on}, resumed on {resumed_on}: {diff:.3g} from one process"
    assert max(abs(a - b) for a, b in zip(resumed.losses, ref.losses[3:], strict=True)) < 1e-10


def test_a_shard_worker_killed_during_a_push_recovers_exactly(tmp_path: Path) -> None:
    """local-1 hosts replica 1 and shard ps-s0-1; it is killed (-9) as step 6 starts pushing step 5's
    gradients, while replica 0's push is in the shards (and the save of checkpoint 6 is on its way). The
    run rolls back to the checkpoint of step 3 (a slow forward gives its parts two steps to be written),
    and ends where the run without the kill ends."""
    results = {}
    for name, env in (("killed", {"local-1": {"CELLMESH_FAULT": "6:push_pull"}}), ("clean", {})):
        job = make_job(tmp_path / name, "ps2", model="slow_mlp", model_kwargs={"seconds": 0.1})
        assert job.plan().dp_groups == (("local-0", "local-1"),)
        with LocalHarness(["local-0", "local-1"], job=f"t-ps-{name}", lease_ttl=LEASE, factories=FACTORIES,
                          worker_env=env, log_dir=tmp_path / name / "logs") as h, job.attach(h):
            results[name] = job.fit(8)
    killed, clean = results["killed"], results["clean"]
    assert [(r.worker, r.step, r.resumed_step) for r in killed.recoveries] == [("local-1", 6, 3)]
    assert clean.recoveries == []
    assert max_abs_diff(killed.state_dict, clean.state_dict) < 1e-12
    assert max(abs(a - b) for a, b in zip(killed.losses, clean.losses, strict=True)) < 1e-12
    ref = train_reference(job, 8)
    assert max_abs_diff(killed.state_dict, ref.state_dict) < TOL64


# -- the shard's contract ----------------------------------------------------------------

ADAM = OptimizerSpec(name="Adam", kwargs={"lr": 0.01})
WAIT = timedelta(seconds=20)


def new_shard(harness: LocalHarness, params: dict[str, torch.Tensor], restore: str = "") -> ShardRef:
    address = harness.address("local-0")
    with RpcClient(address, timeout=WAIT) as c:
        name = f"ck-shard-{next(_shards)}"
        c.call("worker", "assign", Assignment(service=name, kind="param_server"), AssignmentReply)
    ref = ShardRef(address, name)
    setup_shards([ref], params, mode="sync", replicas=1, optimizer=ADAM, timeout=WAIT, keys={"w": "0.weight"},
                 restore=restore)
    return ref


def save(ref: ShardRef, directory: Path, version: int) -> SavedPart:
    request = ShardSave(save=SaveRequest(directory=str(directory), step=version), version=version,
                        part="ps-x", timeout_ms=20_000)
    with RpcClient(ref.address, timeout=WAIT) as c:
        reply, _ = c.call(ref.service, "save", request, SavedPart)
    return reply


def test_a_shard_saves_at_its_version_restores_by_name_and_refuses_a_passed_version(
        harness: LocalHarness, tmp_path: Path) -> None:
    """The save waits for the version, holds torch's Adam state after that update under the given keys; a
    shard restored from it continues exactly as the original; a save for a version gone is refused."""
    start = {"w": torch.randn(3, 2, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    grads = [{n: torch.randn_like(t) for n, t in start.items()} for _ in range(2)]
    ref = new_shard(harness, start)
    into = {n: torch.empty_like(t) for n, t in start.items()}
    with ThreadPoolExecutor(1) as pool, PushPullClient([ref], 0, timeout=WAIT) as client:
        pending = pool.submit(save, ref, tmp_path, 1)  # the shard is at version 0: it waits for update 1
        assert not pending.done()
        client.push_pull(grads[0], 0, into, min_version=1)
        assert pending.result(timeout=30) == SavedPart(step=1, part="ps-x")
        train = part_dirs(tmp_path, "ps-x")[1]
        dcp.merge_parts(tmp_path / "train", [train])  # what the coordinator does once every part is in
        client.push_pull(grads[1], 1, into, min_version=2)
        with pytest.raises(RpcError) as refused:
            save(ref, tmp_path / "late", 1)
        assert refused.value.code == "step_closed" and "past version 1" in refused.value.message

    # the independent reference: torch's Adam over the same gradients
    params = {n: t.clone().requires_grad_() for n, t in start.items()}
    adam = torch.optim.Adam(params.values(), lr=0.01)
    for g in grads[:1]:
        for n, p in params.items():
            p.grad = g[n]
        adam.step()
    saved = dcp.load(tmp_path / "train", sorted(dcp.keys(tmp_path / "train")))
    entries = ("exp_avg", "exp_avg_sq", "step")
    assert sorted(saved) == sorted(f"optim.{k}.{e}" for k in ("0.weight", "b") for e in entries)
    for name, key in (("w", "0.weight"), ("b", "b")):
        for entry, value in adam.state[params[name]].items():
            assert torch.equal(saved[f"optim.{key}.{entry}"], value), (key, entry)

    # restored at version 1 (its values the pulled ones), then the same second update: the same values
    after_one = {n: p.detach().clone() for n, p in params.items()}
    restored = new_shard(harness, after_one, restore=str(tmp_path))
    again = {n: torch.empty_like(t) for n, t in start.items()}
    with PushPullClient([restored], 0, timeout=WAIT) as client:
        client.push_pull(grads[1], 0, again, min_version=1)
    assert all(torch.equal(again[n], into[n]) for n in start)

    with pytest.raises(RpcError) as misshapen:
        new_shard(harness, {"w": torch.zeros(2, 3, dtype=torch.float64), "b": start["b"]},
                  restore=str(tmp_path))
    assert misshapen.value.code == "bad_request" and "0.weight" in misshapen.value.message
