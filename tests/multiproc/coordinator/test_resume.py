"""Resuming: a checkpoint of any plan continues on any other (keyed by name, not by worker), to the same end.

Also what torch reads of it: ``dcp_to_torch_save`` of a checkpoint is the plain ``state_dict`` the
fit reports, and loads into the unwrapped model with ``strict=True``. And the coordinator itself
killed with -9: ``cellmesh run --resume`` ends at the parameters one process reaches.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from coordinator.planning.resources import Resources
from coordinator.runtime.checkpoints import TrainerState, newest, read_trainer
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from tests.harness import commands

pytestmark = pytest.mark.timeout(180)

M = "tests.multiproc.coordinator.models"
TOL = 1e-9


def _job(directory: Path, workers: int, plan: dict[str, Any], **extra: Any) -> Job:
    return Job(model=f"{M}:transformer", loss=f"{M}:token_loss", data=f"{M}:tokens", optimizer="AdamW",
               optimizer_kwargs={"lr": 0.01, "weight_decay": 0.1}, global_batch=8,
               resources=Resources.local(workers), step_timeout_s=60, checkpoint_directory=str(directory),
               checkpoint_keep=10, **plan, **extra)


def test_a_checkpoint_resumes_on_other_plans_and_worker_counts(tmp_path: Path) -> None:
    """2-way data parallel (2 workers) -> 2 stages x 2 replicas (4 workers) -> 2 stages (2 workers)."""
    ckpt = tmp_path / "ckpt"
    first = _job(ckpt, 2, dict(data_parallel=2, num_stages=1, num_microbatches=1))
    result = first.fit(3)
    assert newest(ckpt) == ckpt / "step-00000003" and read_trainer(ckpt / "step-00000003").step == 3
    # what torch reads of it: the plain state_dict the fit reports, strictly loadable into the model
    dcp_to_torch_save(ckpt / "step-00000003", tmp_path / "plain.pt")
    plain = torch.load(tmp_path / "plain.pt", weights_only=True)
    model = first.build_model()
    model.load_state_dict(plain, strict=True)
    assert set(plain) == set(result.state_dict) and max_abs_diff(plain, result.state_dict) == 0.0

    second = _job(ckpt, 4, dict(data_parallel=2, num_stages=2, num_microbatches=2), checkpoint_every_steps=2)
    resumed = second.fit(6, resume=True)
    assert [r.step for r in resumed.steps] == [3, 4, 5] and resumed.plan is not None
    assert (resumed.plan.data_parallel, resumed.plan.num_stages) == (2, 2)
    assert newest(ckpt) == ckpt / "step-00000006"

    third = _job(ckpt, 2, dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="1f1b"))
    final = third.fit(8, resume=ckpt / "step-00000006")
    assert [r.step for r in final.steps] == [6, 7]
    ref = train_reference(third, 8)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL
    assert [round(x, 9) for x in resumed.losses + final.losses] == [round(x, 9) for x in ref.losses[3:]]


def test_resuming_with_other_data_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    (ckpt / "step-00000001").mkdir(parents=True)  # its trainer state is what is checked first
    (ckpt / "step-00000001" / "trainer.json").write_text(TrainerState(
        job="j", step=1, epoch=0, offset=8, global_batch=8, num_samples=64, seed=0, shuffle=True, plan="d=2",
        saved_at=time.time()).model_dump_json())
    other = Job(model=f"{M}:transformer", loss=f"{M}:token_loss", data=f"{M}:tokens", global_batch=4,
                resources=Resources.local(2), checkpoint_directory=str(ckpt), data_parallel=2, num_stages=1)
    with pytest.raises(ValueError, match=r"data\.global_batch is 4 here, 8 in the checkpoint"):
        other.fit(2, resume=True)


def _command(job: Path, run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "cellmesh", "run", str(job), "--run-dir", str(run_dir), "--progress",
            "lines", "--steps", "24", "--checkpoint-every", "4", "--runtime.lease-ttl-s", "2", *extra]


def test_a_killed_coordinator_resumes_and_ends_at_the_one_process_result(tmp_path: Path) -> None:
    spec = tmp_path / "job.yaml"
    spec.write_text(f"""
name: resumed
model: {{factory: "{M}:mlp", kwargs: {{}}}}
data: {{factory: "{M}:regression", global_batch: 16}}
loss: {{factory: "{M}:mse"}}
optimizer: {{name: SGD, kwargs: {{lr: 0.05, momentum: 0.9}}}}
plan: {{data_parallel: 2, num_stages: 1}}
runtime: {{workers: 2}}
""")
    # TMPDIR: the killed coordinator cannot remove its job's keys directory; it is left in the test's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
           "TMPDIR": str(tmp_path)}
    run_dir = tmp_path / "run"
    first = tmp_path / "first.log"
    killed = commands.start(_command(spec, run_dir), env=env, stdout=first, stderr=commands.STDOUT,
                            new_session=True)
    deadline = time.monotonic() + 120
    while newest(run_dir / "checkpoints") is None:  # wait for its first checkpoint
        assert killed.poll() is None and time.monotonic() < deadline, first.read_text()
        time.sleep(0.05)
    os.killpg(killed.pid, signal.SIGKILL)  # the coordinator (its workers, orphaned, leave by themselves)
    killed.wait(10)
    saved = read_trainer(newest(run_dir / "checkpoints"))  # type: ignore[arg-type]
    assert 0 < saved.step < 24
    resumed = commands.run(_command(spec, run_dir, "--resume"), timeout=120, env=env)
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, out
    assert f"resumed from {run_dir / 'checkpoints'}" in out, out
    # the independent reference: one process training the same 24 global batches
    job = Job(model=f"{M}:mlp", data=f"{M}:regression", loss=f"{M}:mse", global_batch=16, optimizer="SGD",
              optimizer_kwargs={"lr": 0.05, "momentum": 0.9}, data_parallel=2, num_stages=1)
    ref = train_reference(job, 24)
    assert max_abs_diff(torch.load(run_dir / "model.pt", weights_only=True), ref.state_dict) < TOL
