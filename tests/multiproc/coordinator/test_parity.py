"""The invariant: every plan trains to the parameters one process reaches on the same global batches.

One harness of four worker processes serves every job of this module (``Job.attach``);
each job places its own services, trains 5 steps, is compared with
``coordinator.runtime.reference.train_reference`` and releases its services.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch

from coordinator.planning.resources import Resources
from coordinator.runtime.harness import LocalHarness
from coordinator.runtime.job import FitResult, Job
from coordinator.runtime.reference import max_abs_diff, train_reference

pytestmark = pytest.mark.timeout(120)

M = "tests.multiproc.coordinator.models"
STEPS = 5
TOL64 = 1e-9
TOL32 = 1e-6  # float32: sums reordered per microbatch and replica; measured <= 6e-8 after 5 steps
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "adam": ("Adam", {"lr": 0.01}),
    "adamw": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
}
PLANS: dict[str, dict[str, Any]] = {
    "dp2": dict(data_parallel=2, num_stages=1, num_microbatches=1),
    "gpipe2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="gpipe"),
    "1f1b2x4": dict(data_parallel=1, num_stages=2, num_microbatches=4, schedule="1f1b"),
    "pp2xdp2": dict(data_parallel=2, num_stages=2, num_microbatches=2, schedule="1f1b"),
    "ps2": dict(data_parallel=2, num_stages=1, num_microbatches=2, mode="parameter_server"),
}
# interleaved 1F1B: 2 stages on each worker (rank r holds stages r and r + R)
INTERLEAVED: dict[str, dict[str, Any]] = {
    "2x2": dict(data_parallel=1, num_stages=4, chunks=2, num_microbatches=4, schedule="interleaved-1f1b"),
    "2x2xdp2": dict(data_parallel=2, num_stages=4, chunks=2, num_microbatches=2, schedule="interleaved-1f1b"),
    "4x2": dict(data_parallel=1, num_stages=8, chunks=2, num_microbatches=4, schedule="interleaved-1f1b"),
    # each replica's one worker holds both stages: the transfers between them stay in its process
    "1x2xdp2": dict(data_parallel=2, num_stages=2, chunks=2, num_microbatches=2, schedule="interleaved-1f1b"),
}
DATA = {"mlp": ("regression", "mse"), "wide_mlp": ("regression", "mse"), "deep_mlp": ("regression", "mse"),
        "skip_model": ("regression", "mse"),
        "transformer": ("tokens", "token_loss")}


@pytest.fixture(scope="module")
def harness() -> Iterator[LocalHarness]:
    factories = [f"{M}:{name}" for name in ("mlp", "wide_mlp", "deep_mlp", "skip_model", "transformer",
                                            "regression", "tokens", "mse", "token_loss", "failing_data")]
    with LocalHarness([f"local-{i}" for i in range(4)], job="t-parity", lease_ttl=timedelta(seconds=6),
                      factories=factories) as h:
        yield h


def make_job(model: str, optimizer: str, *, dtype: str = "float64", **plan: Any) -> Job:
    data, loss = DATA[model]
    name, kwargs = OPTIMIZERS[optimizer]
    return Job(model=f"{M}:{model}", loss=f"{M}:{loss}", data=f"{M}:{data}", optimizer=name,
               optimizer_kwargs=kwargs, model_kwargs={"dtype": dtype},
               data_kwargs={"dtype": dtype} if data == "regression" else {}, global_batch=16, seed=5,
               resources=Resources.local(workers=4), step_timeout_s=30, **plan)


def fit_and_compare(harness: LocalHarness, job: Job, tol: float) -> FitResult:
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    diff = max_abs_diff(result.state_dict, ref.state_dict)
    assert diff < tol, f"{job.plan().summary()}: max abs diff {diff:.3g} >= {tol:g}"
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < max(tol, 1e-12) * 100
    initial = job.build_model().state_dict()
    assert max_abs_diff(initial, ref.state_dict) > 1e-3, "the reference did not move"
    job.build_model().load_state_dict(result.state_dict, strict=True)
    return result


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("plan", list(PLANS))
def test_mlp_every_plan_matches_one_process(harness: LocalHarness, plan: str, optimizer: str) -> None:
    result = fit_and_compare(harness, make_job("mlp", optimizer, **PLANS[plan]), TOL64)
    shape = result.plan
    assert shape is not None and (shape.data_parallel, shape.num_stages) == (
        PLANS[plan]["data_parallel"], PLANS[plan]["num_stages"])
    kinds = {e.name for e in result.steps[-1].events}
    assert {"0F0", "0B0", f"{shape.num_stages - 1}F0"} <= kinds  # the event log holds every action
    if plan in ("dp2", "pp2xdp2"):
        assert "all_reduce" in kinds
    if plan == "ps2":
        assert "push_pull" in kinds


def test_older_steps_keep_their_loss_not_their_detail(harness: LocalHarness) -> None:
    """runtime.detail_replies: the records keep the detail of the latest steps' replies only (2 stages x 2
    replicas: 4 a step, a budget of 9 keeps two steps); the callback sees every step whole."""
    job = make_job("mlp", "sgd", detail_replies=9, **PLANS["pp2xdp2"])
    seen: list[tuple[int, int, set[str]]] = []
    with job.attach(harness):
        result = job.fit(STEPS, callback=lambda r: seen.append((r.step, len(r.replies),
                                                                {e.name for e in r.events})))
    assert [(step, n) for step, n, _ in seen] == [(k, 4) for k in range(STEPS)]
    assert all({"0F0", "1B1", "all_reduce"} <= names for _, _, names in seen)
    assert [r.detailed for r in result.steps] == [False] * (STEPS - 2) + [True, True]
    assert all(r.events == [] and r.traffic == {} for r in result.steps[:-2])
    assert all(len(r.replies) == 4 and len(r.traffic) == 4 for r in result.steps[-2:])
    ref = train_reference(job, STEPS)  # the losses and times of the thinned steps stay
    assert max(abs(a - b) for a, b in zip(result.losses, ref.losses, strict=True)) < 1e-9
    assert [r.loss for r in result.steps] == result.losses and all(r.seconds > 0 for r in result.steps)


def test_the_coordinator_s_presence_lives_as_long_as_the_job_s_lease(harness: LocalHarness) -> None:
    """On etcd the workers take their coordinator for gone when its presence key lapses: its lease is the
    job's runtime.lease_ttl_s, as the workers' cards', not a shorter one of its own."""
    job = make_job("mlp", "sgd", lease_ttl_s=7.0, **PLANS["dp2"])
    with job.attach(harness):
        session = job._session
        assert session is not None and session.loop is not None
        assert session.loop.presence.ttl == timedelta(seconds=7)


