"""Mixed precision: bf16 and fp16 autocast over float32 master weights, fp16 with its loss scale.

One harness of two worker processes serves every job of this module. Each job trains the
float32 MLP of ``models.py`` for 5 steps with SGD and momentum and is compared with:

* ``train_reference``: one process in the same precision on the whole global batch (torch's
  autocast; fp16 with ``torch.amp.GradScaler``), within :data:`TOL_BF16` / :data:`TOL_FP16`;
* for bf16, :func:`one_process`, written here: one process cutting each global batch into the
  plan's microbatches, accumulating their weighted losses' gradients, in bf16 (to float32
  rounding: the plan computes exactly that) and in float32 (far from it: autocast ran).

[Note: the bf16 tolerance] bf16 keeps 8 significant bits. A plan splits the global batch into
microbatches (and replicas): each part's weight gradient leaves its bf16 matmul rounded to 8
bits and the parts add in float32, where one process rounds the whole batch's sum once. So a
gradient entry differs by up to ~2**-8 of its size, and SGD with momentum 0.9 moves the
parameters by the learning rate times the sum of 5 steps' momenta (4.10 + 3.44 + 2.71 + 1.9 +
1 = 13.1 gradients): at most 0.1 * 13.1 * 2**-8 * |g| = 5.1e-3 * |g|. The gradients here stay
below 0.32 (measured): the bound is 1.6e-3, and :data:`TOL_BF16` is 2e-3. Measured, the plans
end 2.7e-4 to 3.2e-4 from one process, and 0 from one process on the same microbatches.
fp16 keeps 11 bits: the same bound is 2e-4 and :data:`TOL_FP16` twice that (measured 3e-5
with 4 microbatches, 0 with one: the same operations in the same order).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from tests.multiproc.coordinator import models

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
P = "tests.multiproc.coordinator.precision_models"
SEED, BATCH, STEPS, LR = 5, 16, 5, 0.1
TOL_BF16 = 2e-3  # see [Note: the bf16 tolerance]
TOL_FP16 = 4e-4
TOL_SAME_SPLIT = 1e-6  # float32: the replicas' gradients averaged rather than accumulated
PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "gpipe2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="gpipe",
                     steps_per_request=1),  # each step's counters in its reply (a window's: on its last)
    "1f1b2x2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="1f1b"),
    "zb2x2": dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="zb-h1"),  # I: whole backward
}
OVERFLOW_SAMPLE = 40  # in step 3 (index 2) without shuffling: samples 32..47


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:mlp", f"{M}:mse", f"{M}:regression", f"{P}:spiky"]
    with LocalHarness(["local-0", "local-1"], job="t-precision", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(precision: str, **fields: Any) -> Job:
    data: dict[str, Any] = dict(data=f"{M}:regression", data_kwargs={"dtype": "float32"})
    if precision == "fp16":  # one step's targets are huge: its gradients overflow at the initial scale
        data = dict(data=f"{P}:spiky", data_kwargs={"indices": [OVERFLOW_SAMPLE], "factor": 1e4},
                    shuffle=False)
    # foreach=False: torch's own loop on the workers too (not the fused kernel, which rounds float32 apart
    # by an ulp), as in the references: these tests compare float32 runs to the last bits
    return Job(model=f"{M}:mlp", model_kwargs={"dtype": "float32"}, loss=f"{M}:mse", optimizer="SGD",
               optimizer_kwargs={"lr": LR, "momentum": 0.9, "foreach": False}, global_batch=BATCH, seed=SEED,
               resources=Resources.local(2), step_timeout_s=30, precision=precision, **data, **fields)


def one_process(job: Job, parts: int, *, bf16: bool) -> FitResult:
    """SGD with momentum on ``job``'s global batches, each cut into ``parts`` contiguous microbatches whose
    size-weighted losses' gradients accumulate; their forwards under bf16 autocast, or in float32."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = nn.Sequential(*models.mlp("float32"))
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        x, y = models.regression("float32")
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    sampler, losses = job.sampler(), []
    for step in range(STEPS):
        index = torch.tensor(sampler.indices(step))
        optimizer.zero_grad()
        total = 0.0
        for part in index.chunk(parts):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss = nn.functional.mse_loss(model(x[part]), y[part])
            (loss * (len(part) / len(index))).backward()  # type: ignore[no-untyped-call]  # torch stub
            total += float(loss.detach()) * len(part) / len(index)
        losses.append(total)
        optimizer.step()
    return FitResult(losses=losses, state_dict={k: v.detach().clone() for k, v in model.state_dict().items()})


def sent_per_step(result: FitResult, worker: str) -> list[int]:
    """The tensor bytes ``worker`` sent in each step after the first (its traffic counters' increments)."""
    sent = [r.traffic[worker].bytes_sent["zmq"] for r in result.steps]
    return [b - a for a, b in itertools.pairwise(sent)]


