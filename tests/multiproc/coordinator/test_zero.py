"""ZeRO-1, ZeRO-2 and hybrid sharding train to the parameters one process reaches (float64, 5 steps).

One harness of four worker processes serves every job (``Job.attach``). The models' dim 0 (12, 7, 5,
3 and a 0-dim scale) leave short and empty shards in groups of 2 and 4.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from coordinator.planning.resources import Resources
from coordinator.runtime.factories import job_factories
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.faults import ENV

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
Z = "tests.multiproc.coordinator.zero_models"
E = "tests.multiproc.coordinator.eval_models"
P = "tests.multiproc.coordinator.precision_models"
STEPS = 5
TOL64 = 1e-9
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
MODELS = {"mlp": f"{M}:mlp", "mixed": f"{Z}:mixed", "deep_mlp": f"{M}:deep_mlp",
          "mixed_dtypes": f"{Z}:mixed_dtypes", "wide": f"{Z}:wide", "own_params": f"{Z}:own_params"}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:{name}" for name in ("mlp", "deep_mlp", "regression", "mse")] + [
        f"{Z}:mixed", f"{Z}:mixed_dtypes", f"{Z}:wide", f"{E}:heldout", f"{E}:abs_error", f"{P}:spiky"]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-zero", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(model: str, optimizer: str, dtype: str = "float64", **plan: Any) -> Job:
    name, kwargs = OPTIMIZERS[optimizer]
    data: dict[str, Any] = dict(data=f"{M}:regression", data_kwargs={"dtype": dtype})
    return Job(model=MODELS[model], loss=f"{M}:mse", optimizer=name, optimizer_kwargs=kwargs,
               model_kwargs={"dtype": dtype}, global_batch=16, seed=5, resources=Resources.local(workers=4),
               step_timeout_s=30, **(data | plan))


def dp(zero: int, d: int, factor: int | None = None) -> dict[str, Any]:
    """``d`` replicas of one stage, sharding in groups of ``factor`` (``d``: one group); zero 0: plain."""
    plain = dict(data_parallel=d, num_stages=1, num_microbatches=1)
    return plain | dict(zero=zero, shard_factor=factor or d) if zero else plain


def fit_and_compare(harness: LocalHarness, job: Job) -> FitResult:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < TOL64, f"{job.plan().summary()}: max abs diff {diff:.3g}"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-10
    assert max_abs_diff(job.build_model().state_dict(), ref.state_dict) > 1e-3, "the reference did not move"
    return result


def phases(result: FitResult) -> set[str]:
    return {e.name for e in result.steps[-1].events}


@pytest.mark.parametrize(("zero", "d", "factor", "model", "optimizer"), [
    (1, 2, 2, "mlp", "sgd"), (1, 4, 4, "mixed", "adamw"), (2, 2, 2, "mixed", "sgd"),
    (2, 2, 2, "mlp", "adamw"), (2, 4, 4, "mixed", "adamw"), (2, 4, 4, "mlp", "sgd"),
    (2, 4, 2, "mixed", "adamw"), (1, 4, 2, "mixed", "sgd"),  # hybrid: 2 groups of 2
    (2, 2, 2, "wide", "adamw"), (2, 4, 2, "wide", "sgd"), (1, 4, 4, "wide", "adamw")])  # a 1 MiB weight
def test_data_parallel_sharding_matches_one_process(harness: LocalHarness, zero: int, d: int, factor: int,
                                                    model: str, optimizer: str) -> None:
    result = fit_and_compare(harness, make_job(model, optimizer, **dp(zero, d, factor)))
    assert result.plan is not None and (result.plan.zero_stage, result.plan.shard_factor) == (zero, factor)
    assert {"optimizer", "all_reduce" if zero == 1 else "reduce_scatter"} <= phases(result)
    assert "all_gather" not in phases(result)  # the update's all-gather runs behind the step's forward


# deep_mlp's layers: Linear(6, 12) 672 B, six Linear(12, 12) of 1,248 B, Linear(12, 3) 312 B (float64)
SMALL_BUCKETS = 1300  # a layer per bucket of the all-gather


@pytest.mark.parametrize(("zero", "optimizer", "extra"), [
    (1, "sgd", dict(accumulate=2)), (2, "adamw", dict(accumulate=2)),
    (2, "sgd", dict(schedule="gpipe", num_stages=2, num_microbatches=2)),
    (1, "adamw", dict(gather_bytes=1)), (2, "sgd", dict(gather_bytes=1, comm_backend="gloo"))])
def test_the_gather_behind_the_forward_in_small_buckets_matches_one_process(
        harness: LocalHarness, zero: int, optimizer: str, extra: dict[str, Any]) -> None:
    """8 buckets gathered one after the other in the next forward; with gradient accumulation (two global
    batches per step) and in a pipeline of 2 stages x 2 replicas. A bucket per parameter (``gather_bytes=1``,
    over zmq and over gloo): every one of 12 rows is gathered in place, the head's 3 rows through buffers
    ([Note: a bucket gathered in place])."""
    plan = dp(zero, 2) | dict(gather_bytes=SMALL_BUCKETS) | extra
    result = fit_and_compare(harness, make_job("deep_mlp", optimizer, **plan))
    assert "all_gather" not in phases(result)


def test_a_checkpoint_mid_run_with_the_gather_behind_the_forward_resumes_exactly(harness: LocalHarness,
                                                                                tmp_path: Path) -> None:
    """The commit that saves gathers at once (the snapshot reads whole parameters); the resumed run goes on
    to what one process reaches."""
    ckpt = tmp_path / "ckpt"

    def job() -> Job:
        return make_job("deep_mlp", "adamw", checkpoint_directory=str(ckpt), checkpoint_keep=10,
                        checkpoint_every_steps=2, gather_bytes=SMALL_BUCKETS, **dp(1, 2))

    with job().attach(harness) as first:
        steps = first.fit(3).steps
    saving = [r.step for r in steps if "snapshot" in {e.name for e in r.events}]
    assert saving and all("all_gather" in {e.name for e in steps[s].events} for s in saving), saving
    resumed = job()
    with resumed.attach(harness, resume=True):
        final = resumed.fit(STEPS - 3)
    assert [r.step for r in final.steps] == [3, 4]
    ref = train_reference(resumed, STEPS)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL64


@pytest.mark.parametrize("zero", [1, 2])
def test_hybrid_sharding_over_gloo_matches_one_process(harness: LocalHarness, zero: int) -> None:
    """torch's gloo process groups: the sub-groups are process groups of their own."""
    result = fit_and_compare(harness, make_job("mixed", "adamw", comm_backend="gloo", **dp(zero, 4, 2)))
    assert result.plan is not None and result.plan.shard_factor == 2