@pytest.mark.parametrize("plan", ["gpipe2x4", "1f1b2x4", "pp2xdp2"])
def test_skip_connection_across_the_cut(harness: LocalHarness, plan: str) -> None:
    job = make_job("skip_model", "adam", **PLANS[plan], balance=[2, 2])
    assert job.plan().stages[0].outgoing.structure == "dict"  # h and the relayed skip cross together
    fit_and_compare(harness, job, TOL64)


@pytest.mark.parametrize(("plan", "optimizer"), [("1f1b2x4", "adamw"), ("pp2xdp2x4", "sgd")])
def test_1f1b_holding_its_weight_gradients(harness: LocalHarness, plan: str, optimizer: str) -> None:
    """Wide layers, few rows: the in-between B's hold their W's for one flush (with the replicas' gradient
    sync armed only after it: pp2xdp2x4)."""
    plans = {**PLANS, "pp2xdp2x4": dict(data_parallel=2, num_stages=2, num_microbatches=4, schedule="1f1b")}
    fit_and_compare(harness, make_job("wide_mlp", optimizer, **plans[plan]), TOL64)


@pytest.mark.parametrize("plan", ["dp2", "1f1b2x4", "pp2xdp2", "ps2"])
def test_transformer(harness: LocalHarness, plan: str) -> None:
    fit_and_compare(harness, make_job("transformer", "adam", **PLANS[plan]), TOL64)


@pytest.mark.parametrize(("model", "plan", "optimizer"), [("mlp", "pp2xdp2", "adam"), ("mlp", "ps2", "adam"),
                                                          ("transformer", "1f1b2x4", "sgd")])
def test_float32_within_tolerance(harness: LocalHarness, model: str, plan: str, optimizer: str) -> None:
    fit_and_compare(harness, make_job(model, optimizer, dtype="float32", **PLANS[plan]), TOL32)


