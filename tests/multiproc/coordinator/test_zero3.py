"""ZeRO-3 (fully sharded parameters) trains through the coordinator to the parameters one process reaches
(float64, 5 steps): data parallel in one group, hybrid groups, and in a pipeline.

One harness of four worker processes serves every job (``Job.attach``), as in ``test_zero.py``, whose jobs
and comparison these reuse.
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
from coordinator.runtime.job import Job
from coordinator.runtime.reference import max_abs_diff, train_reference
from services.faults import ENV
from tests.multiproc.coordinator.test_zero import STEPS, TOL64, M, P, Z, dp, fit_and_compare, make_job, phases

pytestmark = pytest.mark.timeout(120)

HELD_OUT = "tests.multiproc.coordinator.eval_models:heldout"


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:{name}" for name in ("mlp", "deep_mlp", "regression", "mse")]
    factories += [f"{Z}:mixed", f"{Z}:mixed_dtypes", f"{Z}:own_params", f"{P}:spiky", HELD_OUT]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-zero3", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


@pytest.mark.parametrize(("d", "factor", "model", "optimizer"), [
    (2, 2, "mixed", "adamw"), (4, 4, "mixed", "sgd"), (4, 2, "mixed", "adamw")])  # hybrid: 2 groups of 2
def test_fully_sharded_replicas_match_one_process(harness: LocalHarness, d: int, factor: int, model: str,
                                                  optimizer: str) -> None:
    result = fit_and_compare(harness, make_job(model, optimizer, **dp(3, d, factor)))
    assert result.plan is not None and (result.plan.zero_stage, result.plan.shard_factor) == (3, factor)
    assert "reduce_scatter" in phases(result)


@pytest.mark.parametrize("plan", [dp(3, 2), dp(3, 4, 2),
                                  dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b",
                                       zero=3, shard_factor=2, balance=[1, 3]),
                                  dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b",
                                       zero=3, shard_factor=2, balance=[1, 3], recompute=True)],
                         ids=["dp2", "hybrid", "pp2", "pp2-recompute"])
def test_parameters_no_leaf_module_holds_alone_are_the_stage_s_unit(harness: LocalHarness,
                                                                    plan: dict[str, Any]) -> None:
    """A gain and a temperature the model's forward uses itself, a weight two layers share and a weight
    the forward reads again beside its layer: FSDP2 puts such parameters in the root module's unit, and
    so does cellmesh (the stage's own unit, gathered for the step: with recompute, the stage's own code
    runs in per-node modules that no hook brackets)."""
    result = fit_and_compare(harness, make_job("own_params", "adamw", **plan))
    assert result.plan is not None and result.plan.zero_stage == 3


@pytest.mark.parametrize(("gather_bytes", "optimizer"), [(3800, "adamw"), (1000, "sgd")])
def test_units_of_several_cells_match_one_process(harness: LocalHarness, gather_bytes: int,
                                                  optimizer: str) -> None:
    """deep_mlp's cells: Linear(6, 12) 672 B, six blocks of 1,248 B, Linear(12, 3) 312 B (float64). 3,800 B:
    units of 3, 3 and 2 cells; 1,000 B: every block larger than a unit, a unit alone."""
    job = make_job("deep_mlp", optimizer, gather_bytes=gather_bytes, **dp(3, 2))
    fit_and_compare(harness, job)


def test_hybrid_over_gloo_matches_one_process(harness: LocalHarness) -> None:
    """torch's gloo process groups: the groups and the replicas across them are process groups too."""
    result = fit_and_compare(harness, make_job("mixed", "adamw", comm_backend="gloo", **dp(3, 4, 2)))
    assert result.plan is not None and result.plan.shard_factor == 2


def test_a_float32_cell_among_float64_ones_is_a_unit_of_its_own(harness: LocalHarness) -> None:
    job = make_job("mixed_dtypes", "adamw", **dp(3, 2))
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    dtypes = {k: v.dtype for k, v in result.state_dict.items()}
    assert dtypes == {k: v.dtype for k, v in ref.state_dict.items()} and len(set(dtypes.values())) == 2
    assert max_abs_diff(result.state_dict, ref.state_dict) < 1e-6  # float32's sums in another order


@pytest.mark.parametrize("plan", [
    dict(schedule="gpipe", num_microbatches=4), dict(schedule="1f1b", num_microbatches=4),
    dict(schedule="zb-h1", num_microbatches=4),
    dict(schedule="interleaved-1f1b", chunks=2, num_microbatches=2)])
def test_fully_sharded_pipeline_matches_one_process(harness: LocalHarness, plan: dict[str, Any]) -> None:
    """2 stages x 2 replicas: full gradients accumulate over the microbatches, the last backward
    reduce-scatters each unit."""
    job = make_job("deep_mlp", "adamw", data_parallel=2, num_stages=2, zero=3, shard_factor=2, **plan)
    result = fit_and_compare(harness, job)
    assert result.plan is not None and result.plan.num_stages == 2 and result.plan.zero_stage == 3


def test_clipping_with_zero3_is_one_process_clipping(harness: LocalHarness) -> None:
    job = make_job("mixed", "sgd", clip_grad_norm=0.05, **dp(3, 4, 2))
    result = fit_and_compare(harness, job)
    ref = train_reference(job, STEPS)
    norms = [r.grad_norm for r in result.steps]
    assert all(n is not None and n > 0.05 for n in norms), norms  # every step clipped
    assert max(abs(a - b) for a, b in zip(norms, ref.grad_norms, strict=True)) < 1e-9  # type: ignore[operator]