@pytest.mark.parametrize("plan", [dp(2, 2), dp(1, 4, 2)])
def test_mixed_dtypes_shard_in_buckets_of_one_dtype(harness: LocalHarness, plan: dict[str, Any]) -> None:
    """A float32 layer among float64 ones: its gradient travels in a float32 bucket of its own."""
    job = make_job("mixed_dtypes", "adamw", **plan)
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    dtypes = {k: v.dtype for k, v in result.state_dict.items()}
    assert dtypes == {k: v.dtype for k, v in ref.state_dict.items()} and len(set(dtypes.values())) == 2
    # the float32 layer's sums are reordered per replica (test_parity's TOL32), and its rounding reaches
    # the float64 layers' gradients through the backward: measured <= 1.5e-9 there
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < 1e-6, diff


@pytest.mark.parametrize("plan", [
    dict(schedule="gpipe", num_microbatches=4), dict(schedule="1f1b", num_microbatches=4),
    dict(schedule="zb-h1", num_microbatches=4),
    dict(schedule="interleaved-1f1b", chunks=2, num_microbatches=2)])
def test_zero2_in_a_pipeline_matches_one_process(harness: LocalHarness, plan: dict[str, Any]) -> None:
    """2 stages x 2 replicas: gradients accumulate over microbatches, the last backward reduce-scatters."""
    job = make_job("deep_mlp", "adamw", data_parallel=2, num_stages=2, zero=2, shard_factor=2, **plan)
    result = fit_and_compare(harness, job)
    assert result.plan is not None and result.plan.num_stages == 2 and result.plan.zero_stage == 2


def test_clipping_with_zero2_is_one_process_clipping(harness: LocalHarness) -> None:
    job = make_job("mixed", "sgd", clip_grad_norm=0.05, **dp(2, 4, 2))
    result = fit_and_compare(harness, job)
    ref = train_reference(job, STEPS)
    norms = [r.grad_norm for r in result.steps]
    assert all(n is not None and n > 0.05 for n in norms), norms  # every step clipped
    assert max(abs(a - b) for a, b in zip(norms, ref.grad_norms, strict=True)) < 1e-9  # type: ignore[operator]