def test_float32_transformer_with_adam_differs_only_where_the_gradient_is_zero(harness: LocalHarness) -> None:
    # Attention's key bias adds the same q.b_k to every score of a query, and softmax does not
    # see a shift, so its true gradient is 0. In float32 it comes out as rounding noise
    # (~1e-9) that differs with the summation order, and Adam divides by sqrt(v) ~ |noise|:
    # the key bias moves by up to lr per step, differently in each plan, without changing the
    # model's function. Every other entry must match as tightly as with SGD.
    job = make_job("transformer", "adam", dtype="float32", **PLANS["1f1b2x4"])
    with job.attach(harness):
        result = job.fit(STEPS)
    ref = train_reference(job, STEPS)
    width = 16
    for key, value in result.state_dict.items():
        diff = (value - ref.state_dict[key]).abs()
        if key.endswith("self_attn.in_proj_bias"):
            diff = torch.cat([diff[:width], diff[2 * width:]])  # query and value biases; not the key bias
        assert float(diff.max()) < TOL32, key


@pytest.mark.parametrize(("model", "plan", "optimizer"), [
    ("skip_model", "2x2", "sgd"), ("skip_model", "2x2", "adamw"),  # the skip crosses chunks: 0 -> 1 -> 2
    ("deep_mlp", "2x2xdp2", "adamw"), ("deep_mlp", "4x2", "sgd"), ("deep_mlp", "1x2xdp2", "sgd")])
def test_interleaved_1f1b_matches_one_process(harness: LocalHarness, model: str, plan: str,
                                               optimizer: str) -> None:
    result = fit_and_compare(harness, make_job(model, optimizer, **INTERLEAVED[plan]), TOL64)
    shape = result.plan
    assert shape is not None and shape.chunks == 2
    assert shape.num_workers == shape.data_parallel * shape.num_ranks
    schedule = shape.schedule()
    for replica in range(shape.data_parallel):
        for rank in range(shape.num_ranks):  # one worker ran its stages' actions one at a time, in its order
            worker = shape.placement[replica][rank]
            assert shape.stages_of(worker) == schedule.stages_of(rank)
            ran = sorted((e for e in result.steps[-1].events if e.worker == worker and e.action is not None),
                         key=lambda e: e.start)
            assert [e.action for e in ran] == list(schedule.rank_actions(rank))


def test_auto_trains_like_the_same_plan_fixed_by_hand(harness: LocalHarness) -> None:
    auto = make_job("mlp", "sgd", strategy="auto")
    chosen = auto.plan()
    fixed = make_job("mlp", "sgd", data_parallel=chosen.data_parallel, num_stages=chosen.num_stages,
                     mode=chosen.mode, schedule=chosen.schedule_name, chunks=chosen.chunks,
                     num_microbatches=chosen.num_microbatches,
                     balance=[st.stop - st.start for st in chosen.stages])
    assert fixed.plan().placement == chosen.placement and fixed.plan().bounds == chosen.bounds
    a = fit_and_compare(harness, auto, TOL64)
    b = fit_and_compare(harness, fixed, TOL64)
    assert max_abs_diff(a.state_dict, b.state_dict) == 0.0


def test_a_service_error_stops_the_job_naming_worker_service_and_step(harness: LocalHarness) -> None:
    from coordinator.runtime.errors import JobFailed

    job = Job(model=f"{M}:mlp", loss=f"{M}:mse", data=f"{M}:failing_data", num_samples=64, shuffle=False,
              global_batch=16, data_parallel=2, num_stages=1, num_microbatches=1,
              resources=Resources.local(2),
              step_timeout_s=20)
    with pytest.raises(JobFailed) as failed, job.attach(harness):
        job.fit(5)
    # samples 40.. are corrupt: step 2 holds 32..47, its second replica 40..47 (worker local-1)
    message = str(failed.value)
    assert failed.value.step == 2 and failed.value.worker == "local-1", message
    assert "compute-r1-s0" in message and "step 2" in message and "corrupt" in message, message
    # the workers stay usable for the next job
    fit_and_compare(harness, make_job("mlp", "sgd", **PLANS["dp2"]), TOL64)


def test_sampler_feeds_each_sample_once_per_epoch() -> None:
    job = make_job("mlp", "sgd", **PLANS["dp2"])
    sampler = job.sampler()
    epoch = [i for k in range(sampler.steps_per_epoch) for i in sampler.indices(k)]
    assert sorted(epoch) == list(range(64))
    assert torch.tensor(sampler.indices(sampler.steps_per_epoch)).tolist() != epoch[:16]  # reshuffled