def test_a_checkpoint_goes_from_zero3_to_plain_data_parallel_and_back(harness: LocalHarness,
                                                                       tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"

    def job(**plan: Any) -> Job:
        return make_job("mixed", "adamw", checkpoint_directory=str(ckpt), checkpoint_keep=10, **plan)

    with job(**dp(3, 4)).attach(harness) as first:
        first.fit(2)
    with job(**dp(0, 2)).attach(harness, resume=True) as second:
        assert [r.step for r in second.fit(2).steps] == [2, 3]
    third = job(**dp(3, 4, 2))
    with third.attach(harness, resume=True):
        final = third.fit(STEPS - 4)
    assert [r.step for r in final.steps] == [4]
    ref = train_reference(third, STEPS)
    assert max_abs_diff(final.state_dict, ref.state_dict) < TOL64


def test_memory_per_worker_holds_a_shard_of_the_parameters(harness: LocalHarness) -> None:
    """Parameters, gradients and AdamW state as each replica ends a step: ZeRO-3 over 2 holds about half of
    what ZeRO-2 over 2 holds for its parameters (ZeRO-2 keeps them whole)."""
    model = make_job("mlp", "adamw", **dp(0, 2)).build_model()
    params = sum(p.numel() * 8 for p in model.parameters())
    figures: dict[str, list[int]] = {}
    for name, plan in {"zero2x2": dp(2, 2), "zero3x2": dp(3, 2), "zero2x4": dp(2, 4),
                       "zero3x4": dp(3, 4)}.items():
        job = make_job("mlp", "adamw", **plan)
        with job.attach(harness):
            result = job.fit(2)
        figures[name] = [body.held_bytes or 0 for _, body in sorted(result.steps[-1].replies,
                                                                     key=lambda r: r[0].replica)]
    print(f"parameters {params} B; held bytes per replica: {figures}")
    for n in (2, 4):  # ZeRO-3 keeps 1/n of the parameters where ZeRO-2 keeps them whole
        for two, three in zip(figures[f"zero2x{n}"], figures[f"zero3x{n}"], strict=True):
            assert two - three >= params * (n - 1) / n - 8 * 12, (n, two, three)


@pytest.mark.parametrize(("plan", "batch"), [
    (dp(3, 4, 2), 12), (dict(data_parallel=2, num_stages=2, num_microbatches=4, schedule="gpipe", zero=3,
                             shard_factor=2), 16)], ids=["hybrid", "pipeline"])
def test_evaluation_under_zero3_equals_one_process(harness: LocalHarness, plan: dict[str, Any],
                                                   batch: int) -> None:
    """37 held-out samples leave a short last batch, and every forward of a sharding group gathers
    together: in batches of 12, the last one sample leaves 3 of 4 replicas without any; in batches of 16
    over 2 replicas of 4 microbatches, the last 5 give them 3 and 2 microbatches. The short ones run
    padding forwards, left uncounted."""
    job = make_job("mixed", "sgd", eval=HELD_OUT, eval_every_steps=2, eval_global_batch=batch, **plan)
    result = fit_and_compare(harness, job)
    ref = train_reference(job, STEPS)
    assert [e.step for e in result.evals] == [e.step for e in ref.evals] == [2, 4, 5]
    for got, want in zip(result.evals, ref.evals, strict=True):
        assert got.num_samples == want.num_samples == 37 and abs(got.loss - want.loss) < TOL64, (got, want)


def test_fp16_with_zero3_skips_the_overflowing_step_as_grad_scaler(harness: LocalHarness) -> None:
    """float32 master weights; step 3's targets overflow float16: every replica skips it."""
    job = make_job("mlp", "sgd", dtype="float32", precision="fp16", data=f"{P}:spiky",
                   data_kwargs={"indices": [40], "factor": 1e4}, shuffle=False, **dp(3, 2))
    with job.attach(harness):
        result = job.fit(STEPS)
    assert [r.skipped for r in result.steps] == [False, False, True, False, False]
    ref = train_reference(job, STEPS)
    assert max_abs_diff(result.state_dict, ref.state_dict) < 4e-4  # fp16 forwards: test_precision's bound


@pytest.mark.parametrize("fault", ["4:optimizer"])  # test_zero kills one in a backward
def test_a_killed_zero3_replica_is_replaced_and_the_run_ends_failure_free(tmp_path: Path, fault: str) -> None:
    """Adam (stateful: a lost shard of its moments would show), a checkpoint every 3 steps, 8 steps."""
    steps, lease = 8, timedelta(seconds=2)
    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:regression", optimizer="Adam",
              optimizer_kwargs={"lr": 0.01}, global_batch=16, resources=Resources.local(2), step_timeout_s=30,
              lease_ttl_s=lease.total_seconds(), checkpoint_directory=str(tmp_path / "ckpt"),
              checkpoint_every_steps=3, **dp(3, 2))
    with LocalHarness(["local-0", "local-1"], job="t-zero3-rec", lease_ttl=lease,
                      factories=job_factories(job.config), log_dir=tmp_path / "logs",
                      worker_env={"local-1": {ENV: fault}}) as h, job.attach(h):
        result = job.fit(steps)
    [recovery] = result.recoveries
    assert recovery.action == "replaced worker local-1", recovery
    assert [r.step for r in result.steps] == list(range(steps))
    ref = train_reference(job, steps)
    assert max_abs_diff(result.state_dict, ref.state_dict) < TOL64