@pytest.mark.parametrize("plan", list(PLANS))
def test_bf16_matches_one_process_in_bf16_and_not_float32(harness: LocalHarness, plan: str) -> None:
    job = make_job("bf16", **PLANS[plan])
    with job.attach(harness):
        result = job.fit(STEPS)
    shape = result.plan
    assert shape is not None and shape.precision == "bf16" and "bf16 autocast" in str(shape)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL_BF16, f"{plan}: {diff:.3g} from one process in bf16"
    parts = shape.data_parallel * shape.num_microbatches
    same_split = max_abs_diff(result.state_dict, one_process(job, parts, bf16=True).state_dict)
    assert same_split < TOL_SAME_SPLIT, f"{plan}: {same_split:.3g} from one process on the same microbatches"
    in_fp32 = max_abs_diff(result.state_dict, one_process(job, parts, bf16=False).state_dict)
    assert in_fp32 > 100 * TOL_SAME_SPLIT, f"{plan}: only {in_fp32:.3g} from float32 training: no autocast"
    assert abs(result.losses[0] - ref.losses[0]) < 1e-6  # the first forward, before any update
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-2, "the reference did not move"
    if shape.num_stages > 1:  # the activations and their gradients cross the cut as bf16
        assert [t.dtype for t in shape.stages[0].outgoing.tensors] == ["bfloat16"]
    if plan == "gpipe2x4":  # per step, each stage sends the batch's [16, HIDDEN] activations or gradients
        for worker in shape.placement[0]:
            assert sent_per_step(result, worker) == [BATCH * models.HIDDEN * 2] * (STEPS - 1), worker


@pytest.mark.parametrize(("plan", "tol"), [("gpipe2x1", 1e-9), ("1f1b2x4", TOL_FP16)])
def test_fp16_skips_the_overflowing_step_and_halves_the_scale_as_grad_scaler(
        harness: LocalHarness, plan: str, tol: float) -> None:
    m = 1 if plan == "gpipe2x1" else 4
    job = make_job("fp16", data_parallel=1, num_stages=2, num_microbatches=m, schedule=plan[:-3])
    with job.attach(harness):  # runtime.nonfinite is "stop": an overflow is not a failure
        result = job.fit(STEPS)
    assert [r.skipped for r in result.steps] == [False, False, True, False, False]
    assert [r.loss_scale for r in result.steps] == [2.0 ** 16] * 3 + [2.0 ** 15] * 2
    ref = train_reference(job, STEPS)  # torch.amp.GradScaler: skips the same step, halves the same scale
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < tol, f"{plan}: {diff:.3g} from one process with GradScaler"
    good = [0, 1, 3, 4]
    assert max(abs(result.losses[i] - ref.losses[i]) for i in good) < 1e-4  # fp16 forwards of other sizes
    assert result.losses[2] > 1e5  # reported unscaled (scaled it would be 65536 times larger)
    assert result.plan is not None
    assert [t.dtype for t in result.plan.stages[0].outgoing.tensors] == ["float16"]


def test_fp16_loss_scale_is_checkpointed_and_resumed(harness: LocalHarness, tmp_path: Path) -> None:
    fields = dict(data_parallel=1, num_stages=2, num_microbatches=2, schedule="1f1b",
                  checkpoint_directory=str(tmp_path), checkpoint_every_steps=1, checkpoint_keep=5)
    first = make_job("fp16", **fields)
    with first.attach(harness):
        first.fit(4)
    trainer = json.loads((tmp_path / "step-00000004" / "trainer.json").read_text())
    assert trainer["scaler"] == {"scale": 2.0 ** 15, "growth_tracker": 1}  # backed off at step 3, then 1 good
    assert json.loads((tmp_path / "step-00000002" / "trainer.json").read_text())["scaler"] == {
        "scale": 2.0 ** 16, "growth_tracker": 2}
    again = make_job("fp16", **fields)
    with again.attach(harness, resume=tmp_path / "step-00000002"):
        resumed = again.fit(STEPS - 2)
    assert [r.loss_scale for r in resumed.steps] == [2.0 ** 16] + [2.0 ** 15] * 2
    assert [r.skipped for r in resumed.steps] == [True, False, False]
    ref = train_reference(again, STEPS)
    assert max_abs_diff(resumed.state_dict, ref.state_dict) < TOL_FP16


def test_a_checkpoint_due_after_a_skipped_step_is_taken_one_step_later(harness: LocalHarness,
                                                                       tmp_path: Path) -> None:
    """Step 3 (index 2) overflows: the checkpoint due once 3 steps are done has no commit to ride on. It is
    taken after step 4 and resumes to the uninterrupted run's parameters, bit for bit (before: it was
    lost, the next one came at step 6 and a failure in between rolled back to the start)."""
    fields = dict(data_parallel=2, num_stages=1, num_microbatches=1, checkpoint_directory=str(tmp_path),
                  checkpoint_every_steps=3, checkpoint_keep=5)
    full = make_job("fp16", **fields)
    with full.attach(harness):
        uninterrupted = full.fit(6)
    assert [r.skipped for r in uninterrupted.steps] == [False, False, True, False, False, False]
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-00000004", "step-00000006"]
    again = make_job("fp16", **fields)
    with again.attach(harness, resume=tmp_path / "step-00000004"):
        resumed = again.fit(2)
    assert [r.step for r in resumed.steps] == [4, 5]
    assert max_abs_diff(resumed.state_dict, uninterrupted.state_dict) == 0.0


def test_fp16_replicas_overflow_where_one_process_does(harness: LocalHarness) -> None:
    """Step 3's targets x10: one process's fp16 backward at the initial scale stays finite (x13 would not).
    Each replica weighs its loss by its share of the global batch, as one process does, so nothing is
    skipped either (before: each replica's backward held twice one process's values, overflowed, and the
    step was dropped and the scale halved, ending 0.1 away from one process)."""
    job = make_job("fp16", **PLANS["dp2"])
    job.config.data.kwargs["factor"] = 10.0
    with job.attach(harness):
        result = job.fit(STEPS)
    assert [r.skipped for r in result.steps] == [False] * STEPS
    assert [r.loss_scale for r in result.steps] == [2.0 ** 16] * STEPS
    ref = train_reference(job, STEPS)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL_FP16