def test_a_checkpoint_goes_from_zero2_to_plain_data_parallel_and_back(harness: LocalHarness,
                                                                       tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"

    def job(**plan: Any) -> Job:
        return make_job("mixed", "adamw", checkpoint_directory=str(ckpt), checkpoint_keep=10, **plan)

    with job(**dp(2, 4)).attach(harness) as first:
        first.fit(2)
    with job(**dp(0, 2)).attach(harness, resume=True) as second:
        assert [r.step for r in second.fit(2).steps] == [2, 3]
    third = job(**dp(2, 4, 2))
    with third.attach(harness, resume=True):
        final = third.fit(STEPS - 4)
    assert [r.step for r in final.steps] == [4]
    ref = train_reference(third, STEPS)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL64


def held(result: FitResult) -> list[int]:
    return [body.held_bytes or 0 for _, body in sorted(result.steps[-1].replies, key=lambda r: r[0].replica)]


def test_memory_per_worker_shrinks_with_the_group(harness: LocalHarness) -> None:
    """Parameters + held gradients + AdamW state (exp_avg, exp_avg_sq and a float32 step count per
    parameter) as each replica ends a step, against the replicated plan."""
    model = make_job("mlp", "adamw", **dp(0, 2)).build_model()
    params = sum(p.numel() * 8 for p in model.parameters())
    steps = 4 * len(list(model.parameters()))
    figures: dict[str, list[int]] = {}
    for name, plan in {"dp2": dp(0, 2), "zero1x2": dp(1, 2), "zero2x2": dp(2, 2), "zero1x4": dp(1, 4),
                       "zero2x4": dp(2, 4)}.items():
        job = make_job("mlp", "adamw", **plan)
        with job.attach(harness):
            figures[name] = held(job.fit(2))
    print(f"parameters {params} B; held bytes per replica: {figures}")
    assert figures["dp2"] == [4 * params + steps] * 2  # parameters, gradients, exp_avg, exp_avg_sq
    row = 8 * 12  # the widest row of the model: a ceil chunk holds at most one more
    for n in (2, 4):
        one, two = figures[f"zero1x{n}"], figures[f"zero2x{n}"]
        assert all(abs(b - (2 * params + 2 * params / n + steps)) <= 2 * 4 * row for b in one), one
        assert sum(one) == n * (2 * params + steps) + 2 * params  # the state's shards cover it once
        # ZeRO-2's gradient shards are the reduce-scatter's segments: a few padding rows more
        assert all(b < a for a, b in zip(one, two, strict=True))
        least = n * (params + steps) + 3 * params
        assert least <= sum(two) <= least + n * 4 * row, two


def test_evaluation_steps_with_zero2_equal_one_process(harness: LocalHarness) -> None:
    job = make_job("mlp", "sgd", eval=f"{E}:heldout", eval_every_steps=2, eval_metric=f"{E}:abs_error",
                   **dp(2, 2))
    result = fit_and_compare(harness, job)
    ref = train_reference(job, STEPS)
    assert [e.step for e in result.evals] == [e.step for e in ref.evals] == [2, 4, 5]
    assert max(abs(a.loss - b.loss) for a, b in zip(result.evals, ref.evals, strict=True)) < TOL64


def test_fp16_with_zero2_skips_the_overflowing_step_as_grad_scaler(harness: LocalHarness) -> None:
    """float32 master weights; step 3's targets overflow float16: every replica skips it."""
    job = make_job("mlp", "sgd", dtype="float32", precision="fp16", data=f"{P}:spiky",
                   data_kwargs={"indices": [40], "factor": 1e4}, shuffle=False, **dp(2, 2))
    with job.attach(harness):
        result = job.fit(STEPS)
    assert [r.skipped for r in result.steps] == [False, False, True, False, False]
    ref = train_reference(job, STEPS)
    assert max_abs_diff(result.state_dict, ref.state_dict) < 4e-4  # fp16 forwards: test_precision's bound


@pytest.mark.parametrize(("zero", "fault"), [
    (2, "5:backward"),  # test_zero3 kills one at the optimizer
    (1, "4:forward"),  # while the previous commit's all-gather runs behind the forward
    (1, "5:optimizer")])
def test_a_killed_zero12_replica_is_replaced_and_the_run_ends_failure_free(tmp_path: Path, zero: int,
                                                                           fault: str) -> None:
    """Adam (stateful: a lost shard of its moments would show), a checkpoint every 3 steps, 8 steps."""
    steps, lease = 8, timedelta(seconds=2)
    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="Adam",
              optimizer_kwargs={"lr": 0.01}, global_batch=16, resources=Resources.local(2), step_timeout_s=30,
              lease_ttl_s=lease.total_seconds(), checkpoint_directory=str(tmp_path / "ckpt"),
              checkpoint_every_steps=3, gather_bytes=1 << 10, **dp(zero, 2))
    with LocalHarness(["local-0", "local-1"], job="t-zero-rec", lease_ttl=lease,
                      factories=job_factories(job.config), log_dir=tmp_path / "logs",
                      worker_env={"local-1": {ENV: fault}}) as h, job.attach(h):
        result = job.fit(steps)
    [recovery] = result.recoveries
    assert recovery.action == "replaced worker local-1", recovery
    assert [r.step for r in result.steps] == list(range(steps))
    ref = train_reference(job, steps)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL64


def test_a_model_too_big_to_replicate_gets_a_sharded_plan_that_trains_as_one_process(
        harness: LocalHarness) -> None:
    # 4 replicas: on 2 this small model's sharded plans' buffers cost more than the state they save (the
    # memory model's step temporaries take turns with the frames)
    fixed = dict(strategy="data_parallel", data_parallel=4, num_microbatches=1, recompute=False,
                 mode="collective")
    replicated = make_job("mixed", "adamw", **fixed).plan()
    assert replicated.zero_stage == 0  # a replicated plan that fits is taken first
    least = min(make_job("mixed", "adamw", **fixed, zero=z, shard_factor=4).plan().peak_memory_bytes
                for z in (1, 2, 3))
    assert least < replicated.peak_memory_bytes
    budget = (least + replicated.peak_memory_bytes) // 2  # too little to replicate, enough to shard
    job = make_job("mixed", "adamw", **fixed)
    job.resources = Resources.local(workers=4, memory_bytes=budget)
    plan = job.plan()
    assert plan.zero_stage >= 1 and plan.peak_memory_bytes <= budget, plan.summary()
    fit_and_compare(harness, job)
